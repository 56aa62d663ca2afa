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
import functools
import re
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import httpx
import msgspec
from httpx_aiohttp import HttpxAiohttpClient

import rollq.tracing as tracing
from rollq.config import DEFAULT_REDIS_URL
from rollq.engine.types import InferenceEngine, ModelRequest, ModelResponse, ProgressCallback, as_model_request
from rollq.workers.environments.settings import EnvironmentSettings
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from rollq.workers.rewards.processes import shared_pools
from rollq.workers.stats import StatsTracker, WorkflowStats

if TYPE_CHECKING:
    import httpx2


class ContextConfig(msgspec.Struct, kw_only=True, frozen=True):
    tokenizer: str = "tiny"  # the proxy's chat template and tokenizer: "tiny" or an HF directory (the engine's)
    proxy: ProxyConfig = ProxyConfig()
    agent_processes: int = 4  # subproc-mode agents running at once
    agent_hosts: int = 0  # processes running inline agents' episodes (rollq.workers.agents.hosts); 0 = this loop
    # "UID:GID" agents run as, or "FIRST-LAST:GID" (a uid per running command agent; rollq.workers.agents.agent_user);
    # "": this process's user
    agent_user: str = ""
    environments: EnvironmentSettings = EnvironmentSettings()  # what environment jobs run with (their interpreters)
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
    lora: str = ""  # the job's LoRA adapter: carried by the episode's engine requests that name none

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
    areal_before = _set_areal_context(ctx)
    try:
        yield recording.responses
    finally:
        recording.open = False  # anything that inherited this context (a task left running) records no more
        if areal_before is not None:
            _set_areal_context(areal_before)
        _RECORDING.reset(tokens[1])
        _EPISODE.reset(tokens[0])


def _set_areal_context(ctx: Any) -> Any:
    """A workflow that imports AReaL itself reads AReaL's own `workflow_context` (is_eval decides its stats scope):
    set it too when the workflow's imports already loaded it (rollq never imports areal). Returns what it replaced,
    None when AReaL is not loaded. `ctx`: an EpisodeContext, or the AReaL context to put back."""
    areal = sys.modules.get("areal.infra.workflow_context")
    if areal is None:
        return None
    before = areal.get()
    if isinstance(ctx, EpisodeContext):
        ctx = areal.WorkflowContext(is_eval=ctx.is_eval, task_id=ctx.task_id)
    areal.set(ctx)
    return before


class RecordingEngine:
    """Wraps the engine handed to workflows: every response is also kept for the episode that asked for it, and
    a request that sets no `priority` gets its episode's job class priority."""

    traces_calls = True  # each call's engine.generate span (rollq/tracing.py) is made here

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner = inner

    @classmethod
    def wrap(cls, engine: InferenceEngine | None) -> InferenceEngine | None:
        return None if engine is None else cls(engine)

    async def agenerate(self, req: ModelRequest, on_tokens: ProgressCallback | None = None) -> ModelResponse:
        episode = _EPISODE.get()
        req = as_model_request(req)  # AReaL's own ModelRequest too, by its shape
        if episode is not None and episode.priority is not None and req.priority is None:
            req = copy.copy(req)  # the caller's request stays as it was
            req.priority = episode.priority
        if episode is not None and episode.lora and not req.lora_path:
            req = copy.copy(req)
            req.lora_path = episode.lora
        call = self.inner.agenerate(req) if on_tokens is None else self.inner.agenerate(req, on_tokens)
        traced = tracing.active()
        resp = await (call if traced is None else tracing.generation(traced, req, call))
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


def _httpx2_use(dist: str) -> Literal["absent", "no", "optional", "required"]:
    """How the installed distribution `dist` relates to httpx2, from its metadata (no import): not installed, no
    mention, an extra (it accepts httpx2 clients), or a plain requirement (it is built on httpx2)."""
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return "absent"
    markers = [r.partition(";")[2] for r in requires if re.match(r"httpx2\s*(?:[\[(<>=!~;]|$)", r)]
    if not markers:
        return "no"
    return "required" if any("extra" not in m for m in markers) else "optional"


@functools.cache
def agent_client_kind() -> Literal["httpx", "httpx2"]:
    """Which shared client agents get as `http_client`. anthropic>=1.0 is built on httpx2 and refuses anything from
    the httpx package (`_reject_httpx_object` in anthropic/_base_client.py); anthropic<1.0 and older openai (1.x,
    2.0) accept only an `httpx.AsyncClient`; openai 3.x, and the later 2.x that list an httpx2 extra, accept either,
    and so do LangChain's ChatOpenAI and openai-agents, which hand the client to openai. So: httpx2 when the
    installed anthropic needs it and the installed openai (if any) takes it; httpx otherwise, as before (an
    httpx2-only anthropic next to an httpx-only openai fits no one client: anthropic agents then build their own)."""
    if _httpx2_use("anthropic") == "required" and _httpx2_use("openai") in ("absent", "optional", "required"):
        return "httpx2"
    return "httpx"


class _StatsTrackerAccess:
    """AReaL's `stats_tracker` module: `get(name)` and the default tracker's `scalar`, `stat`, `scope`... on the
    running worker's WorkflowStats. Outside a worker what is recorded is kept nowhere."""

    @staticmethod
    def get(name: str = "") -> StatsTracker:
        try:
            stats = _CURRENT.get().stats
        except LookupError:
            stats = WorkflowStats()
        return stats.get(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.get(""), attr)

    def __repr__(self) -> str:
        return "<rollq stats_tracker>"


stats_tracker = _StatsTrackerAccess()


class WorkflowContext:
    def __init__(self, config: ContextConfig | None = None) -> None:
        self.config = config or ContextConfig()
        self._httpx: httpx.AsyncClient | None = None
        self._httpx2: httpx2.AsyncClient | None = None
        self._aiohttp: aiohttp.ClientSession | None = None
        self._proxy: RecordingProxy | None = None
        self._proxy_lock: asyncio.Lock | None = None
        self._pools: dict[Any, Any] = {}  # (kind, settings) -> AsyncRewardWrapper-like pools
        self.stats = WorkflowStats()  # what workflows record with stats_tracker (served on /metrics)
        # Environments' load checks, once per (interpreter, driver, name) in this process, whatever the jobs' kwargs:
        # the verdict (None: it loads; else the driver's message) or the future of the check running now
        # (rollq.workers.environments.agent).
        self.environment_checks: dict[tuple[str, str, str], Any] = {}
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

    def httpx2_client(self) -> httpx2.AsyncClient:
        """The shared httpx2 client: the same settings, also on an aiohttp transport (httpx-aiohttp's httpx2 variant;
        httpx2's own pool where that is missing). For the SDKs built on httpx2, which refuse an httpx client."""
        if self._httpx2 is None:
            import httpx2

            client_cls: type[httpx2.AsyncClient]
            try:
                from httpx_aiohttp.httpx2 import Httpx2AiohttpClient

                client_cls = Httpx2AiohttpClient
            except ImportError:  # httpx-aiohttp < 0.2
                client_cls = httpx2.AsyncClient
            limits = httpx2.Limits(
                max_connections=self.config.http_max_connections,
                max_keepalive_connections=self.config.http_max_connections,
            )
            self._httpx2 = client_cls(limits=limits, timeout=httpx2.Timeout(600.0, connect=30.0))
        return self._httpx2

    def agent_http_client(self) -> httpx.AsyncClient | httpx2.AsyncClient:
        """What agents get as `http_client`: the shared client of the kind the installed SDKs accept
        (`agent_client_kind()`)."""
        return self.httpx2_client() if agent_client_kind() == "httpx2" else self.http_client()

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
        if self._httpx2 is not None:
            await self._httpx2.aclose()
            self._httpx2 = None
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
    "agent_client_kind",
    "episode_scope",
    "stats_tracker",
    "workflow_context",
]
