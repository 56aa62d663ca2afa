from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from rollq.local import Processes, RedisServer, free_port
from rollq.redis_client import redis_client
from rollq.trainer.config import TrainConfig
from tests.helpers import REPO_ROOT, WorkerProcess, engine_healthy
from tests.trainer.helpers import ENGINE_ARGS, Auditor


def pytest_configure(config: pytest.Config) -> None:
    """Bytecode caches on, for the test processes and every process they start. Where the environment turns them off
    (PYTHONDONTWRITEBYTECODE, as on CI here) and the packages came without them (uv installs none), each of the
    suite's Python subprocesses compiled transformers and the rest from source again: 15-30 s before a test trainer's
    first step. Runs in the xdist controller before it starts the test processes, which inherit the environment.

    Local ports come from 10000-19999, handed out in turn (rollq.local.free_port, ROLLQ_LOCAL_PORTS), not from the
    kernel's ephemeral range. The suite starts a few hundred servers on ports it picked first; in the ephemeral range
    the moment between picking a port and the child binding it was open to every bind(0) on the machine, the suite's
    own included (about 3.5 new listeners a second). Local cluster bus ports (+10000) stay below 30000. Set here, not
    in tests/__init__.py: agents the tests import into clean processes import that package after their secrets and
    every ROLLQ_* variable were dropped."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    os.environ.setdefault("ROLLQ_LOCAL_PORTS", "10000-19999")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of a module that share a module-scoped fixture (a trained checkpoint, a built wheel, a Redis Cluster)
    run in one xdist process, so the fixture is built once, not once per process its tests were spread over (which
    also raced: two processes building a wheel from the same tree). Tests already in a group keep it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None:
            continue
        if any(d.scope == "module" for defs in fixtures.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
    # The slow tests first (a stable sort: each keeps its order among its kind): xdist hands out work in this order,
    # so the minute-long ones start at once instead of last, alone, while the other processes sit idle.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny offline model where rollq builds it ($ROLLQ_CACHE, else ~/.cache/rollq: engines started with
    `--tokenizer tiny` use the same build). Built once (about 8 CPU seconds) and read-only to the tests. The xdist
    workers take turns under a file lock, so the first builds and the others find its build."""
    import fcntl

    from rollq.engine.tiny_model import build_tiny, default_cache_dir

    target = default_cache_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_tiny(target)


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
def make_train_config(request: pytest.FixtureRequest, run_name: str, tmp_path: Path):
    """`make_train_config(engine=[url], steps=3, ...)`: a TrainConfig for this test's run: the shared Redis (started
    only when `redis_url` is not given), `run_name`, a run directory under tmp_path; then the given settings."""

    def make(**settings: Any) -> TrainConfig:
        if "redis_url" not in settings:
            settings["redis_url"] = request.getfixturevalue("redis_url")
        return TrainConfig(**{"run": run_name, "run_dir": str(tmp_path / "run"), **settings})

    return make


@pytest.fixture
def unused_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


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


@pytest.fixture
async def engine_process(tmp_path, tiny_dir):  # tiny_dir: built once, before engines that load it race to build it
    """`await engine_process(*args)` runs `python -m rollq.engine --backend synthetic --port P *args` and waits for
    /health; returns (Popen, url). Killed at teardown."""
    procs = Processes(tmp_path, cwd=REPO_ROOT)

    async def spawn(*args: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        # weights load from under the test's tmp_path (a trainer's run_dir there); *args may name another root
        # keyless with its control routes open (insecure_no_auth): the tests' trainers pause and update it
        argv = [sys.executable, "-m", "rollq.engine", "--backend", "synthetic", "--port", str(port)]
        argv.append("--insecure-no-auth")
        proc = procs.start(f"engine-{port}", [*argv, "--weights-root", str(tmp_path), *args])
        url = f"http://127.0.0.1:{port}"
        # a hang guard, not a speed check: four test processes share two cores in CI
        await procs.wait_until(lambda: engine_healthy(url), 90, f"{url} healthy", watch=proc, interval_s=0.02)
        return proc, url

    yield spawn
    procs.stop_all(grace_s=0)


@pytest.fixture
async def stack(engine_process, spawn_worker, redis_url):
    """`await stack(run, engines=2, workers=3)` -> engine URLs (synthetic engines, subprocesses), with `rollq worker`
    subprocesses serving `run`."""

    async def start(run: str, *, engines: int = 2, workers: int = 3, concurrency: int = 4) -> list[str]:
        urls = [(await engine_process(*ENGINE_ARGS))[1] for _ in range(engines)]
        for _ in range(workers):
            spawn_worker(redis_url, run, "--concurrency", str(concurrency), *[a for u in urls for a in ("--engine", u)])
        return urls

    return start


@pytest.fixture
async def auditor(redis):
    """`await auditor(run)`: reads every trajectory of the run through a consumer group of its own, independently
    of the trainer (tests/trainer/helpers.py)."""
    auditors: list[Auditor] = []

    async def start(run: str) -> Auditor:
        a = await Auditor(redis, run).start()
        auditors.append(a)
        return a

    yield start
    for a in auditors:
        await a.stop()
