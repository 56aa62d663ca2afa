"""`rollq train` (against a running stack) and `rollq up` (everything on this machine, the default command)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import msgspec
import uvloop

from trainer.config import load_config

GOAL_LAST10 = 0.8
GOAL_RATIO = 3.0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("train", parents=[common], help="train against a running stack (engines, workers, Redis)")
    t.add_argument("--config", default=None, metavar="FILE", help="YAML config (ROLLQ_* env and KEY=VALUE override it)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. steps=100 lr=1e-4")
    t.set_defaults(handler=run_train)

    u = sub.add_parser("up", parents=[common], help="run everything here: redis (if none answers), reference "
                       "engines, workers and the trainer on the toy task (the default command)")
    u.add_argument("--config", default=None, metavar="FILE")
    u.add_argument("--engines", type=int, default=1, help="reference engines (default 1)")
    u.add_argument("--workers", type=int, default=1, help="rollout worker processes (default 1)")
    u.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    u.set_defaults(handler=run_up)


def _config(args: argparse.Namespace, **defaults: Any):
    overrides = [f"{k}={v}" for k, v in defaults.items()] + list(args.overrides)
    if args.redis:
        overrides.insert(0, f"redis_url={args.redis}")
    if args.run != "default":
        overrides.insert(0, f"run={args.run}")
    return load_config(args.config, overrides=overrides)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [r["reward_mean"] for r in records]
    first = statistics.fmean(rewards[:10]) if rewards else 0.0
    last = statistics.fmean(rewards[-10:]) if rewards else 0.0
    return {"steps": len(records), "reward_first10": round(first, 4), "reward_last10": round(last, 4),
            "goal_met": bool(rewards) and last >= GOAL_LAST10 and last >= GOAL_RATIO * first,
            "dropped_samples": records[-1]["dropped_samples"] if records else 0,
            "staleness_max": max((r["staleness_max"] for r in records), default=0)}


def run_train(args: argparse.Namespace) -> int:
    from engine.pool import EnginePool, PoolConfig
    from engine.registry import EngineRegistry
    from protocol.connection import redis_client
    from trainer.loop import Trainer

    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"rollq train: {exc}", file=sys.stderr)
        return 2

    async def main() -> list[dict[str, Any]]:
        redis = redis_client(cfg.redis_url)
        pool = EnginePool(PoolConfig(urls=cfg.engines))
        registry_client = redis_client(cfg.redis_url)
        pool.follow(EngineRegistry(registry_client, cfg.run))
        try:
            return await Trainer(cfg, redis, pool).run()
        finally:
            await pool.close()
            await redis.aclose()
            await registry_client.aclose()

    records = uvloop.run(main())
    print(msgspec.json.encode(summarize(records)).decode())
    return 0


def run_up(args: argparse.Namespace) -> int:
    from trainer.up import up

    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        cfg = _config(args, run_dir=f"runs/up-{stamp}", run=f"up-{stamp}")
    except ValueError as exc:
        print(f"rollq up: {exc}", file=sys.stderr)
        return 2
    print(f"rollq up: training {cfg.dataset} with the {cfg.model} model for {cfg.steps} steps; run directory "
          f"{cfg.run_dir}", file=sys.stderr)
    started = time.monotonic()
    try:
        records = uvloop.run(up(cfg, engines=args.engines, workers=args.workers,
                                redis_url=args.redis))
    except RuntimeError as exc:
        print(f"rollq up: {exc}", file=sys.stderr)
        return 1
    summary = summarize(records)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["run_dir"] = cfg.run_dir
    print(f"rollq up: reward {summary['reward_first10']:.3f} (first 10 steps) -> {summary['reward_last10']:.3f} "
          f"(last 10) in {summary['seconds']:.0f} s; goal {'met' if summary['goal_met'] else 'NOT met'}; "
          f"{cfg.run_dir}/metrics.jsonl, {cfg.run_dir}/plot.png", file=sys.stderr)
    print(msgspec.json.encode(summary).decode())
    return 0 if summary["goal_met"] else 1


__all__ = ["register", "run_train", "run_up", "summarize"]
