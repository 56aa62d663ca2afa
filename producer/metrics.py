"""Run-level Prometheus metrics, read from Redis when /metrics is scraped (nothing on any hot path): the job
streams per class (depth, lag, pending, oldest entry), the shared results stream, dead letters by reason, the
staleness ledger (admitted vs bound) and live workers; on a partitioned run, summed over its partitions. Every
process that registers `RunCollector` reports the same run-wide numbers; a dashboard takes `max by (run, class)`,
not the sum."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import msgspec
import redis
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollq.metrics_server import process_registry
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP, RunKeys, inflight_key
from rollq.protocol.messages import job_classes
from rollq.redis_client import TRANSIENT_ERRORS, StreamStats, stream_stats, sync_redis_client

WORKER_ALIVE_S = 15.0  # as `rollq status`: a heartbeat this recent means alive
MAX_REASONS = 64  # dead-letter reasons (error types) kept as label values; later new ones count as "other"
DEAD_READ_PER_SCRAPE = 10_000  # dead letters decoded per scrape at most (the rest on the next ones)


def job_lag(st: StreamStats) -> int:
    """Entries no worker has read yet. Redis reports no lag once entries were deleted inside the stream, which
    rollq does to every acked job; as acked jobs leave the stream, what is left and not pending is unread."""
    return st.lag if st.lag is not None else max(0, st.length - st.pending)


def partitions_of(client: redis.Redis, keys: RunKeys) -> list[RunKeys]:
    """The keys of each of the run's partitions."""
    return [keys.at(p) for p in range(int(client.get(keys.partitions) or 1))]  # type: ignore[arg-type]


def queue_families(client: redis.Redis, keys: RunKeys) -> list[Metric]:
    """rollq_queue_{depth,lag,pending,oldest_seconds}{class} for the run's job classes (every partition's stream
    summed; the oldest entry of any)."""
    families = {
        "depth": GaugeMetricFamily(
            "rollq_queue_depth", "Job entries in the class's stream: queued plus running", labels=["class"]
        ),
        "lag": GaugeMetricFamily("rollq_queue_lag", "Job entries no worker has read yet", labels=["class"]),
        "pending": GaugeMetricFamily(
            "rollq_queue_pending",
            "Job entries read by a worker and not finished (running, or held by a dead worker until reclaimed)",
            labels=["class"],
        ),
        "oldest": GaugeMetricFamily(
            "rollq_queue_oldest_seconds", "Age of the oldest job entry in the class's stream", labels=["class"]
        ),
    }
    stored = client.hgetall(keys.classes)
    parts = partitions_of(client, keys)
    for name in sorted(job_classes(stored)):  # type: ignore[arg-type]  # redis-py stub: sync|async union
        stats = [stream_stats(client, k.job_stream(name), WORKER_GROUP) for k in parts]
        families["depth"].add_metric([name], sum(st.length for st in stats))
        families["lag"].add_metric([name], sum(job_lag(st) for st in stats))
        families["pending"].add_metric([name], sum(st.pending for st in stats))
        families["oldest"].add_metric([name], max(st.oldest_age_s for st in stats))
    return list(families.values())


class DeadLetterCount:
    """Dead letters by reason (the error type), read incrementally from the run's `:dead` stream."""

    def __init__(self, keys: RunKeys) -> None:
        self.keys = keys
        self.codec = Codec()
        self.counts: Counter[str] = Counter()
        self._last = "0-0"
        self._lock = threading.Lock()  # scrapes may overlap (one thread per request)

    def read(self, client: redis.Redis) -> Counter[str]:
        with self._lock:
            for _ in range(DEAD_READ_PER_SCRAPE // 1000):
                entries = client.xrange(self.keys.dead, min=f"({self._last}", count=1000)
                for eid, fields in entries:  # type: ignore[union-attr]  # redis-py stub: sync|async union
                    self._last = eid.decode()
                    try:
                        reason = self.codec.decode_dead_letter(fields.get(PAYLOAD_FIELD, b"")).error.type
                    except CodecError:
                        reason = "Undecodable"
                    if reason not in self.counts and len(self.counts) >= MAX_REASONS:
                        reason = "other"
                    self.counts[reason] += 1
                if len(entries) < 1000:  # type: ignore[arg-type]
                    break
            return Counter(self.counts)


class RunCollector(Collector):
    """The run's queues, dead letters, ledger and workers, read from Redis at scrape time (a synchronous client:
    scrapes run in the metrics server's threads). A Redis that does not answer reports `rollq_redis_up 0`."""

    def __init__(self, redis_url: str, run: str) -> None:
        self.keys = RunKeys(run)
        self.client = sync_redis_client(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.dead: dict[int, DeadLetterCount] = {}  # per partition

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("rollq_redis_up", "1 when the last scrape could read the run's keys in Redis")
        try:
            families = self._read()
        except TRANSIENT_ERRORS:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self) -> list[Metric]:
        c, keys = self.client, self.keys
        out = queue_families(c, keys)
        parts = partitions_of(c, keys)
        depth = sum(stream_stats(c, k.results, "trainer").length for k in parts)
        out.append(GaugeMetricFamily("rollq_results_depth", "Entries in the run's shared results stream", value=depth))
        inflight = 0
        for k in parts:
            inflight += int(c.get(inflight_key(k.results)) or 0)  # type: ignore[arg-type]  # sync|async stub
        out.append(
            GaugeMetricFamily(
                "rollq_results_inflight",
                "Samples submitted for the shared results stream and not consumed yet",
                value=inflight,
            )
        )
        dead = CounterMetricFamily(
            "rollq_dead_letters", "Jobs dead-lettered, by reason (error type)", labels=["reason"]
        )
        reasons: Counter[str] = Counter()
        for k in parts:
            reasons += self.dead.setdefault(k.partition, DeadLetterCount(k)).read(c)
        for reason, n in sorted(reasons.items()):
            dead.add_metric([reason], n)
        out.append(dead)
        raw = {k.decode(): int(v) for k, v in c.hgetall(keys.ledger).items()}  # type: ignore[union-attr]
        version, admitted = raw.get("version", 0), raw.get("admitted", 0)
        out.append(GaugeMetricFamily("rollq_ledger_version", "Policy version of the staleness ledger", value=version))
        out.append(
            GaugeMetricFamily(
                "rollq_ledger_admitted", "Samples admitted by the staleness ledger and not given back", value=admitted
            )
        )
        if "eta" in raw and "batch" in raw:
            out.append(
                GaugeMetricFamily(
                    "rollq_ledger_bound",
                    "Samples the ledger may admit at its version: (eta + version + 1) * B",
                    value=(raw["eta"] + version + 1) * raw["batch"],
                )
            )
        out.append(
            CounterMetricFamily(
                "rollq_ledger_released",
                "Samples given back to the ledger by dropped groups",
                value=raw.get("released", 0),
            )
        )
        alive = c.zcount(keys.workers, time.time() - WORKER_ALIVE_S, "+inf")
        out.append(GaugeMetricFamily("rollq_workers_alive", "Workers whose heartbeat is recent", value=int(alive)))  # type: ignore[arg-type]
        return out

    def close(self) -> None:
        self.client.close()


class IngressCollector(Collector):
    """`rollq ingress`'s counters (an IngressStats, read at scrape time): requests, admissions, refusals by
    reason, cancels, SSE events and open event streams."""

    def __init__(self, stats: msgspec.Struct) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        raw: dict[str, int] = msgspec.structs.asdict(self.stats)
        refused = CounterMetricFamily(
            "rollq_ingress_refused",
            "Requests refused, by reason: unauthorized (401), invalid (400), forbidden (403), too_large (413), "
            "busy (429: backpressure), redis_errors (503)",
            labels=["reason"],
        )
        for name, value in raw.items():
            if name.startswith("refused_") or name == "redis_errors":
                refused.add_metric([name.removeprefix("refused_")], value)
            elif name == "event_streams_open":
                yield GaugeMetricFamily("rollq_ingress_event_streams_open", "SSE connections open now", value=value)
            else:
                yield CounterMetricFamily(f"rollq_ingress_{name}", INGRESS_HELP.get(name, name), value=value)
        yield refused


INGRESS_HELP = {
    "requests": "HTTP requests served",
    "jobs_admitted": "Jobs admitted (queued)",
    "samples_admitted": "Samples admitted (a job of n samples counts n)",
    "jobs_duplicate": "Jobs submitted again under a job id the tenant used before (nothing queued)",
    "cancels": "Jobs cancelled",
    "events_sent": "Sample events sent over SSE",
}


def ingress_registry(stats: msgspec.Struct, redis_url: str, run: str) -> CollectorRegistry:
    """The ingress's /metrics (`rollq ingress --metrics-port` serves it with rollq.metrics_server.MetricsServer):
    its counters and the run-wide collector, besides the process's own."""
    registry = process_registry()
    registry.register(IngressCollector(stats))
    registry.register(RunCollector(redis_url, run))
    return registry


__all__ = [
    "DeadLetterCount",
    "IngressCollector",
    "RunCollector",
    "ingress_registry",
    "job_lag",
    "queue_families",
]
