import pytest

from rollq.producer import Producer, ResultConsumer
from rollq.producer.results import PartitionedConsumer
from rollq.protocol import Codec, Trajectory
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.redis_client import TRANSIENT_ERRORS, redis_client
from tests.helpers import running_worker, wait_until


async def _idle_at_least(redis, stream, ms):
    [entry] = await redis.xpending_range(stream, "trainer", min="-", max="+", count=1)
    return entry["time_since_delivered"] >= ms


async def _publish(redis, stream, traj: Trajectory) -> None:
    await redis.xadd(stream, {PAYLOAD_FIELD: Codec().encode(traj)})


async def test_duplicates_are_dropped_by_job_id_and_sample_index(redis, run_name):
    stream = RunKeys(run_name).results
    consumer = ResultConsumer(redis, stream, name="c1")
    await consumer.setup()
    for idx in (0, 1, 0):  # sample 0 arrives twice
        await _publish(redis, stream, Trajectory(job_id="j", sample_index=idx, n=2, status="ok"))
    batch = await consumer.read(block_ms=100)
    assert sorted(d.trajectory.sample_index for d in batch) == [0, 1]
    assert consumer.duplicates_dropped == 1
    assert await consumer.commit(batch) == 2
    # A late duplicate, after the commit (e.g. a replayed publish), is dropped too, even by a new consumer.
    await _publish(redis, stream, Trajectory(job_id="j", sample_index=1, n=2, status="ok"))
    later = ResultConsumer(redis, stream, name="c2")
    assert await later.read(block_ms=100) == []
    assert later.duplicates_dropped == 1
    assert (await redis.xpending(stream, "trainer"))["pending"] == 0


async def test_entries_stay_pending_until_commit_and_come_back_after_a_restart(redis, run_name):
    stream = RunKeys(run_name).results
    first = ResultConsumer(redis, stream, name="trainer-0")
    await first.setup()
    for i in range(5):
        await _publish(redis, stream, Trajectory(job_id=f"j{i}", sample_index=0, n=1, status="ok"))
    got = await first.read(count=3, block_ms=100) + await first.read(count=10, block_ms=100)
    assert len(got) == 5
    # "Crash" before commit: a new consumer with the same name gets the same entries again.
    restarted = ResultConsumer(redis, stream, name="trainer-0")
    again = await restarted.read(count=2, block_ms=100) + await restarted.read(count=10, block_ms=100)
    assert [d.entry_id for d in again] == [d.entry_id for d in got]
    # Reading on before committing does not hand out the same pending entries twice.
    assert await restarted.read(count=10, block_ms=50) == []
    assert await restarted.commit(again) == 5
    assert await restarted.read(count=10, block_ms=50) == []


async def test_a_dead_consumers_pending_entries_are_claimed_by_another(redis, run_name):
    stream = RunKeys(run_name).results
    dead = ResultConsumer(redis, stream, name="dead")
    await dead.setup()
    await _publish(redis, stream, Trajectory(job_id="j", sample_index=0, n=1, status="ok"))
    assert len(await dead.read(block_ms=100)) == 1
    await wait_until(lambda: _idle_at_least(redis, stream, 5), what="the entry to go idle")
    alive = ResultConsumer(redis, stream, name="alive", claim_idle_ms=5)
    claimed = await alive.read(block_ms=100)
    assert [d.trajectory.job_id for d in claimed] == ["j"]


async def test_acked_results_are_trimmed_only_when_every_group_acked(redis, redis_url, run_name):
    producer = Producer(redis, run_name)
    trainer = producer.consumer(group="trainer", name="t")
    monitor = ResultConsumer(redis, producer.reply_to, group="monitor", name="m", release_inflight=False)
    await trainer.setup()
    await monitor.setup()
    async with running_worker(redis_url, run_name):
        await producer.submit_many([])
        for i in range(10):
            await producer.submit("tests.workflows:Echo", {"i": i})
        seen = [t async for t in producer.wait_for({}, timeout_s=1)]
        assert seen == []
        got = []
        while len(got) < 10:
            batch = await trainer.read(count=10, block_ms=2000)
            got += batch
            await trainer.commit(batch)
    trainer._next_trim = 0
    await trainer.commit([])
    assert await redis.xlen(producer.reply_to) == 10  # the monitor group has not read them yet
    mon = await monitor.read(count=20, block_ms=100)
    assert len(mon) == 10
    await monitor.commit(mon)
    monitor._next_trim = 0
    await monitor.commit([])
    assert await redis.xlen(producer.reply_to) <= 1  # the last delivered entry may stay as the group's cursor
    assert await producer.inflight() == 0  # released once, by the primary group


async def test_a_partition_whose_read_fails_does_not_swallow_what_the_others_read(redis, run_name, unused_redis_url):
    """A failover on one partition's Redis node: the others' reads, which moved their entries into this consumer's
    pending list, are handed out by the next read (dropped, they would never come back: their groups never
    complete); and the failed partition walks its own pending list again (a lost reply may have delivered some)."""
    keys = RunKeys(run_name)
    down, up = ResultConsumer(redis, keys.at(0).results, name="t"), ResultConsumer(redis, keys.at(1).results, name="t")
    consumer = PartitionedConsumer([down, up])
    await consumer.setup()
    assert await consumer.read(block_ms=10) == [] and down._own_cursor is None  # walked its (empty) pending list
    await _publish(redis, keys.at(1).results, Trajectory(job_id="j", sample_index=0, n=1, status="ok"))
    away = redis_client(unused_redis_url, retries=0)
    down.redis = away  # partition 0's node goes down
    with pytest.raises(TRANSIENT_ERRORS):
        await consumer.read(block_ms=50)
    assert down._own_cursor == "0"
    down.redis = redis  # and is back
    got = await consumer.read(block_ms=50)
    assert [(d.stream, d.trajectory.job_id) for d in got] == [(keys.at(1).results, "j")]
    await consumer.commit(got)
    assert (await redis.xpending(keys.at(1).results, "trainer"))["pending"] == 0
    await away.aclose()
