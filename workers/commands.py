"""`rollq worker`: a rollout worker process serving one run until SIGTERM / SIGINT (which drain it)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import uvloop

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.registry import EngineRegistry
from rollq.redis_client import redis_client, wait_for_redis
from rollq.workers.chat_template import StopTextDecoder
from rollq.workers.config import WorkerConfig
from rollq.workers.metrics import WorkerMetrics
from rollq.workers.worker import Worker


async def serve(cfg: WorkerConfig) -> int:
    await wait_for_redis(cfg.redis_url, cfg.wait_redis)
    # Engines: the static --engine URLs plus whatever registers in Redis for this run (joining and leaving live).
    pool = EnginePool(PoolConfig(urls=cfg.engine), decode=StopTextDecoder(cfg.tokenizer))
    await pool.start()
    registry_client = redis_client(cfg.redis_url)
    pool.follow(EngineRegistry(registry_client, cfg.run))
    worker = Worker(cfg, engine=pool)
    metrics = WorkerMetrics(worker, pool).serve(cfg.metrics_port) if cfg.metrics_port else None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.run()
    finally:
        if metrics is not None:
            metrics.close()
        await worker.redis.aclose()
        await pool.close()
        await registry_client.aclose()
    return 0


def worker(cfg: WorkerConfig) -> int:
    # Workflows named by import path are looked up from the directory the worker was started in, like arq/celery
    # (the allowlist still decides what may be imported).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return uvloop.run(serve(cfg))


__all__ = ["serve", "worker"]
