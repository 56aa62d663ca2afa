"""Prometheus collectors over the engine client's state (`EnginePool`), read when /metrics is scraped (the worker's
and the trainer's; the server they are served from is rollq.metrics_server)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollq.engine.pool import EngineMember, EnginePool, version_number

ENGINE_STATES = ("healthy", "unhealthy", "paused", "stale")


def engine_state(member: EngineMember) -> str:
    """stale (missed a weight update: out of routing) > paused (held by the fleet's pause or load) > health."""
    if member.stale:
        return "stale"
    if member.held:
        return "paused"
    return "healthy" if member.healthy else "unhealthy"


class PoolCollector(Collector):
    """An EnginePool as this process sees it: engines by state, and per engine its requests in flight, whether it
    takes requests and its weight version. One label value per engine URL (bounded by the fleet's size)."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        members = list(self.pool.members.values())  # a copy: the event loop's thread changes the dict
        by_state = GaugeMetricFamily(
            "rollq_engines",
            "Engines in this process's pool by state: healthy, unhealthy (failed health checks), paused (held by a "
            "weight update), stale (failed a weight update, out of routing until reloaded)",
            labels=["state"],
        )
        counts = dict.fromkeys(ENGINE_STATES, 0)
        for m in members:
            counts[engine_state(m)] += 1
        for state, n in counts.items():
            by_state.add_metric([state], n)
        inflight = GaugeMetricFamily(
            "rollq_engine_inflight_requests", "Requests this process has outstanding on the engine", labels=["engine"]
        )
        up = GaugeMetricFamily(
            "rollq_engine_up", "1 when the engine takes this process's requests (healthy, not stale)", labels=["engine"]
        )
        version = GaugeMetricFamily(
            "rollq_engine_weight_version",
            "Policy version the engine last reported serving (-1: unknown or not an integer)",
            labels=["engine"],
        )
        for m in members:
            inflight.add_metric([m.url], m.outstanding)
            up.add_metric([m.url], 1 if m.routable else 0)
            version.add_metric([m.url], version_number(m.weight_version))
        yield from (by_state, inflight, up, version)


__all__ = ["ENGINE_STATES", "PoolCollector", "engine_state"]
