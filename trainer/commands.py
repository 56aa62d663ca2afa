"""`rollq train` (against a running stack) and `rollq up` (everything on this machine; the default command)."""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from rollq.trainer.config import TrainConfig, UpConfig
from rollq.trainer.metrics import EvalRecord, MetricsLog, StepRecord

# A built-in task's goal: (mean reward of the last 10 steps at least, and that many times the first 10's).
GOALS = {"toy:digits": (0.8, 3.0), "toy:add": (0.5, 3.0)}


def summarize(records: list[StepRecord], evals: list[EvalRecord] | None = None, dataset: str = "") -> dict[str, Any]:
    rewards = [r.reward_mean for r in records]
    first = statistics.fmean(rewards[:10]) if rewards else 0.0
    last = statistics.fmean(rewards[-10:]) if rewards else 0.0
    staleness: dict[str, int] = {}
    for r in records:
        for k, n in r.staleness_hist.items():
            staleness[k] = staleness.get(k, 0) + n
    summary: dict[str, Any] = {
        "steps": len(records),
        "reward_first10": round(first, 4),
        "reward_last10": round(last, 4),
        "trained_samples": records[-1].trained_samples if records else 0,
        "dropped": records[-1].dropped if records else {},
        "staleness_hist": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "pause_ms_median": round(statistics.median(r.pause_s for r in records) * 1000, 1) if records else 0.0,
    }
    if dataset in GOALS:  # a goal means nothing for another dataset
        at_least, ratio = GOALS[dataset]
        summary["goal_met"] = bool(rewards) and last >= at_least and last >= ratio * first
    if evals:
        summary["eval_before"] = round(evals[0].reward_mean, 4) if evals[0].step == 0 else None
        summary["eval_after"] = round(evals[-1].reward_mean, 4)
        summary["evals"] = [[e.step, round(e.reward_mean, 4)] for e in evals]
    return summary


def _run_summary(cfg: TrainConfig, records: list[StepRecord]) -> dict[str, Any]:
    return summarize(records, MetricsLog(Path(cfg.directory)).read_evals(), cfg.dataset)


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
    summary = _run_summary(cfg, records)
    print(msgspec.json.encode(summary).decode())
    return 0


async def run_trainer(cfg: TrainConfig) -> list[StepRecord]:
    """The trainer against an existing stack: engines from the config and the run's registry."""
    from rollq.engine.registry import EngineRegistry
    from rollq.redis_client import redis_client
    from rollq.trainer.engines import engine_pool
    from rollq.trainer.loop import Trainer

    redis = redis_client(cfg.redis_url)
    await redis.ping()  # fail now, in one line, when Redis is unreachable
    registry_client = redis_client(cfg.redis_url)
    pool = engine_pool(cfg)
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
    summary = _run_summary(cfg, records)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["run_dir"] = cfg.directory
    goal = ("; goal " + ("met" if summary["goal_met"] else "NOT met")) if "goal_met" in summary else ""
    held_out = ""
    if summary.get("eval_before") is not None:
        held_out = f"; held-out {summary['eval_before']:.3f} -> {summary['eval_after']:.3f}"
    print(
        f"rollq up: mean reward {summary['reward_first10']:.3f} (first 10 steps) -> {summary['reward_last10']:.3f} "
        f"(last 10) in {summary['seconds']:.0f} s{goal}{held_out}. Wrote {cfg.directory}/metrics.jsonl and "
        f"{cfg.directory}/plot.png",
        file=sys.stderr,
    )
    print(msgspec.json.encode(summary).decode())
    return 0


__all__ = ["run_trainer", "summarize", "train", "up"]
