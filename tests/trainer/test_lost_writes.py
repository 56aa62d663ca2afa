"""What a Redis that lost acknowledged writes (a restart with AOF everysec, a Cluster failover before the replica had
them) costs the trainer: a group whose submission vanished is queued again under its id, a trained group whose
commit vanished is read again and acked, never trained twice, and the record of settled groups survives a restart."""

from __future__ import annotations

import asyncio
import io
import time

import msgspec
import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys, consumed_key
from rollq.redis_client import redis_client
from rollq.trainer import checkpoint
from rollq.trainer.checkpoint import TrainerState
from rollq.trainer.data import PromptOrder, load_prompts
from rollq.trainer.feeder import GroupFeeder
from rollq.trainer.ledger import StalenessLedger
from rollq.trainer.loop import Trainer
from rollq.trainer.settled import SettledGroups
from tests.trainer.helpers import ENGINE_ARGS, WORKFLOW_KWARGS
from tests.trainer.test_collector import PREFIX, pending, publish, sample, setup


def test_settled_groups_keep_a_low_water_mark_and_the_stragglers():
    settled = SettledGroups()
    for index in (1, 3, 0, 5):
        settled.add(index)
    assert settled.below == 2 and settled.above == {3, 5}
    assert 0 in settled and 1 in settled and 3 in settled and 2 not in settled and 4 not in settled
    assert settled.unsettled(7) == [2, 4, 6]
    settled.add(2)
    settled.add(4)
    assert settled.below == 6 and settled.above == set()


def test_the_checkpoint_keeps_the_settled_groups(tmp_path):
    state = TrainerState(run_id="r", settled=SettledGroups(below=4, above={6, 9}))
    checkpoint.write_state(tmp_path, state)
    assert checkpoint.read_state(tmp_path).settled == SettledGroups(below=4, above={6, 9})


async def test_a_trained_groups_samples_read_again_are_acked_not_trained(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name)
    g0, g1 = f"{PREFIX}0", f"{PREFIX}1"
    await publish(redis, run_name, sample(g0, 0, [0]), sample(g0, 1, [0]))
    got = await asyncio.wait_for(collector.collect(1, 0, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [g0]
    await consumer.commit(got.deliveries)
    collector.committed([g0])
    # Redis lost that commit: the samples are back (as in a pending list a failover restored) and unmarked.
    await redis.delete(consumed_key(RunKeys(run_name).results, "trainer", g0))
    await publish(redis, run_name, sample(g0, 0, [0]), sample(g0, 1, [0]), sample(g1, 0, [0]), sample(g1, 1, [0]))
    got = await asyncio.wait_for(collector.collect(1, 0, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [g1]
    assert collector.settled_copies == 2 and await pending(redis, run_name) == 2  # g1's, until the trainer commits


async def lose_submission(redis, run: str, job_id: str) -> int:
    """What a Redis that lost a SUBMIT looks like: the job's marker and entries gone (they are written together)."""
    keys = RunKeys(run)
    codec = Codec()
    ids = [
        eid for eid, fields in await redis.xrange(keys.jobs) if codec.decode_job(fields[PAYLOAD_FIELD]).job_id == job_id
    ]
    await redis.delete(keys.job_seen(job_id))
    return await redis.xdel(keys.jobs, *ids) if ids else 0


async def test_a_group_whose_submission_vanished_is_queued_again(redis, run_name):
    ledger = StalenessLedger(redis, run_name, batch_samples=4, max_staleness=1)
    await ledger.reset()
    feeder = GroupFeeder(
        Producer(redis, run_name),
        ledger,
        PromptOrder(load_prompts("toy:digits")),
        prefix="r-g",
        group_size=2,
        workflow="tests.workflows:Echo",
        workflow_kwargs=None,
        reoffer_after_s=0.05,
    )
    feeding = asyncio.create_task(feeder.run())
    deadline = time.monotonic() + 10
    while feeder.next_index < 4:  # the ledger admits (eta + 1) * B = 8 samples: four groups of two
        assert time.monotonic() < deadline and not feeding.done()
        await asyncio.sleep(0.01)
    feeder.stop()
    await asyncio.wait_for(feeding, 5)
    assert await lose_submission(redis, run_name, "r-g0") == 2
    feeder.settled("r-g1")  # trained meanwhile: never looked for
    await lose_submission(redis, run_name, "r-g1")
    await asyncio.sleep(0.06)  # the groups' age passes reoffer_after_s (the condition under test, not a sync)
    assert await feeder.reoffer_vanished() == ["r-g0"]
    assert feeder.reoffered == 1 and await redis.xlen(RunKeys(run_name).jobs) == 3 * 2  # g0 again, g2, g3
    assert await redis.exists(RunKeys(run_name).job_seen("r-g0"))


@pytest.mark.slow
async def test_a_run_goes_on_when_redis_lost_every_queued_submission(
    redis_url, run_name, tmp_path, make_train_config, engine_process, spawn_worker
):
    _, engine = await engine_process(*ENGINE_ARGS)
    cfg = make_train_config(
        engine=[engine],
        steps=3,
        group_size=2,
        groups_per_step=2,
        max_staleness=1,
        workflow_kwargs=WORKFLOW_KWARGS,
        reoffer_after_s=1.0,
        trained_log=True,
    )
    redis = redis_client(redis_url)
    pool = EnginePool(PoolConfig(urls=[engine]))
    keys = RunKeys(run_name)
    trainer = asyncio.create_task(Trainer(cfg, redis, pool, progress=io.StringIO()).run())
    try:
        deadline = time.monotonic() + 60
        while await redis.xlen(keys.jobs) < 8:  # the ledger's first (eta + 1) * B samples, queued; no worker yet
            assert time.monotonic() < deadline and not trainer.done(), "nothing was queued"
            await asyncio.sleep(0.05)
        lost = [key async for key in redis.scan_iter(match=f"{keys.prefix}:job:*")]
        await redis.delete(*lost)
        await redis.xtrim(keys.jobs, maxlen=0)  # Redis lost every submission so far
        spawn_worker(redis_url, run_name, "--concurrency", "8", "--engine", engine)
        records = msgspec.to_builtins(await asyncio.wait_for(trainer, 120))
    finally:
        trainer.cancel()
        await asyncio.gather(trainer, return_exceptions=True)
        await pool.close()
        await redis.aclose()
    assert [r["step"] for r in records] == [1, 2, 3]
    lines = (tmp_path / "run" / "trained.jsonl").read_bytes().splitlines()
    samples = [(t["job_id"], t["sample_index"]) for t in map(msgspec.json.decode, lines)]
    assert len(samples) == len(set(samples)) == 3 * 4
    assert len(lost) == 4


async def test_a_lost_admission_is_recorded_again_once_and_a_given_back_group_stays_given_back(redis, run_name):
    ledger = StalenessLedger(redis, run_name, batch_samples=4, max_staleness=0)
    await ledger.reset()
    assert (await ledger.admit("g0", 2)).admitted and (await ledger.admit("g1", 2)).admitted
    assert await ledger.release("g1") == 2
    await redis.hdel(RunKeys(run_name).ledger_groups, "g0")  # Redis lost g0's admission...
    await redis.hincrby(RunKeys(run_name).ledger, "admitted", -2)
    assert await ledger.readmit("g0", 2) and not await ledger.readmit("g0", 2)  # recorded again, once
    assert not await ledger.readmit("g1", 2)  # given back: stays so
    state = await ledger.state()
    assert (state.admitted, state.released) == (2, 2)
