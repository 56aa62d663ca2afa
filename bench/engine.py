"""Engine-layer benchmarks (JSON summary as the last line):

(a) reference engine continuous batching vs sequential `model.generate` at concurrency 32 (tokens/s ratio, >= 5x);
(b) EnginePool overhead vs a bare SGLangClient on the synthetic engine (<= 5% at >= 1,000 requests/s): p50
    latency of both at a fixed 1,000 requests/s (open loop), plus saturation throughput and client CPU per request;
(c) pause -> update_weights -> resume across 4 strict engines (SGLang 0.5.23's control plane: /health_generate blocks
    while paused or updating, then 503) under load, with a 3 s weight load, per pause mode: control time excluding
    the load (<= 50 ms), evictions (0), lost or failed requests (0)  [bench/engine_control.py];
(d) prefix reuse in the reference engine (tiny model) on GRPO groups, n = 8, 256-token prompts, 64-token answers:
    prefill tokens computed and generated tokens/s, cache vs none (target >= 2x)  [bench/engine_prefix.py];
(e) weight update disk vs distributed (gloo process group) for the tiny model and a random-init model of
    SmolLM2-135M's shape: seconds and bytes moved  [bench/engine_weights.py].

  python -m bench.engine [--quick] [--skip a,b,c,d,e]
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/engine.py`: the repository root on sys.path)

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import print_summary
from bench.results import add_results_arg, write_results
from rollq.engine.client import SGLangClient
from rollq.engine.http import shared_http_session
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.types import ModelRequest, SamplingParams
from rollq.local import Processes, free_port


async def _drive(call, total: int, concurrency: int) -> tuple[float, float]:
    """(requests/s, client CPU µs per request) of `total` calls, `concurrency` at a time."""
    queue = iter(range(total))

    async def lane() -> None:
        for i in queue:
            await call(i)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0), 1e6 * (time.process_time() - c0) / total


async def _at_rate(call, total: int, rate: float) -> list[float]:
    """Open loop: start one call every 1/rate s (whether or not earlier ones finished); latency of each, seconds."""
    latencies: list[float] = []

    async def timed(i: int) -> None:
        t = time.perf_counter()
        await call(i)
        latencies.append(time.perf_counter() - t)

    tasks = []
    start = time.perf_counter()
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(i)))
    await asyncio.gather(*tasks)
    return latencies


async def bench_pool_overhead(requests: int, concurrency: int, rounds: int, rate: float = 1000.0) -> dict[str, Any]:
    """Saturation throughput (closed loop, `concurrency` lanes) and latency at a fixed `rate` (open loop)."""
    # The engine runs in its own process, as in production, so the client side is what is compared.
    port = free_port()
    logs = tempfile.TemporaryDirectory(prefix="rollq-bench-engine-")
    procs = Processes(Path(logs.name))
    argv = [sys.executable, "-m", "rollq.engine", "--backend", "synthetic", "--port", str(port), "--insecure-no-auth"]
    engine = procs.start("engine", argv)
    url = f"http://127.0.0.1:{port}"
    http = shared_http_session()
    client = SGLangClient(url, http)
    pool = EnginePool(PoolConfig(urls=[url]), http=http)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    try:
        up = "the synthetic engine"
        await procs.wait_until(lambda: client.health_generate(timeout=1), 30, up, watch=engine, interval_s=0.1)

        async def bare(i: int) -> None:
            await client.generate([1, 2, 3, i % 1000], params)

        async def pooled(i: int) -> None:
            await pool.agenerate(ModelRequest(input_ids=[1, 2, 3, i % 1000], sampling=params))

        await _drive(bare, 200, concurrency)  # warm up connections
        bare_runs, pool_runs = [], []
        bare_lat, pool_lat = [], []
        for _ in range(rounds):  # interleaved, so machine noise hits both alike
            bare_runs.append(await _drive(bare, requests, concurrency))
            pool_runs.append(await _drive(pooled, requests, concurrency))
            bare_lat += await _at_rate(bare, 2000, rate)
            pool_lat += await _at_rate(pooled, 2000, rate)
    finally:
        await pool.close()
        await http.close()
        procs.stop_all()
        logs.cleanup()
    bare_rps = statistics.median(r for r, _ in bare_runs)
    pool_rps = statistics.median(r for r, _ in pool_runs)
    bare_cpu = statistics.median(c for _, c in bare_runs)
    pool_cpu = statistics.median(c for _, c in pool_runs)
    # The engine subprocess shares the 2 cores with this process, so throughput swings from run to run; the
    # client-side CPU per request is the steadier measure of what the pool adds.
    bare_p50, pool_p50 = statistics.median(bare_lat), statistics.median(pool_lat)
    bare_mean, pool_mean = statistics.fmean(bare_lat), statistics.fmean(pool_lat)
    return {
        "rate_rps": rate,
        "bare_p50_ms": round(1000 * bare_p50, 3),
        "pool_p50_ms": round(1000 * pool_p50, 3),
        "bare_mean_ms": round(1000 * bare_mean, 3),
        "pool_mean_ms": round(1000 * pool_mean, 3),
        "latency_overhead_pct": round(100 * (pool_p50 / bare_p50 - 1), 2),
        "bare_rps": round(bare_rps, 1),
        "pool_rps": round(pool_rps, 1),
        "throughput_overhead_pct": round(100 * (bare_rps / pool_rps - 1), 2),
        "bare_cpu_us": round(bare_cpu, 1),
        "pool_cpu_us": round(pool_cpu, 1),
        "pool_added_cpu_us": round(pool_cpu - bare_cpu, 1),
        "overhead_pct": round(100 * (pool_cpu - bare_cpu) * bare_rps / 1e6, 2),
        "requests": requests,
        "concurrency": concurrency,
    }


async def bench_batching(quick: bool) -> dict[str, Any]:
    from bench import engine_batching

    args = engine_batching.parse_args(["--quick"] if quick else [])
    return await engine_batching.amain(args)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    skip = set(filter(None, args.skip.split(",")))
    out: dict[str, Any] = {}
    if "a" not in skip:
        out["a_batching"] = await bench_batching(args.quick)
    if "b" not in skip:
        out["b_pool_overhead"] = await bench_pool_overhead(1000 if args.quick else 4000, 64, 1 if args.quick else 5)
    if "c" not in skip:
        from bench.engine_control import control_plane

        out["c_control_plane"] = await control_plane(repeat=1 if args.quick else 3)
    if "d" not in skip:
        from bench.engine_prefix import prefix_reuse

        out["d_prefix_reuse"] = await prefix_reuse(repeat=3 if args.quick else 10)
    if "e" not in skip:
        from bench.engine_weights import disk_vs_distributed

        out["e_weight_update"] = await disk_vs_distributed(repeat=1 if args.quick else 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c,d,e")
    add_results_arg(p)
    args = p.parse_args()
    out = asyncio.run(amain(args))
    print()
    if "a_batching" in out:
        a = out["a_batching"]
        print(f"(a) continuous batching vs sequential generate: {json.dumps(a)[:300]}")
    if "b_pool_overhead" in out:
        b = out["b_pool_overhead"]
        print(
            f"(b) at {b['rate_rps']:,.0f} req/s: p50 latency bare {b['bare_p50_ms']:.3f} ms, pool "
            f"{b['pool_p50_ms']:.3f} ms -> overhead {b['latency_overhead_pct']:+.1f}% (target <= 5%)"
        )
        print(
            f"    saturation: bare client {b['bare_rps']:,.0f} req/s, {b['bare_cpu_us']:.0f} µs CPU/req | pool "
            f"{b['pool_rps']:,.0f} req/s, {b['pool_cpu_us']:.0f} µs CPU/req | "
            f"pool adds {b['pool_added_cpu_us']:.1f} µs "
            f"= {b['overhead_pct']:.1f}% of the bare request time (throughput ratio "
            f"{b['throughput_overhead_pct']:+.1f}%)"
        )
    if "c_control_plane" in out:
        from bench.engine_control import table as control_table

        print("(c) control plane against strict engines:\n" + control_table(out["c_control_plane"]))
    if "d_prefix_reuse" in out:
        d = out["d_prefix_reuse"]
        print(
            f"(d) prefix reuse ({d['model']}): generated tokens/s {d['speedup']:.2f}x with the cache (target >= 2x), "
            f"prefill tokens {d['prefill_ratio']:.1f}x fewer"
        )
    if "e_weight_update" in out:
        from bench.engine_weights import table as weights_table

        print("(e) weight update, disk vs distributed:\n" + weights_table(out["e_weight_update"]))
    targets = {}
    if "b_pool_overhead" in out:
        targets["pool_latency_overhead_at_1000rps<=5%"] = out["b_pool_overhead"]["latency_overhead_pct"] <= 5
        targets["pool_rps>=1000"] = out["b_pool_overhead"]["pool_rps"] >= 1000
    if "c_control_plane" in out:
        targets.update({f"c_{k}": v for k, v in out["c_control_plane"]["targets"].items()})
    if "d_prefix_reuse" in out:
        targets["d_prefix_gen_tok_s>=2x"] = out["d_prefix_reuse"]["speedup"] >= 2
    out["targets"] = targets
    print_summary(out)
    write_results("engine", out, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
