"""A rollout stack for trainer tests: synthetic engines (subprocesses), `rollq worker` subprocesses, and an auditor
that reads every trajectory of the run through its own consumer group, independently of the trainer."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import ENGINE_ARGS, Auditor


@pytest.fixture
async def stack(engine_process, spawn_worker, redis_url):
    """`await stack(run, engines=2, workers=3)` -> engine URLs, with workers serving `run`."""

    async def start(run: str, *, engines: int = 2, workers: int = 3, concurrency: int = 4) -> list[str]:
        urls = [(await engine_process(*ENGINE_ARGS))[1] for _ in range(engines)]
        for _ in range(workers):
            spawn_worker(redis_url, run, "--concurrency", str(concurrency), *[a for u in urls for a in ("--engine", u)])
        return urls

    return start


@pytest.fixture
async def auditor(redis):
    auditors: list[Auditor] = []

    async def start(run: str) -> Auditor:
        a = await Auditor(redis, run).start()
        auditors.append(a)
        return a

    yield start
    for a in auditors:
        await a.stop()
