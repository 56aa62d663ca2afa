"""Workflows for the benchmark (`python -m bench.queue_throughput`): fixed-size trajectories, no engine, no sleeping."""

from __future__ import annotations

import random
from typing import Any

TOKENS = 1024
PROMPT_FRACTION = 0.25  # the first quarter are prompt tokens (loss_mask 0, version -1)
VOCAB = 151_936  # Qwen-sized vocabulary, so token ids take realistic 1-3 byte msgpack ints


def make_trajectory(length: int = TOKENS, reward: float = 1.0, version: int = 3, seed: int = 0) -> dict[str, Any]:
    """One trajectory as a workflow returns it: plain Python lists."""
    rng = random.Random(seed)
    prompt = int(length * PROMPT_FRACTION)
    return {
        "input_ids": [rng.randrange(VOCAB) for _ in range(length)],
        "loss_mask": [0] * prompt + [1] * (length - prompt),
        # float32-representable values, so every encoding round-trips them exactly
        "logprobs": [0.0] * prompt + [-(rng.randrange(1 << 16) / 8192.0) for _ in range(length - prompt)],
        "versions": [-1] * prompt + [version] * (length - prompt),
        "reward": reward,
    }


class FixedTrajectory:
    """Returns the same precomputed `length`-token trajectory for every job (built once, at construction)."""

    def __init__(self, length: int = TOKENS) -> None:
        self._out = make_trajectory(length)

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        return self._out
