"""The drain's edge cases, in process against a Redis of the test's own (SIGSTOPped to stand for a Redis that does
not answer): a result being written as the grace runs out, a Redis that hangs through the drain, a second stop
request. The scale-down under load, with `rollq worker` subprocesses: tests/workers/test_scale_down.py."""

import asyncio
import contextlib
import logging
import os
import signal

import pytest

from rollq.local import RedisServer, wait_until
from rollq.producer import Producer
from rollq.protocol import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP, RunKeys
from rollq.redis_client import ensure_group, redis_client
from rollq.workers import worker as worker_module
from rollq.workers.config import WorkerConfig
from rollq.workers.worker import Worker


@pytest.fixture
def own_redis():
    """A Redis this test alone uses, so it can stop answering (SIGSTOP) without stalling other tests."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        assert server.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, signal.SIGCONT)
        server.close()


@contextlib.contextmanager
def not_answering(server: RedisServer):
    """Redis stops answering (a hung connection, not a refused one) until the block ends."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def started_worker(url: str, run: str, **config) -> tuple[Worker, asyncio.Task]:
    worker = Worker(WorkerConfig(redis_url=url, run=run, allow=["tests"], **config))
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 10)
    return worker, task


def marked(directory, kind: str, *ids: int) -> bool:
    return all((directory / f"{kind}-{i}-{os.getpid()}").exists() for i in ids)


async def test_a_result_being_written_when_the_grace_ends_is_published_once_not_handed_back(
    own_redis, run_name, tmp_path, caplog
):
    """Both jobs finish while Redis does not answer: the first one's publish is in flight, the second's waits behind
    it, when the grace runs out. Handing the second back (its REQUEUE queued with its publish in one batch) would
    publish it AND run it again; the drain waits for both writes instead."""
    caplog.set_level(logging.INFO, logger="rollq.worker")
    redis = redis_client(own_redis.url)
    try:
        keys = RunKeys(run_name)
        producer = Producer(redis, run_name)
        consumer = producer.consumer()
        await consumer.setup()
        await ensure_group(redis, producer.reply_to, "audit")  # never reads: the stream keeps all that was published
        worker, run = await started_worker(own_redis.url, run_name, concurrency=2, drain_grace=0.2)
        for i, sleep in ((0, 0.2), (1, 0.5)):
            await producer.submit(
                "tests.workflows:Echo", {"i": i, "sleep": sleep, "marker_dir": str(tmp_path)}, job_id=f"j{i}"
            )
        await wait_until(lambda: marked(tmp_path, "start", 0, 1), 10, what="both jobs to start")
        with not_answering(own_redis):
            await wait_until(lambda: marked(tmp_path, "end", 0, 1), 10, what="both episodes to end")
            worker.request_stop()
            await wait_until(lambda: "drain grace over" in caplog.text, 10, what="the grace to run out")
        await asyncio.wait_for(run, 15)
        trajs = [t async for t in producer.wait_for({"j0": 1, "j1": 1}, timeout_s=10, consumer=consumer)]
        assert sorted(t.job_id for t in trajs) == ["j0", "j1"]
        assert await redis.xlen(producer.reply_to) == 2  # published once each
        assert await redis.xlen(keys.jobs) == 0  # and not queued again
        assert (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0
        assert worker.stats.completed == 2 and worker.stats.handed_back == 0
        assert "2 jobs writing their outcome, 0 cancelled and handed back" in caplog.text
        await worker.redis.aclose()
    finally:
        await redis.aclose()


async def test_a_worker_whose_redis_hangs_through_the_drain_still_exits_and_loses_nothing(
    own_redis, run_name, tmp_path, monkeypatch
):
    """Redis stops answering mid-episode and stays away: the read in flight never returns and no hand-back lands,
    yet the worker exits in bounded time (before Kubernetes' SIGKILL); the job is still in its stream."""
    monkeypatch.setattr(worker_module, "HAND_BACK_S", 0.5)
    monkeypatch.setattr(worker_module, "DEREGISTER_S", 0.2)
    redis = redis_client(own_redis.url)
    try:
        keys = RunKeys(run_name)
        producer = Producer(redis, run_name)
        worker, run = await started_worker(own_redis.url, run_name, concurrency=2, drain_grace=0.2, block_ms=200)
        await producer.submit("tests.workflows:Echo", {"i": 0, "sleep": 30, "marker_dir": str(tmp_path)}, job_id="j")
        await wait_until(lambda: marked(tmp_path, "start", 0), 10, what="the job to start")
        with not_answering(own_redis):
            worker.request_stop()
            # grace 0.2 + the read 0.2 + 1 + hand-back 0.5 + deregister 0.2: well within 10 s
            await asyncio.wait_for(run, 10)
        assert worker.stats.handed_back == 0  # nothing reached Redis
        # Not lost: still pending (reclaimed after lease_ms), or handed back if the REQUEUE reached Redis's socket.
        assert await redis.xlen(keys.jobs) == 1
        await worker.redis.aclose()
    finally:
        await redis.aclose()


async def test_a_second_stop_request_ends_the_grace_and_hands_back_at_once(redis, redis_url, run_name, tmp_path):
    keys = RunKeys(run_name)
    producer = Producer(redis, run_name)
    worker, run = await started_worker(redis_url, run_name, concurrency=2, drain_grace=120)
    await producer.submit("tests.workflows:Echo", {"i": 0, "sleep": 60, "marker_dir": str(tmp_path)}, job_id="slow")
    await wait_until(lambda: marked(tmp_path, "start", 0), 10, what="the job to start")
    worker.request_stop()
    worker.request_stop()  # a second SIGTERM / Ctrl-C
    await asyncio.wait_for(run, 10)  # not the 120 s grace
    await worker.redis.aclose()
    assert worker.stats.handed_back == 1
    assert (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0
    [(_, fields)] = await redis.xrange(keys.jobs)
    job = Codec().decode_job(fields[PAYLOAD_FIELD])
    assert job.job_id == "slow" and job.attempt == 0
