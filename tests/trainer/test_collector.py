"""The consumption check against a real results stream: fresh complete groups train, the rest is dropped whole
(acked, counted, given back to the ledger)."""

import asyncio
from fractions import Fraction

import msgspec
import pytest
import torch

from rollq.producer.results import ResultConsumer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.messages import Sequence, Trajectory
from rollq.trainer.batch import build_batch
from rollq.trainer.collector import GroupCollector
from rollq.trainer.ledger import StalenessLedger
from rollq.trainer.settled import TrainedPart

PREFIX = "run1-g"


def sample(job: str, index: int, versions: list[int], *, n: int = 2, status: str = "ok", ids: list[int] | None = None):
    ids = ids or [5, 6] + [7] * len(versions)
    seq = Sequence(
        input_ids=ids,
        loss_mask=[0, 0] + [1] * len(versions),
        logprobs=[0.0] * len(ids),
        versions=[-1, -1] + versions,
        reward=float(index),
    )
    return Trajectory(job_id=job, sample_index=index, n=n, status=status, sequences=[seq] if status == "ok" else [])


async def publish(redis, run: str, *trajectories: Trajectory) -> None:
    codec = Codec()
    for t in trajectories:  # as a worker does: one entry per sample on the run's results stream
        await redis.xadd(RunKeys(run).results, {PAYLOAD_FIELD: codec.encode(t)})


async def setup(redis, run: str, eta: int = 1):
    ledger = StalenessLedger(redis, run, batch_samples=64, max_staleness=eta)
    await ledger.reset()
    consumer = ResultConsumer(redis, RunKeys(run).results, group="trainer", name="trainer")
    await consumer.setup()
    collector = GroupCollector(consumer, ledger, group_prefix=PREFIX, max_staleness=eta, vocab_size=100)
    return ledger, consumer, collector


async def pending(redis, run: str) -> int:
    return (await redis.xpending(RunKeys(run).results, "trainer"))["pending"]


async def test_only_complete_fresh_groups_train_and_the_rest_is_dropped_whole(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, eta=1)
    for g in range(6):
        assert (await ledger.admit(f"{PREFIX}{g}", 2)).admitted
    await publish(
        redis,
        run_name,
        sample(f"{PREFIX}0", 0, [3, 3]),
        sample(f"{PREFIX}0", 1, [2, 3]),  # fresh at v=3 (staleness 1)
        sample(f"{PREFIX}1", 0, [1, 3]),
        sample(f"{PREFIX}1", 1, [3]),  # one token from v1: stale
        sample(f"{PREFIX}2", 0, [3]),
        sample(f"{PREFIX}2", 1, [], status="error"),  # a failed sample
        sample(f"{PREFIX}3", 0, [4]),
        sample(f"{PREFIX}3", 1, [3]),  # v4: weights never checkpointed
        sample(f"{PREFIX}4", 0, [3], ids=[5, 6, 500]),
        sample(f"{PREFIX}4", 1, [3]),  # not in the vocab
        sample("oldrun-g9", 0, [3]),  # another trainer's leftovers
        sample(f"{PREFIX}5", 0, [3]),
    )  # incomplete: waits
    before = (await ledger.state()).admitted
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}0"]
    assert sorted(d.trajectory.sample_index for d in got.deliveries) == [0, 1]
    assert got.staleness == {1: 2}
    assert got.dropped == {"stale": 2, "failed": 2, "future": 2, "invalid": 2, "foreign": 1}
    # dropped groups are acked and give their samples back; the trained one stays pending until committed
    assert (await ledger.state()).admitted == before - 8  # stale, failed, future, invalid: 2 each
    assert await pending(redis, run_name) == 3  # g0's two samples + the incomplete g5
    assert collector.waiting_samples == 1
    await consumer.commit(got.deliveries)
    assert await pending(redis, run_name) == 1


async def test_the_stalest_fit_groups_go_first_and_the_rest_wait_for_the_next_step(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name, eta=2)
    await publish(
        redis, run_name, *(sample(f"{PREFIX}{g}", i, [v, v]) for g, v in ((0, 5), (1, 3), (2, 4)) for i in range(2))
    )
    got = await asyncio.wait_for(collector.collect(2, version=5, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}1", f"{PREFIX}2"] and got.staleness == {2: 2, 1: 2}
    # at version 8 the waiting group (v5) is 3 versions old: dropped, not trained
    await publish(redis, run_name, sample(f"{PREFIX}3", 0, [8]), sample(f"{PREFIX}3", 1, [7]))
    got = await asyncio.wait_for(collector.collect(1, version=8, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}3"] and got.dropped == {"stale": 2}


async def test_groups_trained_before_a_restart_are_acked_not_trained_again(redis, run_name):
    ledger, consumer, collector = await setup(redis, run_name)
    await publish(redis, run_name, *(sample(f"{PREFIX}{g}", i, [0]) for g in range(2) for i in range(2)))
    collector.skip = {f"{PREFIX}0"}
    got = await asyncio.wait_for(collector.collect(1, version=0, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}1"]
    assert await pending(redis, run_name) == 2  # g0 acked at once
    assert collector.samples_read == 4 and collector.model_tokens_read == 4


async def test_a_run_where_everything_fails_stops_with_the_first_error(redis, run_name):
    from rollq.protocol.messages import ErrorRecord
    from rollq.trainer.collector import NothingTrains

    ledger, consumer, collector = await setup(redis, run_name)
    collector.fruitless.limit = 4
    failed = [sample(f"{PREFIX}{g}", i, [], status="error") for g in range(2) for i in range(2)]
    for t in failed:
        t.error = ErrorRecord(type="KeyError", message="'prompt'")
    await publish(redis, run_name, *failed)
    with pytest.raises(NothingTrains, match=r"the first 4 samples all failed .*: nothing trains; e.g. KeyError: 'p"):
        await asyncio.wait_for(collector.collect(1, version=0, block_ms=50), 10)


async def test_samples_that_train_nothing_in_a_row_stop_the_run_even_after_some_trained(redis, run_name):
    """Issue 42: an engine that aborts every request leaves samples with no generated token, which trained 0 tokens
    a step for as long as the run went. They count with failed samples; one sample with a token ends the streak."""
    from rollq.protocol.messages import ErrorRecord
    from rollq.trainer.collector import NothingTrains

    ledger, consumer, collector = await setup(redis, run_name)
    collector.fruitless.limit = 4
    for g in range(4):
        assert (await ledger.admit(f"{PREFIX}{g}", 2)).admitted
    failed = sample(f"{PREFIX}1", 1, [], status="error")
    failed.error = ErrorRecord(type="EngineUnavailable", message="HTTP 500: engine error")
    await publish(redis, run_name, sample(f"{PREFIX}0", 0, [0]), sample(f"{PREFIX}0", 1, []))  # one token, none
    await publish(redis, run_name, sample(f"{PREFIX}1", 0, []), failed, sample(f"{PREFIX}2", 0, []))  # 4 in a row
    with pytest.raises(NothingTrains) as stopped:
        await asyncio.wait_for(collector.collect(3, version=0, block_ms=50), 10)
    assert str(stopped.value) == (
        "the last 4 samples all failed or generated no token (1 failed, 3 with no generated token): nothing trains; "
        "e.g. EngineUnavailable: HTTP 500: engine error"
    )
    assert NothingTrains.exit_code == 4

    ledger, consumer, collector = await setup(redis, run_name + "-b")
    collector.fruitless.limit = 4
    empty = [sample(f"{PREFIX}{g}", i, []) for g in range(2) for i in range(2)]
    await publish(redis, run_name + "-b", *empty[:3], sample(f"{PREFIX}2", 0, [0]), empty[3])  # a token between
    got = await asyncio.wait_for(collector.collect(2, version=0, block_ms=50), 10)
    assert sorted(g.job_id for g in got.groups) == [f"{PREFIX}0", f"{PREFIX}1"] and collector.fruitless.count == 1


async def test_under_mask_a_group_trains_while_any_token_is_within_the_bound(redis, run_name):
    ledger, consumer, _ = await setup(redis, run_name, eta=1)
    collector = GroupCollector(
        consumer, ledger, group_prefix=PREFIX, max_staleness=1, vocab_size=100, stale_policy="mask"
    )
    for g in range(2):
        assert (await ledger.admit(f"{PREFIX}{g}", 2)).admitted
    await publish(
        redis,
        run_name,
        sample(f"{PREFIX}0", 0, [0, 1, 2]),  # its first token is older than 3 - 1: masked, the rest trains
        sample(f"{PREFIX}0", 1, [2]),
        sample(f"{PREFIX}1", 0, [0, 1]),  # nothing within the bound: dropped as stale
        sample(f"{PREFIX}1", 1, [1]),
    )
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}0"]
    assert got.dropped == {"stale": 2} and got.staleness == {1: 2}  # staleness of the tokens that train


async def test_a_partial_group_trains_on_its_survivors_and_gives_the_failed_back(redis, run_name):
    ledger, consumer, _ = await setup(redis, run_name, eta=1)
    collector = GroupCollector(consumer, ledger, group_prefix=PREFIX, max_staleness=1, vocab_size=100, partial_groups=2)
    for g in range(3):
        assert (await ledger.admit(f"{PREFIX}{g}", 4)).admitted
    g0, g1, g2 = (f"{PREFIX}{g}" for g in range(3))
    await publish(
        redis,
        run_name,
        *(sample(g0, i, [3], n=4) for i in range(3)),
        sample(g0, 3, [], n=4, status="error"),  # one failed: g0 trains on three
        sample(g1, 0, [3], n=4),
        *(sample(g1, i, [], n=4, status="error") for i in range(1, 4)),  # one left: dropped whole
        *(sample(g2, i, [0], n=4) for i in range(2)),  # too old at v=3: the survivors are dropped as stale later
        *(sample(g2, i, [], n=4, status="rejected") for i in range(2, 4)),
    )
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [(g.job_id, len(g.samples)) for g in got.groups] == [(g0, 3)] and got.partial_groups == 1
    assert len(got.deliveries) == 4  # the failed sample's entry is committed with the step too
    assert got.dropped == {"failed": 1 + 4 + 2, "stale": 2}
    assert [round(float(a), 3) for a in build_batch(got.groups).advantages] == [-1.0, 0.0, 1.0]  # over survivors
    state = await ledger.state()
    assert state.admitted == 3 and state.released == 9 and state.released_by_reason == {"failed": 7, "stale": 2}


async def split_setup(redis, run: str):
    ledger, consumer, _ = await setup(redis, run, eta=1)
    collector = GroupCollector(consumer, ledger, group_prefix=PREFIX, max_staleness=1, vocab_size=100, split_groups=2)
    return ledger, consumer, collector


async def test_a_split_group_trains_its_finished_samples_ahead_of_its_straggler(redis, run_name):
    ledger, consumer, collector = await split_setup(redis, run_name)
    g0, g1, g2, g3 = (f"{PREFIX}{g}" for g in range(4))
    for g in (g0, g1, g2, g3):
        assert (await ledger.admit(g, 4)).admitted
    await publish(
        redis,
        run_name,
        *(sample(g0, i, [2, 3], n=4) for i in range(3)),  # 3 of 4 finished, oldest at v - eta: at risk at v = 3
        *(sample(g1, i, [3], n=4) for i in range(3)),  # 3 of 4 finished but fresh: they wait for their straggler
        *(sample(g2, i, [3], n=4) for i in range(4)),
    )
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert [(g.job_id, len(g.samples)) for g in got.groups] == [(g0, 3), (g2, 4)]  # a part counts 3/4 of a group
    assert got.split_parts == 1 and got.part_samples == [(g0, 0), (g0, 1), (g0, 2)] and got.staleness == {1: 3, 0: 4}
    assert [round(float(a), 3) for a in build_batch(got.groups[:1]).advantages] == [-1.0, 0.0, 1.0]  # over the 3
    assert collector.parts[g0].samples == [0, 1, 2] and collector.index_of(g0) not in collector.settled
    first = got

    # not committed yet (checkpoint_every > 1): the straggler, a second copy of a trained sample (a worker that lost
    # its lease: dropped here, as the consumer only knows committed samples), and a fresh group
    await publish(redis, run_name, sample(g0, 3, [3, 4], n=4), sample(g0, 1, [2, 3], n=4))
    await publish(redis, run_name, *(sample(g3, i, [4], n=4) for i in range(4)))
    got = await asyncio.wait_for(collector.collect(1, version=4, block_ms=50), 10)
    # g0's last part, then g1's finished samples: at risk now (v3 = 4 - eta); g3 waits (its share isn't needed)
    assert [(g.job_id, len(g.samples)) for g in got.groups] == [(g0, 1), (g1, 3)]
    assert got.split_parts == 1 and collector.duplicates == 1
    advantage = float(build_batch(got.groups[:1]).advantages[0])  # the rest: over the whole group (rewards 0..3)
    assert advantage == pytest.approx((3 - 1.5) / torch.tensor([0.0, 1, 2, 3]).std().item(), abs=1e-4)
    assert g0 not in collector.parts and collector.index_of(g0) in collector.settled
    await consumer.commit(first.deliveries + got.deliveries)
    assert await pending(redis, run_name) == 4  # g3 waits
    state = await ledger.state()
    assert state.admitted == 16 and state.released == 0  # nothing given back


async def test_a_restarted_trainer_acks_a_checkpointed_part_and_trains_only_the_rest(redis, run_name):
    ledger, consumer, collector = await split_setup(redis, run_name)
    g0, g1 = f"{PREFIX}0", f"{PREFIX}1"
    for g in (g0, g1):
        assert (await ledger.admit(g, 3)).admitted
    await publish(redis, run_name, *(sample(g0, i, [2, 3], n=3) for i in range(2)))
    await publish(redis, run_name, *(sample(g1, i, [3], n=3) for i in range(3)))
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert got.part_samples == [(g0, 0), (g0, 1)]
    saved = msgspec.json.decode(msgspec.json.encode(collector.parts), type=dict[str, TrainedPart])  # checkpointed;
    # the trainer dies before it commits: a new one reads its pending entries again
    consumer = ResultConsumer(redis, RunKeys(run_name).results, group="trainer", name="trainer")
    collector = GroupCollector(consumer, ledger, group_prefix=PREFIX, max_staleness=1, vocab_size=100, split_groups=2)
    collector.parts = saved
    collector.settled.add(1)
    await publish(redis, run_name, sample(g0, 2, [4], n=3))
    got = await asyncio.wait_for(collector.collect(Fraction(1, 3), version=4, block_ms=50), 10)  # type: ignore[arg-type]
    assert [(g.job_id, [t.sample_index for t in g.samples]) for g in got.groups] == [(g0, [2])]
    assert got.groups[0].context_rewards == [0.0, 1.0] and collector.settled_copies == 5  # g0's part and g1 acked
    await consumer.commit(got.deliveries)
    assert await pending(redis, run_name) == 0


async def test_a_split_group_dropped_later_gives_back_only_what_it_had_not_trained(redis, run_name):
    ledger, consumer, collector = await split_setup(redis, run_name)
    g0, g1 = f"{PREFIX}0", f"{PREFIX}1"
    for g in (g0, g1):
        assert (await ledger.admit(g, 3)).admitted
    await publish(
        redis, run_name, *(sample(g0, i, [2], n=3) for i in range(2)), *(sample(g1, i, [3], n=3) for i in range(3))
    )
    got = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 10)
    assert got.part_samples == [(g0, 0), (g0, 1)]
    await publish(redis, run_name, sample(g0, 2, [], n=3, status="error"))  # its straggler fails: the rest goes back
    await publish(redis, run_name, *(sample(f"{PREFIX}2", i, [5], n=3) for i in range(3)))
    assert (await ledger.admit(f"{PREFIX}2", 3)).admitted
    got = await asyncio.wait_for(collector.collect(1, version=5, block_ms=50), 10)
    assert [g.job_id for g in got.groups] == [f"{PREFIX}2"] and got.dropped == {"failed": 1}
    state = await ledger.state()
    assert state.admitted == 8 and state.released_by_reason == {"failed": 1}  # g0's 2 trained samples stay counted
    assert g0 not in collector.parts and collector.recent_drops[-1] == (g0, "failed", 1)


async def test_collect_at_risk_takes_only_what_would_pass_the_bound_at_the_next_update(redis, run_name):
    ledger, consumer, collector = await split_setup(redis, run_name)
    g0, g1, g2 = (f"{PREFIX}{g}" for g in range(3))
    for g in (g0, g1, g2):
        assert (await ledger.admit(g, 4)).admitted
    await publish(
        redis,
        run_name,
        *(sample(g0, i, [2, 3], n=4) for i in range(4)),  # complete, oldest token v - eta: at risk
        *(sample(g1, i, [3], n=4) for i in range(4)),  # complete and fresh: waits for a step
        *(sample(g2, i, [2], n=4) for i in range(3)),  # 3 of 4 finished, at risk: a part
    )
    got = await asyncio.wait_for(collector.collect_at_risk(version=3), 5)  # no waiting for a quota
    assert [(g.job_id, len(g.samples)) for g in got.groups] == [(g0, 4), (g2, 3)]
    assert got.part_samples == [(g2, i) for i in range(3)] and got.staleness == {1: 7}
    assert (await asyncio.wait_for(collector.collect_at_risk(version=3), 5)).groups == []  # nothing more at risk
    rest = await asyncio.wait_for(collector.collect(1, version=3, block_ms=50), 5)
    assert [g.job_id for g in rest.groups] == [g1]
    merged = got.merged(rest)
    assert [g.job_id for g in merged.groups] == [g0, g2, g1] and merged.staleness == {1: 7, 0: 4}
