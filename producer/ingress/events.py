"""Results streams of many SSE connections read by one blocking XREAD per partition, rather than one Redis
connection per connection (a few thousand open streams would otherwise exhaust Redis's clients and lock workers out).

A `StreamReader` serves one partition: every job's results stream (RunKeys.job_results) of a partition is in its
slot, so one XREAD covers them, also on Redis Cluster. A subscriber registers its stream and where it has read up
to; the reader delivers what follows. A stream joining while the read blocks wakes it through the reader's own wake
stream (RunKeys.ingress_wake), which the read includes, so nobody waits for another stream's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rollq.protocol.keys import RunKeys
from rollq.redis_client import TRANSIENT_ERRORS

log = logging.getLogger("rollq.ingress")

Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry as XREAD returns it
WAKE_TTL_S = 3600  # a wake stream outlives its reader by at most this


def entry_id(eid: str | bytes) -> tuple[int, int]:
    """A stream entry id as a comparable pair (`1700000000000-3` -> (1700000000000, 3))."""
    text = eid.decode() if isinstance(eid, bytes) else eid
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """What one SSE connection receives: batches of entries of its stream, or an error message (the stream can't be
    read). `get(timeout)` waits at most `timeout` seconds (None: nothing arrived)."""

    def __init__(self, stream: str, *, from_since: bool) -> None:
        self.stream = stream
        # The reader took the stream up at this subscriber's `since`: everything after it arrives here (no backlog
        # for the subscriber to read itself).
        self.from_since = from_since
        self._queue: asyncio.Queue[list[Entry] | str] = asyncio.Queue()

    def deliver(self, item: list[Entry] | str) -> None:
        self._queue.put_nowait(item)

    async def get(self, timeout: float) -> list[Entry] | str | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None


class StreamReader:
    """One partition's reader: a background task reading every subscribed stream with one blocking XREAD."""

    def __init__(self, redis: aioredis.Redis, keys: RunKeys, *, block_ms: int = 5_000) -> None:
        self.redis = redis
        self.wake = keys.ingress_wake(f"r{uuid.uuid4().hex[:16]}")
        self.block_ms = block_ms
        self._cursors: dict[str, str] = {}  # stream -> the id read up to
        self._subs: dict[str, set[Subscription]] = {}
        self._changed = asyncio.Event()
        self._reading = False  # an XREAD is in flight (a new stream must wake it)
        self._wake_cursor = "0-0"
        self._task: asyncio.Task[None] | None = None

    @property
    def streams(self) -> int:
        return len(self._subs)

    async def subscribe(self, stream: str, since: str) -> Subscription:
        """Receive the entries of `stream` after `since` (an entry id). When the reader already follows that stream
        for another subscriber (`from_since` false), the entries between `since` and where it is are the caller's to
        read (XRANGE); deliveries may repeat what it read, so it skips ids it has."""
        subs = self._subs.get(stream)
        sub = Subscription(stream, from_since=subs is None)
        if subs is None:
            self._subs[stream] = {sub}
            self._cursors[stream] = since
        else:
            subs.add(sub)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sse-reader-{self.wake}")
        self._changed.set()
        if self._reading:
            await self._wake_up()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.stream)
        if subs is None:
            return
        subs.discard(sub)
        if not subs:
            del self._subs[sub.stream]
            self._cursors.pop(sub.stream, None)

    def cursor(self, stream: str) -> str | None:
        return self._cursors.get(stream)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.redis.delete(self.wake)
        except TRANSIENT_ERRORS:
            pass

    async def _wake_up(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(self.wake, {b"w": b""}, maxlen=16, approximate=True)
        pipe.expire(self.wake, WAKE_TTL_S)
        await pipe.execute()

    async def _run(self) -> None:
        delay = 0.05
        while True:
            if not self._cursors:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._changed.clear()
            streams: dict[Any, Any] = {**self._cursors, self.wake: self._wake_cursor}
            self._reading = True
            try:
                reply = await self.redis.xread(streams, count=256, block=self.block_ms)
                delay = 0.05
            except TRANSIENT_ERRORS as exc:  # ride the outage out; subscribers keep waiting (keepalives go on)
                log.warning("SSE reader: Redis unavailable (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            except ResponseError as exc:  # a key that is not a stream (WRONGTYPE) would stop every stream's read
                await self._drop_unreadable(str(exc))
                continue
            finally:
                self._reading = False
            for raw_key, entries in reply or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if not entries:
                    continue
                last = entries[-1][0]
                if key == self.wake:
                    self._wake_cursor = last.decode() if isinstance(last, bytes) else last
                    continue
                subs = self._subs.get(key)
                if subs is None:  # every subscriber left while the read was out
                    continue
                self._cursors[key] = last.decode() if isinstance(last, bytes) else last
                for sub in subs:
                    sub.deliver(entries)

    async def _drop_unreadable(self, error: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        names = list(self._cursors)
        for name in names:
            pipe.type(name)
        try:
            types = await pipe.execute()
        except TRANSIENT_ERRORS:
            return
        for name, typ in zip(names, types, strict=True):
            kind = typ.decode() if isinstance(typ, bytes) else str(typ)
            if kind not in ("stream", "none"):
                log.error("SSE reader: %s is a %s, not a stream (%s); its subscribers get an error", name, kind, error)
                for sub in self._subs.pop(name, set()):
                    sub.deliver(f"the job's results stream is unreadable ({kind}, not a stream)")
                self._cursors.pop(name, None)
        wake_type = await self.redis.type(self.wake)
        if (wake_type.decode() if isinstance(wake_type, bytes) else str(wake_type)) not in ("stream", "none"):
            await self.redis.delete(self.wake)


__all__ = ["StreamReader", "Subscription", "entry_id"]
