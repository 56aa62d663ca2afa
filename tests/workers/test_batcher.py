"""WriteBatcher against a real redis-server: publishes (XADD of the trajectory + XACK + XDEL of the job entry) and
script ops queued together go out in one MULTI/EXEC; every op's future gets its own reply or error; Redis outages
are waited out. Round trips are counted with INFO commandstats on a redis-server of this module's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from redis.exceptions import ResponseError

from rollq.local import RedisServer, free_port
from rollq.protocol import scripts
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP
from rollq.redis_client import ensure_group, redis_client
from rollq.workers.batcher import WriteBatcher

ECHO = "return ARGV[1]"
FAIL = "return redis.error_reply('boom: ' .. ARGV[1])"
# Holds the server for ARGV[1] microseconds: a transaction that is still in flight while the test queues more.
BUSY = """
local t0 = redis.call('TIME')
local start = tonumber(t0[1]) * 1000000 + tonumber(t0[2])
while true do
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) - start >= tonumber(ARGV[1]) then return 'slept' end
end
"""


@pytest.fixture(scope="module")
def counting_server() -> RedisServer:
    """A server only this module's tests use, so INFO commandstats counts nobody else's commands."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
async def counted(counting_server):
    client = redis_client(counting_server.url)
    await client.flushall()
    await client.config_resetstat()
    yield client
    await client.config_set("maxmemory", "0")
    await client.aclose()


async def calls(redis, *commands: str) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in commands}


async def pending_entries(redis, jobs: str, n: int) -> list[str]:
    """n job entries delivered to (and pending for) a consumer of the workers' group, as a worker holds them."""
    await ensure_group(redis, jobs, WORKER_GROUP)
    for i in range(n):
        await redis.xadd(jobs, {PAYLOAD_FIELD: f"job-{i}".encode()})
    [(_, entries)] = await redis.xreadgroup(WORKER_GROUP, "w1", {jobs: ">"}, count=n)
    return [eid.decode() for eid, _ in entries]


async def payloads(redis, stream: str) -> list[bytes]:
    return [fields[PAYLOAD_FIELD] for _, fields in await redis.xrange(stream)]


async def pending_count(redis, jobs: str) -> int:
    return (await redis.xpending(jobs, WORKER_GROUP))["pending"]


@asynccontextmanager
async def running(batcher: WriteBatcher) -> AsyncIterator[asyncio.Task]:
    task = asyncio.create_task(batcher.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def outcomes(task: asyncio.Task, *futures: asyncio.Future, timeout_s: float = 10.0) -> list:
    """Each future's result or exception; fails at once if the batcher's loop ended instead."""
    gathered = asyncio.ensure_future(asyncio.gather(*futures, return_exceptions=True))
    done, _ = await asyncio.wait([gathered, task], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if gathered not in done:
        gathered.cancel()
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved"
        if task in done:
            exc = None if task.cancelled() else task.exception()
            raise AssertionError(f"the batcher's run loop ended: {exc!r}")
        raise AssertionError(f"futures not resolved in {timeout_s}s")
    return gathered.result()


# -- publish -------------------------------------------------------------------------------------------------------


async def test_publish_adds_the_trajectory_and_acks_and_deletes_the_job(redis, run_name):
    jobs, results = f"{run_name}:jobs", f"{run_name}:results"
    first, second = await pending_entries(redis, jobs, 2)
    batcher = WriteBatcher(redis)
    async with running(batcher) as task:
        assert await outcomes(task, batcher.publish(jobs, WORKER_GROUP, first, results, b"traj-0")) == [1]
    assert await payloads(redis, results) == [b"traj-0"]
    assert await pending_count(redis, jobs) == 1  # only the other entry is still held
    assert [eid.decode() for eid, _ in await redis.xrange(jobs)] == [second]  # the published one is deleted


async def test_queued_publishes_and_scripts_go_out_in_one_transaction(counted):
    redis = counted
    a, b = await pending_entries(redis, "jobs-a", 3), await pending_entries(redis, "jobs-b", 1)
    echo = redis.register_script(ECHO)
    batcher = WriteBatcher(redis)
    before = await calls(redis, "multi", "exec", "xadd", "xack", "xdel", "evalsha")
    # Queued before the loop runs, interleaved: the batcher sends scripts first, then the publishes.
    futures = [
        batcher.publish("jobs-a", WORKER_GROUP, a[0], "results", b"p0"),
        batcher.script(echo, [], ["s0"]),
        batcher.publish("jobs-b", WORKER_GROUP, b[0], "results", b"p1"),
        batcher.publish("jobs-a", WORKER_GROUP, a[1], "other-results", b"p2"),
        batcher.script(echo, [], ["s1"]),
        batcher.publish("jobs-a", WORKER_GROUP, a[2], "results", b"p3"),
    ]
    async with running(batcher) as task:
        assert await outcomes(task, *futures) == [1, b"s0", 1, 1, b"s1", 1]
    after = await calls(redis, "multi", "exec", "xadd", "xack", "xdel", "evalsha")
    delta = {k: after[k] - before[k] for k in after}
    # One MULTI/EXEC; one XACK and one XDEL per jobs stream, however many entries it acks.
    assert delta == {"multi": 1, "exec": 1, "xadd": 4, "xack": 2, "xdel": 2, "evalsha": 2}
    assert await payloads(redis, "results") == [b"p0", b"p1", b"p3"]
    assert await payloads(redis, "other-results") == [b"p2"]
    assert await redis.xlen("jobs-a") == 0 and await redis.xlen("jobs-b") == 0
    assert await pending_count(redis, "jobs-a") == 0 and await pending_count(redis, "jobs-b") == 0


async def test_concurrent_publishers_share_round_trips(counted):
    redis = counted
    ids = await pending_entries(redis, "jobs", 50)
    batcher = WriteBatcher(redis)
    async with running(batcher) as task:
        await outcomes(task, batcher.script(redis.register_script(ECHO), [], ["warm"]))  # connection + script load
        before = await calls(redis, "exec", "xack")

        async def job(i: int, eid: str) -> int:
            await asyncio.sleep(0)  # like a job task finishing its workflow
            return await batcher.publish("jobs", WORKER_GROUP, eid, "results", f"t{i}".encode())

        results = await asyncio.wait_for(asyncio.gather(*(job(i, eid) for i, eid in enumerate(ids))), 10)
        assert not task.done()
    assert results == [1] * 50
    after = await calls(redis, "exec", "xack")
    assert after["exec"] - before["exec"] <= 2, after  # 50 publishes, not 50 transactions
    assert after["xack"] - before["xack"] == after["exec"] - before["exec"]
    assert sorted(await payloads(redis, "results")) == sorted(f"t{i}".encode() for i in range(50))
    assert await pending_count(redis, "jobs") == 0


async def test_writes_queued_during_a_transaction_go_out_together_in_the_next(counted):
    redis = counted
    ids = await pending_entries(redis, "jobs", 4)
    batcher = WriteBatcher(redis)
    async with running(batcher) as task:
        await outcomes(task, batcher.script(redis.register_script(ECHO), [], ["warm"]))
        before = await calls(redis, "exec", "xack")
        slow = batcher.script(redis.register_script(BUSY), [], [300_000])  # 0.3 s in Redis
        await asyncio.sleep(0.1)  # its transaction is on the server now
        later = [batcher.publish("jobs", WORKER_GROUP, eid, "results", f"t{i}".encode()) for i, eid in enumerate(ids)]
        assert not slow.done()
        assert await outcomes(task, slow, *later) == [b"slept", 1, 1, 1, 1]
    after = await calls(redis, "exec", "xack")
    assert (after["exec"] - before["exec"], after["xack"] - before["xack"]) == (2, 1)
    assert await payloads(redis, "results") == [b"t0", b"t1", b"t2", b"t3"]


async def test_max_batch_splits_a_long_queue_in_order(counted):
    redis = counted
    ids = await pending_entries(redis, "jobs", 5)
    batcher = WriteBatcher(redis, max_batch=2)
    before = await calls(redis, "exec")
    futures = [batcher.publish("jobs", WORKER_GROUP, eid, "results", f"t{i}".encode()) for i, eid in enumerate(ids)]
    async with running(batcher) as task:
        assert await outcomes(task, *futures) == [1] * 5
    assert (await calls(redis, "exec"))["exec"] - before["exec"] == 3  # 2 + 2 + 1
    assert await payloads(redis, "results") == [f"t{i}".encode() for i in range(5)]


# -- errors --------------------------------------------------------------------------------------------------------


async def test_each_error_reaches_the_future_of_the_op_that_caused_it(redis, run_name):
    jobs, results = f"{run_name}:jobs", f"{run_name}:results"
    wrong_stream, wrong_jobs = f"{run_name}:a-string", f"{run_name}:jobs-string"
    await redis.set(wrong_stream, "not a stream")
    await redis.set(wrong_jobs, "not a stream")
    ids = await pending_entries(redis, jobs, 3)
    echo, fail = redis.register_script(ECHO), redis.register_script(FAIL)
    batcher = WriteBatcher(redis)
    futures = [
        batcher.script(fail, [], ["first"]),
        batcher.publish(jobs, WORKER_GROUP, ids[0], results, b"ok-0"),
        batcher.publish(jobs, WORKER_GROUP, ids[1], wrong_stream, b"lost"),  # XADD fails
        batcher.script(echo, [], ["fine"]),
        batcher.publish(wrong_jobs, WORKER_GROUP, "1-1", f"{run_name}:other", b"orphan"),  # its XACK fails
        batcher.publish(jobs, WORKER_GROUP, ids[2], results, b"ok-2"),
    ]
    async with running(batcher) as task:
        got = await outcomes(task, *futures)
        assert isinstance(got[0], ResponseError) and "boom: first" in str(got[0])
        assert got[1] == 1
        assert isinstance(got[2], ResponseError) and "WRONGTYPE" in str(got[2])
        assert got[3] == b"fine"
        assert isinstance(got[4], ResponseError) and "WRONGTYPE" in str(got[4])
        assert got[5] == 1
        # the loop goes on serving
        more = await pending_entries(redis, jobs, 1)
        assert await outcomes(task, batcher.publish(jobs, WORKER_GROUP, more[0], results, b"after")) == [1]
    assert await payloads(redis, results) == [b"ok-0", b"ok-2", b"after"]


async def test_a_cancelled_future_is_skipped_and_its_write_still_happens(redis, run_name):
    jobs, results = f"{run_name}:jobs", f"{run_name}:results"
    ids = await pending_entries(redis, jobs, 2)
    batcher = WriteBatcher(redis)
    abandoned = batcher.publish(jobs, WORKER_GROUP, ids[0], results, b"t0")
    kept = batcher.publish(jobs, WORKER_GROUP, ids[1], results, b"t1")
    abandoned.cancel()  # e.g. its caller timed out
    async with running(batcher) as task:
        assert await outcomes(task, kept) == [1]
        assert not task.done()
    assert await payloads(redis, results) == [b"t0", b"t1"]
    assert await pending_count(redis, jobs) == 0


async def test_a_refused_transaction_fails_its_futures_and_the_loop_goes_on(counted):
    """An aborted MULTI/EXEC (EXECABORT: a command refused at queue time, here for memory) wrote nothing: each of
    the batch's callers gets the error, and later batches go out."""
    redis = counted
    ids = await pending_entries(redis, "jobs", 2)
    batcher = WriteBatcher(redis)
    async with running(batcher) as task:
        await redis.config_set("maxmemory", "1")  # noeviction: XADD is refused while queued in MULTI
        try:
            [refused] = await outcomes(task, batcher.publish("jobs", WORKER_GROUP, ids[0], "results", b"t0"))
        finally:
            await redis.config_set("maxmemory", "0")
        assert isinstance(refused, ResponseError)
        assert await outcomes(task, batcher.publish("jobs", WORKER_GROUP, ids[1], "results", b"t1")) == [1]


# -- entries already acked -----------------------------------------------------------------------------------------


async def test_publish_of_an_entry_already_acked_is_a_duplicate_not_an_error(redis, run_name):
    """Another worker reclaimed the entry and finished it: the MULTI/EXEC path has no check, so the trajectory is
    published again (consumers drop it by job id and sample index) and the future still resolves to 1."""
    jobs, results = f"{run_name}:jobs", f"{run_name}:results"
    [eid] = await pending_entries(redis, jobs, 1)
    assert await redis.xack(jobs, WORKER_GROUP, eid) == 1
    batcher = WriteBatcher(redis)
    async with running(batcher) as task:
        assert await outcomes(task, batcher.publish(jobs, WORKER_GROUP, eid, results, b"again")) == [1]
    assert await payloads(redis, results) == [b"again"]
    assert await redis.xlen(jobs) == 0 and await pending_count(redis, jobs) == 0


async def test_finish_script_of_an_entry_already_acked_writes_nothing(redis, run_name):
    jobs, results, dead = f"{run_name}:jobs", f"{run_name}:results", f"{run_name}:dead"
    first, second = await pending_entries(redis, jobs, 2)
    await redis.xack(jobs, WORKER_GROUP, first)
    finish = redis.register_script(scripts.FINISH)
    batcher = WriteBatcher(redis)
    async with running(batcher) as task:
        got = await outcomes(
            task,
            batcher.script(finish, [jobs, results, dead], [WORKER_GROUP, first, b"traj", b"letter"]),
            batcher.script(finish, [jobs, results, dead], [WORKER_GROUP, second, b"traj", b"letter"]),
        )
    assert got == [0, 1]  # the acked entry: a no-op; the held one: finished
    assert await payloads(redis, results) == [b"traj"] and await payloads(redis, dead) == [b"letter"]
    assert [eid.decode() for eid, _ in await redis.xrange(jobs)] == [first]  # left as the other worker left it


# -- outages -------------------------------------------------------------------------------------------------------


async def test_a_batch_is_retried_until_redis_answers():
    port = free_port()
    client = redis_client(f"redis://127.0.0.1:{port}/0")
    server = RedisServer(port=port)
    batcher = WriteBatcher(client)
    try:
        async with running(batcher) as task:
            published = batcher.publish("jobs", WORKER_GROUP, "1-1", "results", b"t0")
            await asyncio.sleep(0.5)  # nothing listens on the port: the batcher backs off and retries
            assert not published.done() and not task.done()
            server.start()
            assert await outcomes(task, published, timeout_s=15) == [1]
        assert await payloads(client, "results") == [b"t0"]  # once, though the batch was tried several times
    finally:
        await client.aclose()
        server.close()
