"""The consumer side of a results stream: consumer-group reads, duplicates dropped by (job id, sample index),
acks only when the caller commits."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rollq.protocol import scripts
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import DEFAULT_RESULTS_GROUP, PAYLOAD_FIELD, consumed_key, inflight_key
from rollq.protocol.messages import Trajectory
from rollq.redis_client import TRANSIENT_ERRORS, ReplicaWait, ensure_group, is_nogroup

DEFAULT_DEDUP_TTL_S = 7 * 24 * 3600

log = logging.getLogger("rollq.results")

_Entry = tuple[bytes, dict[bytes, bytes] | None]  # (entry id, fields); fields is None for a deleted entry


def _entries(reply: Any) -> list[_Entry]:
    """The entries of a one-stream XREADGROUP reply ([[stream, entries]], or empty when nothing was read)."""
    entries: list[_Entry] = reply[0][1] if reply else []
    return entries


class Delivered(msgspec.Struct, frozen=True, gc=False):
    """A trajectory read from the stream; pass it back to commit() once it has been used."""

    entry_id: str
    trajectory: Trajectory
    stream: str = ""  # the results stream it was read from (a partitioned run has one per partition)


class ResultConsumer:
    """Reads trajectories from a results stream through a consumer group.

    Uncommitted entries stay pending: a consumer restarted under the same name reads them again first, and
    entries of a consumer that has been idle longer than ``claim_idle_ms`` are claimed by the others.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        *,
        group: str = DEFAULT_RESULTS_GROUP,
        name: str = "consumer",
        release_inflight: bool = True,
        claim_idle_ms: int = 300_000,
        dedup_ttl_s: int = DEFAULT_DEDUP_TTL_S,
        trim_interval_s: float = 1.0,
        wait: ReplicaWait | None = None,
    ) -> None:
        self.redis = redis
        self.wait = wait  # commits wait for the replicas of their Redis Cluster node (the trainer's: ReplicaWait)
        self.stream = stream
        self.group = group
        self.name = name
        self.release_inflight = release_inflight
        self.claim_idle_ms = claim_idle_ms
        self.dedup_ttl_s = dedup_ttl_s
        self.trim_interval_s = trim_interval_s
        self.codec = Codec()
        self.duplicates_dropped = 0
        self.undecodable = 0
        self._commit = redis.register_script(scripts.COMMIT)
        self._trim = redis.register_script(scripts.TRIM_ACKED)
        self._seen = redis.register_script(scripts.SEEN)
        self._group_ready = False
        self._own_cursor: str | None = "0"  # walks the entries an earlier life of this consumer name left pending
        self._held: set[str] = set()  # entry ids handed out by read() and not committed yet
        self._next_claim = 0.0
        self._next_trim = 0.0

    async def setup(self) -> None:
        """Create the consumer group (and stream) if missing; results published from now on are kept for it."""
        await ensure_group(self.redis, self.stream, self.group)
        self._group_ready = True

    def resync(self) -> None:
        """After Redis was away: walk this consumer's pending list again on the next read (a read whose reply was
        lost with the connection left its entries pending here), skipping what the caller already holds."""
        self._own_cursor = "0"
        self._group_ready = False

    async def read(self, count: int = 256, block_ms: int = 1000) -> list[Delivered]:
        """Up to `count` new trajectories, waiting at most `block_ms` for the first. Duplicates and undecodable
        entries are acked and left out (counted in `duplicates_dropped` / `undecodable`)."""
        if not self._group_ready:
            await self.setup()
        try:
            raw = await self._read_raw(count, block_ms)
            out = await self._filter([e for e in raw if e[0].decode() not in self._held])
        except TRANSIENT_ERRORS:
            # A read whose reply was lost with the connection, or whose entries were read and then not handed out
            # (the duplicate filter failed), left them pending for this consumer: walk its pending list again.
            self._own_cursor = "0"
            raise
        except ResponseError as exc:
            if not is_nogroup(exc):
                raise
            self._group_ready = False
            return []
        self._held.update(d.entry_id for d in out)
        return out

    async def _read_raw(self, count: int, block_ms: int) -> list[_Entry]:
        if self._own_cursor is not None:
            reply = await self.redis.xreadgroup(self.group, self.name, {self.stream: self._own_cursor}, count=count)
            entries = _entries(reply)
            if entries:
                self._own_cursor = entries[-1][0].decode()
                return entries
            self._own_cursor = None
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + self.claim_idle_ms / 4000
            claimed: list[_Entry]
            _, claimed, *_ = await self.redis.xautoclaim(
                self.stream, self.group, self.name, self.claim_idle_ms, "0-0", count=count
            )
            if claimed:
                return claimed
        reply = await self.redis.xreadgroup(self.group, self.name, {self.stream: ">"}, count=count, block=block_ms)
        return _entries(reply)

    async def _filter(self, raw: list[_Entry]) -> list[Delivered]:
        decoded: list[Delivered] = []
        drop: list[tuple[str, str, str]] = []  # (entry id, job id, sample index) to ack without delivering
        for entry_id, fields in raw:
            eid = entry_id.decode()
            payload = (fields or {}).get(PAYLOAD_FIELD)
            try:
                if payload is None:
                    raise CodecError("entry has no payload (deleted or foreign)")
                traj = self.codec.decode_trajectory(payload)
            except CodecError as exc:
                log.warning("dropping undecodable entry %s of %s: %s", eid, self.stream, exc)
                self.undecodable += 1
                drop.append((eid, "", "-1"))
                continue
            decoded.append(Delivered(eid, traj, self.stream))
        if decoded:
            seen_before = await self._seen(
                keys=[consumed_key(self.stream, self.group, d.trajectory.job_id) for d in decoded],
                args=[d.trajectory.sample_index for d in decoded],
            )
            out: list[Delivered] = []
            seen_now: set[tuple[str, int]] = set()
            for d, seen in zip(decoded, seen_before, strict=True):
                key = (d.trajectory.job_id, d.trajectory.sample_index)
                if seen or key in seen_now:
                    self.duplicates_dropped += 1
                    drop.append((d.entry_id, "", "-1"))
                else:
                    seen_now.add(key)
                    out.append(d)
        else:
            out = []
        if drop:
            await self.redis.xack(self.stream, self.group, *[eid for eid, _, _ in drop])
        return out

    async def commit(self, items: list[Delivered]) -> int:
        """Ack the entries and mark their samples consumed. Returns how many were consumed for the first time."""
        if not items:
            await self._maybe_trim()
            return 0
        keys: list[Any] = [self.stream, inflight_key(self.stream)]
        args: list[Any] = [self.group, self.dedup_ttl_s, 1 if self.release_inflight else 0]
        for d in items:
            keys.append(consumed_key(self.stream, self.group, d.trajectory.job_id))
            args.extend((d.entry_id, d.trajectory.sample_index))
        if self.wait is not None:
            fresh = int(await self.wait.script(self._commit, keys, args))
        else:
            fresh = int(await self._commit(keys=keys, args=args))
        self._held.difference_update(d.entry_id for d in items)
        await self._maybe_trim()
        return fresh

    async def _maybe_trim(self) -> None:
        now = time.monotonic()
        if now >= self._next_trim:
            self._next_trim = now + self.trim_interval_s
            await self._trim(keys=[self.stream])


class PartitionedConsumer:
    """The results of a partitioned run: one ResultConsumer per partition's stream (same group and consumer name),
    read together. Each read asks every partition at once (blocking at most `partition_block_ms` there, so a
    quiet partition does not hold up the others' results) and returns up to `count` entries per partition."""

    def __init__(self, parts: list[ResultConsumer], *, partition_block_ms: int = 100) -> None:
        if not parts:
            raise ValueError("a partitioned consumer needs at least one partition")
        self.parts = {part.stream: part for part in parts}
        self.partition_block_ms = partition_block_ms
        # Read from some partitions by a read that failed on another: handed out first by the next read. (Redis
        # delivered them: they are pending for this consumer and held by their part, so no later read returns them.)
        self._carried: list[Delivered] = []

    @property
    def streams(self) -> list[str]:
        return list(self.parts)

    @property
    def duplicates_dropped(self) -> int:
        return sum(part.duplicates_dropped for part in self.parts.values())

    @property
    def undecodable(self) -> int:
        return sum(part.undecodable for part in self.parts.values())

    async def setup(self) -> None:
        for part in self.parts.values():
            await part.setup()

    def resync(self) -> None:
        for part in self.parts.values():
            part.resync()

    async def read(self, count: int = 256, block_ms: int = 1000) -> list[Delivered]:
        """Every partition's new trajectories. When a partition's read fails (its Redis node is away: a Cluster
        failover), the error is raised once all reads are done, and what the others read is kept for the next call
        (a read that moved entries into this consumer's pending list must not be dropped: they would never come
        back, and their groups would never complete)."""
        block = min(block_ms, self.partition_block_ms)
        batches = await asyncio.gather(
            *(part.read(count, block) for part in self.parts.values()), return_exceptions=True
        )
        failed: BaseException | None = None
        for batch in batches:
            if isinstance(batch, BaseException):
                failed = failed or batch
            else:
                self._carried += batch
        if failed is not None:
            raise failed
        out, self._carried = self._carried, []
        return out

    async def commit(self, items: list[Delivered]) -> int:
        """Commit each item on its own partition's stream. Returns how many were consumed for the first time."""
        by_stream: dict[str, list[Delivered]] = {stream: [] for stream in self.parts}
        for d in items:
            by_stream[d.stream].append(d)
        fresh = 0
        for stream, batch in by_stream.items():
            fresh += await self.parts[stream].commit(batch)
        return fresh
