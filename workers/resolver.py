"""Import paths -> objects, behind the worker's allowlist. Every import a job causes comes through here: its workflow,
and inside its workflow kwargs a reward function, tools or anything else a built-in loop resolves.

Jobs come from a queue that every producer can write to, and importing runs code (a module's top level, then a
class's constructor with the job's kwargs), so a worker checks each path against the operator's allowlist *before*
importing or constructing anything. A rollq worker, reward worker and subproc agent child always enforce one
(`enforcing()` / `allowlist=`); code that calls `resolve()` in its own process (a script, a test) without one is
trusted, as any Python import is.

Patterns are shell-style (`fnmatch`) over the dotted name of the object, `module.attr` (`pkg.mod:Cls` is checked as
`pkg.mod.Cls`); a pattern also covers everything below it, so `my_pkg` allows `my_pkg.rewards:score`. After the
import, the walk from the module to the object follows these rules:
- it goes only through classes: `mod:NAME` (any attribute of the module: a function, a class, an object the module
  built such as a ToolRegistry or a list) and `mod:Cls.attr` (`Cls.method`, `Cls.Inner.CONST`) are paths, but
  `mod:OBJ.attr` is not: an object's attributes are whatever it holds, from anywhere (`allowed_pkg:HELPER.scan_once`
  would hand out a C scanner of the json module);
- every class and routine on the way, the object itself included, must be defined in an allowed module (a
  re-export such as `from os import system` is not a way around the list). A callable that is neither (a
  `functools.partial(os.system, ...)`, an instance with `__call__`) is refused: nothing says where what it calls
  comes from. Other objects have no module of their own: they are allowed as attributes of an allowed module or
  class;
- attributes starting with `_` are never followed, and a path must not name a module.

Commands (`exec:PROGRAM ARGS...`, rollq.workers.agents.command) are listed as `command:NAME` patterns and checked by
`Allowlist.check_command`: the program as the job wrote it, and the file it really is (symbolic links resolved), see
there. Environment variables a job passes to a command agent are listed as `env:NAME` patterns. Environments
(`verifiers:ENV_ID`, `openenv:NAME`, rollq.workers.environments) are listed as patterns of the same form and checked
by `Allowlist.check_environment`.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import importlib
import inspect
import os
import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec

from rollq.module_paths import configured_module_paths

# rollq's own objects a job may name without the operator listing them: the built-in loops and the built-in toy
# tasks' rewards.
BUILTIN_ALLOWED = ("rollq.workers.builtin", "rollq.tasks")
COMMAND_PREFIX = "command:"  # patterns naming programs a job may run (`exec:PROGRAM`)
ENV_PREFIX = "env:"  # patterns naming environment variables a job may pass to a command agent
_WILDCARD = re.compile(r"[*?[]")


class WorkflowLoadError(Exception):
    """The import path does not name a usable object. Deterministic: the job is dead-lettered at once."""


class ImportNotAllowed(WorkflowLoadError):
    """The path is outside the allowlist; nothing was imported."""


class Allowlist(msgspec.Struct, frozen=True):
    """What jobs may import on this process: rollq's built-ins plus the operator's patterns; for one job, possibly
    narrowed to what the job itself may use (`within`, Job.allow: its ingress tenant's patterns)."""

    patterns: tuple[str, ...] = ()  # the operator's (shell-style, over dotted names; a name covers what is below it)
    setting: str = "allow"  # where the operator extends the list (flag, config key, variable), named in a refusal
    # A job's own patterns (Job.allow): only what `patterns` AND these (or rollq's built-ins) allow. None: no narrowing.
    within: tuple[str, ...] | None = None

    def narrowed(self, patterns: list[str] | tuple[str, ...] | None) -> Allowlist:
        """This list for a job whose own patterns are `patterns` (None: as it is)."""
        if patterns is None:
            return self
        return msgspec.structs.replace(self, within=tuple(patterns))

    def allows(self, dotted: str) -> bool:
        return _matches(dotted, (*BUILTIN_ALLOWED, *self.patterns)) and (
            self.within is None or _matches(dotted, (*BUILTIN_ALLOWED, *self.within))
        )

    def check(self, path: str, dotted: str | None = None) -> None:
        dotted = dotted or _dotted(path)
        self.check_within(path, dotted)
        if not self.allows(dotted):
            raise ImportNotAllowed(
                f"import path {path!r} is not allowed here, so nothing was imported; the operator can allow it with "
                f"{self.setting} (e.g. {path!r}). Allowed now: {', '.join(self.describe())}"
            )

    def check_within(self, path: str, dotted: str | None = None) -> None:
        """Only the job's own patterns (`within`): for a path this process hands to another to resolve under that
        one's list (a remote reward function, run by a reward worker)."""
        dotted = dotted or _dotted(path)
        if self.within is not None and not _matches(dotted, (*BUILTIN_ALLOWED, *self.within)):
            raise ImportNotAllowed(
                f"import path {path!r} is not among the patterns this job may use (its tenant's, ingress "
                f"tenant_workflows: {', '.join(self.within)}), so nothing was imported"
            )

    def check_command(self, program: str, found: str | None) -> None:
        """A command a job may run: `program` as the job wrote it, `found` the file it names (`shutil.which`: a
        path as it is, a bare name on the worker's PATH; None when there is none).

        - A bare name is allowed by a pattern naming it (`command:python3`, `command:py*`): the program the worker's
          PATH finds under that name, whatever it links to (the operator's PATH is trusted). A bare name no pattern
          names is checked as the path PATH finds for it (below), so `command:/opt/agents/*` covers `exec:run.sh`
          when /opt/agents is on the PATH.
        - A path must match a pattern as written (`command:/opt/agents/*`, `command:agents/*` relative to the
          worker's folder), and the file it really is, symbolic links resolved, must match a pattern too, with the
          fixed folders of path patterns resolved the same way. So a link inside an allowed folder to a file outside
          every allowed one (`agents/sh -> /bin/sh`) is refused, a link to another allowed file is not, and an
          allowed folder reached through a linked parent (/work -> /data/work) still is allowed.
        The caller refuses `..` components before (they could leave an allowed folder) and runs `found`: the file
        checked here, whatever PATH the job's environment names. A narrowed list checks the job's own patterns the
        same way first."""
        if self.within is not None:
            self._within().check_command(program, found)
        if "/" in program:
            if not self._lists_command(program):
                raise self._command_refused(program)
            if found is None:
                return  # allowed by name; the caller says that no such executable exists
        elif self._lists_command(program):
            return
        elif found is None or not self._lists_command(found):
            raise self._command_refused(program)
        real = os.path.realpath(found)
        if not any(fnmatch.fnmatchcase(f"{COMMAND_PREFIX}{real}", _real_pattern(p)) for p in self.patterns):
            raise ImportNotAllowed(
                f"command {program!r} is a symbolic link (or lies in a linked folder) to a file that no command: "
                f"pattern allows, so nothing ran; the operator can allow its target with {self.setting}"
            )

    def check_env(self, name: str) -> None:
        """Environment variables a job passes to a command agent are named as `env:NAME` (e.g. `env:AGENT_MODE`)."""
        if self.within is not None:
            self._within().check_env(name)
        if not any(fnmatch.fnmatchcase(f"{ENV_PREFIX}{name}", p) for p in self.patterns):
            raise ImportNotAllowed(
                f"environment variable {name!r} may not be set by a job here; the operator can allow it with "
                f"{self.setting} (e.g. 'env:{name}')"
            )

    def check_environment(self, kind: str, name: str) -> None:
        """An environment a job names (`verifiers:ENV_ID`, `openenv:NAME`), as written, by a pattern of the same
        form (`verifiers:my-env`, `verifiers:math-*`, `openenv:team/*`, `verifiers:*` for all). A pattern does not
        cover names "below" it here: `openenv:echo` is not `openenv:echo.x`."""
        if self.within is not None:
            self._within().check_environment(kind, name)
        named = f"{kind}:{name}"
        if not any(fnmatch.fnmatchcase(named, p) for p in self.patterns):
            raise ImportNotAllowed(
                f"environment {named!r} is not allowed here, so nothing ran; the operator can allow it with "
                f"{self.setting} (e.g. {named!r})"
            )

    def _within(self) -> Allowlist:
        assert self.within is not None
        return Allowlist(self.within, setting="the job's tenant patterns (ingress tenant_workflows)")

    def _lists_command(self, program: str) -> bool:
        return any(fnmatch.fnmatchcase(f"{COMMAND_PREFIX}{program}", p) for p in self.patterns)

    def _command_refused(self, program: str) -> ImportNotAllowed:
        return ImportNotAllowed(
            f"command {program!r} is not allowed here; the operator can allow it with {self.setting} "
            f"(e.g. 'command:{program}')"
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


def resolve(path: str, *, allowlist: Allowlist | None = None) -> Any:
    """The object `path` names, after the allowlist (the given one, else the active one) has allowed it."""
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
            f"cannot import module {module_name!r} for {path!r}: {type(exc).__name__}: {exc}"
            + _not_found_hint(exc, module_name)
        ) from None
    for part in parts:
        if not (isinstance(obj, ModuleType) or inspect.isclass(obj)):
            raise WorkflowLoadError(
                f"import path {path!r} goes into the attributes of a {type(obj).__name__} object: a path names a "
                "module's attribute or a class's (module:NAME, module:Class.attr), nothing held by other objects"
            )
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WorkflowLoadError(
                f"module {module_name!r} has no attribute {attr_path!r} ({path!r})" + _stale_hint(module_name)
            ) from None
        if isinstance(obj, ModuleType):
            raise WorkflowLoadError(f"import path {path!r} names a module, not a class, function or object")
        if allowlist is not None:
            _check_home(obj, path, allowlist)
    return obj


def _not_found_hint(exc: Exception, module_name: str) -> str:
    """Where a missing user module should have been (the path was allowed, so saying so reveals nothing the
    allowlist hides): the folders of the process's module_paths; a worker does not search its working directory.
    A misspelt module name lands here too."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
        return ""  # found, or something it imports is missing
    folders = configured_module_paths()
    where = f"its module paths: {', '.join(folders)}" if folders else "no module paths are set"
    return (
        f"; no module {missing!r} among the installed packages or on the module paths ({where}): check the name's "
        "spelling; a rollq worker or reward worker imports user modules from the folders of its module_paths "
        "setting (--module-path DIR, ROLLQ_WORKER_MODULE_PATHS), never from its working directory"
    )


def _stale_hint(module_name: str) -> str:
    """A process imports a module once and keeps it: an attribute added to the file since is not there until the
    process restarts (the usual reason a name that is in the file is "missing")."""
    return (
        f"; this process imported {module_name!r} when a job first used it and keeps that copy: edits made to the "
        "file since are seen only after the worker restarts"
    )


def _check_home(obj: Any, path: str, allowlist: Allowlist) -> None:
    """A class or routine on a job's path must be defined in an allowed module. Other callables are refused: what
    they call is not theirs to say (a `functools.partial(os.system, ...)` has the module `functools`, an instance's
    `__call__` may be anything), so no module of theirs could be checked. Other objects (data, registries) have no
    home: allowed as attributes of an allowed module or class."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        if callable(obj):
            raise ImportNotAllowed(
                f"import path {path!r} names a callable {type(obj).__name__} object, neither a class nor a function: "
                "what it calls can't be checked against the allowlist, so a path may name a callable only as a "
                "class, a function or a method (define a function that calls it)"
            )
        return
    home = getattr(obj, "__module__", None) or ""
    defined = f"{home}.{getattr(obj, '__qualname__', '')}"
    if not allowlist.allows(defined):
        raise ImportNotAllowed(
            f"import path {path!r} names {defined}, defined in a module the allowlist does not cover; the "
            f"operator can allow it with {allowlist.setting} (e.g. {home!r})"
        )


def _matches(dotted: str, patterns: tuple[str, ...]) -> bool:
    """Shell-style, a pattern also covering everything below it (`my_pkg` covers `my_pkg.rewards.score`)."""
    return any(fnmatch.fnmatchcase(dotted, p) or fnmatch.fnmatchcase(dotted, p + ".*") for p in patterns)


def _real_pattern(pattern: str) -> str:
    """A `command:` path pattern with its fixed leading folders (up to the first component with a wildcard) resolved
    to their real path, as the program's own path is; other patterns as they are."""
    if not pattern.startswith(COMMAND_PREFIX) or "/" not in pattern:
        return pattern
    parts = pattern[len(COMMAND_PREFIX) :].split("/")
    fixed = next((i for i, part in enumerate(parts) if _WILDCARD.search(part)), len(parts))
    if fixed == 0:
        return pattern  # starts with a wildcard: nothing fixed to resolve
    real = os.path.realpath("/".join(parts[:fixed]) or "/")
    rest = "/".join(parts[fixed:])
    return COMMAND_PREFIX + (f"{real.rstrip('/')}/{rest}" if rest else real)


def _dotted(path: str) -> str:
    module, attr = split_import_path(path)
    return f"{module}.{attr}"


__all__ = [
    "BUILTIN_ALLOWED",
    "Allowlist",
    "ImportNotAllowed",
    "WorkflowLoadError",
    "active_allowlist",
    "enforcing",
    "resolve",
    "split_import_path",
]
