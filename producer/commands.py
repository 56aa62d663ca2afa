"""`rollq enqueue` and `rollq status`, given their typed settings (rollq.producer.config)."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import uuid
from pathlib import Path
from typing import IO, Any

import msgspec
import redis.asyncio as aioredis
import uvloop

from rollq.producer.config import EnqueueConfig, StatusConfig
from rollq.producer.jsonl import JsonlError, json_objects
from rollq.producer.producer import JobRequest, Producer
from rollq.producer.status import format_status, gather_status, render_status
from rollq.protocol.codec import Codec
from rollq.protocol.keys import RunKeys, consumed_key, inflight_key, partition_of
from rollq.protocol.messages import AgentOptions
from rollq.redis_client import TRANSIENT_ERRORS, redis_client
from rollq.tracing import Tracing
from rollq.up_record import FILE as UP_FILE
from rollq.up_record import describe_run_dir, read_record


class InputError(JsonlError):
    pass


def read_jobs(
    stream: IO[str],
    name: str,
    workflow: str,
    n: int,
    *,
    workflow_kwargs: dict[str, Any] | None = None,
    agent: AgentOptions | None = None,
) -> list[JobRequest]:
    """Parse every line first, so a bad line stops the command before anything is submitted."""
    requests: list[JobRequest] = []
    for lineno, data in json_objects(stream, name):
        job_id = data.get("job_id")
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise InputError(f"{name}:{lineno}: job_id must be a non-empty string, got {job_id!r}")
        requests.append(
            JobRequest(workflow=workflow, data=data, n=n, job_id=job_id, workflow_kwargs=workflow_kwargs, agent=agent)
        )
    return requests


def trajectory_record(codec: Codec, traj: Any) -> dict[str, Any]:
    record: dict[str, Any] = codec.to_builtins(traj)
    record.setdefault("sequences", [])
    record.setdefault("error", None)
    return record


async def _enqueue(args: EnqueueConfig, requests: list[JobRequest]) -> int:
    redis = redis_client(args.redis_url)
    keys = RunKeys(args.run)
    reply_to = keys.reply_stream(f"enqueue-{uuid.uuid4().hex[:12]}") if args.wait else keys.results
    # Each job's submit span (trace settings or OTEL_* on): its trace begins here, not at the worker.
    tracing = Tracing.from_settings(args, "enqueue")
    producer = Producer(
        redis,
        args.run,
        reply_to=reply_to,
        max_inflight=args.max_inflight,
        reply_ttl_s=args.reply_ttl if args.wait else 0,
        partitions=args.partitions,
        tracing=tracing,
    )
    keepalive: asyncio.Task[None] | None = None
    admitted: list[Any] = []
    try:
        if args.wait:  # create the reply group (every partition's) before any worker can publish
            await producer.partitions()
            consumer = producer.consumer(group="enqueue", name="enqueue", dedup_ttl_s=args.reply_ttl)
            await consumer.setup()
            await producer.keep_reply_stream()
            keepalive = asyncio.create_task(_keep_alive(producer, args.reply_ttl / 3), name="reply-keepalive")
        results = await producer.submit_many(requests)
        admitted = [r for r in results if r.admitted]
        dups = len(results) - len(admitted)
        print(
            f"rollq enqueue: submitted {len(admitted)} jobs x {args.n} samples to run {args.run!r}"
            + (f"; {dups} job ids were submitted before and are not run again" if dups else ""),
            file=sys.stderr,
        )
        if not args.wait:
            for r in results:
                print(json.dumps({"job_id": r.job_id, "admitted": r.admitted}))
            return 0
        out = open(args.output, "w") if args.output else sys.stdout
        codec = Codec()
        counts = {"ok": 0, "rejected": 0, "error": 0, "cancelled": 0}
        try:
            expected = {r.job_id: args.n for r in admitted}
            async for traj in producer.wait_for(expected, timeout_s=args.timeout or None, consumer=consumer):
                out.write(json.dumps(trajectory_record(codec, traj)) + "\n")
                out.flush()
                counts[traj.status] += 1
        except TimeoutError as exc:
            print(f"rollq enqueue: timed out: {exc}", file=sys.stderr)
            return 1
        finally:
            if out is not sys.stdout:
                out.close()
        print(
            f"rollq enqueue: {counts['ok']} ok, {counts['rejected']} rejected, {counts['error']} errors",
            file=sys.stderr,
        )
        return 0 if counts["error"] == 0 else 1
    finally:
        if keepalive is not None:
            keepalive.cancel()
            await _delete_reply_streams(redis, producer, [r.job_id for r in admitted])
        await redis.aclose()
        await asyncio.to_thread(tracing.shutdown)  # exports the submit spans still buffered


async def _keep_alive(producer: Producer, every_s: float) -> None:
    """Renew the private reply stream's TTL while this command waits (a killed one stops, and its keys expire)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await producer.keep_reply_stream()
        except TRANSIENT_ERRORS:
            pass  # the next renewal tries again, well within the TTL


async def _delete_reply_streams(redis: aioredis.Redis, producer: Producer, job_ids: list[str]) -> None:
    """The private reply stream of every partition, its counter and its duplicate filters (a partition's keys share
    its slot, so each DELETE stays in one); late results for them are dropped by workers."""
    count = await producer.partitions()
    by_partition: dict[int, list[str]] = {}
    for job_id in job_ids:
        by_partition.setdefault(partition_of(job_id, count), []).append(job_id)
    try:
        for p in range(count):
            stream = producer.reply_stream(p)
            keys = [stream, inflight_key(stream)]
            keys += [consumed_key(stream, "enqueue", j) for j in by_partition.get(p, [])]
            for i in range(0, len(keys), 512):
                await redis.delete(*keys[i : i + 512])
    except TRANSIENT_ERRORS:
        pass  # they expire after reply_ttl


def enqueue(args: EnqueueConfig) -> int:
    workflow_kwargs, agent = args.kwargs, _agent_options(args)
    try:
        if args.file == "-":
            requests = read_jobs(
                sys.stdin, "<stdin>", args.workflow, args.n, workflow_kwargs=workflow_kwargs, agent=agent
            )
        else:
            with open(args.file) as f:
                requests = read_jobs(f, args.file, args.workflow, args.n, workflow_kwargs=workflow_kwargs, agent=agent)
    except (InputError, ValueError) as exc:
        print(f"rollq enqueue: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"rollq enqueue: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    for request in requests:
        request.is_eval = args.is_eval
        request.text = args.text
        request.job_class = args.job_class
    try:
        return uvloop.run(_enqueue(args, requests))
    except ValueError as exc:  # an unknown job class, a job that can never fit its bound
        print(f"rollq enqueue: {exc}", file=sys.stderr)
        return 2


def _agent_options(args: EnqueueConfig) -> AgentOptions | None:
    options = AgentOptions(
        mode=args.agent_mode,
        export_style=args.export_style,
        turn_discount=args.turn_discount,
        timeout_seconds=args.agent_timeout,
        max_tokens=args.max_tokens,
    )
    return None if options == AgentOptions() else options  # defaults travel as nothing


async def _status(args: StatusConfig) -> int:
    redis = redis_client(args.redis_url, retries=0)
    try:
        if not args.watch:
            st = await gather_status(redis, args.run)
            print(msgspec.json.encode(st).decode() if args.json else format_status(st))
        elif args.json:  # JSON lines, one per refresh
            while True:
                print(msgspec.json.encode(await gather_status(redis, args.run)).decode(), flush=True)
                await asyncio.sleep(args.watch)
        else:
            await _watch(redis, args)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    finally:
        await redis.aclose()
    return 0


async def _watch(redis: aioredis.Redis, args: StatusConfig) -> None:
    """A live terminal view (rich), redrawn every `args.watch` seconds until Ctrl-C."""
    from rich.live import Live

    with Live(render_status(await gather_status(redis, args.run)), auto_refresh=False, screen=False) as live:
        while True:
            await asyncio.sleep(args.watch)
            live.update(render_status(await gather_status(redis, args.run)), refresh=True)


def status(args: StatusConfig) -> int:
    if args.run_dir:
        try:
            args = _up_run(args)
        except ValueError as exc:
            print(f"rollq status: {exc}", file=sys.stderr)
            return 2
    try:
        return uvloop.run(_status(args))
    except KeyboardInterrupt:  # Ctrl-C ends --watch
        return 0
    except TRANSIENT_ERRORS:
        if not args.run_dir:
            raise  # the CLI's one line: cannot reach Redis at ..., how to start one
        print(f"rollq status: {_up_gone(Path(args.run_dir), 'its Redis does not answer')}", file=sys.stderr)
        return 2


def _up_run(args: StatusConfig) -> StatusConfig:
    """`--run-dir DIR`: the Redis and the run of the `rollq up` running in DIR (DIR/up.json, rollq/up_record.py).
    ValueError saying what DIR holds when no `rollq up` runs there."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"no run directory {run_dir}")
    record = read_record(run_dir)
    if record is None:
        raise ValueError(
            f"{run_dir} has no {UP_FILE}: it is not the run directory of a `rollq up` (give a running stack's "
            f"--redis and --run instead). It holds: {describe_run_dir(run_dir)}"
        )
    if record.redis_url is None:
        raise ValueError(_up_gone(run_dir, "it has exited"))
    return msgspec.structs.replace(args, redis_url=record.redis_url, run=record.run)


def _up_gone(run_dir: Path, why: str) -> str:
    record = read_record(run_dir)
    run = f" of run {record.run!r}" if record is not None else ""
    return (
        f"the `rollq up`{run} in {run_dir} is not running ({why}; the private Redis it starts, with the queue, goes "
        f"with it). {run_dir} holds: {describe_run_dir(run_dir)}. `rollq up --run-dir {shlex.quote(str(run_dir))}` "
        "resumes the run"
    )
