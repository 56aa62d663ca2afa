"""`rollq train` on an engine whose every generation fails exits non-zero, saying why (issue 42, "failure is loud"):
the run used to go on training 0 tokens a step and exit 0. Samples that fail or come back with no generated token,
two steps' worth in a row, stop it with exit code 4 (trainer/nothing_trains.py).

The engine fails for real through its --fault setting (engine/server/faults.py, an in-process server on loopback); a
real worker and the real trainer (`rollq train` itself, on its own event loop in a thread) on real Redis; no mocks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.faults import FaultyBackend, StepFault
from rollq.engine.server.synthetic import LengthDist, SyntheticBackend, SyntheticConfig
from rollq.trainer import commands
from tests.helpers import running_worker

# Two groups of two short answers a step: the run gives up after 2 x 4 samples that trained nothing.
SMALL_RUN: dict[str, Any] = {
    "steps": 3,
    "group_size": 2,
    "groups_per_step": 2,
    "max_staleness": 1,
    "workflow_kwargs": {"reward_fn": "rollq.tasks.digits:digits_reward", "max_new_tokens": 8},
    "weight_update_backoff_s": 0.01,
}


async def test_rollq_train_on_an_engine_whose_generations_fail_exits_4_naming_the_engine_error(
    redis_url: str, run_name: str, make_train_config, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    synthetic = SyntheticConfig(tokenizer="tiny", sampled=True, length=LengthDist(kind="fixed", length=4))
    config = EngineServerConfig(port=0, weight_version="0", weights_root=str(tmp_path))
    # Every real prompt fails; the one-token health probe passes until the engine has failed 4 in a row.
    engine = await serve(FaultyBackend(SyntheticBackend(synthetic), StepFault(min_prompt_tokens=2)), config)
    # The worker gives a request up after 1 s without an engine to run it on, and a job after its first failure.
    worker_pool = EnginePool(PoolConfig(urls=[engine.url], no_engine_timeout_s=1.0, health_interval_s=0.2))
    try:
        async with worker_pool, running_worker(redis_url, run_name, engine=worker_pool, concurrency=4, max_attempts=1):
            cfg = make_train_config(engine=[engine.url], **SMALL_RUN)
            code = await asyncio.wait_for(asyncio.to_thread(commands.train, cfg), 120)
    finally:
        await engine.close()
    err = capsys.readouterr().err
    assert code == 4, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("rollq train: "))
    assert line.startswith("rollq train: the first 8 samples all failed or generated no token (8 failed, 0 with"), line
    # the example names the engine and its own error (its requests failed over, then found no engine to go to)
    assert f"{engine.url}" in line and "HTTP 500: " in line and "engine error: InjectedStepError(" in line, line
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()  # no step trained (on 8676c82: 3 steps of 0 tokens)
