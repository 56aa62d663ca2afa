"""What rollout tracing costs: rollout throughput with tracing off, and on (every trace sampled, exported over OTLP/HTTP
to a loopback receiver), each against the same rollouts on a build with no tracing at all, in the same run (JSON
summary last).

The rollouts: a `rollq worker` subprocess (concurrency C) running rollq's `rlvr` workflow (the engine call and the
reward, each a span when traced) against a synthetic engine subprocess generating `--tokens` tokens per sample at
`--token-latency` seconds a step, fed by a Producer and read by a consumer in this process (the submit span when
traced); a measure is `--samples` samples, its throughput the steady state after the first `--warmup` samples (a
quarter by default: the worker's first episodes load its tokenizer), the warm-up's seconds and the whole measure's
throughput reported beside it. The three builds, interleaved round by round (`--rounds`, the median reported):

- none: the worker from the commit before tracing was added (`--baseline-ref`, default: the parent of the commit
  that added rollq/tracing.py), installed into a directory of its own and put first on the worker's PYTHONPATH;
- off: this build, no endpoint (the default);
- on: this build, `trace_endpoint` the receiver (`python -m rollq.trace_sink --count-only`, a subprocess), sample
  rate `--sample-rate` (default 1.0: every trace); the receiver's count of spans is checked against what the sampled
  samples make.

The worker's CPU per sample (from /proc) is reported for each: what tracing costs in CPU, whatever bounds the
throughput. By default generation bounds it, as in RL (a sample's tokens take the engine about a second, the worker
a few ms); `--stress` makes generation nearly free (2 ms a step), so the worker, engine, Redis and this process share
the 2 cores flat out and every CPU microsecond shows in the throughput (written as tracing-stress.json; with a
`--sample-rate` below 1, as tracing-stress-sampled.json: what the setting `trace_sample_rate` buys back).

  python -m bench.tracing [--stress] [--sample-rate P] [--samples N] [--rounds R] [--concurrency C]
                          [--token-latency S] [--tokens N]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/tracing.py`: the repository root on sys.path)

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.common import REPO, BenchError, bench_env, delete_matching, print_summary, proc_cpu_s, run_bench, start_redis
from bench.results import add_results_arg, write_results
from rollq.local import Processes, free_port
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.keys import RunKeys
from rollq.redis_client import redis_client
from rollq.tracing import Tracing
from rollq.up import engine_healthy

BUILDS = ("none", "off", "on")
SPANS_PER_SAMPLE = 5  # submit, attempt, episode, engine.generate, reward


def baseline_ref() -> str:
    """The parent of the commit that added rollq/tracing.py."""
    added = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", "rollq/tracing.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not added:
        raise BenchError("rollq/tracing.py is not committed yet: pass --baseline-ref")
    return f"{added[-1]}^"


def build_baseline(ref: str, tmp: Path) -> Path:
    """`ref`'s rollq installed into tmp/site (a git worktree of it, built with uv pip --target, no dependencies)."""
    tree, site = tmp / "baseline-tree", tmp / "baseline-site"
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-f", str(tree), ref], cwd=REPO, check=True, capture_output=True
    )
    try:
        uv = Path(sys.executable).parent / "uv"
        installer = (
            [str(uv), "pip", "install", "-p", sys.executable]
            if uv.exists()
            else [sys.executable, "-m", "pip", "install"]
        )
        subprocess.run(
            [*installer, "-q", "--no-deps", "--target", str(site), str(tree)], check=True, capture_output=True
        )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    return site


async def sink_count(url: str) -> int:
    async with httpx.AsyncClient(timeout=5) as client:
        return int((await client.get(f"{url}/count")).json()["spans"])


async def measure(
    procs: Processes, redis_url: str, engine: str, build: str, env: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    run = f"tr-{build}-{uuid.uuid4().hex[:8]}"
    redis = redis_client(redis_url)
    argv = [sys.executable, "-m", "rollq", "worker", "--redis", redis_url, "--run", run, "--engine", engine]
    worker = procs.start(
        f"worker-{build}", [*argv, "--concurrency", str(args.concurrency), "--log-level", "WARNING"], env=env
    )
    tracing = Tracing.disabled()
    try:
        await procs.wait_until(lambda: redis.zcard(RunKeys(run).workers), 60, "worker to register", watch=worker)
        if build == "on":  # the submit spans too, as a traced trainer makes them
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            tracing = Tracing.exporting(
                OTLPSpanExporter(endpoint=env["ROLLQ_TRACE_ENDPOINT"]), service="bench", sample_rate=args.sample_rate
            )
        producer = Producer(redis, run, tracing=tracing)
        consumer = producer.consumer(group="bench", name="bench")
        await consumer.setup()
        kwargs = {"reward_fn": "rollq.tasks.digits:digits_reward", "max_new_tokens": args.tokens, "tokenizer": "tiny"}
        requests = [
            JobRequest(
                workflow="rlvr", data={"prompt": "Write a number using digits only.", "id": i}, workflow_kwargs=kwargs
            )
            for i in range(args.samples)
        ]
        t0 = time.perf_counter()
        submit = asyncio.create_task(producer.submit_many(requests))
        got = bad = 0
        warm: tuple[float, float | None, int] | None = None  # (when, worker CPU, samples) once warmed up
        deadline = time.monotonic() + args.timeout
        while got < args.samples:
            if time.monotonic() > deadline:
                raise BenchError(f"{build}: {got} of {args.samples} samples in {args.timeout:g} s")
            procs.check(worker)
            batch = await consumer.read(count=512, block_ms=1000)
            got += len(batch)
            bad += sum(d.trajectory.status != "ok" for d in batch)
            await consumer.commit(batch)
            if warm is None and got >= args.warmup:
                warm = (time.perf_counter(), proc_cpu_s(worker.pid), got)
        end, cpu1 = time.perf_counter(), proc_cpu_s(worker.pid)
        await submit
        if bad:
            raise BenchError(f"{build}: {bad} samples did not finish ok")
        assert warm is not None
        steady = args.samples - warm[2]
        return {
            "samples_per_s": steady / (end - warm[0]),
            "warmup_s": warm[0] - t0,
            "whole_samples_per_s": args.samples / (end - t0),
            "worker_cpu_us_per_sample": None if warm[1] is None or cpu1 is None else (cpu1 - warm[1]) / steady * 1e6,
        }
    finally:
        await asyncio.to_thread(tracing.shutdown)
        procs.stop(worker, grace_s=10)  # SIGTERM: the worker exports what it buffered as it stops
        await delete_matching(redis, f"{RunKeys(run).prefix}:*")
        await redis.aclose()


async def bench(procs: Processes, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    redis_url = start_redis(procs, tmp)
    port, sink_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "rollq.engine", "--backend", "synthetic", "--port", str(port), "--tokenizer", "tiny"]
    argv += ["--token-latency", str(args.token_latency), "--length-dist", f"fixed:{args.tokens}"]
    argv.append("--insecure-no-auth")  # keyless on loopback: the workers' aborts go through as before
    engine_proc = procs.start("engine", argv, env=bench_env())
    sink_proc = procs.start(
        "sink", [sys.executable, "-m", "rollq.trace_sink", "--port", str(sink_port), "--count-only"], env=bench_env()
    )
    sink = f"http://127.0.0.1:{sink_port}"
    await procs.wait_until(lambda: engine_healthy(engine), 60, "engine healthy", watch=engine_proc)
    await procs.wait_until(lambda: engine_healthy(sink), 60, "trace receiver", watch=sink_proc)
    ref = args.baseline_ref or baseline_ref()
    site = await asyncio.to_thread(build_baseline, ref, tmp)
    base = bench_env()
    envs = {
        "none": {**base, "PYTHONPATH": os.pathsep.join([str(site), base["PYTHONPATH"]])},
        "off": base,
        "on": {**base, "ROLLQ_TRACE_ENDPOINT": f"{sink}/v1/traces", "ROLLQ_TRACE_SAMPLE_RATE": repr(args.sample_rate)},
    }
    results: dict[str, list[dict[str, Any]]] = {b: [] for b in BUILDS}
    spans_before = await sink_count(sink)
    for r in range(args.rounds):
        order = BUILDS[r % 3 :] + BUILDS[: r % 3]  # each build first in turn
        for build in order:
            results[build].append(await measure(procs, redis_url, engine, build, envs[build], args))
            print(f"round {r + 1} {build}: {results[build][-1]['samples_per_s']:.1f} samples/s", file=sys.stderr)
    spans = await sink_count(sink) - spans_before
    every = SPANS_PER_SAMPLE * args.samples * args.rounds  # what the samples make, every one traced
    received_share = spans / every
    # Each job is one sample, sampled or not at its submit: the share is binomial, its deviation under 0.004 here. A
    # share above the rate is a bug (spans of traces not sampled); below it, spans the SDK dropped: a worker making
    # spans faster than its export thread sends them drops what overflows its queue (OTEL_BSP_MAX_QUEUE_SIZE, 2048)
    # rather than slow the rollouts, and says so in its log. Reported, and a failure only past half.
    if received_share > args.sample_rate + 0.05 or received_share < args.sample_rate / 2:
        raise BenchError(f"the receiver got {spans} spans, the samples make {every} at sample rate {args.sample_rate}")

    def median(build: str, key: str) -> float | None:
        values = [m[key] for m in results[build] if m[key] is not None]
        return statistics.median(values) if values else None

    summary: dict[str, Any] = {
        "workload": "stress" if args.stress else "generation-bound",
        "baseline_ref": ref,
        "samples": args.samples,
        "warmup_samples": args.warmup,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "token_latency_s": args.token_latency,
        "tokens": args.tokens,
        "sample_rate": args.sample_rate,
        "spans_received": spans,
        "received_share": received_share,  # of every sample's spans: the sample rate, less what was dropped
        "builds": {
            b: {
                "samples_per_s": median(b, "samples_per_s"),
                "warmup_s": median(b, "warmup_s"),
                "whole_samples_per_s": median(b, "whole_samples_per_s"),
                "worker_cpu_us_per_sample": median(b, "worker_cpu_us_per_sample"),
                "each": [round(m["samples_per_s"], 1) for m in results[b]],
            }
            for b in BUILDS
        },
    }
    # Paired: each round's ratio to the round's own `none` (measured minutes apart, in the same phase of a machine
    # whose speed drifts), then the median over rounds.
    for b in ("off", "on"):
        ratios = [m["samples_per_s"] / n["samples_per_s"] for m, n in zip(results[b], results["none"], strict=True)]
        summary[f"{b}_vs_none"] = statistics.median(ratios)
        summary[f"{b}_vs_none_each"] = [round(r, 3) for r in ratios]
        whole = [
            m["whole_samples_per_s"] / n["whole_samples_per_s"]
            for m, n in zip(results[b], results["none"], strict=True)
        ]
        summary[f"{b}_vs_none_whole"] = statistics.median(whole)  # warm-up included: what startup adds
    summary["off_within_1pct"] = summary["off_vs_none"] >= 0.99
    summary["on_within_3pct"] = summary["on_vs_none"] >= 0.97
    return summary


def table(s: dict[str, Any]) -> str:
    rows = [
        "| build | samples/s (median) | each round | warm-up s | whole measure samples/s | worker CPU us/sample "
        "| / none, paired median (each round) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in BUILDS:
        m = s["builds"][b]
        cpu = m["worker_cpu_us_per_sample"]
        paired = "1" if b == "none" else f"{s[f'{b}_vs_none']:.3f} ({', '.join(map(str, s[f'{b}_vs_none_each']))})"
        rows.append(
            f"| {b} | {m['samples_per_s']:.1f} | {', '.join(map(str, m['each']))} | {m['warmup_s']:.2f} | "
            f"{m['whole_samples_per_s']:.1f} | {'-' if cpu is None else f'{cpu:.0f}'} | {paired} |"
        )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stress", action="store_true", help="generation nearly free: CPU-bound rollouts (see above)")
    p.add_argument("--sample-rate", type=float, default=1.0, help="share of traces sampled when on (default 1)")
    p.add_argument("--samples", type=int, help="samples per measure (default 2500; --stress 8000)")
    p.add_argument("--warmup", type=int, help="samples before the steady state is measured (default: a quarter)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the three builds (default 5; medians)")
    p.add_argument("--concurrency", type=int, default=64, help="the worker's concurrency (default 64)")
    p.add_argument("--token-latency", type=float, help="engine seconds per decode step (default 0.1; --stress 0.002)")
    p.add_argument("--tokens", type=int, help="tokens per sample (default 8; --stress 32)")
    p.add_argument("--baseline-ref", default="", help="git ref of the build with no tracing (default: see above)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a measure may take")
    add_results_arg(p)
    args = p.parse_args()
    if not 0 < args.sample_rate <= 1:
        p.error("--sample-rate must be in (0, 1]")
    args.samples = args.samples or (8000 if args.stress else 2500)
    args.warmup = args.samples // 4 if args.warmup is None else args.warmup
    if not 0 <= args.warmup < args.samples:
        p.error("--warmup must be below --samples")
    args.token_latency = args.token_latency if args.token_latency is not None else (0.002 if args.stress else 0.1)
    args.tokens = args.tokens or (32 if args.stress else 8)
    out: dict[str, Any] = {}

    async def run(procs: Processes, tmp: Path) -> None:
        out.update(await bench(procs, tmp, args))

    rc = run_bench(run, "rollq-bench-tracing-")
    if rc:
        return rc
    print(table(out))
    print_summary(out)
    name = "tracing-stress" if args.stress else "tracing"
    write_results(f"{name}-sampled" if args.sample_rate < 1 else name, out, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
