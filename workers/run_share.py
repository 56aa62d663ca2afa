"""One worker process serving several runs (`rollq worker --run A --also-serve B`): its concurrency shared between
them by weight, the way job classes share a run's (workers/fair_share.py), and never idle while any run has work.

Each run has its own Worker (its streams, consumer group, leases, dead letters) over one engine pool; before each
read a Worker asks how many slots it may fill. A run's cap is its weighted part of the concurrency among the runs
that want slots now (running jobs, or their last read found some); a run whose read comes back empty gives its part
to the others until it has work again. Then, the process being full of the others' jobs, it reads a little of its
own and holds it (Worker._claim_share): it wants again, the others start nothing beyond their parts, and the slots
their jobs free go to it. Whenever a slot frees or a run's want changes, every Worker re-asks."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class RunShare:
    def __init__(self, concurrency: int, weights: dict[str, float]) -> None:
        self.concurrency = concurrency
        self.weights = weights  # run -> weight (missing: 1)
        self._running: dict[str, Callable[[], int]] = {}  # run -> its count of jobs running
        self._wakes: dict[str, asyncio.Event] = {}
        self._wanting: dict[str, bool] = {}

    def join(self, run: str, running: Callable[[], int], wake: asyncio.Event) -> None:
        self._running[run] = running
        self._wakes[run] = wake
        self._wanting[run] = True  # until a read finds nothing

    def weight(self, run: str) -> float:
        return self.weights.get(run, 1.0)

    def _cap(self, run: str, running: dict[str, int]) -> int:
        active = [r for r in self._running if r == run or running[r] > 0 or self._wanting[r]]
        return math.ceil(self.concurrency * self.weight(run) / sum(self.weight(r) for r in active))

    def free(self, run: str) -> int:
        """Slots `run` may fill now: its cap among the runs wanting slots, within what is free in the process."""
        running = {r: count() for r, count in self._running.items()}
        room = self.concurrency - sum(running.values())
        if room <= 0:
            return 0
        return max(0, min(room, self._cap(run, running) - running[run]))

    def under_cap(self, run: str) -> bool:
        """Whether `run` runs fewer jobs than its part: when the process is full of the others' (lent while it had
        nothing), it reads what it has and holds it (Worker._claim_share), and the others start no new jobs beyond
        their parts until it has its own back."""
        running = {r: count() for r, count in self._running.items()}
        return running[run] < self._cap(run, running)

    def wanting(self, run: str, wants: bool) -> None:
        """A read of `run` found work (True) or none (False): the others' caps change."""
        if self._wanting.get(run) != wants:
            self._wanting[run] = wants
            self.released()

    def released(self) -> None:
        """A slot freed somewhere: every run looks again."""
        for event in self._wakes.values():
            event.set()


__all__ = ["RunShare"]
