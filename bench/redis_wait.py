"""What WAIT costs the trainer's writes on a Redis Cluster: a ledger write (ADMIT) and an ack of trained samples
(COMMIT of one group), each without and with `redis_wait_replicas: 1`, on a local six-node cluster.

    python -m bench.redis_wait            # from the repo root (or: python bench/redis_wait.py)
    python -m bench.redis_wait --quick    # smoke run

The cluster is rollq.local.RedisCluster (three primaries, a replica each, all on this machine). The two variants
take turns in rounds of `--round` calls, so both see the same machine; each call is timed alone (one at a time, as
the trainer's ledger writes are). Reported per write and variant: p50, p90, p99 and mean latency in ms, and the
WAIT variant's ratio to the plain one (baseline); WAITs that came back short are counted (they should be none). The
last line printed is a JSON summary.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/redis_wait.py`: the repository root on sys.path)

import argparse
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import print_summary, run_bench
from bench.results import add_results_arg, write_results
from rollq.config import with_query
from rollq.local import Processes, RedisCluster
from rollq.producer.results import ResultConsumer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.messages import Sequence, Trajectory
from rollq.redis_client import ReplicaWait, redis_client
from rollq.trainer.ledger import StalenessLedger


def stats(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)

    def at(q: float) -> float:
        return round(ms[min(len(ms) - 1, int(q * len(ms)))], 3)

    return {"p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "mean_ms": round(statistics.fmean(ms), 3)}


async def amain(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cluster = RedisCluster(node_timeout_ms=5000, directory=tmp / "cluster").start()
    client = redis_client(with_query(cluster.url, {"cluster": "yes"}))
    try:
        run = f"bench-{uuid.uuid4().hex[:10]}"
        keys = RunKeys(run)
        wait = ReplicaWait(client, 1, args.timeout_ms)
        ledgers = {
            "plain": StalenessLedger(client, run, batch_samples=10**9, max_staleness=0),
            "wait": StalenessLedger(client, run, batch_samples=10**9, max_staleness=0, wait=wait),
        }
        await ledgers["plain"].reset()
        consumers = {
            "plain": ResultConsumer(client, keys.results, group="trainer", name="bench"),
            "wait": ResultConsumer(client, keys.results, group="trainer", name="bench", wait=wait),
        }
        await consumers["plain"].setup()
        codec = Codec()
        seq = Sequence(
            input_ids=list(range(64)), loss_mask=[0] * 32 + [1] * 32, logprobs=[0.0] * 64, versions=[0] * 64, reward=1.0
        )
        times: dict[str, dict[str, list[float]]] = {w: {v: [] for v in ledgers} for w in ("admit", "commit")}
        group = 0
        for _ in range(max(1, args.writes // args.round)):
            for variant in ledgers:
                ledger, consumer = ledgers[variant], consumers[variant]
                for _ in range(args.round):
                    group += 1
                    job_id = f"g{group}"
                    t0 = time.perf_counter()
                    await ledger.admit(job_id, args.group)
                    times["admit"][variant].append(time.perf_counter() - t0)
                    for i in range(args.group):  # the group's results, as workers publish them
                        traj = Trajectory(job_id=job_id, sample_index=i, n=args.group, status="ok", sequences=[seq])
                        await client.xadd(keys.results, {PAYLOAD_FIELD: codec.encode(traj)})
                    got = await consumer.read(count=args.group, block_ms=1000)
                    t0 = time.perf_counter()
                    await consumer.commit(got)
                    times["commit"][variant].append(time.perf_counter() - t0)
        rows = {w: {v: stats(t) for v, t in by.items()} for w, by in times.items()}
        for by in rows.values():
            by["wait"]["vs_plain_p50"] = round(by["wait"]["p50_ms"] / by["plain"]["p50_ms"], 3)
        print(f"\n{'write':<8} {'variant':<7} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
        for write, by in rows.items():
            for variant, r in by.items():
                print(
                    f"{write:<8} {variant:<7} {r['p50_ms']:>8.3f} {r['p90_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                    f"{r['mean_ms']:>8.3f}"
                )
        print(f"WAITs answered by the replica: {wait.waited}, short: {wait.short}")
        return {
            "writes_per_variant": len(times["admit"]["plain"]),
            "group_size": args.group,
            "wait_timeout_ms": args.timeout_ms,
            "waited": wait.waited,
            "short": wait.short,
            "cpus": os.cpu_count(),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "rows": rows,
        }
    finally:
        await client.aclose()
        cluster.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.redis_wait", description=__doc__.split("\n\n")[0])
    p.add_argument("--writes", type=int, default=2000, help="writes of each kind per variant (default 2000)")
    p.add_argument("--round", type=int, default=100, help="calls of one variant before the other's turn (100)")
    p.add_argument("--group", type=int, default=8, help="samples per group: acked by one COMMIT (default 8)")
    p.add_argument("--timeout-ms", type=int, default=100, help="WAIT's timeout (redis_wait_timeout_ms, 100)")
    p.add_argument("--quick", action="store_true", help="smoke run: 200 writes")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.writes = min(args.writes, 200)
    if min(args.writes, args.round, args.group, args.timeout_ms) < 1:
        p.error("--writes, --round, --group and --timeout-ms must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def run(procs: Processes, tmp: Path) -> None:
        summary = await amain(args, tmp)
        print_summary(summary)
        write_results("redis_wait", summary, args.results, argv)

    return run_bench(run, "rollq-bench-redis-wait-")


if __name__ == "__main__":
    sys.exit(main())
