"""`rollq train` / `rollq up` on Prometheus (`metrics_port`): one observation per step, from the metrics.jsonl
record (MetricsLog.observers), plus the run's queues, dead letters and ledger (rollq.producer.metrics) and the
engine pool (rollq.engine.metrics), read when /metrics is scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollq.engine.metrics import PoolCollector
from rollq.engine.pool import EnginePool
from rollq.metrics_server import MetricsServer, process_registry
from rollq.producer.metrics import RunCollector
from rollq.trainer.config import TrainConfig
from rollq.trainer.metrics import MetricsLog, StepRecord

DROP_REASONS = ("foreign", "failed", "invalid", "future", "stale")
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, float("inf"))
PHASES = ("collect", "train", "step")
SYNC_KINDS = ("full", "delta", "adapter")  # StepRecord.sync


class TrainerMetrics:
    """The trainer's registry; `log` is the Trainer's MetricsLog, whose every step record it observes."""

    def __init__(self, cfg: TrainConfig, pool: EnginePool, log: MetricsLog) -> None:
        self.registry: CollectorRegistry = process_registry()
        reg = self.registry
        self.pause = Histogram(
            "rollq_weight_update_pause_seconds",
            "How long the engines did not generate for each weight update, pause to resume (0: a LoRA adapter load)",
            buckets=PAUSE_BUCKETS,
            registry=reg,
        )
        self.publish = Histogram(
            "rollq_weight_publish_seconds",
            "Each weight publish as a whole: save or broadcast, and the engines' pause, load and resume",
            buckets=PAUSE_BUCKETS,
            registry=reg,
        )
        self.load = Histogram(
            "rollq_weight_load_seconds",
            "The slowest engine's weight load in each update (within the pause)",
            buckets=PAUSE_BUCKETS,
            registry=reg,
        )
        self.prepare = Histogram(
            "rollq_weight_prepare_seconds",
            "Each weight update's preparation before the pause (engines rebuild the version while generating)",
            buckets=PAUSE_BUCKETS,
            registry=reg,
        )
        self.updates = Counter(
            "rollq_weight_updates",
            "Weight updates by kind: full, delta (a delta shipped to at least one engine), adapter (LoRA)",
            ["kind"],
            registry=reg,
        )
        self.sent_bytes = Counter(
            "rollq_weight_sent_bytes",
            "Weight bytes the engines read or received, summed over engines, by the update's kind",
            ["kind"],
            registry=reg,
        )
        for kind in SYNC_KINDS:
            self.updates.labels(kind)
            self.sent_bytes.labels(kind)
        self.bytes_per_engine = Gauge(
            "rollq_weight_update_bytes_per_engine",
            "The last weight update's bytes per engine updated",
            registry=reg,
        )
        self.delta_share = Gauge(
            "rollq_weight_delta_share",
            "The last update's delta bytes over the full weights' bytes (also when a full update was sent instead)",
            registry=reg,
        )
        self.aborted = Counter(
            "rollq_weight_update_aborted_requests",
            "Requests in flight that weight updates aborted on the engines (their clients saw finish_reason abort)",
            registry=reg,
        )
        self.retracted = Counter(
            "rollq_weight_update_retracted_requests",
            "Requests in flight that weight updates retracted (recomputed after the resume, unseen by the client)",
            registry=reg,
        )
        self.staleness = Histogram(
            "rollq_trained_staleness",
            "Staleness of each trained sample: the step's policy version minus its oldest trained token's version",
            buckets=STALENESS_BUCKETS,
            registry=reg,
        )
        self.steps = Counter("rollq_trainer_steps", "Training steps done by this trainer", registry=reg)
        self.samples = Counter("rollq_trained_samples", "Samples trained on", registry=reg)
        self.tokens = Counter("rollq_trained_tokens", "Tokens in the trained batches", registry=reg)
        self.dropped = Counter(
            "rollq_dropped_samples",
            "Samples read and not trained, by reason: foreign, failed, invalid, future, stale",
            ["reason"],
            registry=reg,
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        self.version = Gauge("rollq_trainer_policy_version", "Policy version after the last step", registry=reg)
        self.reward = Gauge("rollq_trainer_reward_mean", "Mean reward of the last step's batch", registry=reg)
        self.gen_rate = Gauge(
            "rollq_trainer_generated_tokens_per_second",
            "Generated tokens of the samples the trainer read, per second (over at least 10 s)",
            registry=reg,
        )
        self.phase = Gauge(
            "rollq_trainer_step_seconds",
            "The last step's time by phase: collect, train, step (all)",
            ["phase"],
            registry=reg,
        )
        reg.register(RunCollector(cfg.redis_url, cfg.run))
        reg.register(PoolCollector(pool))
        log.observers.append(self.observe)

    def observe(self, r: StepRecord) -> None:
        self.pause.observe(r.pause_s)
        self.publish.observe(r.publish_s)
        self.load.observe(r.weight_load_s)
        self.prepare.observe(r.prepare_s)
        self.updates.labels(r.sync).inc()
        self.sent_bytes.labels(r.sync).inc(r.bytes_sent)
        self.bytes_per_engine.set(r.bytes_per_engine)
        self.delta_share.set(r.delta_share)
        self.aborted.inc(r.aborted_requests)
        self.retracted.inc(r.retracted_requests)
        for staleness, n in r.staleness_hist.items():
            for _ in range(n):
                self.staleness.observe(int(staleness))
        self.steps.inc()
        self.samples.inc(r.samples)
        self.tokens.inc(r.trained_tokens)
        for reason, n in r.dropped_this_step.items():
            self.dropped.labels(reason if reason in DROP_REASONS else "other").inc(n)
        self.version.set(r.version)
        self.reward.set(r.reward_mean)
        self.gen_rate.set(r.gen_tokens_per_s)
        self.phase.labels("collect").set(r.collect_s)
        self.phase.labels("train").set(r.train_s)
        self.phase.labels("step").set(r.step_s)

    def serve(self, port: int, host: str) -> MetricsServer:
        return MetricsServer(self.registry, port, host)


__all__ = ["TrainerMetrics"]
