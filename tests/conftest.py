from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from rollq.redis_client import redis_client
from rollq.workers.config import WorkerConfig
from rollq.workers.worker import Worker
from tests.redis_server import RedisServer, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
async def redis(redis_url: str):
    client = redis_client(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def run_name() -> str:
    """Each test gets its own run, so tests share one server without seeing each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def unused_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


async def wait_until(predicate: Callable, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"):
    """Bounded wait for a condition that has no event to await (another process's progress)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def running_worker(redis_url: str, run: str, engine=None, **config) -> AsyncIterator[Worker]:
    config.setdefault("allow", ["tests"])  # the test suite's workflows, rewards, agents and tools
    worker = Worker(WorkerConfig(redis_url=redis_url, run=run, **config), engine=engine)
    task = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    done, _ = await asyncio.wait([task, ready], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()  # raises the worker's start-up error
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
        await worker.redis.aclose()


class WorkerProcess:
    """`rollq worker` as a real subprocess (for SIGKILL/SIGTERM tests)."""

    def __init__(self, redis_url: str, run: str, *args: str, name: str, env: dict | None = None, log: Path) -> None:
        self.name = name
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "rollq",
            "worker",
            "--redis",
            redis_url,
            "--run",
            run,
            "--name",
            name,
            "--allow",
            "tests",
            *args,
        ]
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()

    def output(self) -> str:
        self._log_file.flush()
        return self.log.read_text()


@pytest.fixture
def spawn_worker(tmp_path: Path):
    procs: list[WorkerProcess] = []

    def spawn(redis_url: str, run: str, *args: str, name: str | None = None, env: dict | None = None) -> WorkerProcess:
        name = name or f"w{len(procs)}-{uuid.uuid4().hex[:6]}"
        proc = WorkerProcess(redis_url, run, *args, name=name, env=env, log=tmp_path / f"{name}.log")
        procs.append(proc)
        return proc

    yield spawn
    for p in procs:
        p.close()


async def engine_healthy(url: str) -> bool:
    """Whether an engine at `url` answers /health (for bounded waits on engine start-up)."""
    import httpx

    try:
        async with httpx.AsyncClient() as c:
            return (await c.get(url + "/health", timeout=1)).status_code == 200
    except httpx.HTTPError:
        return False


async def wait_registered(redis, run: str, name: str, timeout_s: float = 15.0) -> None:
    from rollq.protocol.keys import RunKeys

    key = RunKeys(run).workers
    await wait_until(lambda: redis.zscore(key, name), timeout_s, what=f"worker {name} to register")


@pytest.fixture
async def engine_process(tmp_path):
    """`await engine_process(*args)` runs `python -m rollq.engine --backend synthetic --port P *args` and waits for
    /health; returns (Popen, url). Killed at teardown."""
    procs: list[subprocess.Popen] = []

    async def spawn(*args: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        log = open(tmp_path / f"engine-{port}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollq.engine", "--backend", "synthetic", "--port", str(port), *args],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
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
