"""Crash safety with real worker subprocesses: SIGKILL, SIGTERM drain, and Redis restarted under a running worker."""

import asyncio
from pathlib import Path

import pytest

from rollq.local import RedisServer
from rollq.producer import JobRequest, Producer
from rollq.protocol.keys import WORKER_GROUP, RunKeys
from rollq.redis_client import redis_client
from tests.helpers import wait_registered, wait_until

pytestmark = pytest.mark.slow

FAST_LEASE = ["--lease-ms", "1000"]


def started_in(marker_dir: Path, pid: int) -> int:
    return sum(1 for p in marker_dir.glob(f"start-*-{pid}"))


async def drain_results(producer: Producer, expected: dict[str, int], timeout_s: float = 60):
    return [t async for t in producer.wait_for(expected, timeout_s=timeout_s)]


def assert_exactly_once(trajs, expected: dict[str, int]):
    got = sorted((t.job_id, t.sample_index) for t in trajs)
    assert got == sorted((j, s) for j, n in expected.items() for s in range(n))


async def test_jobs_of_a_sigkilled_worker_are_reclaimed_and_delivered_exactly_once(
    redis, redis_url, run_name, spawn_worker, tmp_path
):
    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    victim = spawn_worker(redis_url, run_name, "--concurrency", "4", *FAST_LEASE)
    await wait_registered(redis, run_name, victim.name)
    reqs = [
        JobRequest(
            workflow="tests.workflows:Echo", data={"i": i, "sleep": 0.4, "marker_dir": str(tmp_path)}, job_id=f"j{i}"
        )
        for i in range(16)
    ]
    await producer.submit_many(reqs)
    await wait_until(lambda: started_in(tmp_path, victim.proc.pid) >= 6, 20, what="the victim to be mid-run")
    victim.kill()
    keys = RunKeys(run_name)
    orphaned = (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"]
    assert orphaned > 0  # the kill really left jobs half-done
    rescuer = spawn_worker(redis_url, run_name, "--concurrency", "4", *FAST_LEASE)
    expected = {f"j{i}": 1 for i in range(16)}
    trajs = [t async for t in producer.wait_for(expected, timeout_s=60, consumer=consumer)]
    assert_exactly_once(trajs, expected)
    assert consumer.duplicates_dropped == 0
    # Nothing was published twice, and the rescuer did the orphaned work.
    assert await redis.xlen(producer.reply_to) <= len(expected)
    assert sum(t.worker_id == rescuer.name for t in trajs) >= orphaned
    assert any(t.attempt == 2 for t in trajs)


async def test_sigterm_drains_in_flight_jobs_and_leaves_the_rest(redis, redis_url, run_name, spawn_worker, tmp_path):
    producer = Producer(redis, run_name)
    keys = RunKeys(run_name)
    leaver = spawn_worker(redis_url, run_name, "--concurrency", "2", "--drain-grace", "20")
    await wait_registered(redis, run_name, leaver.name)
    reqs = [
        JobRequest(
            workflow="tests.workflows:Echo", data={"i": i, "sleep": 1.0, "marker_dir": str(tmp_path)}, job_id=f"j{i}"
        )
        for i in range(8)
    ]
    await producer.submit_many(reqs)
    await wait_until(lambda: started_in(tmp_path, leaver.proc.pid) == 2, 20, what="two jobs to start")
    leaver.terminate()
    assert await asyncio.wait_for(asyncio.to_thread(leaver.proc.wait), 20) == 0
    # Both in-flight jobs finished and were published; nothing is left pending; the rest is still queued.
    assert len(list(tmp_path.glob(f"end-*-{leaver.proc.pid}"))) == 2
    assert await redis.xlen(producer.reply_to) == 2
    assert (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0
    assert await redis.xlen(keys.jobs) == 6
    assert await redis.zscore(keys.workers, leaver.name) is None  # deregistered
    spawn_worker(redis_url, run_name, "--concurrency", "8", env={"ROLLQ_TEST_FAST": "1"})
    expected = {f"j{i}": 1 for i in range(8)}
    trajs = await drain_results(producer, expected)
    assert_exactly_once(trajs, expected)
    assert sum(t.worker_id == leaver.name for t in trajs) == 2


@pytest.fixture
def aof_redis():
    server = RedisServer(aof=True).start()
    yield server
    server.close()


async def test_redis_restarted_mid_run_with_aof_loses_nothing(aof_redis, run_name, spawn_worker, tmp_path):
    redis = redis_client(aof_redis.url, retries=20)
    try:
        producer = Producer(redis, run_name)
        consumer = producer.consumer()
        await consumer.setup()
        worker = spawn_worker(aof_redis.url, run_name, "--concurrency", "4")
        await wait_registered(redis, run_name, worker.name)
        reqs = [
            JobRequest(workflow="tests.workflows:Echo", data={"i": i, "sleep": 0.1}, job_id=f"j{i}", n=2)
            for i in range(30)
        ]
        await producer.submit_many(reqs)
        await wait_until(lambda: _at_least(redis, producer.reply_to, 10), 20, what="some results")
        await redis.aclose()
        aof_redis.stop()  # jobs are pending in the worker and queued in the stream right now
        await asyncio.sleep(0.3)  # a real outage: the worker sees connection errors for a while
        aof_redis.start()
        expected = {f"j{i}": 2 for i in range(30)}
        trajs = await drain_results(producer, expected)
        assert_exactly_once(trajs, expected)
        assert worker.proc.poll() is None  # it rode out the outage
        assert "redis unavailable" in worker.output()
    finally:
        await redis.aclose()


async def _at_least(redis, key, n):
    return await redis.xlen(key) >= n
