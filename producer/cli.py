"""`rollq enqueue` and `rollq status`."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import IO, Any

import msgspec
import uvloop

from producer.jsonl import JsonlError, json_objects
from producer.producer import JobRequest, Producer
from producer.status import format_status, gather_status
from protocol.codec import Codec
from protocol.connection import redis_client
from protocol.keys import RunKeys, inflight_key
from protocol.messages import AgentOptions


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("enqueue", parents=[common], help="submit one job per JSONL line")
    p.add_argument("file", help="JSONL file, one job's data per line ('-' = stdin); a 'job_id' key makes it idempotent")
    p.add_argument("--workflow", required=True, help="workflow import path, e.g. my_module:MyWorkflow")
    p.add_argument("--n", type=int, default=1, help="samples per line (default 1)")
    p.add_argument("--wait", action="store_true", help="wait for the trajectories and write them as JSON lines")
    p.add_argument("--output", default=None, help="where --wait writes trajectories (default stdout)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="give up waiting after S seconds")
    p.add_argument("--max-inflight", type=int, default=0, help="backpressure: samples admitted but not consumed")
    p.add_argument("--kwargs", default=None, metavar="JSON", help="workflow_kwargs: the workflow class's arguments")
    a = p.add_argument_group("agent workflows (a class with `async def run(self, data, **extra_kwargs)`)")
    a.add_argument("--agent-mode", choices=["inline", "subproc"], default="inline",
                   help="inline: in the worker's event loop; subproc: in a process pool, OPENAI_BASE_URL/OPENAI_API_KEY set")
    a.add_argument("--export", choices=["individual", "concat"], default="individual",
                   help="a sequence per completion, or per conversation branch (default individual)")
    a.add_argument("--turn-discount", type=float, default=1.0, help="reward discount per turn up the conversation tree")
    a.add_argument("--agent-timeout", type=float, default=600.0, metavar="S", help="an episode's time limit")
    a.add_argument("--max-tokens", type=int, default=0, help="default max_tokens of the agent's requests")
    p.set_defaults(handler=run_enqueue)

    s = sub.add_parser("status", parents=[common], help="queue lengths, pending work, dead letters, live workers")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(handler=run_status)


class InputError(JsonlError):
    pass


def read_jobs(stream: IO[str], name: str, workflow: str, n: int, *, workflow_kwargs: dict[str, Any] | None = None,
              agent: AgentOptions | None = None) -> list[JobRequest]:
    """Parse every line first, so a bad line stops the command before anything is submitted."""
    requests: list[JobRequest] = []
    for lineno, data in json_objects(stream, name):
        job_id = data.get("job_id")
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise InputError(f"{name}:{lineno}: job_id must be a non-empty string, got {job_id!r}")
        requests.append(JobRequest(workflow=workflow, data=data, n=n, job_id=job_id, workflow_kwargs=workflow_kwargs,
                                   agent=agent))
    return requests


def trajectory_record(codec: Codec, traj: Any) -> dict[str, Any]:
    record = codec.to_builtins(traj)
    record.setdefault("sequences", [])
    record.setdefault("error", None)
    return record


async def _enqueue(args: argparse.Namespace, requests: list[JobRequest]) -> int:
    redis = redis_client(args.redis)
    keys = RunKeys(args.run)
    reply_to = keys.reply_stream(f"enqueue-{uuid.uuid4().hex[:12]}") if args.wait else keys.results
    producer = Producer(redis, args.run, reply_to=reply_to, max_inflight=args.max_inflight)
    try:
        if args.wait:  # create the reply group before any worker can publish
            consumer = producer.consumer(group="enqueue", name="enqueue")
            await consumer.setup()
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
        counts = {"ok": 0, "rejected": 0, "error": 0}
        try:
            expected = {r.job_id: args.n for r in admitted}
            async for traj in producer.wait_for(expected, timeout_s=args.timeout, consumer=consumer):
                out.write(json.dumps(trajectory_record(codec, traj)) + "\n")
                out.flush()
                counts[traj.status] += 1
        except TimeoutError as exc:
            print(f"rollq enqueue: timed out: {exc}", file=sys.stderr)
            return 1
        finally:
            if out is not sys.stdout:
                out.close()
        print(f"rollq enqueue: {counts['ok']} ok, {counts['rejected']} rejected, {counts['error']} errors", file=sys.stderr)
        await redis.delete(reply_to, inflight_key(reply_to))
        return 0 if counts["error"] == 0 else 1
    finally:
        await redis.aclose()


def run_enqueue(args: argparse.Namespace) -> int:
    try:
        RunKeys(args.run)
        if args.n < 1:
            raise InputError(f"--n must be >= 1, got {args.n}")
        options = {"workflow_kwargs": _workflow_kwargs(args.kwargs), "agent": _agent_options(args)}
        if args.file == "-":
            requests = read_jobs(sys.stdin, "<stdin>", args.workflow, args.n, **options)
        else:
            with open(args.file) as f:
                requests = read_jobs(f, args.file, args.workflow, args.n, **options)
    except (InputError, ValueError) as exc:
        print(f"rollq enqueue: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"rollq enqueue: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    return uvloop.run(_enqueue(args, requests))


def _workflow_kwargs(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"--kwargs is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise InputError("--kwargs must be a JSON object")
    return value


def _agent_options(args: argparse.Namespace) -> AgentOptions | None:
    options = AgentOptions(mode=args.agent_mode, export=args.export, turn_discount=args.turn_discount,
                           timeout_seconds=args.agent_timeout, max_tokens=args.max_tokens)
    return None if options == AgentOptions() else options  # defaults travel as nothing


async def _status(args: argparse.Namespace) -> int:
    redis = redis_client(args.redis, retries=0)
    try:
        st = await gather_status(redis, args.run)
    finally:
        await redis.aclose()
    print(msgspec.json.encode(st).decode() if args.json else format_status(st))
    return 0


def run_status(args: argparse.Namespace) -> int:
    try:
        RunKeys(args.run)
    except ValueError as exc:
        print(f"rollq status: {exc}", file=sys.stderr)
        return 2
    return uvloop.run(_status(args))
