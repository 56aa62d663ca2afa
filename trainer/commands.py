"""`rollq train` (against a running stack), and the run summary `rollq up` (rollq.up) prints too."""

from __future__ import annotations

import logging
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from rollq.shield import shield_secrets
from rollq.trainer.config import TrainConfig
from rollq.trainer.metrics import EvalRecord, MetricsLog, StepRecord
from rollq.trainer.nothing_trains import NothingTrains

if TYPE_CHECKING:
    from rollq.trainer.policy import Policy

# A built-in task's goal: (mean reward of the last 10 steps at least, and that many times the first 10's; on a run
# under 20 steps, of its reward_window).
GOALS = {"toy:digits": (0.95, 3.0), "toy:add": (0.5, 3.0)}


REWARD_WINDOW = 10  # the summary compares the mean reward of the first and the last this many steps


def reward_window(steps: int) -> int:
    """Steps at each end of a run that the summary's reward comparison averages: 10, fewer on a run shorter than 20
    steps (half of it, so the two windows never overlap), and 1 (first step -> last step) on one of 2 or 3 steps."""
    return max(1, min(REWARD_WINDOW, steps // 2))


def reward_change(summary: dict[str, Any]) -> str:
    """The summary's reward comparison in words, naming the steps each side averages."""
    first, last, window = summary["reward_first10"], summary["reward_last10"], summary["reward_window"]
    if summary["steps"] < 2:
        return f"mean reward {last:.3f} (step 1)" if summary["steps"] else "no step trained"
    if window == 1:
        return f"mean reward {first:.3f} (step 1) -> {last:.3f} (step {summary['steps']})"
    return f"mean reward {first:.3f} (first {window} steps) -> {last:.3f} (last {window})"


def summarize(records: list[StepRecord], evals: list[EvalRecord] | None = None, dataset: str = "") -> dict[str, Any]:
    rewards = [r.reward_mean for r in records]
    window = reward_window(len(rewards))
    first = statistics.fmean(rewards[:window]) if rewards else 0.0
    last = statistics.fmean(rewards[-window:]) if rewards else 0.0
    staleness: dict[str, int] = {}
    for r in records:
        for k, n in r.staleness_hist.items():
            staleness[k] = staleness.get(k, 0) + n
    summary: dict[str, Any] = {
        "steps": len(records),
        # (named for 10 steps, as since the first runs; a run under 20 steps averages `reward_window` steps)
        "reward_first10": round(first, 4),
        "reward_last10": round(last, 4),
        "reward_window": window,
        "trained_samples": records[-1].trained_samples if records else 0,
        "dropped": records[-1].dropped if records else {},
        "staleness_hist": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "pause_ms_median": round(statistics.median(r.pause_s for r in records) * 1000, 1) if records else 0.0,
    }
    if dataset in GOALS:  # a goal means nothing for another dataset
        at_least, ratio = GOALS[dataset]
        summary["goal_met"] = bool(rewards) and last >= at_least and last >= ratio * first
    if evals:  # None: n/a, every sample of that evaluation failed (eval.jsonl has the count and the first error)
        summary["eval_before"] = _rounded(evals[0].reward_mean) if evals[0].step == 0 else None
        summary["eval_after"] = _rounded(evals[-1].reward_mean)
        summary["evals"] = [[e.step, _rounded(e.reward_mean)] for e in evals]
        summary["eval_failed"] = [[e.step, e.failed] for e in evals if e.failed]
    return summary


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def run_summary(cfg: TrainConfig, records: list[StepRecord]) -> dict[str, Any]:
    """summarize() with the run directory's held-out evaluations: what `rollq train` and `rollq up` print."""
    return summarize(records, MetricsLog(Path(cfg.directory)).read_evals(), cfg.dataset)


def quiet_libraries() -> None:
    """A request line per engine call would bury the progress lines."""
    for name in ("httpx", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _fail(command: str, message: str) -> int:
    print(f"rollq {command}: {message}", file=sys.stderr)
    return 2


def train(cfg: TrainConfig) -> int:
    """`rollq train`: the trainer against a running stack; prints a JSON summary line. With `nproc` above 1 it
    starts itself under torchrun (trainer/launch.py); under torchrun each process is one rank (trainer/ranks.py):
    rank 0 runs the loop below, the others follow it (trainer/follower.py)."""
    import uvloop

    from rollq.trainer.follower import follow
    from rollq.trainer.launch import launch
    from rollq.trainer.policy import Policy
    from rollq.trainer.ranks import join_ranks, torchrun_env

    shield_secrets()  # its engine admin key and Redis URL (rollq/shield.py); ranks read their config file
    if cfg.nproc > 1 and torchrun_env() is None:
        return launch(cfg)
    quiet_libraries()
    ranks = join_ranks(cfg.device, cfg.dist_timeout_s)
    try:
        policy = Policy(cfg, ranks)
        if not ranks.leader:
            follow(policy)
            return 0
        try:
            records = uvloop.run(run_trainer(cfg, policy))
        except NothingTrains as exc:  # samples keep failing or coming back empty
            _fail("train", str(exc))
            return NothingTrains.exit_code
        except (ValueError, RuntimeError) as exc:  # a dataset that can't be read, no engine to update, ...
            return _fail("train", str(exc))
        summary = run_summary(cfg, records)
        print(msgspec.json.encode(summary).decode())
        return 0
    finally:
        ranks.close()


async def run_trainer(cfg: TrainConfig, policy: Policy | None = None) -> list[StepRecord]:
    """The trainer against an existing stack: engines from the config and the run's registry. On N ranks, rank 0
    runs it with its `policy` and stops the other ranks when the run ends (when it fails they stop with it: their
    process group closes)."""
    from rollq.engine.registry import EngineRegistry, control_key
    from rollq.redis_client import redis_client
    from rollq.trainer.engines import engine_pool
    from rollq.trainer.loop import Trainer

    redis = redis_client(cfg.redis_url)
    await redis.ping()  # fail now, in one line, when Redis is unreachable
    registry_client = redis_client(cfg.redis_url)
    pool = engine_pool(cfg)
    # Only engines that registered with the trainer's keys join: a URL planted in Redis never gets them.
    key = control_key(cfg.engine_api_key, cfg.engine_admin_api_key)
    pool.follow(EngineRegistry(registry_client, cfg.run, fleet=cfg.fleet, key=key))
    try:
        records = await Trainer(cfg, redis, pool, policy=policy).run()
        if policy is not None:
            policy.stop_followers()
        return records
    finally:
        await pool.close()
        await redis.aclose()
        await registry_client.aclose()


__all__ = ["quiet_libraries", "reward_change", "reward_window", "run_summary", "run_trainer", "summarize", "train"]
