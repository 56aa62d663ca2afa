"""`rollq classes`: the run's job classes, kept in Redis (`RunKeys.classes`, name -> JSON `JobClass`) so workers,
producers, the ingress and clients in other languages read the same definitions. Workers pick changes up within
`classes_refresh_ms`; the SUBMIT script reads a class's `max_inflight` at every submission."""

from __future__ import annotations

import json
import sys

import msgspec
import redis.asyncio as aioredis
import uvloop

from rollq.producer.config import ClassesConfig
from rollq.protocol.keys import DEFAULT_CLASS, RunKeys
from rollq.protocol.messages import JobClass, job_classes
from rollq.redis_client import redis_client


async def set_class(redis: aioredis.Redis, run: str, job_class: JobClass) -> None:
    """Create or change a class (its stream is created by the first producer or worker that uses it)."""
    await redis.hset(RunKeys(run).classes, job_class.name, msgspec.json.encode(job_class))  # type: ignore[misc,arg-type]


async def get_classes(redis: aioredis.Redis, run: str) -> dict[str, JobClass]:
    """The run's classes, `train` included."""
    return job_classes(await redis.hgetall(RunKeys(run).classes))  # type: ignore[misc]  # redis-py stub


async def delete_class(redis: aioredis.Redis, run: str, name: str) -> None:
    """Remove a class whose stream holds no job (workers stop reading it). `train` returns to its defaults."""
    keys = RunKeys(run)
    queued = await redis.xlen(keys.job_stream(name))
    if queued:
        raise ValueError(f"class {name!r} still has {queued} jobs queued or running; delete it once they finish")
    await redis.hdel(keys.classes, name)  # type: ignore[misc]


async def _classes(args: ClassesConfig) -> int:
    redis = redis_client(args.redis_url)
    keys = RunKeys(args.run)
    try:
        if args.action in ("set", "delete") and not args.name:
            print(f"rollq classes {args.action}: give the class name", file=sys.stderr)
            return 2
        if args.action == "set":
            cls = JobClass(name=args.name, priority=args.priority, weight=args.weight, max_inflight=args.max_inflight)
            await set_class(redis, args.run, cls)
            print(f"rollq classes: {cls.name} set in run {args.run!r}", file=sys.stderr)
        elif args.action == "delete":
            await delete_class(redis, args.run, args.name)
            print(f"rollq classes: {args.name} deleted from run {args.run!r}", file=sys.stderr)
        classes = await get_classes(redis, args.run)
        pipe = redis.pipeline(transaction=False)
        for name in classes:
            pipe.xlen(keys.job_stream(name))
        inflight = dict(zip(classes, await pipe.execute(), strict=True))
        if args.json:
            rows = [
                {**msgspec.structs.asdict(c), "inflight": inflight[n], "stream": keys.job_stream(n)}
                for n, c in classes.items()
            ]
            print(json.dumps(rows))
        elif args.action == "list":
            print(f"{'class':<20} {'priority':>8} {'weight':>7} {'max_inflight':>12} {'in flight':>9}  stream")
            for n, c in sorted(classes.items(), key=lambda kv: (-kv[1].priority, kv[0])):
                bound = str(c.max_inflight) if c.max_inflight else "-"
                print(f"{n:<20} {c.priority:>8} {c.weight:>7g} {bound:>12} {inflight[n]:>9}  {keys.job_stream(n)}")
        return 0
    except ValueError as exc:
        print(f"rollq classes: {exc}", file=sys.stderr)
        return 2
    finally:
        await redis.aclose()


def classes(args: ClassesConfig) -> int:
    return uvloop.run(_classes(args))


__all__ = ["DEFAULT_CLASS", "classes", "delete_class", "get_classes", "set_class"]
