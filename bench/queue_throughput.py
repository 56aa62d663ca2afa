"""End-to-end throughput of rollq vs arq vs an in-process asyncio.Queue pipeline, plus an encoding microbenchmark.

    python -m bench.queue_throughput            # from the repo root (or: python bench/queue_throughput.py)
    python -m bench.queue_throughput --quick    # smoke run

Every system moves the same work item: a job in, one 1,024-token trajectory (input_ids, loss_mask, logprobs,
versions, reward) out, produced by `bench.workflows:FixedTrajectory` (precomputed lists, no sleeping), so what is
measured is the queueing, transport and encoding overhead per trajectory.

- rollq: one `rollq worker` subprocess (uvloop) and, in this process, a `Producer.submit_many` (pipelined) running
  concurrently with a `ResultConsumer` that reads (count=512) and commits; timed from the first submit to the last
  commit, and every (job id, sample index) is checked to arrive exactly once.
- arq: `ArqRedis.enqueue_job` (concurrent, 64 at a time) into one `arq` worker subprocess (max_jobs=256, default
  poll_delay 0.5 s); the results are fetched and decoded by polling their result keys. Jobs and results are msgpack
  (rollq.workers.rewards.arq_codec), as in rollq's own arq use, never arq's default pickle. By default the arq worker
  gets the rollq worker's advantages (uvloop, WARNING-level logs); `--arq-stock` runs it on arq's own loop and logs.
- asyncio.Queue: producer -> queue -> N worker coroutines (decode the job, run the workflow, `to_sequences`,
  `Trajectory`, `Codec.encode`) -> queue -> consumer (`decode_trajectory`): rollq's per-item work minus Redis.

For rollq the CPU time per trajectory of the worker, this process and redis-server is reported too: on a small
machine the three compete for the same cores. The last line printed is a JSON summary.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/queue_throughput.py`: the repository root on sys.path)

import argparse
import asyncio
import contextlib
import json
import pickle
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from bench.common import (
    BenchError,
    bench_env,
    delete_matching,
    print_summary,
    proc_cpu_s,
    run_bench,
    start_redis,
    start_worker,
)
from bench.results import add_results_arg, write_results
from bench.workflows import TOKENS, FixedTrajectory, make_trajectory
from rollq.local import Processes
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import Job, Trajectory
from rollq.redis_client import redis_client
from rollq.workers.outputs import to_sequences

WORKFLOW = "bench.workflows:FixedTrajectory"
TARGET_RATE = 3000.0
TARGET_VS_ARQ = 10.0
ARQ_ENQUEUE_BATCH = 64  # concurrent enqueue_job calls (each holds a pooled connection; redis-py's pool holds 100)


# -- measurement helpers -------------------------------------------------------------------------------------------


def with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


async def redis_cpu_s(redis: Any) -> float | None:
    try:
        info = await redis.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    except Exception:
        return None


def cpu_us_per_item(before: dict[str, float | None], after: dict[str, float | None], n: int) -> dict[str, float | None]:
    return {
        k: (None if before[k] is None or after.get(k) is None else round((after[k] - before[k]) / n * 1e6, 1))
        for k in before
    }


# -- (a) rollq -----------------------------------------------------------------------------------------------------


async def bench_rollq(url: str, procs: Processes, jobs: int, concurrency: int, timeout_s: float) -> dict[str, Any]:
    run = f"bench-{uuid.uuid4().hex[:10]}"
    keys = RunKeys(run)
    redis = redis_client(url)
    worker = await start_worker(
        procs, redis, url, run, "--concurrency", str(concurrency)
    )  # run_bench stops it on failure
    try:
        producer = Producer(redis, run)
        consumer = producer.consumer(group="trainer", name="bench")
        await consumer.setup()
        requests = [JobRequest(workflow=WORKFLOW, data={"i": i}, job_id=f"j{i}") for i in range(jobs)]
        seen: set[tuple[str, int]] = set()
        duplicates = bad = 0

        async def consume() -> None:
            nonlocal duplicates, bad, t_consumed
            while len(seen) < jobs:
                left = run_deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"rollq: only {len(seen)} of {jobs} trajectories arrived in {timeout_s:g} s")
                procs.check(worker)
                batch = await consumer.read(count=512, block_ms=max(1, min(1000, int(left * 1000))))
                for d in batch:
                    t = d.trajectory
                    key = (t.job_id, t.sample_index)
                    if key in seen:
                        duplicates += 1
                    seen.add(key)
                    if t.status != "ok" or len(t.sequences) != 1 or len(t.sequences[0].input_ids) != TOKENS:
                        bad += 1
                await consumer.commit(batch)
            t_consumed = time.perf_counter()

        run_deadline = time.monotonic() + timeout_s
        cpu0 = {
            "worker": proc_cpu_s(worker.pid),
            "bench_process": time.process_time(),
            "redis": await redis_cpu_s(redis),
        }
        t0 = time.perf_counter()
        t_submitted = t_consumed = t0

        async def submit() -> list[Any]:
            nonlocal t_submitted
            out = await producer.submit_many(requests)
            t_submitted = time.perf_counter()
            return out

        submit_task = asyncio.create_task(submit())
        consumer_task = asyncio.create_task(consume())
        tasks = {submit_task, consumer_task}
        try:
            done, _ = await asyncio.wait(tasks, timeout=timeout_s + 5, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the first failure
            if len(done) < 2:
                raise BenchError(
                    f"rollq: still {'submitting' if not submit_task.done() else 'consuming'} after "
                    f"{timeout_s:g} s ({len(seen)} of {jobs} trajectories arrived)"
                )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        submitted = submit_task.result()
        elapsed = t_consumed - t0
        cpu1 = {
            "worker": proc_cpu_s(worker.pid),
            "bench_process": time.process_time(),
            "redis": await redis_cpu_s(redis),
        }

        expected = {(f"j{i}", 0) for i in range(jobs)}
        if not all(s.admitted for s in submitted) or len(submitted) != jobs:
            raise BenchError("rollq: not every job was admitted")
        if seen != expected or duplicates or bad:
            raise BenchError(
                f"rollq: {len(expected - seen)} missing, {len(seen - expected)} unexpected, {duplicates} "
                f"duplicates, {bad} malformed trajectories"
            )
        return {
            "jobs": jobs,
            "seconds": elapsed,
            "traj_per_s": jobs / elapsed,
            "submit_seconds": t_submitted - t0,
            "duplicates_dropped_by_consumer": consumer.duplicates_dropped,
            # CPU per trajectory: the rollq worker, this process (producer + consumer), redis-server
            "cpu_us_per_traj": cpu_us_per_item(cpu0, cpu1, jobs),
        }
    finally:
        procs.stop(worker, grace_s=10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(delete_matching(redis, f"{keys.prefix}:*"), 60)
        await redis.aclose()


# -- (b) arq -------------------------------------------------------------------------------------------------------


async def bench_arq(url: str, procs: Processes, jobs: int, timeout_s: float, *, stock: bool) -> dict[str, Any]:
    from arq.connections import RedisSettings, create_pool
    from arq.jobs import deserialize_result

    from rollq.workers.rewards import arq_codec

    env = bench_env()
    env["BENCH_ARQ_REDIS"] = url
    queue = env["BENCH_ARQ_QUEUE"] = f"arq:bench-{uuid.uuid4().hex[:10]}"  # a queue of its own on a shared Redis
    argv = [sys.executable, "-m", "arq", "bench.arq_settings.WorkerSettings"]
    if not stock:
        env["BENCH_ARQ_UVLOOP"] = "1"
        argv += ["--custom-log-dict", "bench.arq_settings.LOG_CONFIG"]
    pool = await create_pool(
        RedisSettings.from_dsn(url),
        default_queue_name=queue,
        job_serializer=arq_codec.encode,
        job_deserializer=arq_codec.decode,
    )
    worker = procs.start("arq-worker", argv, env=env)
    arq_jobs: list[Any] = []
    try:
        # until the worker polls (it writes its health-check key)
        await procs.wait_until(lambda: pool.exists(f"{queue}:health-check"), 30, "the arq worker", watch=worker)

        run_deadline = time.monotonic() + timeout_s
        t0 = time.perf_counter()
        for start in range(0, jobs, ARQ_ENQUEUE_BATCH):
            chunk = await asyncio.wait_for(
                asyncio.gather(
                    *[
                        pool.enqueue_job("fixed_trajectory", {"i": i})
                        for i in range(start, min(jobs, start + ARQ_ENQUEUE_BATCH))
                    ]
                ),
                max(0.1, run_deadline - time.monotonic()),
            )
            arq_jobs.extend(chunk)
        t_submitted = time.perf_counter()
        if any(j is None for j in arq_jobs):
            raise BenchError("arq: enqueue_job returned None")
        pending = {j.job_id for j in arq_jobs}
        bad = 0
        while pending:
            if time.monotonic() > run_deadline:
                raise BenchError(f"arq: {len(pending)} of {jobs} results missing after {timeout_s:g} s")
            procs.check(worker)
            ids = list(pending)
            got = 0
            for start in range(0, len(ids), 1024):
                part = ids[start : start + 1024]
                values = await pool.mget([f"arq:result:{i}" for i in part])
                for job_id, raw in zip(part, values, strict=True):
                    if raw is None:
                        continue
                    info = deserialize_result(raw, deserializer=arq_codec.decode)
                    out = info.result
                    if not info.success or len(out["input_ids"]) != TOKENS:
                        bad += 1
                    pending.discard(job_id)
                    got += 1
            if not got:
                await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
        if bad:
            raise BenchError(f"arq: {bad} results failed or were malformed")
        return {
            "jobs": jobs,
            "seconds": elapsed,
            "traj_per_s": jobs / elapsed,
            "submit_seconds": t_submitted - t0,
            "worker": "stock arq (asyncio loop, INFO logs)" if stock else "arq on uvloop, WARNING logs",
        }
    finally:
        procs.stop(worker, grace_s=10)
        with contextlib.suppress(Exception):  # only this measurement's keys
            keys = [queue, f"{queue}:health-check"]
            for job in arq_jobs:
                if job is not None:
                    keys += [f"arq:{kind}:{job.job_id}" for kind in ("job", "result", "in-progress", "retry")]
            for start in range(0, len(keys), 5000):
                await asyncio.wait_for(pool.unlink(*keys[start : start + 5000]), 30)
        await pool.aclose()


# -- (c) asyncio.Queue ---------------------------------------------------------------------------------------------


async def bench_asyncio_queue(jobs: int, concurrency: int, timeout_s: float) -> dict[str, Any]:
    codec = Codec()
    workflow = FixedTrajectory()
    q_in: asyncio.Queue[bytes | None] = asyncio.Queue()
    q_out: asyncio.Queue[bytes] = asyncio.Queue()
    worker_name = "inproc"

    async def produce() -> None:
        now = time.time()
        for i in range(jobs):
            job = Job(job_id=f"j{i}", workflow=WORKFLOW, data={"i": i}, reply_to="rollq:{x}:results", submitted_at=now)
            await q_in.put(codec.encode(job))
        for _ in range(concurrency):
            await q_in.put(None)

    async def work() -> None:
        while True:
            payload = await q_in.get()
            if payload is None:
                return
            started = time.time()
            job = codec.decode_job(payload)
            sequences = to_sequences(await workflow.arun_episode(None, job.data))
            traj = Trajectory(
                job_id=job.job_id,
                sample_index=job.sample_index,
                n=job.n,
                status="ok",
                sequences=sequences or [],
                worker_id=worker_name,
                workflow=job.workflow,
                attempt=1,
                submitted_at=job.submitted_at,
                started_at=started,
                finished_at=time.time(),
            )
            await q_out.put(codec.encode(traj))

    async def consume() -> set[tuple[str, int]]:
        seen: set[tuple[str, int]] = set()
        for _ in range(jobs):
            t = codec.decode_trajectory(await q_out.get())
            seen.add((t.job_id, t.sample_index))
            if t.status != "ok" or len(t.sequences[0].input_ids) != TOKENS:
                raise BenchError("asyncio.Queue: malformed trajectory")
        return seen

    t0 = time.perf_counter()
    workers = [asyncio.create_task(work()) for _ in range(concurrency)]
    producer = asyncio.create_task(produce())
    try:
        seen = await asyncio.wait_for(consume(), timeout_s)
    finally:
        producer.cancel()
        for w in workers:
            w.cancel()
        await asyncio.gather(producer, *workers, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    if len(seen) != jobs:
        raise BenchError(f"asyncio.Queue: {jobs - len(seen)} trajectories missing or duplicated")
    return {"jobs": jobs, "seconds": elapsed, "traj_per_s": jobs / elapsed}


# -- encodings -----------------------------------------------------------------------------------------------------


class ListSequence(msgspec.Struct, kw_only=True, gc=False):
    """`protocol.messages.Sequence` with the token columns as plain lists."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0


def _list_variant(struct: type, name: str, overrides: dict[str, Any]) -> type:
    """A copy of a protocol Struct with some field types replaced (kept in sync with the original's fields)."""
    fields = []
    for f in msgspec.structs.fields(struct):
        typ = overrides.get(f.name, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, typ, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ))
    return msgspec.defstruct(name, fields, kw_only=True, omit_defaults=True, gc=False)


# `protocol.messages.Trajectory` with list-based sequences.
ListTrajectory = _list_variant(Trajectory, "ListTrajectory", {"sequences": list[ListSequence]})


def _best_us(fn: Any, min_time_s: float, repeats: int) -> float:
    """Best-of-`repeats` mean time of one call, in microseconds (each repeat runs >= min_time_s)."""
    fn()
    n = 1
    while True:  # calibrate the iteration count
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        if dt >= min_time_s / 4:
            break
        n *= 4
    iters = max(1, int(n * min_time_s / max(dt, 1e-9)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters)
    return best * 1e6


def bench_encodings(
    lengths: tuple[int, ...], min_time_s: float, repeats: int
) -> dict[str, dict[str, dict[str, float]]]:
    codec = Codec()
    list_enc = msgspec.msgpack.Encoder()
    list_dec = msgspec.msgpack.Decoder(ListTrajectory)
    out: dict[str, dict[str, dict[str, float]]] = {}
    now = time.time()
    for length in lengths:
        raw = make_trajectory(length)
        meta = dict(
            job_id=uuid.uuid4().hex,
            sample_index=0,
            n=1,
            status="ok",
            worker_id="host-1234-abcdef",
            workflow=WORKFLOW,
            attempt=1,
            submitted_at=now,
            started_at=now,
            finished_at=now,
        )
        traj = Trajectory(sequences=to_sequences(raw), **meta)
        list_traj = ListTrajectory(sequences=[ListSequence(**raw)], **meta)
        as_dict = {**meta, "sequences": [dict(raw)], "schema": 1}
        # Default arguments bind this iteration's values: the closures are timed after the loop moved on.
        cases: dict[str, tuple[Any, Any]] = {
            "msgspec_msgpack_lists": (lambda t=list_traj: list_enc.encode(t), list_dec.decode),
            "rollq_codec_packed": (lambda t=traj: codec.encode(t), codec.decode_trajectory),
            "rollq_json": (lambda t=traj: codec.encode_json(t), lambda b: codec.decode_json(b, Trajectory)),
            "pickle_lists": (lambda d=as_dict: pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
            "json_stdlib_lists": (lambda d=as_dict: json.dumps(d).encode(), json.loads),
        }
        for name, (enc, dec) in cases.items():
            payload = enc()
            back = dec(payload)
            seqs = back["sequences"] if isinstance(back, dict) else back.sequences
            first = seqs[0] if isinstance(seqs[0], dict) else msgspec.structs.asdict(seqs[0])
            if list(first["input_ids"]) != raw["input_ids"] or list(first["logprobs"]) != raw["logprobs"]:
                raise BenchError(f"encoding {name} does not round-trip")
            out.setdefault(name, {})[str(length)] = {
                "bytes": len(payload),
                "encode_us": round(_best_us(enc, min_time_s, repeats), 2),
                "decode_us": round(_best_us(lambda d=dec, p=payload: d(p), min_time_s, repeats), 2),
            }
    return out


# -- report --------------------------------------------------------------------------------------------------------


def _fmt_rate(r: dict[str, Any] | None) -> str:
    return f"{r['traj_per_s']:,.0f}" if r else "n/a"


def print_report(systems: dict[str, dict[str, Any] | None], encodings: dict[str, Any], summary: dict[str, Any]) -> None:
    arq = systems.get("arq")
    aq = systems.get("asyncio.Queue")
    print()
    print(f"End-to-end trajectories/s ({TOKENS} tokens each, {os.cpu_count()} CPUs)")
    print(f"{'system':<16} {'jobs':>7} {'seconds':>8} {'traj/s':>9} {'vs arq':>8} {'vs asyncio.Queue':>17}")
    for name, r in systems.items():
        if r is None:
            print(f"{name:<16} {'skipped':>7}")
            continue
        vs_arq = f"{r['traj_per_s'] / arq['traj_per_s']:.1f}x" if arq else "n/a"
        vs_aq = f"{r['traj_per_s'] / aq['traj_per_s']:.2f}x" if aq else "n/a"
        print(f"{name:<16} {r['jobs']:>7} {r['seconds']:>8.2f} {_fmt_rate(r):>9} {vs_arq:>8} {vs_aq:>17}")
    cpu = (systems.get("rollq") or {}).get("cpu_us_per_traj")
    if cpu:
        parts = ", ".join(f"{k} {v:.0f}" if v is not None else f"{k} n/a" for k, v in cpu.items())
        print(f"rollq CPU µs per trajectory: {parts}")
    print()
    print("Encoding of one trajectory (best of repeats)")
    lengths = sorted({int(k) for v in encodings.values() for k in v})
    head = f"{'encoding':<24}" + "".join(f" {f'{n} tok: bytes':>15} {'enc µs':>8} {'dec µs':>8}" for n in lengths)
    print(head)
    for name, per_len in encodings.items():
        row = f"{name:<24}"
        for n in lengths:
            e = per_len[str(n)]
            row += f" {e['bytes']:>15,} {e['encode_us']:>8.1f} {e['decode_us']:>8.1f}"
        print(row)
    print()
    print_summary(summary)


def _round(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


# -- main ----------------------------------------------------------------------------------------------------------


async def check_redis(url: str, timeout_s: float = 10.0) -> None:
    client = redis_client(url, retries=0)
    try:
        await asyncio.wait_for(client.ping(), timeout_s)
    except Exception as exc:
        raise BenchError(f"cannot reach Redis at {url}: {type(exc).__name__}: {exc}") from None
    finally:
        await client.aclose()


async def amain(args: argparse.Namespace, url: str, procs: Processes) -> dict[str, Any]:
    await check_redis(url)
    encodings = bench_encodings(
        (TOKENS, 4 * TOKENS), min_time_s=0.02 if args.quick else 0.1, repeats=3 if args.quick else 5
    )

    systems: dict[str, dict[str, Any] | None] = {}
    rollq_runs = []
    for _ in range(args.repeat):
        rollq_runs.append(
            await bench_rollq(url, procs, args.jobs, args.concurrency, args.timeout or max(120.0, args.jobs / 100))
        )
    rollq = sorted(rollq_runs, key=lambda r: r["traj_per_s"])[len(rollq_runs) // 2]  # the median run
    if len(rollq_runs) > 1:
        rollq["all_traj_per_s"] = [round(r["traj_per_s"], 1) for r in rollq_runs]
    systems["rollq"] = rollq
    if args.arq_jobs > 0:
        arq_url = url if args.arq_db is None else with_db(url, args.arq_db)
        systems["arq"] = await bench_arq(
            arq_url, procs, args.arq_jobs, args.timeout or max(120.0, args.arq_jobs / 10), stock=args.arq_stock
        )
    else:
        systems["arq"] = None
    systems["asyncio.Queue"] = await bench_asyncio_queue(args.jobs, args.concurrency, args.timeout or 300.0)

    rate = rollq["traj_per_s"]
    arq_rate = systems["arq"]["traj_per_s"] if systems["arq"] else None
    aq_rate = systems["asyncio.Queue"]["traj_per_s"]
    vs_arq = rate / arq_rate if arq_rate else None
    summary = {
        "rollq_traj_per_s": _round(rate),
        "arq_traj_per_s": _round(arq_rate),
        "asyncio_queue_traj_per_s": _round(aq_rate),
        "rollq_vs_arq": _round(vs_arq, 2),
        "rollq_vs_asyncio_queue": _round(rate / aq_rate, 3),
        "jobs": {"rollq": args.jobs, "arq": args.arq_jobs, "asyncio_queue": args.jobs},
        "tokens_per_trajectory": TOKENS,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "targets": {
            f"rollq_traj_per_s>={TARGET_RATE:.0f}": rate >= TARGET_RATE,
            f"rollq_vs_arq>={TARGET_VS_ARQ:.0f}": None if vs_arq is None else vs_arq >= TARGET_VS_ARQ,
        },
        "systems": {
            k: ({kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()} if v else None)
            for k, v in systems.items()
        },
        "encodings": encodings,
    }
    print_report(systems, encodings, summary)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.queue_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a redis-server")
    p.add_argument("--jobs", type=int, default=20_000, help="trajectories for rollq and asyncio.Queue (default 20000)")
    p.add_argument("--arq-jobs", type=int, default=2_000, help="trajectories for arq (default 2000; 0 skips arq)")
    p.add_argument("--arq-db", type=int, default=1, help="Redis database for arq (default 1)")
    p.add_argument(
        "--arq-stock",
        action="store_true",
        help="run the arq worker as shipped (asyncio loop, per-job INFO logs) instead of on uvloop, quiet",
    )
    p.add_argument("--concurrency", type=int, default=256, help="worker concurrency / worker coroutines (default 256)")
    p.add_argument("--repeat", type=int, default=1, help="rollq measurements (fresh run each; the median is reported)")
    p.add_argument(
        "--timeout", type=float, default=0.0, help="seconds per measurement before giving up (default: by N)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 1000 jobs, 200 arq jobs, short encoding timings")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.jobs = min(args.jobs, 1000)
        args.arq_jobs = min(args.arq_jobs, 200)
    if args.jobs < 1 or args.concurrency < 1 or args.repeat < 1 or args.arq_jobs < 0:
        p.error("--jobs, --concurrency and --repeat must be >= 1, --arq-jobs >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def run(procs: Processes, tmp: Path) -> None:
        summary = await amain(args, args.redis or start_redis(procs, tmp), procs)
        write_results("queue_throughput", summary, args.results, argv)

    return run_bench(run, "rollq-bench-")


if __name__ == "__main__":
    sys.exit(main())
