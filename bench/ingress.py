"""The HTTP ingress: how fast it accepts jobs, and how soon a client hears of the first result.

    python -m bench.ingress            # from the repo root (or: python bench/ingress.py)
    python -m bench.ingress --quick    # smoke run

Set-up: a redis-server and one `rollq ingress` subprocess (uvloop, one tenant).

- accept: batch POSTs of `--batch` jobs (n=1, a tiny workflow, ~100-byte data each) from this process, `--clients`
  connections at a time, no workers running: what is measured is validation, encoding, the all-or-nothing
  INGRESS_SUBMIT script and the HTTP round trip. Request bodies are encoded before the clock starts. Target
  >= 5,000 jobs/s.
- latency: a synthetic engine (`rollq engine --backend synthetic`) and one `rollq worker`; one job at a time
  (a 16-token generation), timed from the POST to the first `sample` event on its SSE stream (opened right after
  the POST answered; events are kept in Redis, so none is missed). p50 / p99.

The last line printed is a JSON summary.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/ingress.py`: the repository root on sys.path)

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.common import (
    BenchError,
    bench_env,
    delete_matching,
    print_summary,
    proc_cpu_s,
    rollq_argv,
    run_bench,
    start_redis,
    start_worker,
)
from bench.results import add_results_arg, write_results
from rollq.engine.types import ModelRequest, SamplingParams
from rollq.local import Processes, free_port
from rollq.protocol.keys import RunKeys
from rollq.redis_client import redis_client

TARGET_ACCEPT = 5000.0
TOKEN = "bench-token"
WORKFLOW = "bench.ingress:Generate"


class Generate:
    """One short generation on the worker's engine pool (the latency part's workflow)."""

    async def arun_episode(self, engine: Any, data: Any) -> dict[str, Any]:
        prompt = [101 + (i % 50) for i in range(8)]
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16)))
        out = resp.output_tokens
        return {
            "input_ids": prompt + out,
            "loss_mask": [0] * len(prompt) + [1] * len(out),
            "logprobs": [0.0] * len(prompt) + list(resp.output_logprobs),
            "versions": [-1] * len(prompt) + list(resp.output_versions),
            "reward": 1.0,
        }


async def wait_http(url: str, proc: Any, procs: Processes, what: str, timeout_s: float = 30.0) -> None:
    """Until `url` answers 200 (ChildExited with its log if `proc` dies first)."""
    async with httpx.AsyncClient() as client:

        async def answers() -> bool:
            try:
                return (await client.get(url, timeout=1)).status_code == 200
            except httpx.HTTPError:
                return False

        await procs.wait_until(answers, timeout_s, f"{what} to answer {url}", watch=proc)


def batch_body(batch: int, start: int) -> bytes:
    jobs = [
        {"workflow": "bench.workflows:FixedTrajectory", "job_id": f"j{start + i}", "data": {"prompt": "x" * 80, "i": i}}
        for i in range(batch)
    ]
    return msgspec.json.encode({"jobs": jobs})


async def measure_accept(base: str, jobs: int, batch: int, clients: int, ingress_pid: int) -> dict[str, Any]:
    bodies = [batch_body(batch, k * batch) for k in range(jobs // batch)]
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    accepted = 0
    latencies: list[float] = []

    async def client() -> None:
        nonlocal accepted
        async with httpx.AsyncClient(timeout=60) as http:
            while not queue.empty():
                body = queue.get_nowait()
                t0 = time.perf_counter()
                resp = await http.post(f"{base}/v1/jobs", content=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                if resp.status_code != 202:
                    raise BenchError(f"POST answered {resp.status_code}: {resp.text[:300]}")
                accepted += sum(j["admitted"] for j in resp.json()["jobs"])

    async with httpx.AsyncClient() as warm:  # one small request so connection set-up is not timed
        await warm.post(f"{base}/v1/jobs", content=batch_body(1, 10**9), headers=headers)
    cpu0 = proc_cpu_s(ingress_pid)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    cpu1 = proc_cpu_s(ingress_pid)
    if accepted != len(bodies) * batch:
        raise BenchError(f"{accepted} of {len(bodies) * batch} jobs admitted")
    latencies.sort()
    return {
        "jobs": accepted,
        "batch": batch,
        "clients": clients,
        "seconds": round(wall, 3),
        "jobs_per_s": round(accepted / wall, 1),
        "post_p50_ms": round(statistics.median(latencies) * 1000, 2),
        "ingress_cpu_ms_per_1k_jobs": None
        if cpu0 is None or cpu1 is None
        else round((cpu1 - cpu0) / accepted * 1e6, 1),
        "target_jobs_per_s": TARGET_ACCEPT,
        "meets_target": accepted / wall >= TARGET_ACCEPT,
    }


async def first_event_s(http: httpx.AsyncClient, base: str, headers: dict[str, str]) -> float:
    job_id = uuid.uuid4().hex
    body = msgspec.json.encode({"workflow": WORKFLOW, "job_id": job_id, "data": {}})
    t0 = time.perf_counter()
    resp = await http.post(f"{base}/v1/jobs", content=body, headers={**headers, "Content-Type": "application/json"})
    if resp.status_code != 202:
        raise BenchError(f"POST answered {resp.status_code}: {resp.text[:300]}")
    async with http.stream("GET", f"{base}/v1/jobs/{job_id}/events", headers=headers) as stream:
        async for line in stream.aiter_lines():
            if line == "event: sample":
                return time.perf_counter() - t0
            if line.startswith("event: ") and line != "event: sample":
                raise BenchError(f"unexpected {line!r} before the first sample")
    raise BenchError("the event stream ended without a sample")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure_latency(base: str, samples: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(3):  # warm-up: the worker builds the workflow, the pool finds the engine
            await first_event_s(http, base, headers)
        times = [await first_event_s(http, base, headers) for _ in range(samples)]
    return {
        "samples": samples,
        "p50_ms": round(pct(times, 0.5) * 1000, 2),
        "p99_ms": round(pct(times, 0.99) * 1000, 2),
        "max_ms": round(max(times) * 1000, 2),
    }


async def amain(args: argparse.Namespace, url: str, procs: Processes) -> dict[str, Any]:
    run = f"bench-ingress-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = bench_env() | {
        "ROLLQ_REDIS_URL": url,
        "ROLLQ_RUN": run,
        "ROLLQ_INGRESS_PORT": str(port),
        "ROLLQ_INGRESS_TOKENS": f"{{{TOKEN}: bench}}",
        "ROLLQ_INGRESS_MAX_BATCH": str(max(args.batch, 1000)),
        "ROLLQ_INGRESS_RETENTION": "600",
    }
    ingress = procs.start("rollq-ingress", [*rollq_argv(), "ingress", "--log-level", "WARNING"], env=env)
    base = f"http://127.0.0.1:{port}"
    await wait_http(f"{base}/healthz", ingress, procs, "rollq ingress")
    redis = redis_client(url)
    try:
        accept = await measure_accept(base, args.jobs, args.batch, args.clients, ingress.pid)
        await delete_matching(redis, f"{RunKeys(run).prefix}:*")  # the accepted jobs never run
        engine_port = free_port()
        engine = procs.start(
            "rollq-engine",
            [*rollq_argv(), "engine", "--backend", "synthetic", "--port", str(engine_port), "--log-level", "WARNING"]
            + ["--insecure-no-auth"],  # keyless on loopback: the workers' aborts go through as before
            env=bench_env(),
        )
        engine_url = f"http://127.0.0.1:{engine_port}"
        await wait_http(f"{engine_url}/health", engine, procs, "rollq engine")
        await start_worker(procs, redis, url, run, "--engine", engine_url)
        latency = await measure_latency(base, args.samples)
    finally:
        await delete_matching(redis, f"{RunKeys(run).prefix}:*")
        await redis.aclose()
    summary = {"bench": "ingress", "cpus": os.cpu_count(), "accept": accept, "first_event": latency}
    print(
        f"accept: {accept['jobs_per_s']:.0f} jobs/s ({accept['jobs']} jobs in batches of {accept['batch']}, "
        f"{accept['clients']} clients; target >= {TARGET_ACCEPT:.0f}: {'met' if accept['meets_target'] else 'MISSED'})"
    )
    print(
        f"POST -> first SSE event: p50 {latency['p50_ms']} ms, p99 {latency['p99_ms']} ms ({latency['samples']} jobs)"
    )
    print_summary(summary)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ingress", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: fewer jobs and samples")
    p.add_argument("--jobs", type=int, default=50_000, help="jobs accepted in the accept part")
    p.add_argument("--batch", type=int, default=500, help="jobs per POST")
    p.add_argument("--clients", type=int, default=2, help="concurrent HTTP clients in the accept part")
    p.add_argument("--samples", type=int, default=200, help="jobs timed in the latency part")
    p.add_argument("--redis", default=None, help="use this Redis instead of starting one")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.samples = min(args.jobs, 5_000), min(args.samples, 30)
    if args.jobs < args.batch:
        p.error("--jobs must be at least --batch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def run(procs: Processes, tmp: Path) -> None:
        summary = await amain(args, args.redis or start_redis(procs, tmp), procs)
        write_results("ingress", summary, args.results, argv)

    return run_bench(run, "rollq-bench-ingress-")


if __name__ == "__main__":
    sys.exit(main())
