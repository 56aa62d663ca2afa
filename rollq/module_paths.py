"""Where the processes that import user code (the rollout worker, the reward worker) find user modules: the folders of
their `module_paths` setting, appended to `sys.path` last, and never the folder they were started in.

Python puts the folder it starts from first on `sys.path` (`python -m rollq`: the working directory; the `rollq`
script: its own folder). A worker's agents could write there (an agent ran in the worker's working directory), and
a module planted there (`arq/__init__.py`, a module of an allowed package) would be imported by the worker itself,
ahead of the installed ones, with everything the worker holds in reach. So those entries leave `sys.path` before
any user module is imported, and user modules come only from folders the operator named, after rollq's own and
the installed packages (a user folder never shadows an installed module). The multiprocessing children these
processes start (reward pools, subproc agents, agent hosts) are given this `sys.path` by multiprocessing itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

SETTING_DOC = (
    "folders user modules (workflows, agents, rewards, tools named by import path) are imported from, after the "
    "installed packages (repeatable); the working directory is never searched"
)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a or ".") == os.path.realpath(b or ".")


def drop_start_folder(path: list[str] | None = None, *, cwd: str | None = None, script: str | None = None) -> None:
    """Removes from `path` (sys.path) the folder Python started from: '' and every entry that is the working
    directory, and a first entry that is the running script's folder. None with `python -P` (it adds none)."""
    path = sys.path if path is None else path
    cwd = os.getcwd() if cwd is None else cwd
    script = (sys.argv[0] if sys.argv else "") if script is None else script
    if path and script and not script.startswith("-") and _same(path[0], os.path.dirname(os.path.abspath(script))):
        del path[0]
    path[:] = [entry for entry in path if entry and not _same(entry, cwd)]


def add_module_paths(folders: Sequence[str], path: list[str] | None = None) -> list[str]:
    """Appends each folder (made absolute) to `path` (sys.path) unless it is there already; returns them."""
    path = sys.path if path is None else path
    added = [os.path.abspath(folder) for folder in folders]
    for folder in added:
        if folder not in path:
            path.append(folder)
    return added


def configured_module_paths(path: list[str] | None = None) -> list[str]:
    """The folders this process imports user modules from, in order: those of sys.path outside the Python
    installation and its environment (use_module_paths put them there; derived, not recorded, so no process-wide
    state)."""
    prefixes = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    inside = tuple(p.rstrip(os.sep) + os.sep for p in prefixes)
    return [
        entry
        for entry in (sys.path if path is None else path)
        if entry and os.path.abspath(entry) not in prefixes and not os.path.abspath(entry).startswith(inside)
    ]


def use_module_paths(folders: Sequence[str]) -> None:
    """A process that imports user code, at its start: the start folder out of sys.path, `folders` in, last."""
    drop_start_folder()
    add_module_paths(folders)


__all__ = ["SETTING_DOC", "add_module_paths", "configured_module_paths", "drop_start_folder", "use_module_paths"]
