"""Queue throughput with a run's queue in 1 vs K partitions, on one Redis and on a local Redis Cluster.

    python -m bench.partitions            # from the repo root (or: python bench/partitions.py)
    python -m bench.partitions --quick    # smoke run

The work item is bench/queue_throughput.py's: a job in, one 1,024-token trajectory out
(`bench.workflows:FixedTrajectory`), so what is measured is queueing, transport and encoding. Each configuration
gets a fresh run: `--workers` `rollq worker` subprocesses, and in this process a `Producer.submit_many` running
concurrently with the consumer that reads every partition's results and commits; every (job id, sample index) must
arrive exactly once.

Configurations: one redis-server with K = 1 (the baseline: rollq as it ran before partitions), then a six-node
Redis Cluster (three primaries with a replica each, created with `redis-cli --cluster create`) with K = 1 and each
K of `--partitions`. Reported per configuration: trajectories/s, the ratio to the baseline, and CPU per trajectory
of the workers, this process and the redis-servers (all primaries summed). On a machine with few cores every
redis-server competes with the workers and this process for them, so a cluster's extra shards add cost here
rather than capacity; the table says how the work spreads (per-primary CPU) as much as how fast it goes. The last
line printed is a JSON summary.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/partitions.py`: the repository root on sys.path)

import argparse
import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import BenchError, print_summary, proc_cpu_s, run_bench, start_redis, start_worker
from bench.results import add_results_arg, write_results
from bench.workflows import TOKENS
from rollq.config import with_query
from rollq.local import Processes, RedisCluster
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.keys import RunKeys, partition_of
from rollq.redis_client import redis_client

WORKFLOW = "bench.workflows:FixedTrajectory"


async def measure(url: str, pids: list[int], procs: Processes, args: argparse.Namespace, partitions: int) -> dict:
    """One fresh run of `args.jobs` jobs over `partitions` partitions; `pids`: the redis-servers (for their CPU)."""
    run = f"bench-{uuid.uuid4().hex[:10]}"
    redis = redis_client(url)
    workers = []
    try:
        producer = Producer(redis, run, partitions=partitions)
        await producer.partitions()  # sets the run's count before the workers read it
        for _ in range(args.workers):
            workers.append(await start_worker(procs, redis, url, run, "--concurrency", str(args.concurrency)))
        consumer = producer.consumer(group="trainer", name="bench")
        await consumer.setup()
        ids = [f"j{i}" for i in range(args.jobs)]
        spread = [0] * partitions
        for job_id in ids:
            spread[partition_of(job_id, partitions)] += 1
        requests = [JobRequest(workflow=WORKFLOW, data={"i": i}, job_id=job_id) for i, job_id in enumerate(ids)]
        seen: set[str] = set()
        duplicates = 0
        deadline = time.monotonic() + args.timeout

        async def consume() -> None:
            nonlocal duplicates
            while len(seen) < args.jobs:
                if time.monotonic() > deadline:
                    raise BenchError(f"only {len(seen)} of {args.jobs} trajectories arrived in {args.timeout:g} s")
                for w in workers:
                    procs.check(w)
                batch = await consumer.read(count=512, block_ms=500)
                for d in batch:
                    if d.trajectory.job_id in seen:
                        duplicates += 1
                    seen.add(d.trajectory.job_id)
                await consumer.commit(batch)

        def cpu() -> dict[str, float]:
            return {
                "workers": sum(proc_cpu_s(w.pid) or 0.0 for w in workers),
                "bench_process": time.process_time(),
                "redis": sum(proc_cpu_s(pid) or 0.0 for pid in pids),
            }

        redis_each0 = [proc_cpu_s(pid) or 0.0 for pid in pids]
        cpu0 = cpu()
        t0 = time.perf_counter()
        submitted, _ = await asyncio.wait_for(
            asyncio.gather(producer.submit_many(requests), consume()), args.timeout + 10
        )
        elapsed = time.perf_counter() - t0
        cpu1 = cpu()
        redis_each = [round((proc_cpu_s(pid) or 0.0) - c, 2) for pid, c in zip(pids, redis_each0, strict=True)]
        if len(submitted) != args.jobs or not all(s.admitted for s in submitted) or seen != set(ids) or duplicates:
            raise BenchError(f"K={partitions}: {len(set(ids) - seen)} missing, {duplicates} duplicates")
        return {
            "run": run,
            "partitions": partitions,
            "jobs_per_partition": spread,
            "seconds": round(elapsed, 3),
            "traj_per_s": round(args.jobs / elapsed, 1),
            "cpu_us_per_traj": {k: round((cpu1[k] - cpu0[k]) / args.jobs * 1e6, 1) for k in cpu0},
            "redis_cpu_s_per_server": redis_each,
        }
    finally:
        for w in workers:
            procs.stop(w, grace_s=10)
        await redis.aclose()


def start_cluster(tmp: Path) -> RedisCluster:
    """A six-node local cluster, closed by the caller."""
    return RedisCluster(node_timeout_ms=5000, directory=tmp / "cluster").start()


async def amain(args: argparse.Namespace, procs: Processes, tmp: Path) -> dict[str, Any]:
    rows: dict[str, dict] = {}
    url = start_redis(procs, tmp)
    probe = redis_client(url)
    server_pid = int((await probe.info("server"))["process_id"])
    await probe.aclose()
    rows["redis K=1"] = await measure(url, [server_pid], procs, args, 1)
    cluster = start_cluster(tmp)
    try:
        curl = with_query(cluster.url, {"cluster": "yes"})
        primaries = [n.proc.pid for n in cluster.primaries()]
        for k in [1, *args.partitions]:
            rows[f"cluster K={k}"] = await measure(curl, primaries, procs, args, k)
            keys = RunKeys(rows[f"cluster K={k}"]["run"])
            rows[f"cluster K={k}"]["shards_used"] = len({cluster.primary_for(keys.at(p).jobs).port for p in range(k)})
    finally:
        cluster.close()
    base = rows["redis K=1"]["traj_per_s"]
    for row in rows.values():
        row["vs_redis_k1"] = round(row["traj_per_s"] / base, 3)
    head = f"{'configuration':<16} {'traj/s':>9} {'vs base':>8} {'worker us':>10} {'bench us':>9} {'redis us':>9}"
    print(f"\n{head}  CPU s per redis-server (primaries)")
    for name, row in rows.items():
        c = row["cpu_us_per_traj"]
        print(
            f"{name:<16} {row['traj_per_s']:>9.1f} {row['vs_redis_k1']:>8.3f} {c['workers']:>10.1f} "
            f"{c['bench_process']:>9.1f} {c['redis']:>9.1f}  {row['redis_cpu_s_per_server']}"
        )
    return {
        "jobs": args.jobs,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "tokens_per_trajectory": TOKENS,
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.partitions", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000, help="trajectories per configuration (default 10000)")
    p.add_argument("--workers", type=int, default=2, help="rollq worker processes (default 2)")
    p.add_argument("--concurrency", type=int, default=128, help="each worker's concurrency (default 128)")
    p.add_argument(
        "--partitions", type=int, nargs="+", default=[3, 6], help="partition counts on the cluster (default 3 6)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration (default 300)")
    p.add_argument("--quick", action="store_true", help="smoke run: 500 jobs, K = 3 only")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.partitions = min(args.jobs, 500), [3]
    if args.jobs < 1 or args.workers < 1 or args.concurrency < 1 or min(args.partitions) < 2:
        p.error("--jobs, --workers, --concurrency must be >= 1 and every --partitions >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def run(procs: Processes, tmp: Path) -> None:
        summary = await amain(args, procs, tmp)
        print_summary(summary)
        write_results("partitions", summary, args.results, argv)

    return run_bench(run, "rollq-bench-partitions-")


if __name__ == "__main__":
    sys.exit(main())
