"""One uid per running command-agent episode, when the worker's `agent_user` is a uid range (`FIRST-LAST:GID`).

Processes of one uid can read each other's /proc/PID/environ, where a command agent's proxy key lies: with that key
one tenant's agent writes completions into another tenant's episode (issue 43, A1). So with a range every
command-agent episode takes a uid that no other running episode has (`UidPool.acquire`: an asyncio wait, cancellable,
bounded by the episode's own timeout, while none is free) and gives it back when it ends.

An agent can leave its process group (setsid, a double fork), which the episode's group kill misses, and then wait
for the next episode of its uid to read that one's environment. So when an episode ends, before its uid goes back,
every process of that uid is killed (`kill_uid`): a short-lived helper drops to the uid and calls kill(-1, SIGKILL),
which, sent by a non-root process, reaches exactly the processes of its own uid (and, in a container, of its own pid
namespace). At the end rather than before reuse: a free uid is then always clean, so a new episode never waits for a
cleanup, and nothing an agent left keeps running (and using the machine) after its episode. A uid is also cleaned
once before its first hand-out in this worker, for what an earlier worker process on this machine left running as
it. A uid whose processes outlive the kill (a process stuck in the kernel) is not handed out again (logged).

The worker must be the only one handing out these uids in its pid namespace: two workers sharing a range would kill
each other's agents. The range's first uid runs the Python agents (subproc mode, agent hosts) and is never handed
out here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import signal
import subprocess
import time

from rollq.workers.agents.agent_user import AgentUser, AgentUsers, become

log = logging.getLogger("rollq.worker")

KILL_TIMEOUT_S = 10.0  # a uid's processes are gone within this after SIGKILL, or the uid is retired
KILL_ROUNDS = 16  # kill(-1) calls per helper; a fork racing one call is caught by the next


class UidPool:
    """The command uids of `users` (a range), each held by at most one episode at a time (one pool per worker
    process: WorkflowContext.pool)."""

    def __init__(self, users: AgentUsers) -> None:
        if not users.pooled:
            raise ValueError(f"agent_user {users} is one uid, not a range")
        self.users = users
        self._free: asyncio.Queue[int] = asyncio.Queue()  # FIFO: a uid just given back is handed out last
        for uid in users.command_uids():
            self._free.put_nowait(uid)
        self._clean: set[int] = set()  # uids this worker cleaned (kill_uid) since they were last in use
        self.waiting = 0  # episodes waiting for a free uid

    async def acquire(self) -> AgentUser:
        """A uid no running episode has, for one episode (waits while none is free). The caller must `release` it."""
        if self._free.empty():
            log.debug("every command-agent uid of agent_user %s is in use: the episode waits", self.users)
        self.waiting += 1
        try:
            uid = await self._free.get()
        finally:
            self.waiting -= 1
        return AgentUser(uid, self.users.gid)

    async def ready(self, user: AgentUser) -> None:
        """Before the episode runs as `user`: on its first hand-out in this worker, kill what runs as it already.
        RuntimeError when that survives."""
        if user.uid in self._clean:
            return
        if not await asyncio.get_running_loop().run_in_executor(None, kill_uid, user):
            raise RuntimeError(f"uid {user.uid} still runs processes after SIGKILL; no agent runs as it")
        self._clean.add(user.uid)

    def release(self, user: AgentUser, clean: bool) -> None:
        """After the episode, once `kill_uid(user)` returned `clean`: the uid is free again, or retired when some
        process of it survived."""
        if clean:
            self._clean.add(user.uid)
            self._free.put_nowait(user.uid)
            return
        self._clean.discard(user.uid)
        log.error(
            "uid %d still runs processes %gs after SIGKILL (or could not be cleaned): no command agent runs as it "
            "again in this worker",
            user.uid,
            KILL_TIMEOUT_S,
        )

    async def close(self) -> None:
        """WorkflowContext.close: nothing to close (episodes end their uids themselves)."""


def kill_uid(user: AgentUser, timeout_s: float = KILL_TIMEOUT_S) -> bool:
    """Kill every process running as `user.uid` (blocking: run it in a thread). True once none is left alive
    (zombies, which run nothing, aside); False when some still are after `timeout_s`, or the helper failed."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    true = shutil.which("true") or "/bin/true"
    while True:
        try:
            subprocess.run(
                [true],
                preexec_fn=functools.partial(_kill_all_as, user),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={},
                cwd="/",
                timeout=max(deadline - time.monotonic(), 1.0),
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.error("cannot kill the processes of uid %d: %s", user.uid, exc)
            return False
        if not live_processes(user.uid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)  # SIGKILLed processes are still exiting (freeing their memory): look again shortly
        pause = min(pause * 2, 0.1)


def _kill_all_as(user: AgentUser) -> None:
    """In the helper, between fork and exec: as `user`, SIGKILL every process of that uid. Never as root (where
    kill(-1) would reach every process): the switch is checked first."""
    become(user)
    if user.uid == 0 or os.getuid() != user.uid or os.geteuid() != user.uid:
        raise RuntimeError(f"the helper does not run as uid {user.uid}")
    for _ in range(KILL_ROUNDS):
        try:
            os.kill(-1, signal.SIGKILL)  # every process this one may signal (its own uid's), itself aside
        except ProcessLookupError:
            return  # none was left


def live_processes(uid: int) -> list[int]:
    """The pids of processes (not zombies) whose real, effective or saved uid is `uid` ([] where there is no
    /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as status:
                state, uids = "", []
                for line in status:
                    if line.startswith("State:"):
                        state = line.split()[1]
                    elif line.startswith("Uid:"):
                        uids = [int(x) for x in line.split()[1:4]]
                        break
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
        if state not in ("Z", "X") and uid in uids:
            found.append(int(name))
    return found


__all__ = ["UidPool", "kill_uid", "live_processes"]
