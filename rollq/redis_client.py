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
from redis.commands.core import AsyncScript
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    ConnectionError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
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


class _ClusterPipeline(aioredis.cluster.ClusterPipeline):
    """redis-py's cluster pipeline, with one of its failover bugs turned into the error it stands for. When a command
    of the pipeline failed while the client was resetting its topology (a node died: another call's connection error
    closes the client), redis-py 5.x raises `AttributeError: 'NoneType' object has no attribute 'name'` (its default
    node is gone; redis/redis-py#3458, #3835). The writes are repeated like any others a failover interrupted."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except AttributeError as exc:
            if "'NoneType' object has no attribute" not in str(exc):
                raise
            raise ConnectionError(f"the cluster's topology changed under a pipeline ({exc})") from exc


class _KnownNodes(dict):
    """A cluster client's startup nodes (those it asks for the topology) that keep every node the client has known.
    redis-py drops a node from them at each connection error on it (`_execute_command`), and closes all the client's
    connections at that moment; in a failover the first error thus also fails the commands in flight on the healthy
    nodes, which drop those nodes in turn. On a young cluster (whose CLUSTER SLOTS lists no replica yet: none has
    acknowledged a write) that empties them, and the client refuses every call from then on, for good, with
    `RedisClusterException: Redis Cluster cannot be connected. Please provide at least one reachable node: None`
    (not a RedisError: it ended the worker that got it). Dropping is a no-op here: a node that is down is asked in
    turn and fails fast, and the next one answers."""

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            return self[key]
        if default:
            return default[0]
        raise KeyError(key)


class _ClusterScript(AsyncScript):
    """redis-py's script, which on NoScriptError loads the script and sends EVALSHA again; on a cluster just after a
    failover the load can go by an out-of-date map of the slots and the second EVALSHA fail too (seen in the chaos
    loop: the trainer's acks died of it). Then EVAL, which carries the script's text, runs wherever the slot is served
    (and leaves the script in that node's cache)."""

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        try:
            return await super().__call__(keys, args, client)
        except NoScriptError:
            keys, args = list(keys or []), list(args or [])
            target: Any = client or self.registered_client  # redis-py's stubs type it a single-node client
            return await target.eval(self.script, len(keys), *keys, *args)


class _RedisCluster(aioredis.RedisCluster):
    """The async cluster client rollq uses: its pipelines are _ClusterPipeline, its startup nodes _KnownNodes, and a
    topology that no node it knows answers for is a ConnectionError (Redis is away: every rollq process rides it
    out), not redis-py's RedisClusterException."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes_manager.startup_nodes = _KnownNodes(self.nodes_manager.startup_nodes)

    async def initialize(self) -> _RedisCluster:
        try:
            await super().initialize()
        except RedisClusterException as exc:
            if "cannot be connected" not in str(exc) and "not covered" not in str(exc):
                raise
            raise ConnectionError(f"no node of the Redis Cluster answered for its topology ({exc})") from exc
        return self

    def register_script(self, script: Any) -> Any:  # redis-py's stubs: a sync Script, taking a single-node client
        return _ClusterScript(self, script)  # type: ignore[arg-type]

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> _ClusterPipeline:
        super().pipeline(transaction, shard_hint)  # refuses what redis-py refuses (transactions, shard hints)
        return _ClusterPipeline(self)  # type: ignore[abstract]  # redis-py's stub: connection_pool is abstract there


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
        client: Any = _RedisCluster.from_url(plain, **options)
        return client  # typed as Redis: the cluster client answers rollq's commands alike
    return aioredis.Redis.from_url(plain, **options)


def sync_redis_client(url: str, **options: Any) -> redis.Redis:
    """A synchronous client (the metrics scrape threads) for `url`, a Redis Cluster one for `cluster=yes`."""
    plain, cluster = cluster_url(url)
    if cluster:
        client: Any = redis.RedisCluster.from_url(plain, **options)
        return client  # typed as Redis: the cluster client answers rollq's commands alike
    return redis.Redis.from_url(plain, **options)


class ReplicaWait:
    """Lua script calls whose writes should survive a Redis Cluster failover: each is followed, on the same
    connection, by `WAIT replicas timeout`, so it returns once that many replicas of the key's node have the write
    (or after the timeout). A plain Redis (no cluster) gets no WAIT. A WAIT that comes back short is logged (once
    until WAITs succeed again) and no WAIT is sent for `backoff_s`: a replica that is down or resyncing, or a cluster
    without replicas, costs one timeout per `backoff_s`, not one per write. The write stands either way: what a
    failover then loses, the caller's recovery writes again (docs/architecture.md, "Redis Cluster failover")."""

    def __init__(self, client: Any, replicas: int = 1, timeout_ms: int = 100, *, backoff_s: float = 10.0) -> None:
        self.client = client
        self.replicas = replicas if is_cluster(client) else 0
        self.timeout_ms = timeout_ms
        self.backoff_s = backoff_s
        self.waited = 0  # WAITs answered by every replica asked for
        self.short = 0  # WAITs that timed out short of them
        self._off_until = 0.0
        self._failing = False  # the last WAIT came back short (logged once per streak)

    def _node(self, key: str) -> Any:
        """The node serving `key`, from the cluster client's map of the slots (no call; before the client's first
        call it has none, and that call goes without WAIT)."""
        if self.replicas <= 0 or time.monotonic() < self._off_until:
            return None
        nodes = self.client.nodes_manager.slots_cache.get(self.client.keyslot(key))
        return nodes[0] if nodes else None

    async def script(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """`await script(keys=keys, args=args)` (a redis-py AsyncScript whose keys share one slot), then WAIT."""
        node = self._node(keys[0])
        if node is None:
            return await script(keys=keys, args=args)
        for send_text in (False, True):
            pipe = self.client.pipeline()
            if send_text:  # EVAL carries the script: it runs on whichever node the slot's owner is by now
                pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
            else:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms, target_nodes=node)
            reply, acked = await pipe.execute(raise_on_error=False)
            # A promoted replica or a restarted node has no script cache. Loading the script and sending EVALSHA
            # again is not enough just after a failover: the load may go to the nodes of an out-of-date slot map
            # (seen in the chaos loop: the trainer's recovery died of NoScriptError).
            if not send_text and isinstance(reply, NoScriptError):
                continue
            break
        if isinstance(reply, Exception):
            raise reply
        self._answered(acked)
        return reply

    def _answered(self, acked: Any) -> None:
        if isinstance(acked, TRANSIENT_ERRORS):
            return  # the write was answered; the next one waits again
        if isinstance(acked, NoPermissionError):  # a Redis user without WAIT: writes go on without it
            log.error("WAIT refused (%s): writes no longer wait for replicas", acked)
            self.replicas = 0
            return
        if not isinstance(acked, Exception) and int(acked) >= self.replicas:
            self.waited += 1
            if self._failing:
                self._failing = False
                log.warning("replicas have the writes again within %d ms (WAIT)", self.timeout_ms)
            return
        self.short += 1  # (an error: the map of the slots is out of date, say, and the node a replica now)
        self._off_until = time.monotonic() + self.backoff_s
        if not self._failing:
            self._failing = True
            log.warning(
                "%s of %d replica(s) had a write within %d ms (WAIT): a failover now may lose it (it is written "
                "again then). Not waiting for replicas for %.0fs at a time until they answer (a cluster without "
                "replicas: redis_wait_replicas 0)",
                f"WAIT failed ({acked}): none" if isinstance(acked, Exception) else f"only {int(acked)}",
                self.replicas,
                self.timeout_ms,
                self.backoff_s,
            )


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
    moved: Callable[[], bool] | None = None,
) -> T:
    """`await op()`, repeated while Redis is away (TRANSIENT_ERRORS), with a backoff capped at 2 s, for up to `limit_s`
    seconds from the first failure; then raise RedisUnavailable. Once a failed op can be tried again, `recover()`
    runs first (re-create what a restarted Redis may have lost: consumer groups, the ledger), within the same limit.
    `moved()` (a ClusterView's) tells when a Redis Cluster failed over without `op` seeing it fail (redis-py's cluster
    client follows a failover by itself once it is over): `recover()` then runs after `op`. `op` must be safe to
    repeat: a reply lost with the connection may mean it was applied. With `stop` set, the wait ends early and the
    last error is raised."""
    loop = asyncio.get_running_loop()
    started: float | None = None
    delay = 0.05
    while True:
        try:
            if started is not None and recover is not None:
                await recover()
            result = await op()
            if recover is not None and moved is not None and moved():
                log.warning(
                    "a Redis Cluster node of %s changed while %s (a failover): writing again what it may have lost",
                    safe_url(url),
                    what,
                )
                await recover()
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


class ClusterView:
    """Which node serves the slot of each of some keys, as a Redis Cluster client last mapped them (no call is made).
    `moved()` says whether one changed since the last look: a failover (or a slot migration) that the client rode
    out by itself, whose new primary may lack the old one's last writes. Always False on a plain Redis."""

    def __init__(self, client: Any, keys: list[str] | None = None) -> None:
        self.client = client
        self._slots: list[int] = []
        self._last: tuple[str, ...] | None = None
        self.watch(keys or [])

    def watch(self, keys: list[str]) -> None:
        """Look at these keys' slots from now on (the next look sets the baseline)."""
        self._slots = sorted({self.client.keyslot(k) for k in keys}) if is_cluster(self.client) else []
        self._last = None

    def moved(self) -> bool:
        if not self._slots:
            return False
        cache = self.client.nodes_manager.slots_cache
        names = []
        for slot in self._slots:
            nodes = cache.get(slot)
            if not nodes:
                return False  # the client is reading the topology again: look next time
            names.append(nodes[0].name)
        view = tuple(names)
        changed = self._last is not None and view != self._last
        self._last = view
        return changed


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
