"""Redis SIGKILLed mid-run and restarted on the same port from its AOF (`appendfsync always`): the trainer, a
`rollq worker` and its engine ride it out and the run finishes with nothing trained twice and every admitted sample
accounted for. Redis that stays away past `redis_outage_s` ends a process with a message naming the URL."""

import asyncio
import io
import time

import msgspec
import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.local import RedisServer, free_port
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP, RunKeys
from rollq.protocol.messages import Job
from rollq.redis_client import RedisUnavailable, redis_client, ride_out
from rollq.trainer.ledger import StalenessLedger
from rollq.trainer.loop import Trainer
from tests.helpers import running_worker, wait_until
from tests.trainer.helpers import ENGINE_ARGS, WORKFLOW_KWARGS


@pytest.fixture
def aof_redis():
    server = RedisServer(aof=True).start()
    yield server
    server.close()


def restart(server: RedisServer) -> RedisServer:
    """SIGKILL (nothing flushed beyond what AOF always already wrote); start() again uses the same port and
    directory."""
    server.kill()
    return server


async def test_ride_out_gives_up_past_the_limit_naming_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    client = redis_client(url, retries=0)
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable) as caught:
        await ride_out(client.ping, what="pinging", limit_s=1.0, url=url)
    await client.aclose()
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert url in str(caught.value) and "pinging" in str(caught.value) and caught.value.waited_s >= 1.0


async def test_a_worker_exits_with_a_clear_message_when_redis_stays_away(aof_redis, run_name, spawn_worker, tmp_path):
    worker = spawn_worker(aof_redis.url, run_name, "--redis-outage-s", "2")
    client = redis_client(aof_redis.url)
    try:
        await wait_until(
            lambda: client.zscore(f"rollq:{{{run_name}}}:workers", worker.name), 20, what="the worker's heartbeat"
        )
    finally:
        await client.aclose()
    restart(aof_redis)  # and never started again
    t0 = time.monotonic()
    code = await asyncio.to_thread(worker.proc.wait, 30)
    log = worker.log.read_text()
    assert code == 3, log[-2000:]
    assert time.monotonic() - t0 < 20
    last = log.strip().splitlines()[-1]
    assert aof_redis.url in last and "redis_outage_s" in last, last


STEPS, GROUP, GROUPS, ETA = 8, 4, 3, 1


@pytest.mark.slow
@pytest.mark.scenario  # a whole training run across a restart: the chaos loop of CONTRIBUTING.md
async def test_the_trainer_and_a_worker_ride_out_a_redis_restart(
    aof_redis, run_name, tmp_path, make_train_config, engine_process, spawn_worker, caplog
):
    caplog.set_level("WARNING", logger="rollq.redis")
    _, url = await engine_process(*ENGINE_ARGS)
    worker = spawn_worker(aof_redis.url, run_name, "--concurrency", "8", "--engine", url)
    cfg = make_train_config(
        redis_url=aof_redis.url,
        engine=[url],
        steps=STEPS,
        group_size=GROUP,
        groups_per_step=GROUPS,
        max_staleness=ETA,
        workflow_kwargs=WORKFLOW_KWARGS,
        redis_outage_s=30,
    )
    redis = redis_client(aof_redis.url)
    pool = EnginePool(PoolConfig(urls=[url]))
    metrics = tmp_path / "run" / "metrics.jsonl"
    trainer = asyncio.create_task(Trainer(cfg, redis, pool, progress=io.StringIO()).run())
    try:

        def at_step(n: int) -> bool:
            return trainer.done() or (metrics.exists() and len(metrics.read_text().splitlines()) >= n)

        await wait_until(lambda: at_step(3), 120, what="step 3")
        assert not trainer.done(), trainer.exception()
        restart(aof_redis)
        await asyncio.sleep(2)  # the outage being simulated, not a synchronization
        aof_redis.start()
        records = msgspec.to_builtins(await asyncio.wait_for(trainer, 180))
    finally:
        trainer.cancel()
        await asyncio.gather(trainer, return_exceptions=True)
        await pool.close()

    assert worker.proc.poll() is None, worker.log.read_text()[-2000:]  # rode it out too
    assert any("is back after" in r.getMessage() for r in caplog.records), "the trainer never saw the outage"
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    trained = [g for r in records for g in r["groups"]]
    assert len(set(trained)) == len(trained), "a group was trained twice"
    assert records[-1]["trained_samples"] == STEPS * GROUP * GROUPS
    # Every admitted sample is accounted for: admitted = held (trained or in flight) + given back by dropped groups.
    ledger = StalenessLedger(redis, run_name, GROUP * GROUPS, ETA)
    state = await ledger.state()
    groups_admitted = await redis.hlen(ledger.keys.ledger_groups)
    assert state.admitted + state.released == GROUP * groups_admitted
    assert state.released == sum(n for reason, n in records[-1]["dropped"].items() if reason != "foreign")
    assert state.admitted >= records[-1]["trained_samples"]
    for r in records:
        assert r["staleness_max"] <= ETA and r["ledger_admitted"] <= r["ledger_limit"]
    await redis.aclose()


async def test_a_job_delivered_by_a_read_whose_reply_was_lost_runs_when_redis_is_back_not_after_its_lease(
    aof_redis, run_name, caplog
):
    """A read's reply lost with the connection (Redis killed under it; on a Redis Cluster, the primary of a partition
    failing over) may have delivered jobs to the worker: they are pending under its name, and nobody runs them until
    their lease expires (`lease_ms`), as if the worker were dead. Once Redis answers again the worker walks its
    pending jobs and runs those it does not hold."""
    caplog.set_level("WARNING", logger="rollq.worker")
    keys = RunKeys(run_name)
    async with running_worker(aof_redis.url, run_name, name="w", lease_ms=60_000, reclaim_interval_ms=60_000):
        client = redis_client(aof_redis.url)
        try:
            job = Job(job_id="j", workflow="tests.workflows:Echo", n=1)
            pipe = client.pipeline(transaction=True)  # queued and delivered to `w` at once: its read never saw it
            pipe.xadd(keys.jobs, {PAYLOAD_FIELD: Codec().encode(job)})
            pipe.xreadgroup(WORKER_GROUP, "w", {keys.jobs: ">"}, count=1)
            await pipe.execute()
            restart(aof_redis)
            await wait_until(
                lambda: any("redis unavailable" in r.getMessage() for r in caplog.records), 15, what="the outage seen"
            )
            aof_redis.start()
            await wait_until(lambda: client.xlen(keys.results), 15, what="the job's result (its lease is 60 s)")
            assert (await client.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0
        finally:
            await client.aclose()
