"""`workflow_context()`: what the workflows of one worker process share — HTTP clients, the recording proxy and the
agent process pools — created on first use inside the worker's event loop and closed when the worker stops.

One keep-alive client per process instead of one per episode: thousands of concurrent episodes would otherwise
each open their own connections (and leak them when an episode fails).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import aiohttp
import httpx
import msgspec
from httpx_aiohttp import HttpxAiohttpClient

from rollq.config import DEFAULT_REDIS_URL
from rollq.engine.types import InferenceEngine
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy


class ContextConfig(msgspec.Struct, kw_only=True, frozen=True):
    tokenizer: str = "tiny"  # the proxy's chat template and tokenizer: "tiny" or an HF directory (the engine's)
    proxy: ProxyConfig = ProxyConfig()
    agent_processes: int = 4  # subproc-mode agents running at once
    http_max_connections: int = 1024
    redis_url: str = DEFAULT_REDIS_URL  # the worker's Redis (remote rewards reach their reward workers through it)
    run: str = "default"  # the worker's run (remote rewards go to its reward workers unless a job names another)


_CURRENT: contextvars.ContextVar[WorkflowContext] = contextvars.ContextVar("rollq_workflow_context")


def workflow_context() -> WorkflowContext:
    """The running worker's shared context (tasks the worker starts inherit it)."""
    try:
        return _CURRENT.get()
    except LookupError:
        raise RuntimeError(
            "no workflow context: run inside a rollq worker or `async with WorkflowContext():`"
        ) from None


class WorkflowContext:
    def __init__(self, config: ContextConfig | None = None) -> None:
        self.config = config or ContextConfig()
        self._httpx: httpx.AsyncClient | None = None
        self._aiohttp: aiohttp.ClientSession | None = None
        self._proxy: RecordingProxy | None = None
        self._proxy_lock: asyncio.Lock | None = None
        self._pools: dict[Any, Any] = {}  # (kind, settings) -> AsyncRewardWrapper-like pools
        self._token: contextvars.Token | None = None

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
                    self._proxy = await RecordingProxy(engine, tokenizer, self.config.proxy).start()
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
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        await self.close()


__all__ = ["ContextConfig", "WorkflowContext", "workflow_context"]
