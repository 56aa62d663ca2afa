"""Asynchronous vs synchronous RL on a long-tail workload: training samples consumed per second at max_staleness
eta = 2 against eta = 0 (synchronous: every step waits for its whole batch, and nothing generates while the trainer
trains), in the same run (JSON summary as the last line).

    python -m bench.async_rl            # from the repo root
    python -m bench.async_rl --quick    # smoke run

Set-up, shared by both variants: a redis-server, synthetic engines (tiny ChatML tokenizer; heavy-tailed output
lengths, Pareto(xmin, alpha) capped at max_new_tokens; a decode step of the engine's whole batch every
`token_latency` seconds, at most `max_running` requests per engine, so the engines behave like GPUs with a fixed
number of batch slots), `rollq worker` subprocesses running the built-in `rlvr` workflow, and the real trainer in
this process: the tiny model, GRPO + decoupled PPO on CPU, weights written and loaded by every engine each step.
Both variants get the same engines, workers, batch (groups x group size) and steps; variants alternate per round
and the figures are medians over rounds. Throughput counts steps after the first two (warm-up).
Target: eta=2 / eta=0 >= 2x (AReaL reports 2.77x at scale).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/async_rl.py`: the repository root on sys.path)

import argparse
import asyncio
import io
import statistics
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    BenchError,
    Procs,
    bench_env,
    free_port,
    print_summary,
    rollq_argv,
    run_bench,
    start_redis,
    start_worker,
)
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.redis_client import redis_client
from rollq.trainer.config import TrainConfig
from rollq.trainer.metrics import StepRecord

TARGET_SPEEDUP = 2.0
WARMUP_STEPS = 2


async def start_engines(procs: Procs, args: argparse.Namespace) -> list[str]:
    import httpx

    urls = []
    for _ in range(args.engines):
        port = free_port()
        proc = procs.start(
            "engine",
            [
                *rollq_argv(),
                "engine",
                "--backend",
                "synthetic",
                "--tokenizer",
                "tiny",
                "--sampled",
                "--port",
                str(port),
                "--length-dist",
                f"pareto:{args.xmin}:{args.alpha}",
                "--token-latency",
                str(args.token_latency),
                "--max-running",
                str(args.max_running),
                "--log-level",
                "WARNING",
            ],
            env=bench_env(),
        )
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=1) as http:
            for _ in range(300):
                if proc.poll() is not None:
                    raise BenchError(f"engine exited with {proc.returncode}:\n{procs.log_tail(proc)}")
                try:
                    if (await http.get(url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise BenchError(f"engine {url} did not come up in 30 s")
        urls.append(url)
    return urls


def throughput(records: list[StepRecord]) -> float:
    """Trained samples per second over the steps after the warm-up."""
    a, b = records[WARMUP_STEPS - 1], records[-1]
    return (b.trained_samples - a.trained_samples) / (b.elapsed_s - a.elapsed_s)


async def run_variant(
    url: str, procs: Procs, engines: list[str], tmp: Path, eta: int, args: argparse.Namespace
) -> dict[str, Any]:
    from rollq.trainer.loop import Trainer  # here, not at the top: `--help` does not load torch

    run = f"bench-eta{eta}-{uuid.uuid4().hex[:8]}"
    redis = redis_client(url)
    workers = []
    try:
        for _ in range(args.workers):
            workers.append(
                await start_worker(
                    procs,
                    redis,
                    url,
                    run,
                    "--concurrency",
                    str(args.concurrency),
                    *[a for e in engines for a in ("--engine", e)],
                )
            )
        cfg = TrainConfig(
            redis_url=url,
            run=run,
            run_dir=str(tmp / run),
            engine=engines,
            model="tiny",
            dataset="toy:digits",
            workflow="rlvr",
            workflow_kwargs={"reward_fn": "rollq.trainer.toy:digits_reward", "max_new_tokens": args.max_new_tokens},
            steps=args.steps,
            group_size=args.group_size,
            groups_per_step=args.groups,
            max_staleness=eta,
            lr=1e-4,
            seed=0,
        )
        pool = EnginePool(PoolConfig(urls=engines))
        try:
            records = await Trainer(cfg, redis, pool, progress=io.StringIO()).run()
        finally:
            await pool.close()
    finally:
        for w in workers:
            procs.stop(w)
        await redis.aclose()
    hist: dict[str, int] = {}
    for r in records[WARMUP_STEPS:]:
        for k, n in r.staleness_hist.items():
            hist[k] = hist.get(k, 0) + n
    steps = records[WARMUP_STEPS:]
    return {
        "eta": eta,
        "samples_per_s": throughput(records),
        "step_s_median": statistics.median(r.step_s for r in steps),
        "train_s_median": statistics.median(r.train_s for r in steps),
        "collect_s_median": statistics.median(r.collect_s for r in steps),
        "pause_ms_median": statistics.median(r.pause_s for r in steps) * 1000,
        "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "staleness_max": max(r.staleness_max for r in records),
        "dropped": records[-1].dropped,
        "ledger_ok": all(r.ledger_admitted <= r.ledger_limit for r in records),
    }


def print_report(rounds: list[dict[int, dict[str, Any]]], summary: dict[str, Any]) -> None:
    print(f"\nasync vs sync RL, long-tail workload ({summary['workload']})")
    print(
        "| variant | trained samples/s | step s (median) | train s | wait for batch s | pause ms "
        "| staleness of trained samples | dropped |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for eta in (2, 0):
        for i, r in enumerate(rnd[eta] for rnd in rounds):
            label = f"eta={eta} ({'async' if eta else 'sync'}), round {i + 1}"
            print(
                f"| {label} | {r['samples_per_s']:.1f} | {r['step_s_median']:.2f} | {r['train_s_median']:.2f} | "
                f"{r['collect_s_median']:.2f} | {r['pause_ms_median']:.0f} | {r['staleness_hist']} | "
                f"{r['dropped'] or 0} |"
            )
    print(
        f"\nspeedup eta=2 / eta=0 (median of rounds): {summary['speedup']:.2f}x (target >= {TARGET_SPEEDUP}x); "
        f"per round: {', '.join(f'{s:.2f}x' for s in summary['speedup_per_round'])}"
    )


async def amain(args: argparse.Namespace, procs: Procs, tmp: Path) -> dict[str, Any]:
    url = args.redis or start_redis(procs, tmp)
    engines = await start_engines(procs, args)
    rounds: list[dict[int, dict[str, Any]]] = []
    for i in range(args.rounds):
        order = (2, 0) if i % 2 == 0 else (0, 2)
        results = {}
        for eta in order:
            print(f"round {i + 1}: eta={eta} ...", file=sys.stderr, flush=True)
            results[eta] = await run_variant(url, procs, engines, tmp, eta, args)
            print(f"  {results[eta]['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
        rounds.append(results)
    per_round = [r[2]["samples_per_s"] / r[0]["samples_per_s"] for r in rounds]
    summary = {
        "workload": (
            f"{args.engines} synthetic engines x {args.max_running} slots, {args.token_latency * 1000:g} ms per "
            f"decode step, Pareto({args.xmin:g}, {args.alpha:g}) output lengths capped at "
            f"{args.max_new_tokens}; {args.workers} workers; B = {args.groups} groups x {args.group_size}; "
            f"{args.steps} steps"
        ),
        "async_samples_per_s": statistics.median(r[2]["samples_per_s"] for r in rounds),
        "sync_samples_per_s": statistics.median(r[0]["samples_per_s"] for r in rounds),
        "speedup": statistics.median(per_round),
        "speedup_per_round": per_round,
        "target": TARGET_SPEEDUP,
        "async_staleness_hist": rounds[-1][2]["staleness_hist"],
        "async_staleness_max": max(r[2]["staleness_max"] for r in rounds),
        "sync_staleness_max": max(r[0]["staleness_max"] for r in rounds),
        "dropped_async": [r[2]["dropped"] for r in rounds],
        "ledger_bound_held": all(r[eta]["ledger_ok"] for r in rounds for eta in (0, 2)),
    }
    summary["target_met"] = summary["speedup"] >= TARGET_SPEEDUP
    print_report(rounds, summary)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis", default=None, help="use this Redis instead of starting one")
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps, one round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--max-running", type=int, default=32, help="batch slots per engine")
    p.add_argument("--token-latency", type=float, default=0.005, help="seconds per decode step")
    p.add_argument("--xmin", type=float, default=16.0)
    p.add_argument("--alpha", type=float, default=1.2)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=128, help="jobs each worker runs at once")
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 6, 1
    if args.steps <= WARMUP_STEPS + 1:
        p.error(f"--steps must be > {WARMUP_STEPS + 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def run(procs: Procs, tmp: Path) -> None:
        summary = await amain(args, procs, tmp)
        print_summary(summary)

    return run_bench(run, "rollq-bench-async-")


if __name__ == "__main__":
    sys.exit(main())
