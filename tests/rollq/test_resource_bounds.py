"""Resource bounds: what abandoned callers and crashed workers leave in Redis expires, and unconsumed results stay in
Redis rather than in a consumer's memory. Real redis-server, real `rollq enqueue` / `rollq worker` subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from rollq.producer.producer import Producer
from rollq.producer.results import ResultConsumer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys, inflight_key
from rollq.protocol.messages import Trajectory
from tests.helpers import REPO_ROOT, rss_kib, running_worker, wait_registered, wait_until


async def _reply_keys(redis, run: str) -> list[bytes]:
    """The private reply streams of `enqueue --wait` callers (not their counters or duplicate filters)."""
    found = [k async for k in redis.scan_iter(match=f"{RunKeys(run).prefix}:results:enqueue-*")]
    return [k for k in found if k.count(b":") == 3]  # rollq:{run}:results:enqueue-<hex>


async def test_a_killed_enqueue_wait_leaves_nothing_behind(redis, redis_url, run_name, tmp_path):
    keys = RunKeys(run_name)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"job_id": f"j{i}", "length": 2}) + "\n" for i in range(3)))
    cmd = [sys.executable, "-m", "rollq", "enqueue", str(jobs), "--workflow", "tests.workflows:Echo", "--n", "2"]
    cmd += ["--wait", "--reply-ttl", "2", "--redis", redis_url, "--run", run_name]
    enqueue = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # No worker yet: the command waits. Its reply stream and in-flight counter carry the TTL...
        found = await wait_until(lambda: _reply_keys(redis, run_name), 20, what="the private reply stream")
        stream = found[0].decode()
        await wait_until(lambda: redis.get(inflight_key(stream)), 10, what="the in-flight counter")
        assert 0 < await redis.pttl(stream) <= 2000 and 0 < await redis.pttl(inflight_key(stream)) <= 2000
        # ... renewed while the caller lives (every TTL/3): the stream outlives its first TTL.
        # A TTL only falls between two reads unless renewed in between (against the first read alone, a read taken
        # just after a renewal left only a millisecond-wide window to see the next one).
        last = [await redis.pttl(stream)]
        await wait_until(lambda: _pttl_rose(redis, stream, last), 5, what="a renewal of the TTL")
    finally:
        enqueue.kill()
        enqueue.wait(10)
    # Killed: nothing renews them, so they expire.
    await wait_until(lambda: _gone(redis, stream, inflight_key(stream)), 10, what="the reply stream to expire")
    assert await redis.exists(keys.job_seen("j0")) and 0 < await redis.ttl(keys.job_seen("j0"))  # 7-day markers
    # A worker that runs the orphaned jobs drops their results (counted) instead of recreating the stream.
    async with running_worker(redis_url, run_name, concurrency=4) as worker:
        await wait_until(lambda: _dropped(redis, run_name, 6), 20, what="6 results dropped")
        assert worker.stats.results_dropped == 6 and worker.stats.completed == 0
    assert not await redis.exists(stream) and not await redis.exists(inflight_key(stream))
    assert await redis.xlen(keys.jobs) == 0


async def _pttl_rose(redis, key: str, last: list[int]) -> bool:
    now = await redis.pttl(key)
    rose, last[0] = now > last[0], now
    return rose


async def _gone(redis, *keys: str) -> bool:
    return await redis.exists(*keys) == 0


async def _dropped(redis, run: str, n: int) -> bool:
    return int(await redis.hget(RunKeys(run).dropped, "reply_gone") or 0) >= n


async def test_enqueue_wait_removes_its_keys_when_done(redis, redis_url, run_name, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"job_id": f"d{i}", "length": 2}) + "\n" for i in range(2)))
    async with running_worker(redis_url, run_name, concurrency=4):
        cmd = [sys.executable, "-m", "rollq", "enqueue", str(jobs), "--workflow", "tests.workflows:Echo", "--n", "2"]
        cmd += ["--wait", "--timeout", "60", "--redis", redis_url, "--run", run_name]
        run = subprocess.run
        res = await asyncio.to_thread(run, cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
        assert res.returncode == 0, res.stderr
        assert len(res.stdout.splitlines()) == 4
    assert [k async for k in redis.scan_iter(match=f"{RunKeys(run_name).prefix}:results:enqueue-*")] == []


async def test_a_crashed_workers_heartbeat_and_info_are_forgotten(redis, redis_url, run_name, spawn_worker):
    keys = RunKeys(run_name)
    crashed = spawn_worker(redis_url, run_name)
    await wait_registered(redis, run_name, crashed.name)
    await wait_until(lambda: redis.hexists(keys.worker_info, crashed.name), 10, what="its info")
    crashed.kill()
    await redis.hset(keys.worker_info, "orphan", "{}")  # info without a heartbeat (an older version's leftover)
    async with running_worker(redis_url, run_name, heartbeat_ms=50, forget_workers_after=1.0) as live:
        await wait_until(lambda: _forgotten(redis, keys, crashed.name), 15, what="the crashed worker forgotten")
        assert not await redis.hexists(keys.worker_info, "orphan")
        assert await redis.zscore(keys.workers, live.name) and await redis.hexists(keys.worker_info, live.name)


async def _forgotten(redis, keys: RunKeys, name: str) -> bool:
    return await redis.zscore(keys.workers, name) is None and not await redis.hexists(keys.worker_info, name)


async def test_unconsumed_results_stay_in_redis(redis, run_name):
    """A slow consumer holds at most one read batch; the backlog waits in the stream (pending or unread)."""
    producer = Producer(redis, run_name)
    consumer = ResultConsumer(redis, producer.reply_to, name="slow")
    await consumer.setup()
    codec, total, batch = Codec(), 300, 16
    pipe = redis.pipeline(transaction=False)
    for i in range(total):
        traj = Trajectory(job_id=f"r{i}", sample_index=0, n=1, status="ok", worker_id="w", workflow="x")
        pipe.xadd(producer.reply_to, {PAYLOAD_FIELD: codec.encode(traj)})
    await pipe.execute()
    consumed = 0
    while consumed < total:
        got = await consumer.read(count=batch, block_ms=100)
        assert 0 < len(got) <= batch
        held_by_redis = (await redis.xpending(producer.reply_to, consumer.group))["pending"]
        assert held_by_redis == len(got)  # what the process holds is exactly what it read, nothing more
        assert await redis.xlen(producer.reply_to) >= total - consumed  # the rest waits in Redis
        consumed += await consumer.commit(got)
    assert consumed == total


def test_rss_probe_reads_this_process():
    peak, now = rss_kib(os.getpid())
    assert 0 < now <= peak
    started = time.monotonic()
    assert rss_kib(os.getpid())[0] >= peak and time.monotonic() - started < 1
