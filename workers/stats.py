"""AReaL's `stats_tracker` for workflows in a rollq worker: `stats_tracker.get(workflow_context.stat_scope())
.scalar(reward=r)` and the rest of its recording surface (scope, stat, denominator, record_timing, export).

What a workflow records lands in its worker's `WorkflowStats` (one per worker, in its WorkflowContext) and is served
on the worker's /metrics as the summary `rollq_workflow_stat` (`_sum`, `_count`) by tracker and key: the
mean reward of the rollouts, eval rollouts apart. AReaL reduces these across its trainer's ranks; here each worker
process counts its own and Prometheus adds them up.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

MAX_KEYS = 256  # (tracker, key) pairs kept per worker: label values on /metrics; more are dropped with a count


def _number(value: Any) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"stats_tracker.scalar takes numbers, got {type(value).__name__}")
    return float(value)


class StatsTracker:
    """One named tracker (AReaL's DistributedStatsTracker, one process): running sums and counts per key."""

    def __init__(self, owner: WorkflowStats, name: str = "") -> None:
        self.owner = owner
        self.name = name
        self._scopes: list[str] = []
        self._denominators: dict[str, Any] = {}

    def _key(self, key: str) -> str:
        return "/".join([*self._scopes, key])

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Keys recorded inside are prefixed `name/`."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def scalar(self, **values: Any) -> None:
        for key, value in values.items():
            self.owner.add(self.name, self._key(key), _number(value), 1)

    def denominator(self, **masks: Any) -> None:
        """Boolean masks (tensors) later `stat` calls average over, by name."""
        for key, mask in masks.items():
            self._denominators[self._key(key)] = mask

    def stat(self, denominator: str, reduce_type: Any = None, **values: Any) -> None:
        """Per-element values (tensors) averaged over the positions the named denominator mask marks."""
        mask = self._denominators.get(self._key(denominator))
        if mask is None:
            raise ValueError(f"stats_tracker.stat: no denominator {denominator!r} (call denominator() first)")
        for key, value in values.items():
            kept = value[mask.bool()] if hasattr(mask, "bool") else value
            count = int(kept.numel()) if hasattr(kept, "numel") else len(kept)
            total = float(kept.float().sum()) if hasattr(kept, "float") else float(sum(kept))
            self.owner.add(self.name, self._key(key), total, count)

    @contextlib.contextmanager
    def record_timing(self, key: str) -> Iterator[None]:
        """Seconds spent in the block, recorded as `timeperf/<key>` (AReaL's name)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.owner.add(self.name, self._key(f"timeperf/{key}"), time.perf_counter() - start, 1)

    def export(self, key: str | None = None, reset: bool = True, **_: Any) -> dict[str, float]:
        """Means of what this tracker recorded since the last reset (all keys, or one)."""
        return self.owner.export(self.name, key, reset)


class WorkflowStats:
    """A worker's stats: (tracker, key) -> [sum, count], cumulative for /metrics, resettable means for export()."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, str], list[float]] = {}  # for /metrics: never reset
        self._since_export: dict[tuple[str, str], list[float]] = {}
        self._trackers: dict[str, StatsTracker] = {}
        self.dropped = 0  # values of keys beyond MAX_KEYS

    def get(self, name: str = "") -> StatsTracker:
        tracker = self._trackers.get(name)
        if tracker is None:
            tracker = self._trackers[name] = StatsTracker(self, name)
        return tracker

    def add(self, name: str, key: str, total: float, count: int) -> None:
        slot = (name, key)
        if slot not in self.totals and len(self.totals) >= MAX_KEYS:
            self.dropped += count
            return
        for table in (self.totals, self._since_export):
            entry = table.setdefault(slot, [0.0, 0])
            entry[0] += total
            entry[1] += count

    def export(self, name: str, key: str | None, reset: bool) -> dict[str, float]:
        out = {
            k: s / c for (n, k), (s, c) in self._since_export.items() if n == name and c and (key is None or k == key)
        }
        if reset:
            for k in out:
                self._since_export.pop((name, k), None)
        return out
