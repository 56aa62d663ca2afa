"""`rollq reward-worker`: serves a run's remote reward calls until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import os
import sys

from rollq.shield import shield_secrets
from rollq.workers.rewards.config import RewardWorkerConfig
from rollq.workers.rewards.worker import serve


def reward_worker(cfg: RewardWorkerConfig) -> int:
    # Reward functions named by import path are looked up from the directory the worker was started in (the
    # allowlist still decides what may be imported).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    shield_secrets()  # its Redis URL, out of reach of the reward functions' processes and the agents
    return asyncio.run(serve(cfg))


__all__ = ["reward_worker"]
