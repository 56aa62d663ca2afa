"""Run reward functions in separate worker processes, with a hard per-call timeout.

Reward code is user code (graders, sandboxes, regex over model output) and may hang, leak, crash the interpreter or
hold the GIL. Running it in the worker's event loop or in a thread could stall every rollout of the worker, and a
hung thread cannot be stopped. So each call runs in a pooled child process; a call that overruns its timeout gets its
process SIGKILLed and raises `RewardTimeout` (never a silent 0 reward), and a crashed process is replaced.

`concurrent.futures.ProcessPoolExecutor` cannot kill a single hung task (and marks the whole pool broken when one
child dies), hence this small pool: one `Pipe` per child, at most `max_workers` calls at once, children started
lazily and reused, because a fresh process costs tens to hundreds of milliseconds while a reused one costs well
under one.

AReaL's signature is accepted (`AsyncRewardWrapper(reward_fn, timeout_seconds=15, max_workers=None, max_retries=3)`),
and, as in AReaL, wrappers share processes: AReaL's agents build a new wrapper inside every `run()`. Inside a rollq
worker, wrappers of the same function and settings share one pool that the worker closes when it stops (close() on
such a wrapper does nothing); elsewhere a wrapper owns its pool, closed by close() or when it is garbage-collected.
Unlike AReaL, a timeout never turns into a silent 0: the call is retried `max_retries` times (each in a fresh
process), then RewardTimeout is raised.
"""

from __future__ import annotations

import asyncio
import contextvars
import multiprocessing
import signal
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, cast

import msgspec

import rollq.tracing as tracing
from rollq.workers.rewards.values import as_reward

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

DEFAULT_MAX_WORKERS = 4  # what max_workers=None means
STARTUP_TIMEOUT_S = 60.0  # a new child must be importing-done and ready within this; not part of the call timeout
JOIN_TIMEOUT_S = 5.0  # how long close() lets an idle child exit on its own before killing it


class RewardTimeout(Exception):
    """The reward function ran longer than the timeout; its process was killed."""


class RewardError(Exception):
    """The reward function raised, or its process died (os._exit, segfault, OOM kill) while running it."""

    def __init__(self, message: str, remote_traceback: str = "", *, process_died: bool = False) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.process_died = process_died


class RewardNotANumber(Exception):
    """The reward function returned something other than a finite int/float (bools are rejected too)."""


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    timeout_seconds: float = 15.0  # per call, counted from handing the call to a ready child
    max_workers: int = 4  # child processes, and so calls running at once
    # forkserver: children fork from a small clean server process, so starting one is cheap and inherits neither
    # the parent's threads nor its sockets (plain fork would copy the event loop and Redis connections).
    start_method: str = "forkserver"

    def __post_init__(self) -> None:
        if not self.timeout_seconds > 0:
            raise ValueError("timeout_seconds must be > 0")
        if self.max_workers < 1:
            raise ValueError("max_workers must be >= 1")


# Messages child -> parent. Tagged tuples keep the pickled payload tiny and never carry user objects, so the parent
# never has to unpickle a type it can't import.
_READY = "ready"  # once, after start-up
_OK = "ok"  # (_OK, float)
_RAISED = "raised"  # (_RAISED, exception type name, str(exc), formatted traceback)
_NOT_A_NUMBER = "nan"  # (_NOT_A_NUMBER, type name, repr)


def _child_main(fn: Callable[..., Any], conn: Connection, accept: Callable[[Any], Any] = as_reward) -> None:
    """Child loop: one (args, kwargs) in, one tagged result out, until the parent says stop or goes away."""
    # Ctrl-C reaches the whole process group; the parent decides when children stop, so don't die mid-reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Bootstrapping (imports, unpickling fn) takes ~100+ ms; saying "ready" keeps that out of the first call's timeout.
    conn.send(_READY)
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if call is None:
            return
        args, kwargs = call
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            reply: tuple = (_RAISED, type(exc).__name__, str(exc), traceback.format_exc())
        else:
            result = accept(value)
            reply = (_OK, result) if result is not None else (_NOT_A_NUMBER, type(value).__name__, repr(value)[:200])
        conn.send(reply)


class _Child(msgspec.Struct, frozen=True):  # frozen: hashable, kept in a set
    process: Any  # multiprocessing BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        return self.process.pid


# Set by the worker's WorkflowContext: `share(key, factory)` returns the pool registered under key (built once).
shared_pools: contextvars.ContextVar[Callable[[Any, Callable[[], Any]], Any] | None] = contextvars.ContextVar(
    "rollq_shared_reward_pools", default=None
)


class AsyncRewardWrapper:
    """`await wrapper(*args, **kwargs) -> float`, running the picklable module-level `reward_fn` in a child process
    (AReaL's `areal.api.reward_api.AsyncRewardWrapper` signature; `max_workers=None`: DEFAULT_MAX_WORKERS)."""

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        timeout_seconds: float = 15.0,
        max_workers: int | None = None,
        max_retries: int = 3,  # AReaL's default
        *,
        start_method: str = "forkserver",
        accept: Callable[[Any], Any] = as_reward,
        what: str = "reward function",
        expected: str = "a finite number",
    ) -> None:
        """`accept` (module-level, runs in the child) maps a return value to the result, or None when it is not
        one; `what` and `expected` word the errors. The defaults make it a reward function runner. `max_retries`:
        further tries after a timeout or a dead process (an exception the function raises is not retried)."""
        try:
            # Children receive fn by pickle (module + name); a lambda or closure should fail here, not per call.
            pickled = bytes(ForkingPickler.dumps(reward_fn))
        except Exception as exc:
            raise TypeError(f"reward function {reward_fn!r} must be a picklable module-level function: {exc}") from exc
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.fn = self.reward_fn = reward_fn
        self.max_retries = max_retries
        config = RewardConfig(
            timeout_seconds=timeout_seconds,
            max_workers=DEFAULT_MAX_WORKERS if max_workers is None else max_workers,
            start_method=start_method,
        )
        self.config = config
        self.timeout_seconds, self.max_workers = config.timeout_seconds, config.max_workers

        def build() -> _Pool:
            return _Pool(reward_fn, config, accept=accept, what=what, expected=expected)

        share = shared_pools.get()
        if share is not None:
            self._pool: _Pool = share(("reward-pool", pickled, config, accept, what, expected), build)
            self._owned = False
        else:
            self._pool = build()
            self._owned = True
            weakref.finalize(self, self._pool.kill_now)

    @property
    def pids(self) -> list[int]:
        """Pids of the live children (idle and busy)."""
        return self._pool.pids

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        return await tracing.reward("process", self.untraced(*args, **kwargs))

    async def untraced(self, *args: Any, **kwargs: Any) -> float:
        """The call without its `reward` span (a caller that makes its own)."""
        for attempt in range(self.max_retries + 1):
            try:
                return await self._pool(*args, **kwargs)
            except RewardTimeout:
                if attempt == self.max_retries:
                    raise
            except RewardError as exc:
                if not exc.process_died or attempt == self.max_retries:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Stop the children of an owned pool (a worker's shared pool is closed by the worker)."""
        if self._owned:
            await self._pool.close()

    async def __aenter__(self) -> AsyncRewardWrapper:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Pool:
    """The child processes of one reward function (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config: RewardConfig,
        *,
        accept: Callable[[Any], Any] = as_reward,
        what: str = "reward function",
        expected: str = "a finite number",
    ) -> None:
        self.fn = fn
        self.accept = accept
        self.what = what
        self.expected = expected
        self.config = config
        # get_context(str) is typed as BaseContext, which declares no Process; each concrete context has one.
        self._ctx = cast(
            "ForkServerContext | ForkContext | SpawnContext", multiprocessing.get_context(config.start_method)
        )
        self._slots = asyncio.Semaphore(config.max_workers)
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()  # idle and busy, so close() can reach all of them
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """Pids of the live children (idle and busy)."""
        return [c.pid for c in self._children]

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        if self._closed:
            raise RuntimeError("AsyncRewardWrapper is closed")
        try:
            # Pickled up front, so arguments that can't cross the boundary fail before a child is involved.
            payload = ForkingPickler.dumps((args, kwargs))
        except Exception as exc:
            raise RewardError(f"reward arguments could not be sent: {type(exc).__name__}: {exc}") from exc
        async with self._slots:
            if self._closed:  # closed while this call waited for a slot
                raise RuntimeError("AsyncRewardWrapper is closed")
            child = await self._take_child()
            healthy = False
            try:
                reply = await self._run(child, payload)
                healthy = True
            finally:
                # Anything but a clean reply (timeout, crash, caller cancelled mid-call) leaves the child in an
                # unknown state, so it is killed rather than reused.
                if healthy and not self._closed:
                    self._idle.append(child)
                else:
                    await self._discard(child)
        return self._unpack(reply)

    async def _run(self, child: _Child, payload: bytes | memoryview) -> tuple:
        try:
            child.conn.send_bytes(payload)  # what conn.send() would write; the child's conn.recv() unpickles it
        except OSError as exc:
            raise RewardError(f"reward worker {child.pid} died before the call: {exc}") from exc
        try:
            await _wait_readable(child.conn, self.config.timeout_seconds)
        except TimeoutError:
            raise RewardTimeout(
                f"{self.what} {_name(self.fn)} took longer than {self.config.timeout_seconds:g}s; "
                f"worker {child.pid} killed"
            ) from None
        try:
            return child.conn.recv()
        except (EOFError, OSError):
            await _reap(child)
            raise RewardError(
                f"worker process {child.pid} died while running {self.what} {_name(self.fn)} "
                f"(exit code {child.process.exitcode})",
                process_died=True,
            ) from None

    def _unpack(self, reply: tuple) -> float:
        tag = reply[0]
        if tag == _OK:
            return reply[1]
        if tag == _RAISED:
            _, type_name, text, tb = reply
            raise RewardError(f"{self.what} {_name(self.fn)} raised {type_name}: {text}", remote_traceback=tb)
        _, type_name, value_repr = reply
        raise RewardNotANumber(f"{self.what} {_name(self.fn)} returned {type_name} {value_repr}, not {self.expected}")

    async def _take_child(self) -> _Child:
        while self._idle:
            child = self._idle.pop()
            if child.process.is_alive():  # an idle child may have been OOM-killed meanwhile
                return child
            await self._discard(child)
        child = await asyncio.to_thread(self._start_child)  # start() blocks on the fork server for a moment
        try:
            await _wait_readable(child.conn, STARTUP_TIMEOUT_S)
            if child.conn.recv() != _READY:
                raise EOFError("unexpected first message")
        except BaseException as exc:
            await self._discard(child)
            if isinstance(exc, (EOFError, OSError, TimeoutError)):
                raise RewardError(
                    f"reward worker for {_name(self.fn)} failed to start (exit code {child.process.exitcode}); "
                    "is the function importable by module path?"
                ) from None
            raise
        return child

    def _start_child(self) -> _Child:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_child_main, args=(self.fn, child_conn, self.accept), daemon=True, name="rollq-reward"
        )
        process.start()
        # Drop our copy of the child's end, so the child's death shows up as EOF on ours.
        child_conn.close()
        child = _Child(process=process, conn=parent_conn)
        self._children.add(child)
        return child

    async def _discard(self, child: _Child) -> None:
        self._children.discard(child)
        if child.process.is_alive():
            child.process.kill()
        await _reap(child)
        child.conn.close()

    async def close(self) -> None:
        """Stop all children: idle ones are asked to exit, busy ones are killed (their calls raise RewardError)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for child in idle:
            try:
                child.conn.send(None)
            except OSError:
                pass
        busy = [c for c in self._children if c not in idle]
        for child in busy:
            child.process.kill()
        await asyncio.to_thread(join_all, [c.process for c in idle + busy])
        for child in idle:
            self._children.discard(child)
            child.conn.close()

    def kill_now(self) -> None:
        """Synchronous last resort (the owning wrapper was garbage-collected unclosed): kill every child."""
        self._closed = True
        for child in list(self._children):
            if child.process.is_alive():
                child.process.kill()
            child.conn.close()
        self._children.clear()
        self._idle.clear()


async def _wait_readable(conn: Connection, timeout: float) -> None:
    """Wait until `conn` has data or EOF, without a thread per call."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await asyncio.wait_for(fut, timeout)
    finally:
        # Synchronously, before the caller may close the fd: a later, reused fd number must not lose its reader.
        loop.remove_reader(fd)


async def _reap(child: _Child) -> None:
    # Join so the pid is really gone (a zombie still answers os.kill(pid, 0)) and exitcode is known.
    await asyncio.to_thread(child.process.join, JOIN_TIMEOUT_S)


def join_all(processes: list[Any]) -> None:
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(JOIN_TIMEOUT_S)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


__all__ = [
    "DEFAULT_MAX_WORKERS",
    "AsyncRewardWrapper",
    "RewardConfig",
    "RewardError",
    "RewardNotANumber",
    "RewardTimeout",
    "shared_pools",
]
