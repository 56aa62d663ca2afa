"""Job classes measured: the shares a real `rollq worker` gives two backlogged classes, and how fast a high-priority
class overtakes a queued backlog.

    python -m bench.fair_share            # from the repo root (or: python bench/fair_share.py)
    python -m bench.fair_share --quick    # smoke run

Per row: the classes `train` and `ext` are defined (`rollq classes` semantics: weights, priority 0), both are filled
at the submission ratio before one worker subprocess (`--concurrency C`) starts, and every trajectory is read back.
The observed share is train's fraction of the jobs started (ordered by the trajectories' `started_at`) while both
classes still had jobs queued, i.e. up to the last start of the scarcer class. The priority row queues a backlog of
`train`, then submits `eval` (priority 10) once the worker is busy, and reports how many backlog jobs still started
after the first eval job did (at most the slots that were free) and the eval jobs' wait. The last line printed is a
JSON summary.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/fair_share.py`: the repository root on sys.path)

import argparse
import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import BenchError, delete_matching, print_summary, run_bench, start_redis, start_worker
from bench.results import add_results_arg, write_results
from rollq.local import Processes
from rollq.producer.classes import set_class
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import JobClass, Trajectory
from rollq.redis_client import redis_client

WORKFLOW = "bench.fair_share:Pause"


class Pause:
    """An episode of `data["ms"]` milliseconds (an engine call's stand-in) returning a small trajectory."""

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        await asyncio.sleep(data.get("ms", 1) / 1000)
        return {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "logprobs": [0.0] * 4, "versions": [-1] * 4}


def requests(job_class: str, count: int, ms: float, tag: str) -> list[JobRequest]:
    return [
        JobRequest(workflow=WORKFLOW, data={"ms": ms}, job_id=f"{tag}-{job_class}-{i}", job_class=job_class)
        for i in range(count)
    ]


async def collect(producer: Producer, expected: dict[str, int], timeout_s: float) -> list[Trajectory]:
    trajs = [t async for t in producer.wait_for(expected, timeout_s=timeout_s)]
    bad = [t for t in trajs if t.status != "ok"]
    if bad:
        raise BenchError(f"{len(bad)} jobs failed: {bad[0].error}")
    return trajs


async def share_row(
    url: str, procs: Processes, ratio: tuple[int, int], weights: tuple[float, float], few: int, args: argparse.Namespace
) -> dict[str, Any]:
    """train:ext submitted at `ratio` (the scarcer side `few` jobs), weights train:ext."""
    run = f"fair-{uuid.uuid4().hex[:8]}"
    redis = redis_client(url)
    try:
        await set_class(redis, run, JobClass(name="train", weight=weights[0]))
        await set_class(redis, run, JobClass(name="ext", weight=weights[1]))
        counts = {"train": few * ratio[0] // min(ratio), "ext": few * ratio[1] // min(ratio)}
        producer = Producer(redis, run)
        reqs = requests("train", counts["train"], args.ms, "s") + requests("ext", counts["ext"], args.ms, "s")
        await producer.submit_many(reqs)
        consumer = producer.consumer()
        await consumer.setup()
        worker = await start_worker(procs, redis, url, run, "--concurrency", str(args.concurrency))
        try:
            trajs = await collect(producer, {r.job_id or "": 1 for r in reqs}, args.timeout)
        finally:
            procs.stop(worker, grace_s=10)
        elapsed = max(t.finished_at for t in trajs) - min(t.started_at for t in trajs)
        order = [t.job_id.split("-")[1] for t in sorted(trajs, key=lambda t: t.started_at)]
        scarce = "train" if counts["train"] <= counts["ext"] else "ext"
        last = max(i for i, c in enumerate(order) if c == scarce)
        window = order[: last + 1]
        observed = window.count("train") / len(window)
        expected = weights[0] / sum(weights)
        return {
            "submitted_train_ext": f"{counts['train']}:{counts['ext']}",
            "weights_train_ext": f"{weights[0]:g}:{weights[1]:g}",
            "expected_train_share": round(expected, 3),
            "observed_train_share": round(observed, 3),
            "relative_error": round(abs(observed - expected) / expected, 3),
            "window_jobs": len(window),
            "jobs_per_s": round(len(order) / elapsed, 1),  # first start to last finish
        }
    finally:
        with contextlib.suppress(Exception):
            await delete_matching(redis, f"{RunKeys(run).prefix}:*")
        await redis.aclose()


async def priority_row(
    url: str, procs: Processes, backlog: int, urgent: int, args: argparse.Namespace
) -> dict[str, Any]:
    run = f"prio-{uuid.uuid4().hex[:8]}"
    redis = redis_client(url)
    try:
        await set_class(redis, run, JobClass(name="eval", priority=10))
        producer = Producer(redis, run)
        bulk = requests("train", backlog, args.ms, "p")
        await producer.submit_many(bulk)
        worker = await start_worker(procs, redis, url, run, "--concurrency", str(args.concurrency))
        try:
            keys = RunKeys(run)

            async def started() -> bool:  # let the worker get going
                return await redis.xlen(keys.jobs) <= backlog * 3 // 4

            await procs.wait_until(started, 30, "the worker to start the backlog", watch=worker, interval_s=0.005)
            evals = requests("eval", urgent, args.ms, "p")
            t_submit = time.time()
            await producer.submit_many(evals)
            trajs = await collect(producer, {r.job_id or "": 1 for r in [*bulk, *evals]}, args.timeout)
        finally:
            procs.stop(worker, grace_s=10)
        ordered = sorted(trajs, key=lambda t: t.started_at)
        first_eval = next(i for i, t in enumerate(ordered) if t.job_id.startswith("p-eval"))
        last_eval = max(i for i, t in enumerate(ordered) if t.job_id.startswith("p-eval"))
        overtaken = sum(1 for t in ordered[first_eval:] if t.job_id.startswith("p-train"))
        waits = sorted(t.started_at - t_submit for t in trajs if t.job_id.startswith("p-eval"))
        bulk_left = sum(1 for t in trajs if t.job_id.startswith("p-train") and t.started_at >= t_submit)
        return {
            "backlog": backlog,
            "eval_jobs": urgent,
            "bulk_queued_when_eval_arrived": bulk_left,
            "bulk_started_between_first_and_last_eval": sum(
                1 for t in ordered[first_eval : last_eval + 1] if t.job_id.startswith("p-train")
            ),
            "bulk_started_after_first_eval": overtaken,
            "eval_wait_p50_ms": round(waits[len(waits) // 2] * 1000, 1),
            "eval_wait_max_ms": round(waits[-1] * 1000, 1),
        }
    finally:
        with contextlib.suppress(Exception):
            await delete_matching(redis, f"{RunKeys(run).prefix}:*")
        await redis.aclose()


async def main(args: argparse.Namespace, procs: Processes, tmp: Path) -> None:
    url = args.redis or start_redis(procs, tmp)
    few = args.few
    rows = []
    for ratio, weights in [
        ((1, 10), (1.0, 1.0)),
        ((10, 1), (1.0, 1.0)),
        ((1, 10), (3.0, 1.0)),
        ((10, 1), (1.0, 3.0)),
        ((1, 10), (1.0, 3.0)),
        ((1, 10), (10.0, 1.0)),
    ]:
        rows.append(await share_row(url, procs, ratio, weights, few, args))
    prio = await priority_row(url, procs, few * 10, max(10, few // 4), args)
    print(f"{'submitted train:ext':>20} {'weights':>8} {'expected':>9} {'observed':>9} {'error':>6} {'window':>7}")
    for r in rows:
        print(
            f"{r['submitted_train_ext']:>20} {r['weights_train_ext']:>8} {r['expected_train_share']:>9.3f} "
            f"{r['observed_train_share']:>9.3f} {r['relative_error'] * 100:>5.1f}% {r['window_jobs']:>7}"
        )
    between = prio["bulk_started_between_first_and_last_eval"]
    print(
        f"priority: {prio['eval_jobs']} eval jobs (priority 10) submitted behind "
        f"{prio['bulk_queued_when_eval_arrived']} queued train jobs: {between} train jobs started while they "
        f"started; eval wait p50 {prio['eval_wait_p50_ms']} ms, max {prio['eval_wait_max_ms']} ms"
    )
    worst = max(r["relative_error"] for r in rows)
    summary = {
        "shares": rows,
        "priority": prio,
        "concurrency": args.concurrency,
        "episode_ms": args.ms,
        "worst_relative_error": worst,
        "targets": {"shares_within_10pct": worst <= 0.1},
    }
    print_summary(summary)
    write_results("fair_share", summary, args.results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=None, help="a running Redis (default: start one)")
    p.add_argument("--few", type=int, default=200, help="jobs of the scarcer class per row (default 200)")
    p.add_argument("--concurrency", type=int, default=32, help="the worker's --concurrency (default 32)")
    p.add_argument("--ms", type=float, default=2.0, help="episode length in milliseconds (default 2)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="smoke run: 60 jobs of the scarcer class")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.few = min(args.few, 60)
    return args


if __name__ == "__main__":
    cli = parse_args()
    sys.exit(run_bench(lambda procs, tmp: main(cli, procs, tmp), "rollq-fair-share-"))
