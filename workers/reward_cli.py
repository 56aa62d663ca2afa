"""`rollq reward-worker`: serves a run's remote reward calls (see workers.remote_rewards)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from workers.remote_rewards import RewardWorkerConfig, worker_settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("reward-worker", parents=[common],
                       help="run a reward worker for reward_mode=remote workflows (scale by starting more)")
    p.add_argument("--max-workers", type=int, default=2, metavar="N",
                   help="child processes per reward function, so rewards run at once (default 2)")
    p.add_argument("--timeout", type=float, default=15.0, metavar="S",
                   help="seconds one reward call may run before its process is killed (default 15)")
    p.add_argument("--max-jobs", type=int, default=None, metavar="N",
                   help="reward jobs taken from the queue at once (default: --max-workers)")
    p.set_defaults(handler=run_reward_worker)


async def _serve(cfg: RewardWorkerConfig) -> int:
    from arq.worker import Worker

    # Built inside the running loop: arq binds its SIGTERM/SIGINT handlers to the loop it finds.
    worker = Worker(**worker_settings(cfg))
    try:
        await worker.async_run()
    except asyncio.CancelledError:  # arq's signal handler cancels its main task: a normal stop
        pass
    finally:
        await worker.close()  # waits for cancelled jobs, then on_shutdown stops the reward children
    return 0


def run_reward_worker(args: argparse.Namespace) -> int:
    # Reward functions named by import path are looked up from the directory the worker was started in.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cfg = RewardWorkerConfig(redis_url=args.redis, run=args.run, max_workers=args.max_workers,
                                 timeout_seconds=args.timeout, max_jobs=args.max_jobs)
    except ValueError as exc:
        print(f"rollq reward-worker: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg))
