"""Agent host processes: inline agents' episodes (`async def run`) run in N child processes instead of the worker's
event loop (`--agent-hosts N`).

An agent on the OpenAI SDK spends about as much CPU per model request in the SDK itself (request transform, httpx,
pydantic parsing) as the worker spends on the request (proxy, engine pool, Redis). In the worker's loop both share
one core; in a host the SDK's part runs on another. Each host is a long-lived child with its own event loop (uvloop
when installed), its own shared HTTP client (`WorkflowContext.agent_http_client()`, the same aiohttp-backed client
inline agents get) and many episodes at once; the agent still talks to the worker's recording proxy over loopback.

Wire: a socketpair per host, frames of a 4-byte big-endian length + a msgpack array, read with asyncio streams on
both sides (no thread per message).
  worker -> host  ["run", id, path, kwargs_json, data, urls, api_key, allowlist, episode, timeout_s]
                  ["cancel", id]   ["stop"]
  host -> worker  ["ready", pid]
                  ["ok", id, kind, value]        (agent_result's ("none" | "reward" | "rewards", value))
                  ["raised", id, type, message, traceback]
                  ["bad", id, type, repr]        (the agent returned something that is not a reward)
                  ["timeout", id]                (the episode's timeout fired in the host; its task was cancelled)

In the host the agent class is resolved with the worker's allowlist (checked again there), built once per (path,
kwargs) and called as inline mode calls it: `await agent.run(data, **extra_kwargs_for(agent.run, offered))` with
base_url, anthropic_base_url, api_key and http_client offered. The host runs a light WorkflowContext (no proxy):
`workflow_context()` works inside agents, and AsyncRewardWrappers they build share pools within the host, closed
with it.

Working directory and user: each host works in a fresh folder of its own (not per episode: its episodes share the
process), never the worker's working directory, removed when the host has exited; with the worker's agent_user it
switches to that user before any agent code runs (rollq.workers.agents.agent_user).

Environment: a host starts with the worker's environment minus the worker's secrets (ROLLQ_*, REDIS*; see
rollq.workers.agents.environment). It still holds the worker's ContextConfig, whose redis_url (with any password) is
what agents' remote rewards use to reach the reward workers: code in a host can read it.

Failure handling (worker side): an episode is picked onto the least-loaded host; hosts start lazily. The host
enforces the timeout cooperatively; the worker waits timeout + HOST_GRACE_S more, and a host that has not answered
by then is stuck (a CPU-bound agent blocking its loop): it is SIGKILLed and every episode it ran fails with
AgentHostError (retried by the worker like any workflow error). A host that dies (OOM kill, SIGKILL) fails its
episodes with its exit code. A replacement starts on the next episode. Cancelling an episode on the worker side
sends "cancel", so the host cancels the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import multiprocessing
import os
import signal
import socket
import struct
import traceback
from typing import TYPE_CHECKING, Any, cast

import msgspec

from rollq.workers.agents.agent_user import enter_folder, new_folder_path, parse_agent_user, remove_folder
from rollq.workers.agents.environment import drop_worker_secrets
from rollq.workers.context import ContextConfig, EpisodeContext, WorkflowContext, episode_scope
from rollq.workers.resolver import Allowlist, enforcing, resolve
from rollq.workers.rewards.processes import join_all

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

HOST_GRACE_S = 3.0  # past an episode's timeout, how long the worker waits for its host's answer before killing it
STARTUP_TIMEOUT_S = 60.0  # a new host must be imported and ready within this (not part of any episode's timeout)
JOIN_TIMEOUT_S = 5.0  # how long close() lets a host stop on its own before killing it
STOP_TASKS_S = 3.0  # in a stopping host, how long cancelled episodes get to unwind
_HEADER = struct.Struct(">I")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class AgentHostError(Exception):
    """The agent host process running the episode died, was killed (an agent blocked its loop) or was closed."""


class AgentHostStuck(AgentHostError):
    """This episode ran past its timeout and its host did not answer within the grace: the host was killed."""


def _frame(msg: list[Any]) -> bytes:
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


async def _read(reader: asyncio.StreamReader) -> list[Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return cast("list[Any]", _decoder.decode(await reader.readexactly(size)))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code}, {signal.Signals(-code).name}"
    return f"exit code {code}"


# -- the host process --------------------------------------------------------------------------------------------


def _host_main(sock: socket.socket, config: ContextConfig, workdir: str) -> None:
    # The host inherited the worker's environment (through the fork server); agents (and what they start) must not
    # see its secrets. The Redis URL that agents' remote rewards use comes in `config`, not from the environment.
    drop_worker_secrets(os.environ)
    # As the agents' user (if set) from here on, in a folder of its own (its episodes share the process, and so
    # its working directory), never the worker's; the worker removes it when the host has exited.
    enter_folder(workdir, parse_agent_user(config.agent_user))
    # Ctrl-C reaches the whole process group; the worker decides when hosts stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Started as a daemon (so a worker that exits without closing its hosts takes them along), but agents' own
    # AsyncRewardWrappers start processes, which a daemonic process may not.
    multiprocessing.current_process().daemon = False
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(sock, config))
    else:
        uvloop.run(_serve(sock, config))


class _Host:
    """What one host process runs: episode tasks by id, agents by (path, kwargs, allowlist)."""

    def __init__(self, writer: asyncio.StreamWriter, ctx: WorkflowContext) -> None:
        self.writer = writer
        self.ctx = ctx
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.agents: dict[tuple[str, str, Allowlist | None], Any] = {}

    def send(self, msg: list[Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(_frame(msg))

    def agent(self, path: str, kwargs_json: str, allowlist: Allowlist | None) -> Any:
        key = (path, kwargs_json, allowlist)
        agent = self.agents.get(key)
        if agent is None:
            obj = resolve(path, allowlist=allowlist)  # the worker's allowlist, checked again here
            agent = self.agents[key] = obj(**json.loads(kwargs_json)) if inspect.isclass(obj) else obj
        return agent

    def start(self, msg: list[Any]) -> None:
        _, eid, path, kwargs_json, data, urls, api_key, allow, episode, timeout = msg
        allowlist = None
        if allow is not None:
            within = None if allow[2] is None else tuple(allow[2])
            allowlist = Allowlist(patterns=tuple(allow[0]), setting=allow[1], within=within)
        ep = msgspec.convert(episode, EpisodeContext) if episode is not None else EpisodeContext()
        task = asyncio.create_task(self.episode(eid, path, kwargs_json, data, urls, api_key, allowlist, ep, timeout))
        self.tasks[eid] = task
        task.add_done_callback(lambda _: self.tasks.pop(eid, None))

    async def episode(
        self,
        eid: int,
        path: str,
        kwargs_json: str,
        data: Any,
        urls: dict[str, str],
        api_key: str,
        allowlist: Allowlist | None,
        ep: EpisodeContext,
        timeout: float,
    ) -> None:
        from rollq.workers.agents.subproc import agent_result, extra_kwargs_for

        deadline = asyncio.timeout(timeout)
        reply: list[Any]
        try:
            with enforcing(allowlist) if allowlist is not None else contextlib.nullcontext(), episode_scope(ep):
                async with deadline:
                    agent = self.agent(path, kwargs_json, allowlist)
                    offered = {**urls, "api_key": api_key, "http_client": self.ctx.agent_http_client()}
                    value = await agent.run(data, **extra_kwargs_for(agent.run, offered))
        except asyncio.CancelledError:  # the worker cancelled the episode (or the host stops): no reply
            raise
        except BaseException as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                reply = ["timeout", eid]
            else:  # the agent's own exception (a TimeoutError of its own too)
                reply = ["raised", eid, type(exc).__name__, str(exc), traceback.format_exc()]
        else:
            result = agent_result(value)
            reply = (
                ["ok", eid, *result] if result is not None else ["bad", eid, type(value).__name__, repr(value)[:200]]
            )
        try:
            self.send(reply)
        except (TypeError, ValueError) as exc:  # a value msgpack can't carry (agent_result only passes floats)
            self.send(["raised", eid, type(exc).__name__, f"the agent's result could not be sent: {exc}", ""])


async def _serve(sock: socket.socket, config: ContextConfig) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    async with WorkflowContext(config) as ctx:  # workflow_context() + shared reward pools, closed on the way out
        host = _Host(writer, ctx)
        host.send(["ready", os.getpid()])
        try:
            while True:
                try:
                    msg = await _read(reader)
                except (asyncio.IncompleteReadError, ConnectionError):  # the worker is gone
                    break
                tag = msg[0]
                if tag == "run":
                    host.start(msg)
                elif tag == "cancel":
                    task = host.tasks.get(msg[1])
                    if task is not None:
                        task.cancel()
                elif tag == "stop":
                    break
        finally:
            tasks = list(host.tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=STOP_TASKS_S)
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


# -- the worker's side -------------------------------------------------------------------------------------------


class _HostHandle:
    """The worker's view of one host process."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.process: Any = None  # multiprocessing BaseProcess, once started
        self.pid = 0
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, asyncio.Future[list[Any]]] = {}  # episodes on this host, by id
        self.starting: asyncio.Task[None] | None = None
        self.reader_task: asyncio.Task[None] | None = None
        self.dead: str | None = None  # why it can take no more episodes
        self.workdir = new_folder_path("agent-host")  # its working directory, made by the host itself

    def send(self, msg: list[Any]) -> None:
        self.send_frame(_frame(msg))

    def send_frame(self, frame: bytes) -> None:
        if self.dead is None and self.writer is not None and not self.writer.is_closing():
            self.writer.write(frame)

    def fail_pending(self, why: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(AgentHostError(why))


class AgentHosts:
    """N agent host processes (started lazily) and the episodes running in them; `close()` stops them all."""

    def __init__(
        self,
        count: int,
        config: ContextConfig | None = None,
        *,
        start_method: str = "forkserver",
        grace_s: float = HOST_GRACE_S,
    ) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        # The hosts' own context: no proxy (agents use the worker's), and never hosts of their own.
        self.config = msgspec.structs.replace(config or ContextConfig(), agent_hosts=0)
        self.grace_s = grace_s
        self._mp = cast("ForkServerContext | SpawnContext", multiprocessing.get_context(start_method))
        self._slots: list[_HostHandle | None] = [None] * count
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """Pids of the started hosts."""
        return [h.pid for h in self._slots if h is not None and h.pid]

    def load(self) -> list[int]:
        """Episodes per host slot (an unstarted slot: 0)."""
        return [0 if h is None else len(h.pending) for h in self._slots]

    def _pick(self) -> _HostHandle:
        # The least-loaded host; an unstarted slot counts as load 0 but yields to a started host with no episodes.
        best = min(range(len(self._slots)), key=lambda i: self._rank(self._slots[i]))
        host = self._slots[best]
        if host is None:
            host = self._slots[best] = _HostHandle(best)
            host.starting = asyncio.create_task(self._start(host), name=f"rollq-agent-host-{best}")
            # Its failure reaches the episodes waiting on it; none may be left to look (they were cancelled).
            host.starting.add_done_callback(lambda t: t.cancelled() or t.exception())
        return host

    @staticmethod
    def _rank(host: _HostHandle | None) -> tuple[int, int]:
        return (0, 1) if host is None else (len(host.pending), 0)

    async def run(
        self,
        path: str,
        kwargs_json: str,
        data: Any,
        urls: dict[str, str],
        api_key: str,
        allowlist: Allowlist | None,
        episode: EpisodeContext | None,
        timeout_s: float,
    ) -> list[Any]:
        """Run one episode in a host; returns the host's reply (["ok", id, kind, value], ["raised", id, type,
        message, traceback], ["bad", id, type, repr] or ["timeout", id]). Raises AgentHostError when its host dies
        or is closed, AgentHostStuck when the host did not answer by timeout_s + grace (it was killed)."""
        if self._closed:
            raise AgentHostError("the agent hosts are closed (the worker is stopping)")
        eid = next(self._ids)
        msg = [
            "run",
            eid,
            path,
            kwargs_json,
            data,
            urls,
            api_key,
            None if allowlist is None else [list(allowlist.patterns), allowlist.setting, allowlist.within],
            None if episode is None else msgspec.to_builtins(episode),
            timeout_s,
        ]
        try:
            frame = _frame(msg)  # what can't cross (data msgpack can't carry) fails here, before a host is involved
        except (TypeError, ValueError) as exc:
            raise AgentHostError(f"the episode's data could not be sent to an agent host: {exc}") from exc
        host = self._pick()
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        host.pending[eid] = fut  # counts towards its load from now on
        sent = False
        try:
            if host.starting is not None:
                await asyncio.shield(host.starting)  # bounded by STARTUP_TIMEOUT_S; raises if the host failed
            if host.dead is not None:
                raise AgentHostError(host.dead)
            host.send_frame(frame)
            sent = True
            await asyncio.wait([fut], timeout=timeout_s + self.grace_s)  # (fut is not cancelled at the timeout)
            if fut.done():
                return fut.result()  # the host's reply, or AgentHostError when the host died
            self._kill(
                host,
                f"agent host {host.pid} was killed: an episode of agent {path} ran past its timeout "
                f"({timeout_s:g}s) and the host did not answer within {self.grace_s:g}s more (an agent blocking "
                "the host's event loop, e.g. CPU-bound code); this episode was running there",
            )
            raise AgentHostStuck(
                f"its host process {host.pid} did not answer within {self.grace_s:g}s past the timeout (an "
                "agent blocking the host's event loop, e.g. CPU-bound code), so the host was killed"
            )
        except asyncio.CancelledError:
            if sent:
                host.send(["cancel", eid])
            raise
        finally:
            host.pending.pop(eid, None)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved (a failure set here after this episode stopped waiting is not news)

    async def _start(self, host: _HostHandle) -> None:
        parent, child = socket.socketpair()
        try:
            process = self._mp.Process(
                target=_host_main,
                args=(child, self.config, host.workdir),
                daemon=True,
                name=f"rollq-agent-host-{host.slot}",
            )
            host.process = process
            await asyncio.to_thread(process.start)  # start() waits on the fork server for a moment
            child.close()  # only the host holds its end now: its death shows up here as EOF
            reader, writer = await asyncio.open_connection(sock=parent)
            host.writer = writer
            ready = await asyncio.wait_for(_read(reader), STARTUP_TIMEOUT_S)
            if ready[0] != "ready":
                raise EOFError(f"unexpected first message {ready[0]!r}")
            host.pid = int(ready[1])
        except BaseException as exc:
            child.close()
            code = await self._reap(host)
            why = f"an agent host failed to start ({_exit_text(code)}): {type(exc).__name__}: {exc}"
            self._retire(host, why)
            host.fail_pending(why)
            if host.writer is not None:
                host.writer.close()
            else:
                parent.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise AgentHostError(why) from None
        finally:
            host.starting = None
        host.reader_task = asyncio.create_task(self._read_loop(host, reader), name=f"rollq-agent-host-{host.pid}")

    async def _read_loop(self, host: _HostHandle, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await _read(reader)
                fut = host.pending.get(msg[1])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass
        # EOF: the host exited, was killed here, or died (OOM kill, SIGKILL, a crash).
        killed = host.dead
        self._retire(host, host.dead or "")
        code = await self._reap(host)
        why = killed or f"agent host {host.pid} died ({_exit_text(code)}) while running this episode"
        host.dead = why
        host.fail_pending(why)
        if host.writer is not None:
            host.writer.close()

    def _retire(self, host: _HostHandle, why: str) -> None:
        """No more episodes go to `host`; its slot is free for a replacement (started on the next episode)."""
        host.dead = host.dead or why or "retired"
        if self._slots[host.slot] is host:
            self._slots[host.slot] = None

    def _kill(self, host: _HostHandle, why: str) -> None:
        if host.dead is None:
            host.dead = why
        self._retire(host, why)
        if host.process is not None and host.process.is_alive():
            host.process.kill()
        host.fail_pending(why)

    async def _reap(self, host: _HostHandle) -> int | None:
        if host.process is None or host.process.pid is None:
            return None
        await asyncio.to_thread(host.process.join, JOIN_TIMEOUT_S)
        if host.process.exitcode is not None:  # exited: what its agents left goes
            await asyncio.to_thread(remove_folder, host.workdir, parse_agent_user(self.config.agent_user))
        return cast("int | None", host.process.exitcode)

    async def close(self) -> None:
        """Stop every host: running episodes fail with AgentHostError, hosts are asked to stop, then killed."""
        self._closed = True
        hosts = [h for h in self._slots if h is not None]
        self._slots = [None] * len(self._slots)
        starting = [h.starting for h in hosts if h.starting is not None]
        if starting:
            await asyncio.wait(starting, timeout=STARTUP_TIMEOUT_S)
        for host in hosts:
            host.fail_pending("the agent hosts were closed (the worker is stopping)")
            host.send(["stop"])
            host.dead = host.dead or "closed"
        processes = [h.process for h in hosts if h.process is not None and h.process.pid is not None]
        await asyncio.to_thread(join_all, processes)
        readers = [h.reader_task for h in hosts if h.reader_task is not None]
        if readers:
            await asyncio.wait(readers, timeout=JOIN_TIMEOUT_S)
        # (a reader that joined a host at the same moment as join_all may not have seen its exit code)
        user = parse_agent_user(self.config.agent_user)
        for host in hosts:
            await asyncio.to_thread(remove_folder, host.workdir, user)
        for host in hosts:
            if host.writer is not None:
                host.writer.close()


__all__ = ["HOST_GRACE_S", "AgentHostError", "AgentHostStuck", "AgentHosts"]
