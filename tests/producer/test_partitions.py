"""A run split into K partitions (RunKeys.partitions): producers spread jobs by job id, each job's keys share its
partition's hash tag, workers read every partition, consumers read every partition's results; bounds are per
partition. Against one real Redis here; tests/protocol/test_cluster.py runs the same scenarios on a real cluster."""

from __future__ import annotations

import collections

import httpx
import pytest

from rollq.producer.producer import BackpressureError, JobRequest, Producer, QueueFull
from rollq.producer.status import format_status, gather_status
from rollq.protocol.keys import RunKeys, partition_of
from rollq.redis_client import redis_client
from tests.helpers import running_worker, wait_until
from tests.producer.ingress_helpers import running_ingress

ECHO = "tests.workflows:Echo"


async def spread_and_collect(url: str, run: str, partitions: int, jobs: int = 24, n: int = 2) -> None:
    """Submit `jobs` jobs of `n` over `partitions`, run them with one worker, and collect every sample once."""
    client = redis_client(url)
    try:
        producer = Producer(client, run, partitions=partitions)
        ids = [f"job-{i}" for i in range(jobs)]
        reqs = [JobRequest(workflow=ECHO, data={"i": i}, n=n, job_id=job_id) for i, job_id in enumerate(ids)]
        results = await producer.submit_many(reqs)
        assert [r.job_id for r in results] == ids and all(r.admitted for r in results)
        keys = RunKeys(run)
        where = collections.Counter(partition_of(job_id, partitions) for job_id in ids)
        assert len(where) == partitions  # the ids spread over every partition
        assert await client.get(keys.partitions) == str(partitions).encode()
        for p in range(partitions):
            assert await client.xlen(keys.at(p).job_stream()) == where[p] * n
        for job_id, result in zip(ids, results, strict=True):
            p = partition_of(job_id, partitions)
            assert result.reply_to == keys.at(p).results
            assert await client.get(keys.at(p).job_seen(job_id)) == keys.at(p).results.encode()
        again = await producer.submit_many(reqs)  # idempotent: each id finds its marker on its own partition
        assert not any(r.admitted for r in again)
        async with running_worker(url, run, concurrency=8):
            got = [t async for t in producer.wait_for(dict.fromkeys(ids, n), timeout_s=30)]
        assert sorted((t.job_id, t.sample_index) for t in got) == sorted((j, i) for j in ids for i in range(n))
        assert all(t.status == "ok" for t in got)
        for p in range(partitions):
            assert await client.xlen(keys.at(p).job_stream()) == 0  # acked and deleted on its own partition
            assert await client.get(f"{keys.at(p).results}:inflight") in (b"0", None)
    finally:
        await client.aclose()


async def test_jobs_spread_over_partitions_and_every_sample_comes_back_once(redis_url, run_name):
    await spread_and_collect(redis_url, run_name, 3)


async def test_a_process_with_another_partition_count_is_refused(redis, run_name):
    await Producer(redis, run_name, partitions=3).submit(ECHO, {}, job_id="a")
    with pytest.raises(ValueError, match=r"the run has 3 partition\(s\).*partitions=2"):
        await Producer(redis, run_name, partitions=2).submit(ECHO, {}, job_id="b")
    following = Producer(redis, run_name)  # 0: follow the run's count
    assert await following.partitions() == 3
    await following.submit(ECHO, {}, job_id="c")
    assert await redis.xlen(RunKeys(run_name).at(partition_of("c", 3)).jobs) >= 1


async def test_status_sums_every_partition(redis, run_name):
    keys = RunKeys(run_name)
    await Producer(redis, run_name, partitions=3).submit_many(
        [JobRequest(workflow=ECHO, job_id=f"s{i}") for i in range(9)]
    )
    await redis.hincrby(keys.at(2).dropped, "reply_gone", 2)  # as a worker counts a result whose caller left
    status = await gather_status(redis, run_name)
    assert status.partitions == 3
    assert [s.key for s in status.job_streams] == [keys.at(p).jobs for p in range(3)]
    assert sum(s.length for s in status.job_streams) == 9
    assert [r.key for r in status.results] == [keys.at(p).results for p in range(3)]
    assert status.dropped == {"reply_gone": 2}
    text = format_status(status)
    assert "(3 partitions)" in text and "dropped results (reply_gone): 2" in text


async def test_bounds_are_split_evenly_over_partitions(redis, run_name):
    producer = Producer(redis, run_name, partitions=2, max_inflight=4)  # 2 samples per partition
    with pytest.raises(BackpressureError, match="2 per partition of 2"):
        await producer.submit(ECHO, {}, n=3)
    ids = [f"b{i}" for i in range(40)]
    on0 = [j for j in ids if partition_of(j, 2) == 0][:3]
    await producer.submit_many([JobRequest(workflow=ECHO, n=1, job_id=j) for j in on0[:2]])
    with pytest.raises(QueueFull) as full:
        await producer.submit_many([JobRequest(workflow=ECHO, n=1, job_id=on0[2])], wait=False)
    assert full.value.bound == "reply"
    on1 = next(j for j in ids if partition_of(j, 2) == 1)
    assert (await producer.submit_many([JobRequest(workflow=ECHO, job_id=on1)], wait=False))[0].admitted
    with pytest.raises(ValueError, match="atomic batch must keep its jobs on one"):
        await producer.submit_many([JobRequest(workflow=ECHO, job_id=j) for j in (on0[2], on1)], atomic=True)


async def test_a_worker_started_first_follows_the_partitions_once_the_run_sets_them(redis_url, redis, run_name):
    async with running_worker(redis_url, run_name, concurrency=4, classes_refresh_ms=50):
        producer = Producer(redis, run_name, partitions=4)
        ids = [f"late-{i}" for i in range(16)]
        await producer.submit_many([JobRequest(workflow=ECHO, job_id=j) for j in ids])
        got = [t async for t in producer.wait_for(dict.fromkeys(ids, 1), timeout_s=30)]
    assert sorted(t.job_id for t in got) == sorted(ids)


async def test_partitions_are_read_fairly_when_all_are_backlogged(redis_url, redis, run_name):
    """One worker, every partition backlogged: starts alternate over the partitions (none waits for another to
    empty)."""
    producer = Producer(redis, run_name, partitions=3)
    ids = [f"f{i}" for i in range(90)]
    await producer.submit_many([JobRequest(workflow=ECHO, data={"sleep": 0.01}, job_id=j) for j in ids])
    async with running_worker(redis_url, run_name, concurrency=3):
        seen = [t async for t in producer.wait_for(dict.fromkeys(ids, 1), timeout_s=60)]
    first_third = collections.Counter(partition_of(t.job_id, 3) for t in sorted(seen, key=lambda t: t.started_at)[:30])
    assert min(first_third.values()) >= 6, first_third  # 10 each when perfectly even


async def test_the_ingress_places_each_job_on_its_partition(redis_url, redis, run_name):
    keys = RunKeys(run_name)
    await redis.set(keys.partitions, 3)
    async with running_ingress(redis_url, run_name) as (_, base), httpx.AsyncClient(timeout=10) as http:
        auth = {"Authorization": "Bearer tok-acme"}
        jobs = [{"workflow": ECHO, "data": {"i": i}, "n": 2, "job_id": f"ing-{i}"} for i in range(9)]
        resp = await http.post(f"{base}/v1/jobs", json={"jobs": jobs}, headers=auth)
        assert resp.status_code == 202, resp.text
        parts = {partition_of(f"acme:ing-{i}", 3) for i in range(9)}
        assert len(parts) > 1
        for i in range(9):
            p = partition_of(f"acme:ing-{i}", 3)
            assert await redis.exists(keys.at(p).job_control(f"acme:ing-{i}"))
        async with running_worker(redis_url, run_name, concurrency=8):

            async def all_done() -> bool:
                states = [(await http.get(f"{base}/v1/jobs/ing-{i}", headers=auth)).json() for i in range(9)]
                return all(s["done"] for s in states)

            await wait_until(all_done, 30, what="every ingress job done")
        resend = await http.post(f"{base}/v1/jobs", json={"jobs": jobs}, headers=auth)
        assert [a["admitted"] for a in resend.json()["jobs"]] == [False] * 9
        queued = {"workflow": ECHO, "n": 3, "job_id": "ing-cancel"}  # no worker runs now: cancelled before start
        assert (await http.post(f"{base}/v1/jobs", json=queued, headers=auth)).status_code == 202
        cancel = await http.delete(f"{base}/v1/jobs/ing-cancel", headers=auth)
        assert cancel.status_code == 200 and cancel.json()["cancelled"] == [0, 1, 2], cancel.text
        state = (await http.get(f"{base}/v1/jobs/ing-cancel", headers=auth)).json()
        assert state["counts"]["cancelled"] == 3 and state["done"]
        home = keys.at(partition_of("acme:ing-cancel", 3))
        assert await redis.xlen(home.job_results("acme:ing-cancel")) == 3
        assert await redis.xlen(home.jobs) == 3  # still queued there; a worker acks them without running them


async def test_the_first_process_that_writes_jobs_fixes_the_count_and_readers_do_not(redis, redis_url, run_name):
    keys = RunKeys(run_name)
    async with running_worker(redis_url, run_name):  # a reader: follows, never sets the count
        assert await redis.get(keys.partitions) is None
        await Producer(redis, run_name).submit(ECHO, {}, job_id="first")  # follows (0), writes: claims 1
    assert await redis.get(keys.partitions) == b"1"
    with pytest.raises(ValueError, match=r"the run has 1 partition\(s\)"):
        await Producer(redis, run_name, partitions=3).submit(ECHO, {}, job_id="second")
