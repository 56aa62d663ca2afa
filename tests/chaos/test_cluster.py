"""A partitioned run on a real Redis Cluster (six `redis-server --cluster-enabled yes` on loopback, three primaries with
a replica each): the partitions land on different shards, every sample comes back once, and a training run goes on
when the primary holding the run's tag (the ledger and partition 0) is SIGKILLed mid-run and its replica takes over."""

from __future__ import annotations

import asyncio
import io

import msgspec
import pytest

from rollq.config import with_query
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.local import wait_until
from rollq.protocol.keys import RunKeys
from rollq.redis_client import redis_client
from rollq.trainer.loop import Trainer
from tests.producer.test_partitions import spread_and_collect
from tests.redis_cluster import LocalCluster, local_cluster
from tests.trainer.helpers import ENGINE_ARGS, WORKFLOW_KWARGS

PARTITIONS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> LocalCluster:
    # The nodes' directories (redis.log, nodes.conf) stay under pytest's basetemp for a post-mortem.
    with local_cluster(node_timeout_ms=1000, directory=str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def client_url(cluster: LocalCluster) -> str:
    return with_query(cluster.url, {"cluster": "yes"})


async def test_partitions_spread_over_shards_and_every_sample_comes_back_once(cluster, run_name):
    keys = RunKeys(run_name)
    shards = {cluster.primary_for(keys.at(p).jobs).port for p in range(8)}
    assert len(shards) >= 2, "eight partitions' hash tags all on one shard"
    await spread_and_collect(client_url(cluster), run_name, 4)


STEPS, GROUP, GROUPS, ETA = 8, 4, 3, 1


@pytest.mark.slow
@pytest.mark.scenario  # the failover loop of CONTRIBUTING.md runs it 20 times under load
async def test_a_training_run_goes_on_when_the_primary_of_the_run_is_killed(
    cluster, run_name, tmp_path, make_train_config, engine_process, spawn_worker, caplog
):
    caplog.set_level("WARNING", logger="rollq.redis")
    url = client_url(cluster)
    _, engine = await engine_process(*ENGINE_ARGS)
    workers = [spawn_worker(url, run_name, "--concurrency", "6", "--engine", engine) for _ in range(2)]
    cfg = make_train_config(
        redis_url=url,
        partitions=PARTITIONS,
        engine=[engine],
        steps=STEPS,
        group_size=GROUP,
        groups_per_step=GROUPS,
        max_staleness=ETA,
        workflow_kwargs=WORKFLOW_KWARGS,
        redis_outage_s=30,
        trained_log=True,
    )
    redis = redis_client(url)
    pool = EnginePool(PoolConfig(urls=[engine]))
    metrics = tmp_path / "run" / "metrics.jsonl"
    trainer = asyncio.create_task(Trainer(cfg, redis, pool, progress=io.StringIO()).run())
    victim = cluster.primary_for(RunKeys(run_name).ledger)
    try:

        def at_step_3() -> bool:
            return trainer.done() or (metrics.exists() and len(metrics.read_text().splitlines()) >= 3)

        await wait_until(at_step_3, 120, 0.1, "step 3")
        assert not trainer.done(), trainer.exception()
        cluster.kill(victim)
        promoted = await asyncio.to_thread(cluster.wait_failover, victim, 20.0)
        assert cluster.primary_for(RunKeys(run_name).ledger) is promoted
        records = msgspec.to_builtins(await asyncio.wait_for(trainer, 180))
    finally:
        trainer.cancel()
        await asyncio.gather(trainer, return_exceptions=True)
        await pool.close()
        await redis.aclose()
        await asyncio.to_thread(cluster.restart, victim)  # the module's other tests get a whole cluster back

    for w in workers:
        assert w.proc.poll() is None, w.log.read_text()[-2000:]  # rode it out
    assert any("unavailable" in r.getMessage() for r in caplog.records), "the trainer never saw the failover"
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    trained = [msgspec.json.decode(line) for line in (tmp_path / "run" / "trained.jsonl").read_bytes().splitlines()]
    samples = [(t["job_id"], t["sample_index"]) for t in trained]
    assert len(samples) == len(set(samples)) == STEPS * GROUP * GROUPS, "a sample was trained twice"
    for t in trained:
        assert t["oldest"] is None or t["oldest"] >= t["version"] - ETA  # the staleness bound held
    for r in records:
        assert r["staleness_max"] <= ETA


async def test_run_metrics_sum_every_partition_over_the_cluster(cluster, run_name):
    from rollq.producer.metrics import RunCollector
    from rollq.producer.producer import JobRequest, Producer

    url = client_url(cluster)
    redis = redis_client(url)
    collector = RunCollector(url, run_name)
    try:
        producer = Producer(redis, run_name, partitions=3)
        await producer.submit_many([JobRequest(workflow="tests.workflows:Echo", n=2, job_id=f"m{i}") for i in range(9)])
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in await asyncio.to_thread(lambda: list(collector.collect()))
            for s in family.samples
        }
    finally:
        collector.close()
        await redis.aclose()
    assert samples[("rollq_redis_up", ())] == 1
    assert samples[("rollq_queue_depth", (("class", "train"),))] == 18  # every partition's stream
    assert samples[("rollq_results_inflight", ())] == 18
