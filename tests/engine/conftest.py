"""Engine servers for tests: in-process (synthetic backend via `engine.server.serve`) and `python -m engine`
subprocesses. Real servers on loopback; no mocks."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from engine.server import EngineServerConfig, ServerHandle, serve
from engine.synthetic import SyntheticBackend, SyntheticConfig
from tests.conftest import REPO_ROOT, engine_healthy, wait_until
from tests.redis_server import free_port


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


@pytest.fixture
async def engine_process(tmp_path):
    """`await engine_process(*args)` runs `python -m engine --backend synthetic --port P *args` and waits for
    /health; returns (Popen, url). Killed at teardown."""
    procs: list[subprocess.Popen] = []

    async def spawn(*args: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        log = open(tmp_path / f"engine-{port}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "--backend", "synthetic", "--port", str(port), *args],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        await wait_until(lambda: proc.poll() is not None or engine_healthy(url), 30, what=f"{url} healthy")
        assert proc.poll() is None, (tmp_path / f"engine-{port}.log").read_text()
        return proc, url

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
