"""`rollq worker`: a rollout worker process serving one run until SIGTERM / SIGINT (which drain it)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import msgspec
import uvloop

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.registry import EngineRegistry, control_key
from rollq.module_paths import use_module_paths
from rollq.redis_client import redis_client, wait_for_redis
from rollq.shield import shield_secrets
from rollq.workers.agents.writable import AgentCanWrite, check_agents_cannot_write
from rollq.workers.chat_template import StopTextDecoder
from rollq.workers.config import WorkerConfig
from rollq.workers.metrics import WorkerMetrics
from rollq.workers.model_names import hub_offline
from rollq.workers.run_share import RunShare
from rollq.workers.worker import Worker

log = logging.getLogger("rollq.worker")


def engine_pool(cfg: WorkerConfig) -> EnginePool:
    """The worker's engines (--engine URLs; registered ones join through `follow`), called with its engine keys."""
    keys = PoolConfig(
        urls=cfg.engine,
        api_key=cfg.engine_api_key,
        admin_api_key=cfg.engine_admin_api_key,
        gateway_admin_api_key=cfg.gateway_admin_api_key,
    )
    return EnginePool(keys, decode=StopTextDecoder(cfg.tokenizer))


async def serve(cfg: WorkerConfig) -> int:
    await wait_for_redis(cfg.redis_url, cfg.wait_redis)
    # Engines: the static --engine URLs plus whatever registers in Redis for this run (joining and leaving live).
    pool = engine_pool(cfg)
    await pool.start()
    registry_client = redis_client(cfg.redis_url)
    # Only engines that registered with this worker's keys join: a URL planted in Redis never gets them.
    key = control_key(cfg.engine_api_key, cfg.engine_admin_api_key)
    pool.follow(EngineRegistry(registry_client, cfg.run, fleet=cfg.fleet, key=key))
    # One Worker per served run over the one pool; several share the concurrency (workers/run_share.py).
    share = RunShare(cfg.concurrency, cfg.weights()) if len(cfg.runs) > 1 else None
    per_run = [msgspec.structs.replace(cfg, run=run, also_serve=[], run_weight=[]) for run in cfg.runs]
    workers = [Worker(run_cfg, engine=pool, share=share) for run_cfg in per_run]
    worker = workers[0]
    metrics = WorkerMetrics(worker, pool).serve(cfg.metrics_port, cfg.metrics_host) if cfg.metrics_port else None
    loop = asyncio.get_running_loop()

    signals = 0

    def stop_all(sig: signal.Signals) -> None:
        # The first stops reading and drains (drain_grace); a second ends the grace: what runs is handed back now.
        nonlocal signals
        signals += 1
        what = f"stopping: running jobs get {cfg.drain_grace:g}s" if signals == 1 else "handing back running jobs now"
        log.info("%s received: %s", sig.name, what)
        for w in workers:
            w.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all, sig)
    try:
        await asyncio.gather(*(w.run() for w in workers))
    finally:
        if metrics is not None:
            metrics.close()
        for w in workers:
            await w.redis.aclose()
        await pool.close()
        await registry_client.aclose()
    return 0


def worker(cfg: WorkerConfig) -> int:
    # Workflows named by import path come from the module_paths folders, never from the folder the worker was
    # started in, which Python put first on sys.path (the allowlist still decides what may be imported).
    use_module_paths(cfg.module_paths)
    try:
        check_agents_cannot_write(cfg.allow, cfg.agent_user, cfg.environments().virtualenvs())
    except (ValueError, AgentCanWrite) as exc:
        print(f"rollq worker: {exc}", file=sys.stderr)
        return 2
    hub_offline(os.environ)  # before anything imports huggingface_hub; inherited by every process it starts
    shield_secrets()  # keeps the settings' secrets from the agents it runs (rollq/shield.py)
    return uvloop.run(serve(cfg))


__all__ = ["engine_pool", "serve", "shield_secrets", "worker"]
