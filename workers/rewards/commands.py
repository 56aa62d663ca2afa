"""`rollq reward-worker`: serves a run's remote reward calls until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio

from rollq.module_paths import use_module_paths
from rollq.shield import shield_secrets
from rollq.workers.rewards.config import RewardWorkerConfig
from rollq.workers.rewards.worker import serve


def reward_worker(cfg: RewardWorkerConfig) -> int:
    # Reward functions named by import path come from the module_paths folders, never from the folder the worker
    # was started in (the allowlist still decides what may be imported).
    use_module_paths(cfg.module_paths)
    shield_secrets()  # its Redis URL, out of reach of the reward functions' processes and the agents
    return asyncio.run(serve(cfg))


__all__ = ["reward_worker"]
