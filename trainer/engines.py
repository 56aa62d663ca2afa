"""The trainer's engine pool, built from its settings (`rollq train` and `rollq up` both use it)."""

from __future__ import annotations

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.trainer.config import TrainConfig


def engine_pool(cfg: TrainConfig) -> EnginePool:
    """The trainer's engines (cfg.engine; registered ones join through `follow`), called with its engine keys: the
    admin key (default: the api key) on the control routes it drives (pause, weights, continue). A gateway among
    them (smg) is followed with its admin key: its engines take the control calls (engine/gateway.py). An SGLang
    engine's host agent (cfg.engine_agents, or its registry entry) prepares its weight deltas."""
    return EnginePool(
        PoolConfig(
            urls=cfg.engine,
            api_key=cfg.engine_api_key,
            admin_api_key=cfg.engine_admin_api_key,
            gateway_admin_api_key=cfg.gateway_admin_api_key,
            agent_urls=cfg.engine_agents,
        )
    )


__all__ = ["engine_pool"]
