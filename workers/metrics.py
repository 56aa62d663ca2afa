"""`rollq worker` and `rollq reward-worker` on Prometheus: what each process does, read from its own objects when
/metrics is scraped, plus the one observation per episode a histogram needs (Worker.episode_observers).

Run-wide numbers (queue depth per class, dead letters by reason, the ledger) come from the trainer's and the
ingress's `rollq.producer.metrics.RunCollector`; these are per process (Prometheus adds `instance`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from rollq.engine.metrics import PoolCollector
from rollq.engine.pool import EnginePool
from rollq.metrics_server import MetricsServer, process_registry
from rollq.protocol.keys import DEFAULT_CLASS
from rollq.protocol.messages import Sequence
from rollq.redis_client import TRANSIENT_ERRORS, sync_redis_client
from rollq.workers.stats import WorkflowStats

if TYPE_CHECKING:
    from rollq.workers.worker import Worker

MAX_CLASSES = 32  # job classes kept as label values; more count as "other"
EPISODE_OUTCOMES = ("ok", "rejected", "failed", "dead_lettered")
# Episodes run from milliseconds (a synthetic engine) to many minutes (agents with tools).
EPISODE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))


class WorkerCollector(Collector):
    """A Worker's counters (WorkerStats) and slots, read at scrape time."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w, stats = self.worker, self.worker.stats
        jobs = CounterMetricFamily(
            "rollq_worker_jobs",
            "Jobs this worker finished, by outcome: completed, rejected (the workflow returned None), requeued "
            "(failed, to be retried), dead_lettered",
            labels=["outcome"],
        )
        for outcome in ("completed", "rejected", "requeued", "dead_lettered"):
            jobs.add_metric([outcome], getattr(stats, outcome))
        yield jobs
        yield CounterMetricFamily(
            "rollq_worker_reclaimed", "Pending jobs this worker took over from dead workers", value=stats.reclaimed
        )
        yield GaugeMetricFamily("rollq_worker_running_jobs", "Jobs running in this worker", value=len(w._running))
        yield GaugeMetricFamily("rollq_worker_concurrency", "Jobs this worker runs at once at most", w.cfg.concurrency)
        yield from _workflow_stats(w.context.stats)


def _workflow_stats(stats: WorkflowStats) -> Iterator[Metric]:
    """What workflows recorded with AReaL's stats_tracker (rollq.workers.stats): sum and count per tracker and key
    (the mean reward of eval rollouts: sum / count of tracker "eval-rollout", key "reward")."""
    family = SummaryMetricFamily(
        "rollq_workflow_stat",
        "Values workflows recorded with stats_tracker, by tracker (e.g. rollout, eval-rollout) and key",
        labels=["tracker", "key"],
    )
    for (tracker, key), (total, count) in list(stats.totals.items()):
        family.add_metric([tracker, key], count_value=int(count), sum_value=total)
    yield family


class WorkerMetrics:
    """A worker's registry: its collector, its engine pool's, and the per-episode histogram and token counter."""

    def __init__(self, worker: Worker, pool: EnginePool | None = None) -> None:
        self.registry: CollectorRegistry = process_registry()
        self.episodes = Histogram(
            "rollq_episode_seconds",
            "Episode latency: from the job's start in this worker to its outcome (ok, rejected, failed: to be "
            "retried, dead_lettered), by job class",
            ["class", "outcome"],
            buckets=EPISODE_BUCKETS,
            registry=self.registry,
        )
        for outcome in EPISODE_OUTCOMES:
            self.episodes.labels(DEFAULT_CLASS, outcome)  # the series exist from the start (rate() needs a zero)
        self.tokens = Counter(
            "rollq_generated_tokens",
            "Tokens the policy generated in this worker's published trajectories (loss mask 1), by job class",
            ["class"],
            registry=self.registry,
        )
        self.tokens.labels(DEFAULT_CLASS)
        self._classes: set[str] = {DEFAULT_CLASS}
        self.registry.register(WorkerCollector(worker))
        if pool is not None:
            self.registry.register(PoolCollector(pool))
        worker.episode_observers.append(self.observe)

    def observe(self, job_class: str, outcome: str, seconds: float, sequences: list[Sequence] | None) -> None:
        if job_class not in self._classes:  # bounded label values, whatever jobs claim to be
            if len(self._classes) >= MAX_CLASSES:
                job_class = "other"
            self._classes.add(job_class)
        self.episodes.labels(job_class, outcome).observe(seconds)
        if sequences:
            self.tokens.labels(job_class).inc(sum(s.loss_mask.count(1) for s in sequences))

    def serve(self, port: int, host: str) -> MetricsServer:
        return MetricsServer(self.registry, port, host)


class RewardWorkerCollector(Collector):
    """An arq reward worker: calls by outcome (arq's counters), calls running, the run's reward queue, and reward
    results by outcome (ok or the error type: RewardTimeout, RewardNotANumber, RewardError)."""

    def __init__(self, arq_worker: Any, queue: str, redis_url: str, results: dict[str, int]) -> None:
        self.arq_worker = arq_worker
        self.queue = queue
        self.results = results
        self.client = sync_redis_client(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)

    def collect(self) -> Iterator[Metric]:
        w = self.arq_worker
        calls = CounterMetricFamily(
            "rollq_reward_calls",
            "Reward jobs this reward worker ran, by arq outcome: complete, failed (the job raised), retried",
            labels=["outcome"],
        )
        calls.add_metric(["complete"], w.jobs_complete)
        calls.add_metric(["failed"], w.jobs_failed)
        calls.add_metric(["retried"], w.jobs_retried)
        yield calls
        results = CounterMetricFamily(
            "rollq_reward_results", "Reward calls by result: ok, or the error type", labels=["outcome"]
        )
        for outcome, n in sorted({"ok": 0, **self.results}.items()):
            results.add_metric([outcome], n)
        yield results
        yield GaugeMetricFamily("rollq_reward_calls_running", "Reward jobs running in this worker", value=len(w.tasks))
        try:
            depth: int | None = int(self.client.zcard(self.queue))  # type: ignore[arg-type]  # sync|async stub
        except TRANSIENT_ERRORS:
            depth = None
        if depth is not None:
            yield GaugeMetricFamily("rollq_reward_queue_depth", "Reward calls queued for the run", value=depth)

    def close(self) -> None:
        self.client.close()


def reward_worker_registry(
    arq_worker: Any, queue: str, redis_url: str, results: dict[str, int]
) -> tuple[CollectorRegistry, RewardWorkerCollector]:
    """The registry, and its collector (whose `arq_worker` follows a restarted arq worker)."""
    registry = process_registry()
    collector = RewardWorkerCollector(arq_worker, queue, redis_url, results)
    registry.register(collector)
    return registry, collector


__all__ = [
    "EPISODE_BUCKETS",
    "EPISODE_OUTCOMES",
    "RewardWorkerCollector",
    "WorkerCollector",
    "WorkerMetrics",
    "reward_worker_registry",
]
