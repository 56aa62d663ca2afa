"""`rollq worker`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import uvloop

from engine.pool import EnginePool, PoolConfig
from engine.registry import EngineRegistry
from protocol.keys import RunKeys
from protocol.connection import TRANSIENT_ERRORS, redis_client
from workers.config import WorkerConfig
from workers.worker import Worker

log = logging.getLogger("rollq.worker")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("worker", parents=[common], help="run a rollout worker (scale by starting more)")
    p.add_argument("--concurrency", type=int, default=64, help="jobs run at once (default 64)")
    p.add_argument("--name", default="", help="consumer name (default host-pid-random); reuse it to resume its pending jobs")
    p.add_argument("--engine", action="append", default=[], metavar="URL", help="inference engine URL (repeatable)")
    p.add_argument("--max-attempts", type=int, default=3, help="runs of a job before it is dead-lettered (default 3)")
    p.add_argument("--lease-ms", type=int, default=60_000, help="idle time after which a dead worker's job is reclaimed")
    p.add_argument("--drain-grace", type=float, default=30.0, help="seconds in-flight jobs get to finish on SIGTERM")
    p.add_argument("--wait-redis", type=float, default=0.0, metavar="S", help="wait up to S seconds for Redis at start")
    g = p.add_argument_group("agent workflows")
    g.add_argument("--tokenizer", default="tiny",
                   help="tokenizer + chat template of the agents' proxy: `tiny` or the served model's directory")
    g.add_argument("--agent-processes", type=int, default=4, help="subproc-mode agents running at once (default 4)")
    g.add_argument("--proxy-host", default="127.0.0.1", help="where the agents' OpenAI-compatible proxy listens")
    g.add_argument("--proxy-port", type=int, default=0, help="its port (default: a free one)")
    p.set_defaults(handler=run_worker)


async def _wait_for_redis(url: str, wait_s: float) -> None:
    client = redis_client(url, retries=0)
    deadline = asyncio.get_running_loop().time() + wait_s
    try:
        while True:
            try:
                await client.ping()
                return
            except TRANSIENT_ERRORS:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await client.aclose()


async def _serve(cfg: WorkerConfig, wait_s: float) -> int:
    await _wait_for_redis(cfg.redis_url, wait_s)
    # Engines: the static --engine URLs plus whatever registers in Redis for this run (joining and leaving live).
    pool = EnginePool(PoolConfig(urls=cfg.engine_urls))
    await pool.start()
    registry_client = redis_client(cfg.redis_url)
    pool.follow(EngineRegistry(registry_client, cfg.run))
    worker = Worker(cfg, engine=pool)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.run()
    finally:
        await worker.redis.aclose()
        await pool.close()
        await registry_client.aclose()
    return 0


def run_worker(args: argparse.Namespace) -> int:
    # Workflows named by import path are looked up from the directory the worker was started in, like arq/celery.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cfg = WorkerConfig(
            redis_url=args.redis,
            run=args.run,
            name=args.name,
            concurrency=args.concurrency,
            engine_urls=args.engine,
            max_attempts=args.max_attempts,
            lease_idle_ms=args.lease_ms,
            drain_grace_s=args.drain_grace,
            tokenizer=args.tokenizer,
            agent_processes=args.agent_processes,
            proxy_host=args.proxy_host,
            proxy_port=args.proxy_port,
        )
        RunKeys(args.run)
    except ValueError as exc:
        print(f"rollq worker: {exc}", file=sys.stderr)
        return 2
    return uvloop.run(_serve(cfg, args.wait_redis))
