"""`workflow_context()`: what the workflows of one worker process share — HTTP clients, the recording proxy and the
agent process pools — created on first use inside the worker's event loop and closed when the worker stops.

One keep-alive client per process instead of one per episode: thousands of concurrent episodes would otherwise
each open their own connections (and leak them when an episode fails).

The same object is also AReaL's `workflow_context` module (`from areal.infra import workflow_context`):
`workflow_context.get()` -> this episode's EpisodeContext (is_eval, task_id, sample_index, group_size),
`await workflow_context.get_aiohttp_session()`, `await workflow_context.get_httpx_client()`, `stat_scope()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import msgspec
from httpx_aiohttp import HttpxAiohttpClient

from rollq.config import DEFAULT_REDIS_URL
from rollq.engine.types import InferenceEngine, ModelRequest, ModelResponse, ProgressCallback
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from rollq.workers.rewards.processes import shared_pools


class ContextConfig(msgspec.Struct, kw_only=True, frozen=True):
    tokenizer: str = "tiny"  # the proxy's chat template and tokenizer: "tiny" or an HF directory (the engine's)
    proxy: ProxyConfig = ProxyConfig()
    agent_processes: int = 4  # subproc-mode agents running at once
    agent_hosts: int = 0  # processes running inline agents' episodes (rollq.workers.agents.hosts); 0 = this loop
    http_max_connections: int = 1024
    redis_url: str = DEFAULT_REDIS_URL  # where remote rewards reach their reward workers (RunSettings.rewards_url)
    run: str = "default"  # the worker's run (remote rewards go to its reward workers unless a job names another)


_CURRENT: contextvars.ContextVar[WorkflowContext] = contextvars.ContextVar("rollq_workflow_context")


class EpisodeContext(msgspec.Struct, kw_only=True, frozen=True):
    """The running episode, as `workflow_context.get()` returns it: AReaL's WorkflowContext fields (is_eval,
    task_id) and the sample's place in its group."""

    is_eval: bool = False
    task_id: str | None = None  # the job id (shared by the n samples of a prompt)
    sample_index: int = 0  # index of this sample within its group, 0..group_size-1
    group_size: int = 1  # the job's n
    attempt: int = 0  # earlier failed runs of this sample
    job_class: str = "train"  # the job's class (its stream)
    # The class's priority, carried by the episode's engine requests that set none (RecordingEngine). None for
    # priority 0, SGLang's default: only a run that uses priorities needs --enable-priority-scheduling.
    priority: int | None = None

    def __post_init__(self) -> None:
        if self.priority == 0:
            msgspec.structs.force_setattr(self, "priority", None)


class _Recording:
    """The engine responses of one episode (for workflows that return AReaL's `output_ids` template)."""

    def __init__(self) -> None:
        self.responses: list[ModelResponse] = []
        self.open = True


_NO_EPISODE = EpisodeContext()
_EPISODE: contextvars.ContextVar[EpisodeContext | None] = contextvars.ContextVar("rollq_episode_context", default=None)
_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("rollq_episode_responses", default=None)


@contextlib.contextmanager
def episode_scope(ctx: EpisodeContext) -> Iterator[list[ModelResponse]]:
    """Run an episode under `ctx` (what workflow_context.get() returns in it); yields the list that collects the
    responses a RecordingEngine returns inside it."""
    recording = _Recording()
    tokens = (_EPISODE.set(ctx), _RECORDING.set(recording))
    try:
        yield recording.responses
    finally:
        recording.open = False  # anything that inherited this context (a task left running) records no more
        _RECORDING.reset(tokens[1])
        _EPISODE.reset(tokens[0])


class RecordingEngine:
    """Wraps the engine handed to workflows: every response is also kept for the episode that asked for it, and
    a request that sets no `priority` gets its episode's job class priority."""

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner = inner

    @classmethod
    def wrap(cls, engine: InferenceEngine | None) -> InferenceEngine | None:
        return None if engine is None else cls(engine)

    async def agenerate(self, req: ModelRequest, on_tokens: ProgressCallback | None = None) -> ModelResponse:
        episode = _EPISODE.get()
        if episode is not None and episode.priority is not None and req.priority is None:
            req = copy.copy(req)  # the caller's request stays as it was
            req.priority = episode.priority
        if on_tokens is None:
            resp = await self.inner.agenerate(req)
        else:
            resp = await self.inner.agenerate(req, on_tokens)
        recording = _RECORDING.get()
        if recording is not None and recording.open:
            recording.responses.append(resp)
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _shared() -> WorkflowContext:
    try:
        return _CURRENT.get()
    except LookupError:
        raise RuntimeError(
            "no workflow context: run inside a rollq worker or `async with WorkflowContext():`"
        ) from None


class _WorkflowContextAccess:
    """`workflow_context()`: the running worker's shared WorkflowContext (tasks the worker starts inherit it).
    As a module, AReaL's: `get()`, `set()`, `stat_scope()`, `get_aiohttp_session()`, `get_httpx_client()`."""

    def __call__(self) -> WorkflowContext:
        return _shared()

    @staticmethod
    def get() -> EpisodeContext:
        """This episode's context (defaults outside an episode)."""
        return _EPISODE.get() or _NO_EPISODE

    @staticmethod
    def set(ctx: EpisodeContext) -> None:
        _EPISODE.set(ctx)

    @staticmethod
    def stat_scope() -> str:
        return "eval-rollout" if (_EPISODE.get() or _NO_EPISODE).is_eval else "rollout"

    @staticmethod
    async def get_aiohttp_session() -> aiohttp.ClientSession:
        """The worker's shared aiohttp session (closed by the worker; don't close it)."""
        return _shared().aiohttp_session()

    @staticmethod
    async def get_httpx_client() -> httpx.AsyncClient:
        """The worker's shared httpx client (what agents get as `http_client`; closed by the worker)."""
        return _shared().http_client()

    def __repr__(self) -> str:
        return "<rollq workflow_context>"


workflow_context = _WorkflowContextAccess()


class WorkflowContext:
    def __init__(self, config: ContextConfig | None = None) -> None:
        self.config = config or ContextConfig()
        self._httpx: httpx.AsyncClient | None = None
        self._aiohttp: aiohttp.ClientSession | None = None
        self._proxy: RecordingProxy | None = None
        self._proxy_lock: asyncio.Lock | None = None
        self._pools: dict[Any, Any] = {}  # (kind, settings) -> AsyncRewardWrapper-like pools
        self._token: contextvars.Token | None = None
        self._share_token: contextvars.Token | None = None

    def http_client(self) -> httpx.AsyncClient:
        """The shared httpx client (what agents get as `http_client`). An `httpx.AsyncClient` on an aiohttp
        transport: httpcore's connection pool spends milliseconds of CPU per request once dozens of agents share
        it (measured by bench/agents.py), aiohttp's does not."""
        if self._httpx is None:
            limits = httpx.Limits(
                max_connections=self.config.http_max_connections,
                max_keepalive_connections=self.config.http_max_connections,
            )
            self._httpx = HttpxAiohttpClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0))
        return self._httpx

    def aiohttp_session(self) -> aiohttp.ClientSession:
        if self._aiohttp is None:
            connector = aiohttp.TCPConnector(limit=self.config.http_max_connections)
            self._aiohttp = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        return self._aiohttp

    async def proxy(self, engine: InferenceEngine | None) -> RecordingProxy:
        """The process's recording proxy, started on first use (the tokenizer loads off the event loop)."""
        if self._proxy is None:
            self._proxy_lock = self._proxy_lock or asyncio.Lock()
            async with self._proxy_lock:
                if self._proxy is None:
                    from rollq.workers.chat_template import load_tokenizer

                    tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer)
                    # Started outside the episode: the server's tasks inherit this context, and must not record
                    # into (or report) the episode that happened to start it.
                    tokens = (_EPISODE.set(None), _RECORDING.set(None))
                    try:
                        self._proxy = await RecordingProxy(engine, tokenizer, self.config.proxy).start()
                    finally:
                        _RECORDING.reset(tokens[1])
                        _EPISODE.reset(tokens[0])
        if engine is not None:
            self._proxy.engine = engine
        return self._proxy

    def pool(self, key: Any, factory: Any) -> Any:
        """A process pool shared by every episode asking with the same key (built by `factory()` once)."""
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = factory()
        return pool

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        await asyncio.gather(*(p.close() for p in pools), return_exceptions=True)
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None
        if self._httpx is not None:
            await self._httpx.aclose()
            self._httpx = None
        if self._aiohttp is not None:
            await self._aiohttp.close()
            self._aiohttp = None

    async def __aenter__(self) -> WorkflowContext:
        self._token = _CURRENT.set(self)
        # AsyncRewardWrappers built in here (one per agent run, as AReaL's agents do) share pooled processes.
        self._share_token = shared_pools.set(self.pool)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._share_token is not None:
            shared_pools.reset(self._share_token)
            self._share_token = None
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        await self.close()


__all__ = [
    "ContextConfig",
    "EpisodeContext",
    "RecordingEngine",
    "WorkflowContext",
    "episode_scope",
    "workflow_context",
]
