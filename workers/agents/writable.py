"""Whether agents can write where the worker imports or executes from, checked when the worker starts.

An agent that can write a folder on the worker's `sys.path` (or anything in it) plants a module the worker, or a
process it starts, imports: its code then runs with the worker's Redis password and engine keys in reach. One that
can write an allowed command folder (`command:/opt/agents/*`) puts any program there (a copy of /bin/sh) and a job
runs it, so the pattern allows anything. One that can write an environment's virtualenv (`verifiers_python`,
`openenv_python`: rollq.workers.environments) changes the code every later episode of that environment runs. The
worker's working directory counts too: Python processes started with `-c` (multiprocessing's fork server and
resource tracker) import from it first.

- With `agent_user` (agents run as another user) every such place, and everything below the folders, must be
  unwritable by that user: the worker refuses to start otherwise (`AgentCanWrite`, naming the path). A uid range
  (`FIRST-LAST:GID`) is checked as one identity: a place is writable when any uid of the range owns it, the group
  may write it, or everyone may (one walk, whatever the range's size).
- Without it agents run as the worker's own user and can write whatever that user can: the worker logs one WARNING
  naming the places its own user can write (the entries themselves; what lies below them is the same user's too).

The check reads owners and modes (a user may write what it owns, since it may change its mode, and what its group or
everyone may write); ACLs and read-only mounts are not looked at.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import sys
from collections.abc import Iterator, Sequence

import msgspec

from rollq.workers.agents.agent_user import AgentUser, AgentUsers, cannot_switch, parse_agent_users
from rollq.workers.resolver import COMMAND_PREFIX

log = logging.getLogger("rollq.worker")

_WILDCARD = re.compile(r"[*?[]")


class AgentCanWrite(Exception):
    """The agents' user can write a place the worker imports or executes from."""


class Writable(msgspec.Struct, frozen=True):
    path: str  # what the agents' user can write
    place: str  # the entry it is or lies in
    # "command folder", "PATH folder", "allowed program", "sys.path entry", "working directory" or "virtualenv"
    kind: str

    def describe(self) -> str:
        where = "" if self.path == self.place else f" (in {self.place})"
        return f"{self.path}{where}, {_KIND_TEXT[self.kind]}"


_KIND_TEXT = {
    "command folder": "an allowed command folder",
    "sys.path entry": "a sys.path entry",
    "working directory": "the worker's working directory",
    "PATH folder": "a folder on the worker's PATH, where a program allowed by name is looked up",
    "allowed program": "a program allowed by name",
    "virtualenv": "the virtualenv of an environment's interpreter (verifiers_python, openenv_python)",
}


def command_folders(patterns: Sequence[str], cwd: str) -> list[str]:
    """The fixed leading part of each `command:` pattern that names a path (up to its first component with a
    wildcard: `command:agents/*` -> CWD/agents), absolute."""
    out = []
    for pattern in patterns:
        if not pattern.startswith(COMMAND_PREFIX) or "/" not in pattern:
            continue
        parts = pattern[len(COMMAND_PREFIX) :].split("/")
        fixed = next((i for i, part in enumerate(parts) if _WILDCARD.search(part)), len(parts))
        head = "/".join(parts[:fixed]) or "/"
        out.append(os.path.normpath(os.path.join(cwd, head)))
    return list(dict.fromkeys(out))


def command_names(patterns: Sequence[str]) -> list[str]:
    """The `command:` patterns that name a program by its name alone (`command:node`): found on the worker's PATH."""
    return [p[len(COMMAND_PREFIX) :] for p in patterns if p.startswith(COMMAND_PREFIX) and "/" not in p]


def path_places(names: Sequence[str], search_path: str) -> list[tuple[str, str]]:
    """For programs allowed by name: every PATH folder (an agent that can write one earlier than the program's own
    puts its own program of that name there, and a job runs it) and the program each name finds (replaced in
    place)."""
    if not names:
        return []
    found = [(os.path.abspath(folder), "PATH folder") for folder in search_path.split(os.pathsep) if folder]
    for name in names:
        program = None if _WILDCARD.search(name) else shutil.which(name, path=search_path)
        if program is not None:
            found.append((os.path.abspath(program), "allowed program"))
    return found


def places(
    patterns: Sequence[str],
    path: Sequence[str],
    cwd: str,
    search_path: str | None = None,
    virtualenvs: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """(place, kind) for every place agents must not write (`search_path`: the worker's PATH; `virtualenvs`: the
    folders of the environments' interpreters)."""
    search_path = os.environ.get("PATH", os.defpath) if search_path is None else search_path
    found = [(folder, "command folder") for folder in command_folders(patterns, cwd)]
    found += [(os.path.abspath(folder), "virtualenv") for folder in virtualenvs]
    found += path_places(command_names(patterns), search_path)
    found += [(os.path.abspath(entry), "sys.path entry") for entry in path if entry]
    found.append((cwd, "working directory"))
    unique: dict[str, str] = {}
    for place, kind in found:
        unique.setdefault(place, kind)  # a place once, as the first kind that names it
    return list(unique.items())


Agents = AgentUser | AgentUsers  # one user, or a uid range with one group


def user_can_write(st: os.stat_result, user: Agents) -> bool:
    """`user` (no supplementary groups; with a range, any of its uids) may write the file `st` describes: it owns it
    (and so may change its mode), or its group or everyone may write it."""
    owner = st.st_uid == user.uid if isinstance(user, AgentUser) else user.holds(st.st_uid)
    if owner:
        return True
    if st.st_gid == user.gid:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _existing(path: str) -> str:
    """`path`, or its nearest existing ancestor (where a missing entry could be created)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _walk_writable(top: str, user: Agents) -> Iterator[str]:
    """Everything under `top` (itself included; a file also through its folder) that `user` can write. Links are
    not followed into (a link's own mode means nothing), but a link's target is checked itself."""
    real = os.path.realpath(top)
    try:
        st = os.stat(real)
    except OSError:
        return
    if user_can_write(st, user):
        yield top
    if not stat.S_ISDIR(st.st_mode):
        parent = os.path.dirname(real)
        if user_can_write(os.stat(parent), user):
            yield parent  # it can replace the file
        return
    for root, dirs, files in os.walk(real, onerror=lambda _: None):
        for name in dirs + files:
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
                if stat.S_ISLNK(st.st_mode):
                    st = os.stat(full)
            except OSError:
                continue  # a dangling link: nothing to import through it
            if user_can_write(st, user):
                yield full


def writable_places(
    patterns: Sequence[str],
    user: Agents | None,
    *,
    path: Sequence[str] | None = None,
    cwd: str | None = None,
    search_path: str | None = None,
    virtualenvs: Sequence[str] = (),
) -> list[Writable]:
    """What agents could write among the places the worker imports or executes from: allowed command folders
    (`patterns`: the worker's allowlist), with programs allowed by name the folders of `search_path` (default PATH),
    `path` (default sys.path), `cwd` (default the working directory) and `virtualenvs` (the environments').
    `user` None: the worker's own user (the places themselves, by os.access); else everything in them that `user`
    can write, the first finding per place."""
    cwd = os.getcwd() if cwd is None else cwd
    path = sys.path if path is None else path
    found = []
    for place, kind in places(patterns, path, cwd, search_path, virtualenvs):
        target = _existing(place)
        if user is None:
            if os.access(target, os.W_OK):
                found.append(Writable(target, place, kind))
            continue
        if target != place:  # missing: whoever can write its nearest ancestor can create it
            try:
                if user_can_write(os.stat(target), user):
                    found.append(Writable(target, place, kind))
            except OSError:
                pass
            continue
        if kind in ("working directory", "PATH folder"):  # the folder's own entries: what is looked up in it
            try:
                writable = user_can_write(os.stat(place), user)
            except OSError:
                writable = False
            if writable:
                found.append(Writable(place, place, kind))
            continue
        first = next(_walk_writable(place, user), None)
        if first is not None:
            found.append(Writable(first, place, kind))
    return found


def check_agent_writable(
    patterns: Sequence[str],
    user: Agents | None,
    *,
    path: Sequence[str] | None = None,
    cwd: str | None = None,
    search_path: str | None = None,
    virtualenvs: Sequence[str] = (),
) -> list[Writable]:
    """At the worker's start. With `user`: AgentCanWrite naming the first place it can write. Without: one WARNING
    naming the places the worker's own user (and so its agents) can write. Returns what was found."""
    found = writable_places(patterns, user, path=path, cwd=cwd, search_path=search_path, virtualenvs=virtualenvs)
    if not found:
        return found
    if user is not None:
        first = found[0]
        raise AgentCanWrite(
            f"agent_user {user} can write {first.describe()}: an agent could plant code this worker imports or "
            "runs. Make it unwritable by that user, or run agents as another user (agent_user, "
            "ROLLQ_WORKER_AGENT_USER)"
        )
    log.warning(
        "agents run as the worker's own user (agent_user is unset), so they can write where it imports or executes "
        "from: %s. Set agent_user to run them as a user that cannot (docs/security.md)",
        "; ".join(w.describe() for w in found),
    )
    return found


def check_agents_cannot_write(allow: Sequence[str], agent_user: str, virtualenvs: Sequence[str] = ()) -> list[Writable]:
    """The worker's check at its start (`allow`, `agent_user`: its settings; `virtualenvs`: its environments'):
    ValueError for an agent_user it cannot switch to, else check_agent_writable."""
    users = parse_agent_users(agent_user)
    if users is None:
        return check_agent_writable(allow, None, virtualenvs=virtualenvs)
    # A range: the worker switches to uids that are not its own (the first one and a command agent's) and kills
    # all processes of a command agent's uid, which must never be its own.
    if users.pooled and users.holds(os.getuid()):
        raise ValueError(f"agent_user {agent_user!r} holds this worker's own uid {os.getuid()}")
    for user in (users.shared, *([AgentUser(users.last, users.gid)] if users.pooled else [])):
        if (why := cannot_switch(user)) is not None:
            raise ValueError(f"agent_user {agent_user!r} is set but {why}, so it cannot run agents as that user")
    return check_agent_writable(allow, users if users.pooled else users.shared, virtualenvs=virtualenvs)


__all__ = [
    "AgentCanWrite",
    "Writable",
    "check_agent_writable",
    "check_agents_cannot_write",
    "command_folders",
    "user_can_write",
    "writable_places",
]
