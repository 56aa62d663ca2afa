"""The users agents run as (the worker's `agent_user` setting) and the fresh folder each agent works in.

Agents run the code under training. As the worker's own user they can write whatever the worker's user owns: its
code, its user modules, the folders its allowed commands live in. With `agent_user` they run as another user, which
the worker's files are read-only to (rollq.workers.agents.writable refuses to start a worker where they are not):
command agents are started as that user, subproc-mode agent processes and agent hosts switch to it before any
agent code runs. The worker needs the right to switch users and to kill another user's processes (an agent past its
timeout): CAP_SETUID, CAP_SETGID and CAP_KILL, which root has (compose.yaml's worker is root with those three
capabilities and no other).

Every agent works in a fresh folder of its own, removed after it (a command agent: its episode HOME; a subproc agent:
one per episode; an agent host: one per host, whose episodes share the process and so its working directory), never
in the worker's working directory. With `agent_user` the agent's side creates the folder, so it belongs to that user
(mode 0700), and removes it as that user: the worker needs no right to change owners or to bypass file modes.

`agent_user` is one user (`UID:GID`, a name), which every agent shares: agents of different episodes can then read
each other's /proc/PID/environ (their proxy keys) and signal each other. Or a range of uids, `FIRST-LAST:GID`: the
first uid runs the Python agents (subproc mode, agent hosts: these share one uid) and every running command-agent
episode gets one of the others for its whole life, returned once nothing of it runs any more
(rollq.workers.agents.uid_pool).
"""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile

import msgspec

CAP_KILL = 5  # to kill the agents' processes (another user's) at their timeout
CAP_SETGID = 6
CAP_SETUID = 7
MAX_UID = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel
MAX_RANGE_UIDS = 65536  # a larger range is a typo (each uid is a slot the worker keeps)
REMOVE_TIMEOUT_S = 60.0  # a folder left by an agent is removed within this (a very large tree may take long)


class AgentUser(msgspec.Struct, frozen=True):
    """A numeric user and group (supplementary groups: none)."""

    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


class AgentUsers(msgspec.Struct, frozen=True):
    """The `agent_user` setting: one user all agents share (`pooled` False: first == last), or uids FIRST..LAST with
    group `gid` (`pooled`), whose first uid runs the Python agents and whose others are handed out, one per running
    command-agent episode."""

    first: int
    last: int
    gid: int
    pooled: bool = False

    @property
    def shared(self) -> AgentUser:
        """The user the Python agents (subproc mode, agent hosts) run as; all command agents too when not pooled."""
        return AgentUser(self.first, self.gid)

    def command_uids(self) -> range:
        """The uids handed out one per command-agent episode (empty when not pooled: they share `shared`)."""
        return range(self.first + 1, self.last + 1) if self.pooled else range(0)

    def holds(self, uid: int) -> bool:
        return self.first <= uid <= self.last

    def __str__(self) -> str:
        return f"{self.first}-{self.last}:{self.gid}" if self.pooled else f"{self.first}:{self.gid}"


def _id(value: str, lookup: str) -> int:
    if value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid if lookup == "user" else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"agent_user {value!r}: no {lookup} of that name on this machine") from None


def parse_agent_users(spec: str) -> AgentUsers | None:
    """`UID:GID`, `NAME:GROUP`, a user name (its primary group), a UID with an entry in /etc/passwd, or a uid range
    `FIRST-LAST:GID` (GID numeric or a group name; at least two uids); "" = None."""
    spec = spec.strip()
    if not spec:
        return None
    user, sep, group = spec.partition(":")
    first, dash, last = user.partition("-")
    if dash and first.isdigit() and last.isdigit():  # a range (a user name may hold a dash: rollq-agent)
        if not (sep and group):
            raise ValueError(f"agent_user {spec!r}: a uid range is FIRST-LAST:GID, e.g. 20000-20255:20000")
        if int(last) <= int(first) or int(last) - int(first) >= MAX_RANGE_UIDS or int(last) > MAX_UID:
            raise ValueError(
                f"agent_user {spec!r}: a uid range holds 2 to {MAX_RANGE_UIDS} uids up to {MAX_UID} (the first runs "
                "Python agents, each running command agent gets one of the others)"
            )
        gid = _id(group, "group")
        if int(first) == 0 or gid == 0:
            raise ValueError(f"agent_user {spec!r} holds root (uid or gid 0): agents must run as unprivileged users")
        return AgentUsers(int(first), int(last), gid, pooled=True)
    single = _parse_single(spec, user, sep, group)
    return AgentUsers(single.uid, single.uid, single.gid)


def parse_agent_user(spec: str) -> AgentUser | None:
    """The user Python agents (subproc mode, agent hosts) run as: `agent_user`'s only user, or its range's first
    uid (parse_agent_users); "" = None."""
    users = parse_agent_users(spec)
    return None if users is None else users.shared


def _parse_single(spec: str, user: str, sep: str, group: str) -> AgentUser:
    if not user or (sep and not group):
        raise ValueError(f"agent_user {spec!r} must be UID:GID or a user name")
    uid = _id(user, "user")
    if sep:
        gid = _id(group, "group")
    else:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            raise ValueError(f"agent_user {spec!r}: no such user here; give UID:GID") from None
    if uid == 0 or gid == 0:
        raise ValueError(f"agent_user {spec!r} is root (uid or gid 0): agents must run as an unprivileged user")
    return AgentUser(uid, gid)


def cannot_switch(user: AgentUser) -> str | None:
    """Why this process cannot run processes as `user` (None: it can)."""
    if os.geteuid() == user.uid and os.getegid() == user.gid:
        return None
    if not sys.platform.startswith("linux"):
        return None if os.geteuid() == 0 else "the worker is not root"
    try:
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("CapEff:"))
    except (OSError, StopIteration):
        return None if os.geteuid() == 0 else "the worker is not root"
    effective = int(line.split()[1], 16)
    if all(effective >> cap & 1 for cap in (CAP_SETUID, CAP_SETGID, CAP_KILL)):
        return None
    return "the worker lacks CAP_SETUID, CAP_SETGID or CAP_KILL (to start agents as that user and kill them)"


def become(user: AgentUser | None) -> None:
    """Switch this process to `user` for good (its groups dropped); a no-op when it runs as `user` already."""
    if user is None or (os.getuid() == user.uid and os.getgid() == user.gid and not os.getgroups()):
        return
    os.setgroups([])
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)


def new_folder_path(kind: str = "agent") -> str:
    """A fresh, unguessable path in the temporary directory, for a folder the agent's side creates."""
    return os.path.join(tempfile.gettempdir(), f"rollq-{kind}-{secrets.token_hex(12)}")


def enter_folder(path: str, user: AgentUser | None) -> None:
    """In the agent's process: become `user`, create `path` (mode 0700, so it is the agent's) and work in it."""
    become(user)
    os.mkdir(path, 0o700)
    os.chdir(path)


def remove_folder(path: str, user: AgentUser | None) -> None:
    """Remove an agent's folder and all it holds (blocking: run it in a thread). As `user` when that is another
    user than this process's, whose files this process may have no right to remove."""
    if user is None or os.geteuid() == user.uid:
        shutil.rmtree(path, ignore_errors=True)
        return
    if not os.path.lexists(path):
        return
    rm = shutil.which("rm") or "/bin/rm"
    subprocess.run(
        [rm, "-rf", "--", path],
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=REMOVE_TIMEOUT_S,
        check=False,
        cwd="/",
    )


__all__ = [
    "AgentUser",
    "AgentUsers",
    "become",
    "cannot_switch",
    "enter_folder",
    "new_folder_path",
    "parse_agent_user",
    "parse_agent_users",
    "remove_folder",
]
