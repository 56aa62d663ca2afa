"""Engine servers for tests: in-process (synthetic backend via `engine.server.serve`; `engine_process`, in the
root conftest, runs them as subprocesses). Real servers on loopback; no mocks."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rollq.engine.server.app import EngineServerConfig, ServerHandle, serve
from rollq.engine.server.backend import Backend
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig


@pytest.fixture
async def start_engine(tmp_path: Path):
    """`await start_engine(server=dict(...), **synthetic_config)` -> ServerHandle (`backend=` another backend instead
    of a synthetic one); closed at teardown. The engine loads weights from under the test's tmp_path (weights_root)
    unless `server` says otherwise."""
    handles: list[ServerHandle] = []

    async def start(server: dict | None = None, backend: Backend | None = None, **synthetic) -> ServerHandle:
        backend = backend or SyntheticBackend(SyntheticConfig(**synthetic))
        config = {"host": "127.0.0.1", "port": 0, "weights_root": str(tmp_path), **(server or {})}
        handle = await serve(backend, EngineServerConfig(**config))
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
