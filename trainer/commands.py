"""`rollq train` (against a running stack) and `rollq up` (everything on this machine; the default command)."""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time
from typing import Any

import msgspec

from rollq.trainer.config import TrainConfig, UpConfig
from rollq.trainer.metrics import StepRecord

GOAL_LAST10 = 0.8  # the toy task's goal: mean reward of the last 10 steps ...
GOAL_RATIO = 3.0  # ... and that many times the first 10


def summarize(records: list[StepRecord]) -> dict[str, Any]:
    rewards = [r.reward_mean for r in records]
    first = statistics.fmean(rewards[:10]) if rewards else 0.0
    last = statistics.fmean(rewards[-10:]) if rewards else 0.0
    staleness: dict[str, int] = {}
    for r in records:
        for k, n in r.staleness_hist.items():
            staleness[k] = staleness.get(k, 0) + n
    return {
        "steps": len(records),
        "reward_first10": round(first, 4),
        "reward_last10": round(last, 4),
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


def train(cfg: TrainConfig) -> int:
    """`rollq train`: the trainer against a running stack; prints a JSON summary line."""
    import uvloop

    _quiet_libraries()
    try:
        records = uvloop.run(run_trainer(cfg))
    except (ValueError, RuntimeError) as exc:  # a dataset that can't be read, no engine to update, ...
        return _fail("train", str(exc))
    summary = summarize(records)
    if not cfg.dataset.startswith("toy:"):
        del summary["goal_met"]  # the toy task's goal means nothing for another dataset
    print(msgspec.json.encode(summary).decode())
    return 0


async def run_trainer(cfg: TrainConfig) -> list[StepRecord]:
    """The trainer against an existing stack: engines from the config and the run's registry."""
    from rollq.engine.pool import EnginePool, PoolConfig
    from rollq.engine.registry import EngineRegistry
    from rollq.redis_client import redis_client
    from rollq.trainer.loop import Trainer

    redis = redis_client(cfg.redis_url)
    await redis.ping()  # fail now, in one line, when Redis is unreachable
    registry_client = redis_client(cfg.redis_url)
    pool = EnginePool(PoolConfig(urls=cfg.engine))
    pool.follow(EngineRegistry(registry_client, cfg.run))
    try:
        return await Trainer(cfg, redis, pool).run()
    finally:
        await pool.close()
        await redis.aclose()
        await registry_client.aclose()


def up(stack: UpConfig, cfg: TrainConfig) -> int:
    """`rollq up` (and plain `rollq`): the whole stack on this machine, training `cfg`."""
    import uvloop

    from rollq.trainer.up import StackError, run_stack

    if cfg.run == "default":  # a fresh run: repeated `up`s never share keys
        cfg = msgspec.structs.replace(cfg, run=f"up-{time.strftime('%Y%m%d-%H%M%S')}")
    print(
        f"rollq up: training {cfg.dataset} with the {cfg.model} model for {cfg.steps} steps "
        f"({cfg.groups_per_step} groups x {cfg.group_size} samples, max staleness {cfg.max_staleness}); "
        f"run directory {cfg.directory}",
        file=sys.stderr,
    )
    started = time.monotonic()
    _quiet_libraries()
    try:
        records = uvloop.run(run_stack(cfg, stack))
    except (StackError, RuntimeError, ValueError) as exc:  # StackError: a part died; RuntimeError: nothing trains
        return _fail("up", str(exc))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C / SIGTERM: the stack was stopped on the way out
        print("rollq up: stopped; the run directory keeps what was done", file=sys.stderr)
        return 130
    summary = summarize(records)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["run_dir"] = cfg.directory
    toy = cfg.dataset.startswith("toy:")
    goal = ("; toy goal " + ("met" if summary["goal_met"] else "NOT met")) if toy else ""
    print(
        f"rollq up: mean reward {summary['reward_first10']:.3f} (first 10 steps) -> {summary['reward_last10']:.3f} "
        f"(last 10) in {summary['seconds']:.0f} s{goal}. Wrote {cfg.directory}/metrics.jsonl and "
        f"{cfg.directory}/plot.png",
        file=sys.stderr,
    )
    print(msgspec.json.encode(summary).decode())
    return 0


__all__ = ["run_trainer", "summarize", "train", "up"]
