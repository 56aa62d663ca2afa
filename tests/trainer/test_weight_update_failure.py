"""A weight update that reaches too few engines stops the trainer (min_engines_updated, weight_update_retries,
weight_update_backoff_s; trainer/publish.py), after retrying with backoff, with an error naming each failing
engine's route, HTTP status and answer; one that succeeds on a retry lets the step go on. Real synthetic engines
in-process, a real gateway that answers generation and refuses control calls like sglang-router
(tests/control_gateway.py), real Redis, no mocks."""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rollq.engine.fleet import CycleReport, FleetController, FleetResult
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, ServerHandle, serve
from rollq.engine.server.synthetic import LengthDist, SyntheticBackend, SyntheticConfig
from rollq.local import free_port
from rollq.trainer import commands
from rollq.trainer.loop import Trainer
from rollq.trainer.publish import UpdateRequirement, WeightUpdateFailed, publish
from tests.control_gateway import ControlGateway
from tests.helpers import running_worker

REFUSED = "HTTP 404: 404 page not found"  # what the gateway answers a control call, as the error quotes it
CYCLE_ROUTES = ("/pause_generation", "/update_weights_from_disk", "/continue_generation")
QUICK = UpdateRequirement(retries=2, backoff_s=0.05)  # waits 0.05 + 0.1 s in all


@pytest.fixture
async def start_engine(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[ServerHandle]]]:
    """`await start_engine(**synthetic)` -> an in-process synthetic engine at version 0 that loads weights from under
    tmp_path (where the trainer's run directory is); closed at teardown."""
    handles: list[ServerHandle] = []

    async def start(**synthetic: Any) -> ServerHandle:
        config = EngineServerConfig(port=0, weight_version="0", weights_root=str(tmp_path))
        handles.append(await serve(SyntheticBackend(SyntheticConfig(**synthetic)), config))
        return handles[-1]

    yield start
    for h in handles:
        await h.close()


def disk_cycle(fleet: FleetController, path: Path, version: int) -> Callable[[], Awaitable[CycleReport]]:
    path.mkdir(exist_ok=True)
    return lambda: fleet.run_cycle(lambda: fleet.update_weights(str(path), version))


def refusals_of(gateway: ControlGateway) -> list[str]:
    return [f"{gateway.url}{route}: {REFUSED}" for route in CYCLE_ROUTES]


async def test_an_update_short_of_every_healthy_engine_is_retried_then_stops_naming_each_refusal(
    start_engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rollq.trainer")
    direct, behind = await start_engine(), await start_engine()
    async with ControlGateway(behind.url) as gateway, EnginePool(PoolConfig(urls=[direct.url, gateway.url])) as pool:
        fleet = FleetController(pool, retries=0)
        started = time.monotonic()
        with pytest.raises(WeightUpdateFailed) as failed:
            await publish(disk_cycle(fleet, tmp_path / "v1", 1), pool, QUICK, 1)
        waited = time.monotonic() - started
        assert gateway.refused["/update_weights_from_disk"] == 3 and waited >= 0.05 + 0.1  # backoff: 0.05 s, 0.1 s
        assert pool.members[gateway.url].stale and not pool.members[direct.url].stale  # never routed at version 0

        # min_engines_updated 1: the same fleet goes on with the engine that loaded the weights.
        report = await publish(disk_cycle(fleet, tmp_path / "v2", 2), pool, UpdateRequirement(min_engines=1), 2)
        assert report.updated == [direct.url] and pool.members[gateway.url].stale

    message = str(failed.value)
    assert message.startswith("weight update to version 1 reached 1 of the 2 engines it needs (min_engines_updated 0")
    assert message.splitlines()[1:] == [f"  {line}" for line in refusals_of(gateway)]  # each route, status, body
    assert "in 3 attempts" in message and direct.url not in message
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == 2 and all(REFUSED in r for r in retries)
    assert direct.server.weight_version == "2" and behind.server.weight_version == "0"


async def test_an_engine_that_refuses_a_few_control_calls_is_updated_on_a_retry(start_engine, tmp_path: Path) -> None:
    behind = await start_engine()
    # Refuses the first cycle whole (pause, update, resume) and the second one's pause: the update goes through then.
    async with ControlGateway(behind.url, refusals=4) as gateway, EnginePool(PoolConfig(urls=[gateway.url])) as pool:
        report = await publish(disk_cycle(FleetController(pool, retries=0), tmp_path / "v1", 1), pool, QUICK, 1)
    assert report.updated == [gateway.url] and report.failures() == {gateway.url: [refusals_of(gateway)[0]]}
    assert sum(gateway.refused.values()) == 4 and behind.server.weight_version == "1"


async def test_a_dead_engine_is_out_of_routing_and_not_waited_for_but_a_fleet_of_none_stops(
    start_engine, tmp_path: Path
) -> None:
    live = await start_engine()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: its control calls cannot connect
    async with EnginePool(PoolConfig(urls=[live.url, dead])) as pool:
        fleet = FleetController(pool, retries=0)
        report = await publish(disk_cycle(fleet, tmp_path / "v1", 1), pool, QUICK, 1)
        assert report.updated == [live.url] and not pool.members[dead].healthy
    async with EnginePool(PoolConfig(urls=[dead])) as pool:
        with pytest.raises(WeightUpdateFailed, match=rf"reached 0 of the 1 engines(.|\n)*{dead}/pause_generation: "):
            await publish(disk_cycle(FleetController(pool, retries=0), tmp_path / "v2", 2), pool, QUICK, 2)


async def test_a_distributed_update_refused_by_an_engine_stops_naming_the_route(start_engine) -> None:
    torch = pytest.importorskip("torch")
    from rollq.engine.weight_group import DistributedSyncConfig, DistributedWeightSync

    behind = await start_engine()
    async with ControlGateway(behind.url) as gateway, EnginePool(PoolConfig(urls=[gateway.url])) as pool:
        fleet = FleetController(pool, retries=0)
        sync = DistributedWeightSync(pool, DistributedSyncConfig(timeout_s=5.0))
        named = [("w", torch.zeros(4))]

        def update() -> Awaitable[FleetResult]:
            return sync.update(named, 1)

        with pytest.raises(WeightUpdateFailed) as failed:
            await publish(lambda: fleet.run_cycle(update), pool, UpdateRequirement(retries=1, backoff_s=0.01), 1)
        await sync.close()
    assert f"  {gateway.url}/begin_weight_update: {REFUSED}" in str(failed.value).splitlines()
    assert f"  {gateway.url}/pause_generation: {REFUSED}" in str(failed.value).splitlines()


# A one-step run of two groups of two short answers, retrying weight updates at once.
SMALL_RUN: dict[str, Any] = {
    "steps": 1,
    "group_size": 2,
    "groups_per_step": 2,
    "max_staleness": 1,
    "workflow_kwargs": {"reward_fn": "rollq.tasks.digits:digits_reward", "max_new_tokens": 8},
    "weight_update_backoff_s": 0.01,
}


async def test_rollq_train_exits_naming_the_engine_route_and_status_when_its_engine_refuses_weight_updates(
    start_engine, make_train_config, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    behind = await start_engine()
    async with ControlGateway(behind.url) as gateway:
        cfg = make_train_config(engine=[gateway.url], **SMALL_RUN, weight_update_retries=1)
        # `rollq train` itself (its own event loop, in a thread: this loop keeps serving the gateway and the engine).
        code = await asyncio.wait_for(asyncio.to_thread(commands.train, cfg), 60)
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("rollq train: weight update to version 0 reached 0 of the 1 engines"), err
    assert all(line in err for line in refusals_of(gateway)), err
    assert gateway.refused["/update_weights_from_disk"] == 2  # the first attempt and one retry
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


@pytest.mark.slow
async def test_a_weight_update_refused_for_a_while_is_retried_and_the_step_goes_on(
    start_engine, redis, redis_url: str, run_name: str, make_train_config, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rollq.trainer")
    engine = await start_engine(tokenizer="tiny", sampled=True, length=LengthDist(kind="fixed", length=4))
    # The start-up cycle goes through (3 calls); step 1's delta prepare (delta_sync) and its first cycle are refused
    # whole, its retry goes through (with the full weights: the engine never prepared the delta).
    async with (
        ControlGateway(engine.url, forward_first=3, refusals=4) as gateway,
        EnginePool(PoolConfig(urls=[engine.url])) as worker_pool,
        running_worker(redis_url, run_name, engine=worker_pool, concurrency=4),
    ):
        cfg = make_train_config(engine=[gateway.url], **{**SMALL_RUN, "steps": 2})
        pool = EnginePool(PoolConfig(urls=[gateway.url]))
        try:
            records = msgspec.to_builtins(
                await asyncio.wait_for(Trainer(cfg, redis, pool, progress=io.StringIO()).run(), 60)
            )
        finally:
            await pool.close()
    assert [r["version"] for r in records] == [1, 2] and engine.server.weight_version == "2"
    assert sum(gateway.refused.values()) == 4 and gateway.refused["/rollq/prepare_weights"] == 1
    retried = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retried) == 1 and "weight update to version 1 reached 0 of the 1 engines" in retried[0]
    assert all(line in retried[0] for line in refusals_of(gateway))


async def test_a_run_dir_with_a_single_file_checkpoint_of_an_older_rollq_is_refused(redis, make_train_config, tmp_path):
    """Starting over would reset the run's ledger and train its groups again: the trainer stops, naming the file."""
    cfg = make_train_config(engine=["http://127.0.0.1:9"], steps=1)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"from an older rollq")
    pool = EnginePool(PoolConfig(urls=cfg.engine))
    try:
        with pytest.raises(ValueError, match="checkpoint.pt of an older rollq"):
            await asyncio.wait_for(Trainer(cfg, redis, pool, progress=io.StringIO()).run(), 60)
    finally:
        await pool.close()
    assert not (tmp_path / "run" / "checkpoints").exists()
