"""Batches the Redis writes of many concurrent jobs into one MULTI/EXEC, retrying through Redis outages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from rollq.protocol.keys import PAYLOAD_FIELD
from rollq.redis_client import TRANSIENT_ERRORS, OutageClock, RedisUnavailable

log = logging.getLogger("rollq.worker")


class _ScriptOp:
    def __init__(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> None:
        self.script, self.keys, self.args = script, keys, args

    async def queue(self, pipe: Any) -> None:
        await self.script(keys=self.keys, args=self.args, client=pipe)


class _PublishOp(NamedTuple):
    """Ack + delete a job entry and publish its trajectory (the hot path: no Lua, so the payload is copied once)."""

    jobs: str
    group: str
    entry_id: str
    stream: str
    payload: bytes
    private: bool = False  # a private reply stream: published only while it exists (XADD NOMKSTREAM)


_Op = _ScriptOp | _PublishOp


class WriteBatcher:
    """Writes queued while a transaction is in flight go out together in the next one; each write is atomic on its
    own (and so is the batch). A batch is repeated until Redis answers, which is safe: the scripts are no-ops for
    entries already acked, and a repeated publish is a duplicate that consumers drop by (job id, sample index)."""

    def __init__(
        self, redis: aioredis.Redis, max_batch: int = 256, *, outage_s: float = float("inf"), url: str = ""
    ) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self.outage_s = outage_s  # past this, a batch fails with RedisUnavailable (its jobs stay pending: reclaimed)
        self.url = url
        self._queue: list[tuple[_Op, asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()

    def _submit(self, op: _Op) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((op, fut))
        self._wake.set()
        return fut

    def script(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> asyncio.Future:
        """Run a Lua script; resolves to its reply."""
        return self._submit(_ScriptOp(script, keys, args))

    def publish(
        self, jobs: str, group: str, entry_id: str, stream: str, payload: bytes, *, private: bool = False
    ) -> asyncio.Future:
        """Ack and delete the job entry and publish its trajectory, atomically; resolves to 1, or to 0 when `private`
        and the stream no longer exists (the entry is acked, the trajectory dropped: the stream is not recreated)."""
        return self._submit(_PublishOp(jobs, group, entry_id, stream, payload, private))

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[: self.max_batch]
                del self._queue[: self.max_batch]
                await self._execute(batch)

    async def _execute(self, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> None:
        scripts = [(op, fut) for op, fut in batch if isinstance(op, _ScriptOp)]
        publishes = [(op, fut) for op, fut in batch if isinstance(op, _PublishOp)]
        acks: dict[tuple[str, str], list[str]] = {}
        for publish, _ in publishes:
            acks.setdefault((publish.jobs, publish.group), []).append(publish.entry_id)
        delay = 0.05
        clock = OutageClock(self.url, self.outage_s, f"publishing {len(batch)} results")
        while True:
            try:
                pipe = self.redis.pipeline(transaction=True)
                for script, _ in scripts:
                    await script.queue(pipe)
                for publish, _ in publishes:
                    pipe.xadd(publish.stream, {PAYLOAD_FIELD: publish.payload}, nomkstream=publish.private)
                for (jobs, group), ids in acks.items():  # one XACK and one XDEL for the whole batch
                    pipe.xack(jobs, group, *ids)
                    pipe.xdel(jobs, *ids)
                replies = await pipe.execute(raise_on_error=False)
                break
            except TRANSIENT_ERRORS as exc:
                try:
                    clock.failed(exc)
                except RedisUnavailable as gone:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(gone)
                    return
                log.warning(
                    "redis unavailable while publishing %d results (%s); retrying in %.2fs", len(batch), exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except Exception as exc:  # refused as a whole (EXECABORT: OOM, ...): nothing was written
                log.error("redis refused a batch of %d writes: %s: %s", len(batch), type(exc).__name__, exc)
                for _, fut in batch:  # each caller sees the error; the loop goes on with the next batch
                    if not fut.done():
                        fut.set_exception(exc)
                return
        ack_errors = {
            key: next(
                (r for r in replies[len(batch) + 2 * i : len(batch) + 2 * i + 2] if isinstance(r, Exception)), None
            )
            for i, key in enumerate(acks)
        }
        # The first len(batch) replies answer the ops; the XACK/XDEL pairs after them were read above.
        ordered: list[tuple[_Op, asyncio.Future[Any]]] = [*scripts, *publishes]
        for (op, fut), reply in zip(ordered, replies[: len(batch)], strict=True):
            if fut.done():
                continue
            if isinstance(op, _PublishOp) and not isinstance(reply, Exception):
                reply = ack_errors[(op.jobs, op.group)] or (0 if reply is None else 1)
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
