"""Import paths -> objects, behind the worker's allowlist. Every import a job causes comes through here: its workflow,
and inside its workflow kwargs a reward function, tools or anything else a built-in loop resolves.

Jobs come from a queue that every producer can write to, and importing runs code (a module's top level, then a
class's constructor with the job's kwargs), so a worker checks each path against the operator's allowlist *before*
importing or constructing anything. A rollq worker, reward worker and subproc agent child always enforce one
(`enforcing()` / `allowlist=`); code that calls `resolve()` in its own process (a script, a test) without one is
trusted, as any Python import is.

Patterns are shell-style (`fnmatch`) over the dotted name of the object, `module.attr` (`pkg.mod:Cls` is checked as
`pkg.mod.Cls`); a pattern also covers everything below it, so `my_pkg` allows `my_pkg.rewards:score`. Besides the
path itself, the module a resolved class or function was defined in must be allowed too (a re-export is not a way
around the list), attributes starting with `_` are never followed, and a path must not name a module.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import importlib
import inspect
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec

log = logging.getLogger("rollq.worker")

# rollq's own objects a job may name without the operator listing them: the built-in loops and tasks' rewards.
BUILTIN_ALLOWED = ("rollq.workers.builtin", "rollq.trainer.toy", "rollq.trainer.arithmetic")

# Import paths that jobs and configs named before the packages moved under `rollq.` (module -> its new name).
LEGACY_MODULES = {
    "workers.builtin.rlvr": "rollq.workers.builtin.rlvr",
    "workers.builtin.multi_turn": "rollq.workers.builtin.multi_turn",
    "workers.builtin.tool_agent": "rollq.workers.builtin.tool_agent",
    "trainer.toy": "rollq.trainer.toy",
}
_OLD_TOP_LEVEL = ("protocol", "producer", "workers", "engine", "trainer")


class WorkflowLoadError(Exception):
    """The import path does not name a usable object. Deterministic: the job is dead-lettered at once."""


class ImportNotAllowed(WorkflowLoadError):
    """The path is outside the allowlist; nothing was imported."""


class Allowlist(msgspec.Struct, frozen=True):
    """What jobs may import on this process: rollq's built-ins plus the operator's patterns."""

    patterns: tuple[str, ...] = ()  # the operator's (shell-style, over dotted names; a name covers what is below it)
    setting: str = "allow"  # where the operator extends the list (flag, config key, variable), named in a refusal

    def allows(self, dotted: str) -> bool:
        return any(
            fnmatch.fnmatchcase(dotted, p) or fnmatch.fnmatchcase(dotted, p + ".*")
            for p in (*BUILTIN_ALLOWED, *self.patterns)
        )

    def check(self, path: str, dotted: str | None = None) -> None:
        dotted = dotted or _dotted(path)
        if not self.allows(dotted):
            raise ImportNotAllowed(
                f"import path {path!r} is not allowed here, so nothing was imported; the operator can allow it with "
                f"{self.setting} (e.g. {path!r}). Allowed now: {', '.join(self.describe())}"
            )

    def check_command(self, executable: str) -> None:
        """Commands a job may run are named the same way, as `command:NAME` (e.g. `command:python3`)."""
        if not any(fnmatch.fnmatchcase(f"command:{executable}", p) for p in self.patterns):
            raise ImportNotAllowed(
                f"command {executable!r} is not allowed here; the operator can allow it with {self.setting} "
                f"(e.g. 'command:{executable}')"
            )

    def describe(self) -> list[str]:
        return [f"{p}.*" for p in BUILTIN_ALLOWED] + list(self.patterns)


_ACTIVE: contextvars.ContextVar[Allowlist | None] = contextvars.ContextVar("rollq_import_allowlist", default=None)


@contextlib.contextmanager
def enforcing(allowlist: Allowlist) -> Iterator[None]:
    """Every `resolve()` in this context (and the tasks and threads it starts) checks `allowlist`."""
    token = _ACTIVE.set(allowlist)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_allowlist() -> Allowlist | None:
    return _ACTIVE.get()


def split_import_path(path: str) -> tuple[str, str]:
    if not isinstance(path, str):
        raise WorkflowLoadError(f"an import path must be a string, got {type(path).__name__}")
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise WorkflowLoadError(f"{path!r} is not an import path like 'package.module:Class' or 'package.module.Class'")
    return module, attr


def current_path(path: str) -> str:
    """`path` with a module that moved under `rollq.` renamed (old jobs and configs keep working)."""
    module, attr = split_import_path(path)
    new = LEGACY_MODULES.get(module)
    if new is None:
        return path
    log.warning("import path %r names rollq's old module %r; using %r", path, module, new)
    return f"{new}:{attr}"


def resolve(path: str, *, allowlist: Allowlist | None = None) -> Any:
    """The object `path` names, after the allowlist (the given one, else the active one) has allowed it."""
    path = current_path(path)
    module_name, attr_path = split_import_path(path)
    allowlist = allowlist or _ACTIVE.get()
    if allowlist is not None:
        allowlist.check(path)
    parts = attr_path.split(".")
    if any(p.startswith("_") for p in parts):
        raise WorkflowLoadError(f"import path {path!r} names a private attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import can raise anything
        raise WorkflowLoadError(
            f"cannot import module {module_name!r} for {path!r}: {type(exc).__name__}: {exc}{_moved_hint(module_name)}"
        ) from None
    for part in parts:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WorkflowLoadError(f"module {module_name!r} has no attribute {attr_path!r} ({path!r})") from None
        if isinstance(obj, ModuleType):
            raise WorkflowLoadError(f"import path {path!r} names a module, not a class, function or object")
    if allowlist is not None and (inspect.isclass(obj) or inspect.isroutine(obj)):
        home = getattr(obj, "__module__", None) or ""
        defined = f"{home}.{getattr(obj, '__qualname__', '')}"
        if not allowlist.allows(defined):
            raise ImportNotAllowed(
                f"import path {path!r} names {defined}, defined in a module the allowlist does not cover; the "
                f"operator can allow it with {allowlist.setting} (e.g. {home!r})"
            )
    return obj


def _dotted(path: str) -> str:
    module, attr = split_import_path(path)
    return f"{module}.{attr}"


def _moved_hint(module: str) -> str:
    if module.split(".", 1)[0] in _OLD_TOP_LEVEL:
        return f" (rollq's packages import as rollq.*: did you mean 'rollq.{module}'?)"
    return ""


__all__ = [
    "BUILTIN_ALLOWED",
    "Allowlist",
    "ImportNotAllowed",
    "WorkflowLoadError",
    "active_allowlist",
    "current_path",
    "enforcing",
    "resolve",
    "split_import_path",
]
