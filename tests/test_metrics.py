"""Prometheus /metrics: the collectors against a real Redis and real services, scraped over HTTP; and every metric
the Grafana dashboard (deploy/grafana/rollq.json) queries is served by some rollq service."""

from __future__ import annotations

import asyncio
import io
import json
import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rollq.local import free_port
from rollq.metrics_server import MetricsServer
from rollq.producer import JobRequest, Producer
from rollq.producer.ingress import IngressStats
from rollq.producer.metrics import RunCollector, ingress_registry
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.workers.metrics import WorkerMetrics
from tests.helpers import REPO_ROOT, running_worker, wait_until

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "rollq.json"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_sync(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


async def scrape(port: int) -> Samples:
    return await asyncio.to_thread(scrape_sync, port)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@contextmanager
def serving(registry: CollectorRegistry) -> Iterator[MetricsServer]:
    server = MetricsServer(registry, 0, "127.0.0.1")
    try:
        yield server
    finally:
        server.close()


def run_registry(redis_url: str, run: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RunCollector(redis_url, run))
    return registry


async def test_queue_depth_follows_submits_and_dead_letters_count_by_reason(redis, redis_url, run_name):
    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    with serving(run_registry(redis_url, run_name)) as run_metrics:
        before = await scrape(run_metrics.port)
        assert value(before, "rollq_queue_depth", **{"class": "train"}) == 0
        assert value(before, "rollq_redis_up") == 1
        await producer.submit_many(
            [JobRequest(workflow="tests.workflows:Echo", data={"i": i}, n=2, job_id=f"e{i}") for i in range(5)]
        )
        queued = await scrape(run_metrics.port)
        assert value(queued, "rollq_queue_depth", **{"class": "train"}) == 10
        assert value(queued, "rollq_queue_lag", **{"class": "train"}) == 10
        assert value(queued, "rollq_queue_pending", **{"class": "train"}) == 0
        assert value(queued, "rollq_queue_oldest_seconds", **{"class": "train"}) >= 0
        assert value(queued, "rollq_results_inflight") == 10

        async with running_worker(redis_url, run_name, concurrency=4, max_attempts=1) as worker:
            with serving(WorkerMetrics(worker).registry) as worker_metrics:
                await redis.xadd(RunKeys(run_name).jobs, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
                await producer.submit("tests.workflows:Boom", {"i": 1}, job_id="boom", n=2)
                got = [t async for t in producer.wait_for({**{f"e{i}": 2 for i in range(5)}, "boom": 2}, timeout_s=20)]
                assert sorted(t.status for t in got) == ["error"] * 2 + ["ok"] * 10
                await wait_until(lambda: worker.stats.dead_lettered == 3, 10, what="three dead letters")
                done = await scrape(run_metrics.port)
                assert value(done, "rollq_dead_letters_total", reason="RuntimeError") == 2
                assert value(done, "rollq_dead_letters_total", reason="MalformedJob") == 1
                assert value(done, "rollq_queue_depth", **{"class": "train"}) == 0
                assert value(done, "rollq_workers_alive") == 1
                w = await scrape(worker_metrics.port)
        # A second reading counts nothing twice (dead letters are read incrementally).
        again = await scrape(run_metrics.port)
        assert value(again, "rollq_dead_letters_total", reason="RuntimeError") == 2
    assert value(w, "rollq_worker_jobs_total", outcome="completed") == 10
    assert value(w, "rollq_worker_jobs_total", outcome="dead_lettered") == 3
    assert value(w, "rollq_episode_seconds_count", **{"class": "train", "outcome": "ok"}) == 10
    assert value(w, "rollq_episode_seconds_count", **{"class": "train", "outcome": "dead_lettered"}) == 3
    # Echo's i-th sequence has loss mask 1 on 1 + i tokens (its data sets the length: see tests/workflows.py).
    assert value(w, "rollq_generated_tokens_total", **{"class": "train"}) > 0
    assert value(w, "rollq_worker_running_jobs") == 0 and value(w, "rollq_worker_concurrency") == 4


async def test_a_redis_that_does_not_answer_is_reported_not_raised(unused_redis_url, run_name):
    with serving(run_registry(unused_redis_url, run_name)) as server:
        samples = await scrape(server.port)
    assert value(samples, "rollq_redis_up") == 0


async def test_the_ledger_reads_admitted_against_its_bound(redis, redis_url, run_name):
    from rollq.trainer.ledger import StalenessLedger

    ledger = StalenessLedger(redis, run_name, batch_samples=8, max_staleness=1)
    await ledger.reset()
    await ledger.admit("g0", 4)
    await ledger.set_version(1)
    with serving(run_registry(redis_url, run_name)) as server:
        samples = await scrape(server.port)
    assert value(samples, "rollq_ledger_admitted") == 4
    assert value(samples, "rollq_ledger_version") == 1
    assert value(samples, "rollq_ledger_bound") == (1 + 1 + 1) * 8


def dashboard_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs and all(
        p.get("datasource", {}).get("uid") == "prometheus" for p in dash["panels"] if p["type"] != "row"
    )
    return {name for e in exprs for name in re.findall(r"\brollq_[a-zA-Z0-9_]+", e)}


def test_the_dashboard_queries_rollq_metrics():
    names = dashboard_metrics()
    assert {"rollq_queue_depth", "rollq_episode_seconds_bucket", "rollq_weight_update_pause_seconds_bucket"} <= names
    # issue 46: the publish, its preparation, the bytes per update by kind and per engine, and the requests updates
    # aborted or retracted (every one served: test_every_metric_the_dashboard_queries_is_served)
    assert {
        "rollq_weight_publish_seconds_bucket",
        "rollq_weight_prepare_seconds_bucket",
        "rollq_weight_sent_bytes_total",
        "rollq_weight_updates_total",
        "rollq_weight_update_bytes_per_engine",
        "rollq_weight_update_aborted_requests_total",
        "rollq_weight_update_retracted_requests_total",
    } <= names


@pytest.mark.slow
async def test_every_metric_the_dashboard_queries_is_served(
    redis, redis_url, run_name, tmp_path, make_train_config, engine_process, spawn_worker
):
    """A synthetic engine, a `rollq worker` and a `rollq reward-worker` (subprocesses, --metrics-port), the real
    trainer for a step or more (metrics_port) and the ingress's counters with the run collector; then the union of
    what their /metrics serve holds every metric name in the dashboard's queries."""
    from rollq.engine.pool import EnginePool, PoolConfig
    from rollq.trainer.loop import Trainer
    from tests.trainer.helpers import WORKFLOW_KWARGS
    from tests.workers.test_remote_rewards import reward_worker

    _, url = await engine_process("--tokenizer", "tiny")
    worker_port, reward_port, trainer_port = free_port(), free_port(), free_port()
    spawn_worker(redis_url, run_name, "--engine", url, "--concurrency", "8", "--metrics-port", str(worker_port))
    await redis.xadd(RunKeys(run_name).jobs, {PAYLOAD_FIELD: b"\xc1 not msgpack"})  # a dead letter to count
    cfg = make_train_config(
        engine=[url],
        steps=1000,  # stopped once scraped
        group_size=2,
        groups_per_step=2,
        workflow_kwargs=WORKFLOW_KWARGS,
        metrics_port=trainer_port,
    )
    pool = EnginePool(PoolConfig(urls=[url]))
    trainer = Trainer(cfg, redis, pool, progress=io.StringIO())
    training = asyncio.create_task(trainer.run())
    served: set[str] = set()
    try:
        with reward_worker(redis_url, run_name, tmp_path / "reward.log", "--metrics-port", str(reward_port)):
            await wait_until(lambda: training.done() or trainer.state.step >= 2, 60, what="two training steps")
            assert not training.done(), training.exception()
            for port in (worker_port, reward_port, trainer_port):
                served |= {name for name, _ in await scrape(port)}
        with serving(ingress_registry(IngressStats(), redis_url, run_name)) as ingress:
            served |= {name for name, _ in await scrape(ingress.port)}
    finally:
        training.cancel()
        await asyncio.gather(training, return_exceptions=True)
        await pool.close()
    missing = sorted(dashboard_metrics() - served)
    assert missing == [], f"the dashboard queries metrics no service serves: {missing}"
