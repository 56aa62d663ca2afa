"""How every rollq process builds its Redis client and waits for Redis (no I/O happens until a client is used).

A leaf module shared by every service (it imports no service and not the CLI)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    ConnectionError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from rollq.config import CLUSTER_QUERY_ARG, DEFAULT_REDIS_URL, TLS_QUERY_ARGS

REDIS_URL_ENV = "ROLLQ_REDIS_URL"

log = logging.getLogger("rollq.redis")
T = TypeVar("T")

# Errors after which a call is worth repeating once Redis answers again (restart, failover, AOF loading; on Redis
# Cluster also a cluster that is down while a replica takes over, a slot being moved, a slot not served yet).
# ClusterDownError and TryAgainError are ResponseErrors: handlers of ResponseError test these first.
TRANSIENT_ERRORS = (
    ConnectionError,
    TimeoutError,
    BusyLoadingError,
    OSError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    ClusterError,
)


def redis_url_from_env(explicit: str | None = None) -> str:
    return explicit or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def safe_url(url: str) -> str:
    """`url` fit for logs and messages: no password, no query (TLS file paths)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.hostname:
        return url.split("?", 1)[0]
    user = f"{parts.username}@" if parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, f"{user}{parts.hostname}{port}", parts.path, "", ""))


def cluster_url(url: str) -> tuple[str, bool]:
    """(`url` without rollq's `cluster` query argument, whether it names a Redis Cluster node)."""
    from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qs(parts.query)
    flag = query.pop(CLUSTER_QUERY_ARG, None)
    if flag is None:
        return url, False
    if flag[-1].lower() not in ("yes", "true", "1", "no", "false", "0"):
        raise ValueError(f"redis_url: {CLUSTER_QUERY_ARG}={flag[-1]!r} must be yes or no")
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True))), flag[-1].lower() in ("yes", "true", "1")


def is_cluster(client: Any) -> bool:
    """`client` talks to a Redis Cluster (multi-key commands must stay within one slot; no MULTI across slots)."""
    return isinstance(client, aioredis.RedisCluster)


def redis_client(url: str, *, retries: int = 3) -> aioredis.Redis:
    """A client with a small built-in retry for single commands; long outages are handled by the callers' loops.
    A URL with `cluster=yes` (RunSettings.redis_cluster) gets a Redis Cluster client, typed as a plain one: rollq
    keeps every multi-key step within one hash tag, so the two answer the commands it sends alike."""
    plain, cluster = cluster_url(url)
    options: dict[str, Any] = {
        "decode_responses": False,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        "retry_on_error": [ConnectionError, TimeoutError, BusyLoadingError],
        "health_check_interval": 30,
        "socket_connect_timeout": 5,
    }
    if cluster:
        client: Any = aioredis.RedisCluster.from_url(plain, **options)
        return client  # typed as Redis: the cluster client answers rollq's commands alike
    return aioredis.Redis.from_url(plain, **options)


def sync_redis_client(url: str, **options: Any) -> redis.Redis:
    """A synchronous client (the metrics scrape threads) for `url`, a Redis Cluster one for `cluster=yes`."""
    plain, cluster = cluster_url(url)
    if cluster:
        client: Any = redis.RedisCluster.from_url(plain, **options)
        return client  # typed as Redis: the cluster client answers rollq's commands alike
    return redis.Redis.from_url(plain, **options)


async def run_partitions(client: aioredis.Redis, key: str, wanted: int = 0, *, claim: bool = False) -> int:
    """The run's partition count, stored at `key` (RunKeys.partitions; absent = 1). `wanted` > 0 sets it when unset
    and must equal it when set (a run's jobs stay where its partitions put them). With `claim` (a process about to
    write jobs), an unset count is set to `wanted` or 1, so the keys it writes keep their partition for good."""
    if wanted > 0 or claim:
        await client.set(key, wanted or 1, nx=True)
    stored = await client.get(key)
    count = int(stored) if stored else 1
    if wanted > 0 and count != wanted:
        raise ValueError(f"the run has {count} partition(s) ({key}); this process was started with partitions={wanted}")
    return count


def arq_settings(url: str) -> Any:
    """arq's RedisSettings for `url`, with what arq's own `from_dsn` drops: the TLS files that RunSettings folds into
    the URL's query (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`), so reward workers speak TLS like the rest."""
    from urllib.parse import parse_qs, urlsplit

    from arq.connections import RedisSettings

    url, cluster = cluster_url(url)
    if cluster:
        raise ValueError(
            "remote rewards use arq, which has no Redis Cluster support: set reward_redis_url (ROLLQ_REWARD_REDIS_URL) "
            "to a plain Redis for their queue"
        )
    settings = RedisSettings.from_dsn(url)
    query = {name: values[-1] for name, values in parse_qs(urlsplit(url).query).items()}
    for name in TLS_QUERY_ARGS.values():
        if query.get(name):
            setattr(settings, name, query[name])
    return settings


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


class RedisUnavailable(Exception):
    """Redis stayed away longer than the process may wait (`redis_outage_s`): the process should exit."""

    def __init__(self, url: str, what: str, waited_s: float, cause: BaseException) -> None:
        self.url, self.what, self.waited_s = url, what, waited_s
        reason = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        super().__init__(
            f"cannot reach Redis at {safe_url(url) if url else '?'}: gave up {what} after waiting {waited_s:.1f}s "
            f"(redis_outage_s) for it to come back ({reason})"
        )


async def ride_out(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    limit_s: float,
    url: str = "",
    recover: Callable[[], Awaitable[object]] | None = None,
    stop: asyncio.Event | None = None,
) -> T:
    """`await op()`, repeated while Redis is away (TRANSIENT_ERRORS), with a backoff capped at 2 s, for up to `limit_s`
    seconds from the first failure; then raise RedisUnavailable. Once a failed op can be tried again, `recover()`
    runs first (re-create what a restarted Redis may have lost: consumer groups, the ledger), within the same limit.
    `op` must be safe to repeat: a reply lost with the connection may mean it was applied. With `stop` set, the
    wait ends early and the last error is raised."""
    loop = asyncio.get_running_loop()
    started: float | None = None
    delay = 0.05
    while True:
        try:
            if started is not None and recover is not None:
                await recover()
            result = await op()
        except TRANSIENT_ERRORS as exc:
            now = loop.time()
            if started is None:
                started = now
                log.warning(
                    "redis at %s unavailable while %s (%s); waiting up to %.0fs", safe_url(url), what, exc, limit_s
                )
            waited = now - started
            if waited >= limit_s or (stop is not None and stop.is_set()):
                raise RedisUnavailable(url, what, waited, exc) from exc
            pause = min(delay, limit_s - waited)
            delay = min(delay * 2, 2.0)
            if stop is None:
                await asyncio.sleep(pause)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)
            continue
        if started is not None:
            log.warning("redis at %s is back after %.1fs (%s)", safe_url(url), loop.time() - started, what)
        return result


class OutageClock:
    """For loops that handle TRANSIENT_ERRORS themselves: `failed(exc)` on each error (raises RedisUnavailable past
    `limit_s` since the first one), `ok()` once a call succeeds again."""

    def __init__(self, url: str, limit_s: float, what: str) -> None:
        self.url, self.limit_s, self.what = url, limit_s, what
        self.since: float | None = None

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since >= self.limit_s:
            raise RedisUnavailable(self.url, self.what, now - self.since, exc) from exc

    def ok(self) -> None:
        if self.since is not None:
            log.warning(
                "redis at %s is back after %.1fs (%s)", safe_url(self.url), time.monotonic() - self.since, self.what
            )
            self.since = None


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
