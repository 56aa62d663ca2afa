"""`min_step_s`: a step publishes its weights no sooner than that after it began (the engines keep generating), waiting
before it collects."""

from __future__ import annotations

import io

import msgspec
import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.trainer.loop import Trainer
from tests.trainer.helpers import ENGINE_ARGS, WORKFLOW_KWARGS


@pytest.mark.slow
async def test_paced_steps_publish_no_sooner_than_min_step_s(
    redis, redis_url, run_name, make_train_config, engine_process, spawn_worker
):
    _, engine = await engine_process(*ENGINE_ARGS)
    spawn_worker(redis_url, run_name, "--concurrency", "8", "--engine", engine)
    cfg = make_train_config(
        engine=[engine],
        steps=3,
        group_size=2,
        groups_per_step=2,
        workflow_kwargs=WORKFLOW_KWARGS,
        min_step_s=0.5,
    )
    pool = EnginePool(PoolConfig(urls=[engine]))
    try:
        records = msgspec.to_builtins(await Trainer(cfg, redis, pool, progress=io.StringIO()).run())
    finally:
        await pool.close()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["step_s"] >= 0.5 for r in records)
    # The wait comes first (min_step_s less the last train time), then collecting and training: nothing publishes
    # before min_step_s, and a step's own work is not held up by more than the wait it needed.
    assert all(r["collect_s"] + r["train_s"] + r["paced_s"] >= 0.5 - 0.02 for r in records)
    assert all(r["paced_s"] <= 0.5 + 0.02 for r in records)
    assert all(r["paced_s"] > 0 for r in records)  # the tiny model trains faster than that: every step waited
