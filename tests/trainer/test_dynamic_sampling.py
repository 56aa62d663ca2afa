"""DAPO's dynamic sampling in the collector, against a real results stream and ledger: a complete group whose rewards
are all equal is not trained but dropped as `filtered` (acked, given back to the ledger, counted, its rewards handed
out for the step's metrics), within a per-step budget past which such groups train so a solved task still steps."""

import asyncio

from rollq.producer.results import ResultConsumer
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import Sequence, Trajectory
from rollq.trainer.batch import build_batch
from rollq.trainer.collector import GroupCollector
from rollq.trainer.ledger import StalenessLedger
from tests.trainer.test_collector import PREFIX, pending, publish

N = 4  # samples per group


def sample(group: int, index: int, reward: float, *, status: str = "ok", version: int = 3) -> Trajectory:
    seq = Sequence(
        input_ids=[5, 6, 7], loss_mask=[0, 0, 1], logprobs=[0.0] * 3, versions=[-1, -1, version], reward=reward
    )
    ok = status == "ok"
    return Trajectory(job_id=f"{PREFIX}{group}", sample_index=index, n=N, status=status, sequences=[seq] if ok else [])


def group(g: int, *rewards: float) -> list[Trajectory]:
    return [sample(g, i, r) for i, r in enumerate(rewards)]


async def setup(redis, run: str, groups: int, **kwargs):
    ledger = StalenessLedger(redis, run, batch_samples=64, max_staleness=1)
    await ledger.reset()
    for g in range(groups):
        assert (await ledger.admit(f"{PREFIX}{g}", N)).admitted
    consumer = ResultConsumer(redis, RunKeys(run).results, group="trainer", name="trainer")
    await consumer.setup()
    collector = GroupCollector(consumer, ledger, group_prefix=PREFIX, max_staleness=1, vocab_size=100, **kwargs)
    return ledger, consumer, collector


async def test_a_group_whose_rewards_are_all_equal_is_acked_given_back_and_counted_not_trained(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, 3, filter_groups=8)
    released: list[str] = []
    collector.on_settled = released.append
    await publish(redis, run_name, *group(0, 1.0, 1.0, 1.0, 1.0), *group(1, 0.0, 0.5, 1.0, 0.5))
    await publish(redis, run_name, *group(2, 0.0, 0.0, 0.0, 0.0))
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}1"]
    assert got.dropped == {"filtered": 2 * N} and got.filtered_groups == 2
    assert sorted(got.filtered_rewards) == [0.0] * N + [1.0] * N  # for the step's reward metrics
    assert await pending(redis, run_name) == N  # the filtered groups are acked at once, the trained one waits
    state = await ledger.state()  # given back: the feeder may admit two more groups in their place
    assert state.admitted == N and state.released_by_reason == {"filtered": 2 * N}
    assert set(released) == {f"{PREFIX}{g}" for g in range(3)}  # settled: nothing more is expected of them
    assert all(collector.index_of(f"{PREFIX}{g}") in collector.settled for g in (0, 2))
    assert collector.filtered_groups == 2 and (f"{PREFIX}2", "filtered", None) in collector.recent_drops
    assert build_batch(got.groups).advantages.abs().sum() > 0  # what trains has a signal


async def test_past_the_budget_groups_without_a_signal_train_after_those_with_one(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, 7, filter_groups=1.5)  # rounded up: 2
    await publish(redis, run_name, *group(0, 1.0, 1.0, 1.0, 1.0), *group(1, 1.0, 1.0, 1.0, 1.0))  # the budget
    await publish(redis, run_name, *group(2, 1.0, 1.0, 1.0, 1.0), *group(3, 0.0, 1.0, 1.0, 1.0))
    got = await asyncio.wait_for(collector.collect(2, version=3, block_ms=50), 10)
    # g3 has a signal: first, though g2 completed before it; g2 fills the step (zero advantage) rather than wait
    assert [g.job_id for g in got.groups] == [f"{PREFIX}3", f"{PREFIX}2"]
    assert got.filtered_groups == 2 and got.dropped == {"filtered": 2 * N}
    assert build_batch(got.groups[1:]).advantages.abs().sum() == 0

    # a solved task: every group all 1.0. Each step filters its budget (afresh), then trains what comes: it never
    # starves
    await publish(redis, run_name, *(t for g in (4, 5, 6) for t in group(g, 1.0, 1.0, 1.0, 1.0)))
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}6"] and got.filtered_groups == 2
    assert collector.filtered_groups == 4 and (await ledger.state()).released_by_reason == {"filtered": 4 * N}


async def test_off_a_group_without_a_signal_trains(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, 1)
    await publish(redis, run_name, *group(0, 0.5, 0.5, 0.5, 0.5))
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}0"] and got.dropped == {} and got.filtered_groups == 0


async def test_a_partial_group_whose_survivors_agree_gives_all_its_samples_back(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, 2, filter_groups=8, partial_groups=2)
    await publish(redis, run_name, *group(0, 1.0, 1.0, 1.0), sample(0, 3, 0.0, status="error"))
    await publish(redis, run_name, *group(1, 0.0, 1.0, 1.0, 1.0))
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}1"]
    assert got.dropped == {"failed": 1, "filtered": 3} and got.filtered_rewards == [1.0, 1.0, 1.0]
    state = await ledger.state()
    assert state.admitted == N and state.released_by_reason == {"failed": 1, "filtered": 3}


async def test_a_restart_neither_trains_a_filtered_group_nor_loses_it(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, 3, filter_groups=8)
    await publish(redis, run_name, *group(0, 1.0, 1.0, 1.0, 1.0), *group(1, 0.0, 1.0, 0.0, 1.0))
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}1"] and got.filtered_groups == 1
    # a second copy of a filtered sample (a worker that lost its lease published it too): the filter committed the
    # group's samples, so the consumer's dedup drops it; it never reaches a group
    await publish(redis, run_name, sample(0, 2, 1.0))
    await publish(redis, run_name, *group(2, 0.0, 0.0, 1.0, 1.0))
    got2 = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got2.groups] == [f"{PREFIX}2"] and consumer.duplicates_dropped == 1

    # the trainer dies before its checkpoint: nothing it trained was committed. A new one (its checkpoint from
    # before any of this: nothing settled, nothing to skip) reads the pending entries again
    consumer = ResultConsumer(redis, RunKeys(run_name).results, group="trainer", name="trainer")
    collector = GroupCollector(consumer, ledger, group_prefix=PREFIX, max_staleness=1, vocab_size=100, filter_groups=8)
    got = await asyncio.wait_for(collector.collect(2, version=3, block_ms=50), 10)
    assert sorted(g.job_id for g in got.groups) == [f"{PREFIX}1", f"{PREFIX}2"]  # trained now, once
    assert got.dropped == {} and collector.samples_read == 2 * N  # g0 was acked when filtered: not read again
    await consumer.commit(got.deliveries)
    assert await pending(redis, run_name) == 0
    # nor lost: its samples stay given back, once, however often the give-back is written again (Trainer._recover)
    assert await ledger.release(f"{PREFIX}0", "filtered") == 0
    state = await ledger.state()
    assert state.admitted == 2 * N and state.released_by_reason == {"filtered": N}
