"""What a weight update did to the requests in flight, counted on the engines: the growth of each engine's request
counters between a read before the pause and one after the resume, summed over the engines read both times.

Both engine kinds are read the same way, from their Prometheus text on `/metrics` (open, no key; SGLang serves it with
`--enable-metrics`, which rollq's launcher, compose and the Kubernetes manifests pass):
- `sglang:num_aborted_requests_total`: rollq's reference engine counts each request aborted (a pause in `abort`
  mode, `/abort_request`, a client gone); SGLang 0.5.23 counts each abort *call* (tokenizer_manager.py abort_request:
  one per `abort_all`, and an `abort` pause calls it at least once, then once a second until the engine drained).
- `sglang:num_retracted_requests_total`: the reference engine counts each running request a `retract` pause moved
  back to the waiting queue; SGLang 0.5.23 counts only retractions under KV-cache pressure (scheduler.py
  retract_decode), not a pause's (its retract pause leaves the counter as it is).
So on SGLang `aborted` says whether an update aborted (>= 1 per engine for an `abort` pause) rather than how many
requests, and `retracted` holds no pause retractions; docs/operations.md says so."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.parser import text_string_to_metric_families

from rollq.engine.client import EngineError, EngineUnavailable, SGLangClient
from rollq.engine.pool import EngineMember

log = logging.getLogger("rollq.engine")

# phase key -> the engine counter it is read from (SGLang's names; the reference engine serves the same)
COUNTERS = {
    "aborted": "sglang:num_aborted_requests_total",
    "retracted": "sglang:num_retracted_requests_total",
}
READ_TIMEOUT_S = 2.0  # a read is bookkeeping: an engine slower than this is left out of the count, never waited on

Counts = dict[str, float]  # phase key -> the counter's value (summed over its series)


def parse_counts(text: str) -> Counts:
    """The COUNTERS in one Prometheus text, each summed over its series (labels: model name, DP rank ...); a counter
    the engine does not serve is absent."""
    samples = {name: key for key, name in COUNTERS.items()}
    counts: Counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = samples.get(sample.name)
            if key is not None:
                counts[key] = counts.get(key, 0.0) + float(sample.value)
    return counts


async def read_counts(members: list[EngineMember], timeout: float = READ_TIMEOUT_S) -> dict[str, Counts]:
    """Each engine's counters now (url -> counts); an engine that does not answer in time, or serves no /metrics
    (SGLang without --enable-metrics), is left out."""

    async def one(client: SGLangClient) -> Counts | None:
        try:
            return parse_counts(await asyncio.wait_for(client.metrics_text(timeout=timeout), timeout))
        except (EngineError, EngineUnavailable, TimeoutError, ValueError) as exc:
            log.debug("request counters of %s not read: %s", client.url, exc)
            return None

    read = await asyncio.gather(*(one(m.client) for m in members))
    return {m.url: counts for m, counts in zip(members, read, strict=True) if counts is not None}


def counted(before: dict[str, Counts], after: dict[str, Counts]) -> dict[str, float]:
    """Each phase key's growth between the two reads, summed over the engines read both times. A counter that went
    down belongs to an engine restarted in between: what it counted before is gone, so it adds nothing."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url, was in before.items():
        now = after.get(url)
        if now is None:
            continue
        for key in COUNTERS:
            if key in was and key in now:
                totals[key] += max(0.0, now[key] - was[key])
    return totals


__all__ = ["COUNTERS", "Counts", "counted", "parse_counts", "read_counts"]
