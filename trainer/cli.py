"""`rollq train` (against a running stack) and `rollq up` (everything on this machine; the default command)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from typing import Any

import msgspec

from protocol.config import ConfigError
from trainer.config import SECTION_KEYS, TrainConfig, load_config
from trainer.metrics import StepRecord

GOAL_LAST10 = 0.8  # the toy task's goal: mean reward of the last 10 steps ...
GOAL_RATIO = 3.0  # ... and that many times the first 10


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    keys = ", ".join(SECTION_KEYS)
    t = sub.add_parser("train", parents=[common], help="train against a running stack (Redis, engines, workers)",
                       epilog=f"settings (the config's `trainer` section, ROLLQ_TRAINER_<KEY>, KEY=VALUE): {keys}")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="trainer settings, e.g. steps=200 lr=1e-4")
    t.set_defaults(handler=run_train)

    u = sub.add_parser("up", parents=[common], help="everything on this machine: Redis (if none answers), reference "
                       "engines, workers and the trainer on the toy task (the default command)",
                       epilog=f"trainer settings (KEY=VALUE): {keys}")
    u.add_argument("--engines", type=int, default=1, help="reference engines (default 1)")
    u.add_argument("--workers", type=int, default=1, help="rollout worker processes (default 1)")
    u.add_argument("--concurrency", type=int, default=64, help="jobs each worker runs at once (default 64)")
    u.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="trainer settings, e.g. steps=50")
    u.set_defaults(handler=run_up)


def summarize(records: list[StepRecord]) -> dict[str, Any]:
    rewards = [r.reward_mean for r in records]
    first = statistics.fmean(rewards[:10]) if rewards else 0.0
    last = statistics.fmean(rewards[-10:]) if rewards else 0.0
    staleness: dict[str, int] = {}
    for r in records:
        for k, n in r.staleness_hist.items():
            staleness[k] = staleness.get(k, 0) + n
    return {
        "steps": len(records), "reward_first10": round(first, 4), "reward_last10": round(last, 4),
        "goal_met": bool(rewards) and last >= GOAL_LAST10 and last >= GOAL_RATIO * first,
        "trained_samples": records[-1].trained_samples if records else 0,
        "dropped": records[-1].dropped if records else {},
        "staleness_hist": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "pause_ms_median": round(statistics.median(r.pause_s for r in records) * 1000, 1) if records else 0.0,
    }


def _quiet_libraries() -> None:
    """A request line per engine call would bury the progress lines."""
    for name in ("httpx", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _fail(command: str, message: str) -> int:
    print(f"rollq {command}: {message}", file=sys.stderr)
    return 2


def run_train(args: argparse.Namespace) -> int:
    import uvloop

    try:
        cfg = load_config(args.config, overrides=args.overrides, redis_url=args.redis, run=args.run)
    except ConfigError as exc:
        return _fail("train", str(exc))
    _quiet_libraries()
    try:
        records = uvloop.run(train(cfg))
    except (ValueError, RuntimeError) as exc:  # a dataset that can't be read, no engine to update, ...
        return _fail("train", str(exc))
    summary = summarize(records)
    if not cfg.dataset.startswith("toy:"):
        del summary["goal_met"]  # the toy task's goal means nothing for another dataset
    print(msgspec.json.encode(summary).decode())
    return 0


async def train(cfg: TrainConfig) -> list[StepRecord]:
    """The trainer against an existing stack: engines from the config and the run's registry."""
    from engine.pool import EnginePool, PoolConfig
    from engine.registry import EngineRegistry
    from protocol.connection import redis_client
    from trainer.loop import Trainer

    redis = redis_client(cfg.redis_url)
    await redis.ping()  # fail now, in one line, when Redis is unreachable
    registry_client = redis_client(cfg.redis_url)
    pool = EnginePool(PoolConfig(urls=cfg.engines))
    pool.follow(EngineRegistry(registry_client, cfg.run))
    try:
        return await Trainer(cfg, redis, pool).run()
    finally:
        await pool.close()
        await redis.aclose()
        await registry_client.aclose()


def run_up(args: argparse.Namespace) -> int:
    import uvloop

    from trainer.up import StackError, up

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = args.run if args.run != "default" else f"up-{stamp}"  # a fresh run: repeated `up`s never share keys
    try:
        cfg = load_config(args.config, overrides=args.overrides, redis_url=args.redis, run=run,
                          defaults={"run_dir": f"runs/up-{stamp}"})
    except ConfigError as exc:
        return _fail("up", str(exc))
    for name in ("engines", "workers", "concurrency"):
        if getattr(args, name) < 1:
            return _fail("up", f"--{name} must be >= 1")
    print(f"rollq up: training {cfg.dataset} with the {cfg.model} model for {cfg.steps} steps "
          f"({cfg.groups_per_step} groups x {cfg.group_size} samples, max staleness {cfg.max_staleness}); "
          f"run directory {cfg.run_dir}", file=sys.stderr)
    started = time.monotonic()
    _quiet_libraries()
    try:
        records = uvloop.run(up(cfg, engines=args.engines, workers=args.workers, concurrency=args.concurrency,
                                redis_url=args.redis if args.redis_given else None))
    except (StackError, RuntimeError, ValueError) as exc:  # StackError: a part died; RuntimeError: nothing trains
        return _fail("up", str(exc))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C / SIGTERM: the stack was stopped on the way out
        print("rollq up: stopped; the run directory keeps what was done", file=sys.stderr)
        return 130
    summary = summarize(records)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["run_dir"] = cfg.run_dir
    toy = cfg.dataset.startswith("toy:")
    goal = ("; toy goal " + ("met" if summary["goal_met"] else "NOT met")) if toy else ""
    print(f"rollq up: mean reward {summary['reward_first10']:.3f} (first 10 steps) -> {summary['reward_last10']:.3f} "
          f"(last 10) in {summary['seconds']:.0f} s{goal}. Wrote {cfg.run_dir}/metrics.jsonl and "
          f"{cfg.run_dir}/plot.png", file=sys.stderr)
    print(msgspec.json.encode(summary).decode())
    return 0


__all__ = ["register", "run_train", "run_up", "summarize", "train"]
