"""Which job class a worker's free slots go to: strict priority between levels, deficit round robin (DRR) by weight
within a level. Pure bookkeeping (no I/O): the worker asks `allocate(free, candidates)`, reads that many entries from
each class's stream, and reports classes that came back short with `exhausted()`.

DRR with unit-cost jobs: the classes of a level sit on a ring; a class whose turn begins gets its quantum
(`weight / smallest weight of the level`, so every turn serves at least one job) added to its deficit and is served
while the deficit lasts, then the turn passes on. An empty class's deficit is reset (nothing is banked while idle),
so when both are backlogged, weights 3:1 get 75 % : 25 % of the starts whatever they submit, and a class of any
weight is served at least once per round. Slots are handed out one at a time, so a worker that frees one slot at a
time keeps the same shares as one that frees many.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollq.protocol.messages import JobClass


class FairShare:
    def __init__(self, classes: Iterable[JobClass] = ()) -> None:
        self.classes: dict[str, JobClass] = {}
        self._deficit: dict[str, float] = {}
        self._turn: dict[int, tuple[str, bool]] = {}  # level -> the class whose turn it is, and whether it began
        self._levels: list[tuple[int, list[str]]] = []  # highest priority first; a level's ring in name order
        self.update(classes)

    def update(self, classes: Iterable[JobClass]) -> None:
        """New definitions (classes added, removed or changed); deficits of classes still there are kept."""
        self.classes = {c.name: c for c in classes}
        self._deficit = {name: self._deficit.get(name, 0.0) for name in self.classes}
        levels: dict[int, list[str]] = {}
        for c in sorted(self.classes.values(), key=lambda c: c.name):
            levels.setdefault(c.priority, []).append(c.name)
        self._levels = sorted(levels.items(), key=lambda kv: -kv[0])
        self._turn = {p: turn for p, names in self._levels if (turn := self._turn.get(p)) and turn[0] in names}

    def order(self) -> list[str]:
        """Every class, highest priority first (for work that is not shared by weight, such as reclaiming)."""
        return [name for _, names in self._levels for name in names]

    def allocate(self, free: int, candidates: set[str]) -> list[str]:
        """Which class each of `free` slots goes to now, in DRR service order, among `candidates` (those that may
        have queued jobs): only the highest level that has a candidate, shared by DRR."""
        for priority, names in self._levels:
            ring = [n for n in names if n in candidates]
            if ring:
                return self._drr(priority, names, ring, free)
        return []

    def _drr(self, priority: int, names: list[str], ring: list[str], free: int) -> list[str]:
        smallest = min(self.classes[n].weight for n in ring)
        current, started = self._turn.get(priority, (names[0], False))
        k = names.index(current)
        name = next(n for n in names[k:] + names[:k] if n in ring)  # the first candidate from the turn on
        i = ring.index(name)
        if name != current or not started:  # its turn begins
            self._deficit[name] += self.classes[name].weight / smallest
        out: list[str] = []
        while free > 0:
            name = ring[i]
            if self._deficit[name] >= 1.0:
                self._deficit[name] -= 1.0
                out.append(name)
                free -= 1
                continue
            i = (i + 1) % len(ring)  # its turn ends; the next class's begins
            nxt = ring[i]
            self._deficit[nxt] += self.classes[nxt].weight / smallest
        self._turn[priority] = (ring[i], True)
        return out

    def exhausted(self, name: str) -> None:
        """`name` had fewer queued jobs than it was given: its turn ends and its deficit is reset (nothing banked
        while idle); the next class of its level is up."""
        c = self.classes.get(name)
        if c is None:
            return
        self._deficit[name] = 0.0
        names = next(ns for p, ns in self._levels if p == c.priority)
        if self._turn.get(c.priority, (name, False))[0] == name:
            self._turn[c.priority] = (names[(names.index(name) + 1) % len(names)], False)


__all__ = ["FairShare"]
