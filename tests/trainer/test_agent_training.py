"""Training an agent (a class with `async def run(self, data, **kw)`) from the trainer: its options (agent_mode,
agent_timeout, export_style, turn_discount) are trainer settings that the training jobs carry."""

from __future__ import annotations

import io
import json

import pytest

from rollq.config import build
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.trainer.config import TrainConfig
from rollq.trainer.loop import Trainer


@pytest.mark.slow
async def test_turn_discount_set_on_the_trainer_discounts_the_trained_rewards(
    redis, redis_url, run_name, tmp_path, stack
):
    engines = await stack(run_name, engines=1, workers=1, concurrency=4)
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text("".join(json.dumps({"question": f"What is {i} + 3?"}) + "\n" for i in range(4)))
    cfg = build(
        TrainConfig,
        "trainer",
        {
            "run": run_name,
            "redis_url": redis_url,
            "run_dir": str(tmp_path / "run"),
            "engine": engines,
            "dataset": str(dataset),
            "workflow": "tests.agents:TwoTurnAgent",  # as `rollq up workflow=...`: no toy-task workflow_kwargs
            "turn_discount": 0.5,
            "steps": 2,
            "group_size": 2,
            "groups_per_step": 1,
            "dynamic_sampling": False,  # every group's rewards are alike: train them anyway
        },
    )
    assert cfg.workflow_kwargs == {}
    pool = EnginePool(PoolConfig(urls=engines))
    try:
        records = await Trainer(cfg, redis, pool, progress=io.StringIO()).run()
    finally:
        await pool.close()
    # Each sample: the first turn's completion 0 + 0.5 x the second's 1.0, the second's 1.0 (the default 1.0
    # would give 1.0 and 1.0)
    assert [r.reward_mean for r in records] == [0.75, 0.75]
