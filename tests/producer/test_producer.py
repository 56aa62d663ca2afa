import asyncio

import pytest

from rollq.producer import BackpressureError, JobRequest, Producer
from rollq.protocol.keys import RunKeys, inflight_key
from tests.helpers import running_worker, wait_until


async def test_submit_is_idempotent_by_job_id(redis, run_name):
    producer = Producer(redis, run_name)
    first = await producer.submit("tests.workflows:Echo", {"i": 1}, n=3, job_id="prompt-1")
    again = await producer.submit("tests.workflows:Echo", {"i": 1}, n=3, job_id="prompt-1")
    assert first.admitted and not again.admitted
    assert again.reply_to == producer.reply_to
    # Concurrent duplicates from several producers: still queued once.
    others = [Producer(redis, run_name) for _ in range(4)]
    results = await asyncio.gather(*(p.submit("tests.workflows:Echo", n=2, job_id="prompt-2") for p in others))
    assert sum(r.admitted for r in results) == 1
    assert await redis.xlen(RunKeys(run_name).jobs) == 3 + 2
    assert await producer.inflight() == 5


async def test_submit_many_is_pipelined_in_order_with_n_samples(redis, run_name):
    producer = Producer(redis, run_name, chunk_size=7)
    reqs = [JobRequest(workflow="tests.workflows:Echo", data={"i": i}, n=2, job_id=f"j{i}") for i in range(20)]
    results = await producer.submit_many(reqs)
    assert [r.job_id for r in results] == [f"j{i}" for i in range(20)]
    entries = await redis.xrange(RunKeys(run_name).jobs)
    jobs = [producer.codec.decode_job(fields[b"d"]) for _, fields in entries]
    assert [(j.job_id, j.sample_index) for j in jobs] == [(f"j{i}", s) for i in range(20) for s in range(2)]
    assert all(j.n == 2 and j.reply_to == producer.reply_to for j in jobs)


async def test_bad_requests_get_clear_errors(redis, run_name):
    producer = Producer(redis, run_name, max_inflight=4)
    with pytest.raises(BackpressureError, match="n=5 samples can never fit max_inflight=4"):
        await producer.submit("tests.workflows:Echo", n=5)
    with pytest.raises(ValueError, match="n must be >= 1"):
        await producer.submit("tests.workflows:Echo", n=0)
    with pytest.raises(ValueError, match="not in run"):
        Producer(redis, run_name, reply_to="rollq:{other}:results")


async def test_backpressure_waits_while_too_many_samples_are_unconsumed(redis, redis_url, run_name):
    producer = Producer(redis, run_name, max_inflight=4, poll_interval_s=0.01)
    consumer = producer.consumer()
    await consumer.setup()
    reqs = [JobRequest(workflow="tests.workflows:Echo", data={"i": i}, n=2, job_id=f"j{i}") for i in range(6)]
    async with running_worker(redis_url, run_name, concurrency=8):
        submit = asyncio.create_task(producer.submit_many(reqs))
        key = inflight_key(producer.reply_to)
        # Nobody consumes yet: exactly two jobs (4 samples) get in, the rest wait.
        await wait_until(lambda: consumer.redis.xlen(producer.reply_to), what="first results")
        await wait_until(lambda: _len_at_least(redis, producer.reply_to, 4), what="4 results")
        assert not submit.done()
        assert int(await redis.get(key)) == 4
        seen = []
        while len(seen) < 12:
            batch = await consumer.read(count=3, block_ms=2000)
            assert int(await redis.get(key)) <= 4  # the bound holds at every step
            seen += [(d.trajectory.job_id, d.trajectory.sample_index) for d in batch]
            await consumer.commit(batch)
        results = await asyncio.wait_for(submit, 10)
    assert all(r.admitted for r in results)
    assert sorted(seen) == sorted((f"j{i}", s) for i in range(6) for s in range(2))
    assert int(await redis.get(key)) == 0


async def _len_at_least(redis, key, n):
    return await redis.xlen(key) >= n
