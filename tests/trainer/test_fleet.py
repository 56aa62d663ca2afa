"""Two LoRA runs sharing one fleet: one reference engine registered in the fleet, one worker process serving both
runs (`--also-serve`, `--fleet`), two trainers. Both advance their versions, each run's adapters sit side by side on
the engine, no pause, flush or full-weight call reaches it, and each run's auditor finds its steps trained exactly
once within the staleness bound. (That both runs learn the toy task: `python -m bench.lora --learn`, a loop of
CONTRIBUTING.md.) A full-weight run is refused a shared fleet."""

from __future__ import annotations

import asyncio
import io

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.registry import EngineRegistry
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.trainer.config import TrainConfig
from rollq.trainer.feeder import adapter_name
from rollq.trainer.loop import Trainer
from tests.trainer.helpers import WORKFLOW_KWARGS

pytestmark = pytest.mark.slow

STEPS, GROUP, GROUPS, ETA = 3, 4, 2, 1
NEVER = ("/pause_generation", "/continue_generation", "/update_weights_from_disk", "/flush_cache")


def test_a_full_weight_run_is_refused_a_shared_fleet():
    with pytest.raises(ValueError, match="would pause every run on it"):
        TrainConfig(fleet="shared")
    with pytest.raises(ValueError, match="would pause every run on it"):
        TrainConfig(fleet="shared", lora_rank=8, lora_publish="merged")
    assert TrainConfig(fleet="shared", lora_rank=8).fleet == "shared"


async def test_two_lora_runs_share_one_engine_and_one_worker_without_pausing_each_other(
    redis, redis_url, run_name, tmp_path, spawn_worker, auditor
):
    fleet = f"{run_name}-fleet"
    runs = [f"{run_name}-a", f"{run_name}-b"]
    engine = await serve(
        ReferenceBackend(ReferenceConfig(model="tiny", max_running=16)),
        EngineServerConfig(port=0, enable_lora=True, weights_root=str(tmp_path)),
    )
    registration = asyncio.create_task(EngineRegistry(redis, "", fleet=fleet).keep_registered(engine.url))
    audits = [await auditor(run) for run in runs]
    spawn_worker(redis_url, runs[0], "--also-serve", runs[1], "--fleet", fleet, "--concurrency", "8")
    pools: list[EnginePool] = []
    try:
        trainers = []
        for run in runs:
            cfg = TrainConfig(
                redis_url=redis_url,
                run=run,
                run_dir=str(tmp_path / run),
                fleet=fleet,
                steps=STEPS,
                group_size=GROUP,
                groups_per_step=GROUPS,
                max_staleness=ETA,
                lora_rank=4,
                workflow_kwargs={**WORKFLOW_KWARGS, "max_new_tokens": 8},
            )
            pool = EnginePool(PoolConfig())
            pool.follow(EngineRegistry(redis, run, fleet=fleet), interval_s=0.2)
            pools.append(pool)
            trainers.append(Trainer(cfg, redis, pool, progress=io.StringIO()))
        await asyncio.gather(*(t.run() for t in trainers))

        calls = engine.server.control_calls
        assert not any(calls[route] for route in NEVER), dict(calls)
        assert calls["/load_lora_adapter"] == 2 * STEPS
        for run, audit in zip(runs, audits, strict=True):
            assert adapter_name(run, STEPS) in engine.server.adapters
            await audit.check_run(
                tmp_path / run / "metrics.jsonl", steps=STEPS, group_size=GROUP, groups_per_step=GROUPS, eta=ETA
            )
    finally:
        registration.cancel()
        await asyncio.gather(registration, return_exceptions=True)
        for pool in pools:
            await pool.close()
        await engine.close()


async def test_a_trainer_refuses_a_fleet_serving_another_base_model(redis, redis_url, run_name, tmp_path):
    from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig

    other = tmp_path / "other-model"  # what the engine says it serves (/model_info's model_path)
    other.mkdir()
    engine = await serve(SyntheticBackend(SyntheticConfig(model_path=str(other))), EngineServerConfig(port=0))
    pool = EnginePool(PoolConfig(urls=[engine.url]))
    try:
        cfg = TrainConfig(redis_url=redis_url, run=run_name, run_dir=str(tmp_path / "run"), fleet="f", lora_rank=4)
        with pytest.raises(ValueError, match=f"serves {other}, and this run trains tiny"):
            await Trainer(cfg, redis, pool, progress=io.StringIO()).run()
    finally:
        await pool.close()
        await engine.close()
