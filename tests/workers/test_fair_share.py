"""Job classes: per-class streams, strict priority between levels, DRR by weight within one, per-class admission
budgets, reclaim per stream, and old single-stream jobs. Shares are measured by the order in which a real worker
starts the jobs (the `Recorder` workflow notes each start), with both classes backlogged before it starts."""

from __future__ import annotations

import asyncio

import pytest

from rollq.producer import JobRequest, Producer
from rollq.producer.classes import get_classes, set_class
from rollq.producer.producer import QueueFull
from rollq.protocol import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP, RunKeys
from rollq.protocol.messages import Job, JobClass
from rollq.workers.context import workflow_context
from rollq.workers.fair_share import FairShare
from tests.helpers import running_worker, wait_until
from tests.workflows import trajectory

STARTS: dict[str, list[str]] = {}  # run -> job classes in the order their jobs started
GATES: dict[str, asyncio.Event] = {}  # run -> opened by the test (a job with data["gate"] waits for it)
WORKFLOW = "tests.workers.test_fair_share:Recorder"


class Recorder:
    """Notes which class each started job belongs to; returns the episode's class priority as the reward."""

    async def arun_episode(self, engine, data):
        episode = workflow_context.get()
        STARTS.setdefault(data["run"], []).append(episode.job_class)
        if data.get("gate"):
            await GATES[data["run"]].wait()
        return trajectory(4, float(episode.priority or 0))


def jobs(run: str, job_class: str, count: int, **data) -> list[JobRequest]:
    return [
        JobRequest(workflow=WORKFLOW, data={"run": run, **data}, job_id=f"{job_class}-{i}", job_class=job_class)
        for i in range(count)
    ]


async def run_all(redis_url: str, producer: Producer, expected: dict[str, int], **config) -> None:
    consumer = producer.consumer()
    await consumer.setup()
    async with running_worker(redis_url, producer.keys.run, **config):
        trajs = [t async for t in producer.wait_for(expected, timeout_s=60, consumer=consumer)]
    assert all(t.status == "ok" for t in trajs), [t.error for t in trajs if t.error]


def share(starts: list[str], name: str) -> float:
    return starts.count(name) / len(starts)


def test_drr_shares_and_levels():
    fair = FairShare([JobClass(name="a", weight=3), JobClass(name="b"), JobClass(name="hi", priority=5)])
    counts = {"a": 0, "b": 0}
    for _ in range(400):  # one slot at a time
        for name in fair.allocate(1, {"a", "b"}):
            counts[name] += 1
    assert counts == {"a": 300, "b": 100}
    assert fair.allocate(8, {"a", "b"}) == ["a", "a", "a", "b", "a", "a", "a", "b"]  # the service order
    assert fair.allocate(8, {"a", "b", "hi"}) == ["hi"] * 8  # strict priority
    fair.exhausted("a")  # a came back empty: b is up, a's deficit is gone
    assert fair.allocate(1, {"b"}) == ["b"]


@pytest.mark.parametrize(
    ("weights", "flooded", "expected"),
    [((1.0, 1.0), "ext", 0.5), ((3.0, 1.0), "ext", 0.75), ((1.0, 3.0), "train", 0.25)],
    ids=["equal-weights", "3-to-1", "1-to-3"],
)
async def test_backlogged_classes_get_their_weighted_share_at_10_to_1(
    redis, redis_url, run_name, weights, flooded, expected
):
    """train and ext submitted 10:1 (either way round); while both are backlogged, train's share of the starts
    is its weight's share, within 10 %."""
    await set_class(redis, run_name, JobClass(name="train", weight=weights[0]))
    await set_class(redis, run_name, JobClass(name="ext", weight=weights[1]))
    few = 30
    counts = {"train": few, "ext": few}
    counts[flooded] = 10 * few
    producer = Producer(redis, run_name)
    await producer.submit_many(jobs(run_name, "train", counts["train"]) + jobs(run_name, "ext", counts["ext"]))
    await run_all(redis_url, producer, {f"{c}-{i}": 1 for c, k in counts.items() for i in range(k)}, concurrency=2)
    starts = STARTS.pop(run_name)
    assert len(starts) == sum(counts.values())
    scarce = "train" if flooded == "ext" else "ext"
    scarce_share = expected if scarce == "train" else 1 - expected
    window = starts[: int(few / scarce_share) - 2]  # the starts while the scarce class still had jobs queued
    assert abs(share(window, "train") - expected) <= 0.1 * expected, window
    # and once the scarce class is done, the flooded one gets everything
    assert set(starts[int(few / scarce_share) + 2 :]) == {flooded}


async def test_a_starving_low_weight_class_is_still_served(redis, redis_url, run_name):
    await set_class(redis, run_name, JobClass(name="train", weight=50))
    await set_class(redis, run_name, JobClass(name="bulk", weight=1))
    producer = Producer(redis, run_name)
    await producer.submit_many(jobs(run_name, "train", 300) + jobs(run_name, "bulk", 5))
    await run_all(redis_url, producer, {**{f"train-{i}": 1 for i in range(300)}, **{f"bulk-{i}": 1 for i in range(5)}})
    starts = STARTS.pop(run_name)
    positions = [i for i, c in enumerate(starts) if c == "bulk"]
    # weights 50:1 -> bulk gets a start in every 51 while both are backlogged
    assert len(positions) == 5 and all(p < (k + 1) * 51 + 1 for k, p in enumerate(positions)), positions


async def test_a_high_priority_class_overtakes_a_queued_backlog(redis, redis_url, run_name):
    await set_class(redis, run_name, JobClass(name="eval", priority=10))
    GATES[run_name] = asyncio.Event()
    producer = Producer(redis, run_name)
    first = JobRequest(workflow=WORKFLOW, data={"run": run_name, "gate": True}, job_id="train-gate")
    await producer.submit_many([first, *jobs(run_name, "train", 40)])
    consumer = producer.consumer()
    await consumer.setup()
    expected = {"train-gate": 1, **{f"train-{i}": 1 for i in range(40)}, **{f"eval-{i}": 1 for i in range(5)}}
    async with running_worker(redis_url, run_name, concurrency=1):
        # the worker is busy with the gated job; the backlog waits
        await wait_until(lambda: STARTS.get(run_name) == ["train"], 10, what="the gated job to start")
        await producer.submit_many(jobs(run_name, "eval", 5))  # submitted after the backlog
        GATES[run_name].set()
        trajs = [t async for t in producer.wait_for(expected, timeout_s=60, consumer=consumer)]
    starts = STARTS.pop(run_name)
    assert starts[1:6] == ["eval"] * 5 and set(starts[6:]) == {"train"}
    rewards = {t.job_id: t.sequences[0].reward for t in trajs}
    assert rewards["eval-0"] == 10.0 and rewards["train-0"] == 0.0  # the episode carries its class's priority


async def test_per_class_admission_budget_blocks_one_class_only(redis, redis_url, run_name):
    await set_class(redis, run_name, JobClass(name="ext", max_inflight=4))
    keys = RunKeys(run_name)
    producer = Producer(redis, run_name)
    assert all(r.admitted for r in await producer.submit_many(jobs(run_name, "ext", 4)))
    with pytest.raises(QueueFull) as full:
        await producer.submit_many([JobRequest(workflow=WORKFLOW, data={"run": run_name}, job_class="ext")], wait=False)
    assert full.value.bound == "class" and full.value.job_class == "ext"
    # training is still admitted
    train = jobs(run_name, "train", 10)
    assert all(r.admitted for r in await producer.submit_many(train))
    # a batch is admitted all or nothing: a train job beside an ext job that does not fit is not queued either
    batch = [
        JobRequest(workflow=WORKFLOW, data={"run": run_name}, job_id="batch-train"),
        JobRequest(workflow=WORKFLOW, data={"run": run_name}, job_id="batch-ext", job_class="ext"),
    ]
    with pytest.raises(QueueFull) as full:
        await producer.submit_many(batch, atomic=True, wait=False)
    assert full.value.admitted == []
    assert await redis.xlen(keys.jobs) == 10 and await redis.xlen(keys.job_stream("ext")) == 4
    assert not await redis.exists(keys.job_seen("batch-train"))
    # with waiting, the batch goes in once workers make room
    consumer = producer.consumer()
    await consumer.setup()
    expected = {**{f"ext-{i}": 1 for i in range(4)}, **{f"train-{i}": 1 for i in range(10)}}
    async with running_worker(redis_url, run_name, concurrency=4):
        results = await asyncio.wait_for(producer.submit_many(batch, atomic=True), 30)
        expected.update({"batch-train": 1, "batch-ext": 1})
        trajs = [t async for t in producer.wait_for(expected, timeout_s=30, consumer=consumer)]
    assert all(r.admitted for r in results) and len(trajs) == 16
    assert await redis.xlen(keys.job_stream("ext")) == 0  # finished entries leave the stream: the budget is free
    STARTS.pop(run_name, None)


async def test_unknown_class_and_oversized_job_are_refused_before_anything_is_queued(redis, run_name):
    await set_class(redis, run_name, JobClass(name="small", max_inflight=2))
    producer = Producer(redis, run_name)
    with pytest.raises(ValueError, match="unknown job class"):
        await producer.submit_many(jobs(run_name, "train", 3) + jobs(run_name, "nope", 1))
    with pytest.raises(ValueError, match="can never fit class 'small'"):
        await producer.submit_many([JobRequest(workflow=WORKFLOW, n=3, job_class="small")])
    assert await redis.xlen(RunKeys(run_name).jobs) == 0
    assert set(await get_classes(redis, run_name)) == {"train", "small"}


async def test_a_dead_workers_entries_on_a_class_stream_are_reclaimed(redis, redis_url, run_name):
    await set_class(redis, run_name, JobClass(name="ext", weight=2))
    keys = RunKeys(run_name)
    producer = Producer(redis, run_name)
    await producer.submit_many(jobs(run_name, "ext", 3))
    # A worker that took two entries and died (never acked, never refreshed their lease).
    taken = await redis.xreadgroup(WORKER_GROUP, "dead-worker", {keys.job_stream("ext"): ">"}, count=2)
    assert len(taken[0][1]) == 2
    consumer = producer.consumer()
    await consumer.setup()
    async with running_worker(redis_url, run_name, lease_ms=200) as worker:
        trajs = [t async for t in producer.wait_for({f"ext-{i}": 1 for i in range(3)}, timeout_s=30, consumer=consumer)]
    assert worker.stats.reclaimed == 2
    assert sorted(t.attempt for t in trajs) == [1, 2, 2]  # the reclaimed ones were delivered a second time
    assert await redis.xlen(keys.job_stream("ext")) == 0
    assert (await redis.xpending(keys.job_stream("ext"), WORKER_GROUP))["pending"] == 0
    STARTS.pop(run_name, None)


async def test_old_single_stream_jobs_still_run_beside_classes(redis, redis_url, run_name):
    """Entries written as before classes existed (no job_class field, msgpack or JSON) on `rollq:{run}:jobs`."""
    await set_class(redis, run_name, JobClass(name="ext"))
    keys = RunKeys(run_name)
    codec = Codec()
    old = Job(job_id="old-msgpack", workflow=WORKFLOW, data={"run": run_name})
    assert b"job_class" not in codec.encode(old)  # the default class is omitted on the wire
    await redis.xadd(keys.jobs, {PAYLOAD_FIELD: codec.encode(old)})
    as_json = f'{{"job_id": "old-json", "workflow": "{WORKFLOW}", "data": {{"run": "{run_name}"}}}}'
    await redis.xadd(keys.jobs, {PAYLOAD_FIELD: as_json})
    producer = Producer(redis, run_name)
    await producer.submit_many(jobs(run_name, "ext", 2))
    await run_all(redis_url, producer, {"old-msgpack": 1, "old-json": 1, "ext-0": 1, "ext-1": 1})
    assert sorted(STARTS.pop(run_name)) == ["ext", "ext", "train", "train"]
    assert await redis.xlen(keys.jobs) == 0


async def test_a_jobs_own_priority_overrides_its_classs_for_its_engine_requests(redis, redis_url, run_name):
    await set_class(redis, run_name, JobClass(name="eval", priority=10))
    producer = Producer(redis, run_name)
    own = [
        JobRequest(workflow=WORKFLOW, data={"run": run_name}, job_id="old-group", priority=-3),
        JobRequest(workflow=WORKFLOW, data={"run": run_name}, job_id="eval-own", job_class="eval", priority=4),
        JobRequest(workflow=WORKFLOW, data={"run": run_name}, job_id="plain"),
    ]
    await producer.submit_many(own)
    consumer = producer.consumer()
    await consumer.setup()
    async with running_worker(redis_url, run_name, concurrency=2):
        expected = dict.fromkeys(["old-group", "eval-own", "plain"], 1)
        trajs = [t async for t in producer.wait_for(expected, timeout_s=30, consumer=consumer)]
    rewards = {t.job_id: t.sequences[0].reward for t in trajs}
    assert rewards == {"old-group": -3.0, "eval-own": 4.0, "plain": 0.0}
    STARTS.pop(run_name, None)
