"""Which of a run's groups are settled (trained or dropped), by group index, in memory bounded by how far out of
order groups finish rather than by the run's length."""

from __future__ import annotations

import msgspec


class SettledGroups(msgspec.Struct, kw_only=True):
    """Every group index below `below`, plus those in `above`. Saved in the trainer's checkpoint."""

    below: int = 0  # every group with a smaller index is settled
    above: set[int] = set()  # settled groups at or past `below` (those finished out of order)

    def add(self, index: int) -> None:
        if index < self.below:
            return
        self.above.add(index)
        while self.below in self.above:
            self.above.discard(self.below)
            self.below += 1

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and (index < self.below or index in self.above)

    def unsettled(self, until: int) -> list[int]:
        """The indices below `until` not settled yet."""
        return [i for i in range(self.below, until) if i not in self.above]


class TrainedPart(msgspec.Struct, kw_only=True):
    """What of a split group (split_groups) trained at earlier steps. Saved in the trainer's checkpoint: a restarted
    trainer acks those samples when they are read again, and normalises the group's rest over their rewards too."""

    samples: list[int] = []  # their sample indices
    rewards: list[float] = []  # their sequences' rewards


__all__ = ["SettledGroups", "TrainedPart"]
