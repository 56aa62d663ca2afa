"""Engine servers for tests: in-process (synthetic backend via `engine.server.serve`; `engine_process`, in the
root conftest, runs them as subprocesses). Real servers on loopback; no mocks."""

from __future__ import annotations

import httpx
import pytest

from rollq.engine.server.app import EngineServerConfig, ServerHandle, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig


@pytest.fixture
async def start_engine():
    """`await start_engine(server=dict(...), **synthetic_config)` -> ServerHandle; closed at teardown."""
    handles: list[ServerHandle] = []

    async def start(server: dict | None = None, **synthetic) -> ServerHandle:
        backend = SyntheticBackend(SyntheticConfig(**synthetic))
        handle = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0, **(server or {})))
        handles.append(handle)
        return handle

    yield start
    for h in handles:
        await h.close()


@pytest.fixture
async def engine(start_engine) -> ServerHandle:
    return await start_engine()


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        yield client
