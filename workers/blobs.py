"""Reading jobs' data from the run's blob store (RunKeys.blob): a job whose data travels by reference
(`Job.data_ref`) gets it here. The bytes are checked against their digest and kept in a small cache by digest (a
group's n samples usually reach one worker together: one read for all); each sample decodes its own copy, so a
workflow that changes its data changes no other sample's."""

from __future__ import annotations

import asyncio
import collections

import redis.asyncio as aioredis

from rollq.protocol.blobs import digest_of
from rollq.protocol.keys import RunKeys
from rollq.protocol.limits import describe_bytes


class BlobError(Exception):
    """The job's data can't be had: `kind` names why (JobDataMissing, JobDataCorrupt, JobTooLarge)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class BlobReader:
    """Fetches blobs by digest, at most `max_bytes` (each), keeping up to `cache_bytes` of them."""

    def __init__(self, redis: aioredis.Redis, *, max_bytes: int, cache_bytes: int = 64 << 20) -> None:
        self.redis = redis
        self.max_bytes = max_bytes
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._cached = 0
        self._reading: dict[str, asyncio.Future[bytes]] = {}  # digest -> the read in flight (one per digest)

    async def get(self, keys: RunKeys, digest: str) -> bytes:
        """The payload named `digest` on `keys`' partition. Raises BlobError."""
        try:
            key = keys.blob(digest)
        except ValueError as exc:
            raise BlobError("MalformedJob", str(exc)) from None
        payload = self._cache.get(digest)
        if payload is not None:
            self._cache.move_to_end(digest)
            return payload
        reading = self._reading.get(digest)
        if reading is None:
            reading = self._reading[digest] = asyncio.ensure_future(self._read(key, digest))
            reading.add_done_callback(lambda _: self._reading.pop(digest, None))
        return await asyncio.shield(reading)

    async def _read(self, key: str, digest: str) -> bytes:
        pipe = self.redis.pipeline(transaction=False)
        pipe.strlen(key)
        pipe.getrange(key, 0, self.max_bytes)  # never more than the bound (and one byte to tell it is over)
        size, payload = await pipe.execute()
        if not size:
            raise BlobError(
                "JobDataMissing",
                f"the job's data (blob {digest[:16]}...) is not in Redis: it expired (past its submission's "
                "retention) or was deleted",
            )
        if size > self.max_bytes:
            raise BlobError(
                "JobTooLarge",
                f"the job's data (blob {digest[:16]}...) is {describe_bytes(size)}, over the worker's "
                f"max_job_bytes={self.max_bytes}",
            )
        if digest_of(payload) != digest:
            raise BlobError("JobDataCorrupt", f"the job's data (blob {digest[:16]}...) does not match its digest")
        self._keep(digest, payload)
        return payload

    def _keep(self, digest: str, payload: bytes) -> None:
        if len(payload) > self.cache_bytes // 4:
            return  # one huge payload would push out everything else
        self._cache[digest] = payload
        self._cached += len(payload)
        while self._cached > self.cache_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached -= len(dropped)


__all__ = ["BlobError", "BlobReader"]
