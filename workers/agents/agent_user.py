"""The user agents run as (the worker's `agent_user` setting) and the fresh folder each agent works in.

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
REMOVE_TIMEOUT_S = 60.0  # a folder left by an agent is removed within this (a very large tree may take long)


class AgentUser(msgspec.Struct, frozen=True):
    """A numeric user and group (supplementary groups: none)."""

    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


def _id(value: str, lookup: str) -> int:
    if value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid if lookup == "user" else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"agent_user {value!r}: no {lookup} of that name on this machine") from None


def parse_agent_user(spec: str) -> AgentUser | None:
    """`UID:GID`, `NAME:GROUP`, a user name (its primary group) or a UID with an entry in /etc/passwd; "" = None."""
    spec = spec.strip()
    if not spec:
        return None
    user, sep, group = spec.partition(":")
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
    "become",
    "cannot_switch",
    "enter_folder",
    "new_folder_path",
    "parse_agent_user",
    "remove_folder",
]
