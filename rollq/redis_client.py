"""How every rollq process builds its Redis client and waits for Redis (no I/O happens until a client is used).

A leaf module shared by every service (it imports no service and not the CLI)."""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

from rollq.config import DEFAULT_REDIS_URL

REDIS_URL_ENV = "ROLLQ_REDIS_URL"

# Errors after which a call is worth repeating once Redis answers again (restart, failover, AOF loading).
TRANSIENT_ERRORS = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


def redis_url_from_env(explicit: str | None = None) -> str:
    return explicit or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def redis_client(url: str, *, retries: int = 3) -> aioredis.Redis:
    """A client with a small built-in retry for single commands; long outages are handled by the callers' loops."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
        health_check_interval=30,
        socket_connect_timeout=5,
    )


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing. Starts at 0 so entries added earlier are delivered."""
    from redis.exceptions import ResponseError

    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def is_nogroup(exc: BaseException) -> bool:
    """Redis lost the consumer group (restarted without persistence, or the stream was deleted)."""
    return "NOGROUP" in str(exc)


async def wait_for_redis(url: str, wait_s: float) -> None:
    """Return once Redis at `url` answers; after `wait_s` seconds of failures, raise the last connection error."""
    import asyncio

    client = redis_client(url, retries=0)
    deadline = asyncio.get_running_loop().time() + wait_s
    try:
        while True:
            try:
                await client.ping()
                return
            except TRANSIENT_ERRORS:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await client.aclose()


class StreamStats(NamedTuple):
    """One stream as its consumer group sees it (read by the services' Prometheus collectors at scrape time)."""

    length: int  # XLEN: entries in the stream (rollq deletes a job entry when it is acked: queued + running)
    lag: int | None  # entries the group has not read yet (None: Redis could not tell, or no such group)
    pending: int  # read by a consumer of the group and not acked yet
    oldest_age_s: float  # age of the oldest entry (0 when empty), from its id's milliseconds


def stream_stats(client: redis.Redis, stream: str, group: str) -> StreamStats:
    """XLEN, XINFO GROUPS (lag, pending) and the oldest entry's age, over a synchronous client (a scrape thread)."""
    from redis.exceptions import ResponseError

    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xrange(stream, count=1)
    length, first = pipe.execute()
    lag: int | None = None
    pending = 0
    try:
        groups: Any = client.xinfo_groups(stream)  # redis-py stub: sync|async union
    except ResponseError:  # no such stream yet
        groups = []
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name == group:
            pending = int(g["pending"])
            lag = None if g.get("lag") is None else int(g["lag"])
    oldest = 0.0
    if first:
        millis = int(first[0][0].split(b"-")[0])
        oldest = max(0.0, time.time() - millis / 1000)
    return StreamStats(int(length), lag, pending, oldest)
