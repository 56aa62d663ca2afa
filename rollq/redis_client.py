"""How every rollq process builds its Redis client and waits for Redis (no I/O happens until a client is used).

A leaf module shared by every service (it imports no service and not the CLI)."""

from __future__ import annotations

import os

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
