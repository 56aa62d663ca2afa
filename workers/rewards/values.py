"""What counts as a reward: one check for every place a reward or an agent's result crosses into rollq."""

from __future__ import annotations

import math
import numbers
from typing import Any


def as_reward(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (numpy scalars included), else None. Bools are refused:
    a reward function returning True/False is almost always a bug."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


__all__ = ["as_reward"]
