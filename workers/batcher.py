"""Batches the Redis writes of many concurrent jobs into one MULTI/EXEC, retrying through Redis outages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from rollq.protocol import scripts as lua
from rollq.protocol.keys import PAYLOAD_FIELD
from rollq.redis_client import TRANSIENT_ERRORS, OutageClock, RedisUnavailable, is_cluster

log = logging.getLogger("rollq.worker")


class _ScriptOp:
    def __init__(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> None:
        self.script, self.keys, self.args = script, keys, args

    async def queue(self, pipe: Any) -> None:
        await self.script(keys=self.keys, args=self.args, client=pipe)

    def queue_evalsha(self, pipe: Any) -> None:
        """Queue as a raw EVALSHA: redis-py's cluster pipeline refuses scripts (NOSCRIPT is the caller's to handle)."""
        pipe.execute_command("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)


class _PublishOp(NamedTuple):
    """Ack + delete a job entry and publish its trajectory (the hot path: no Lua, so the payload is copied once)."""

    jobs: str
    group: str
    entry_id: str
    stream: str
    payload: bytes
    private: bool = False  # a private reply stream: published only while it exists (XADD NOMKSTREAM)


_Op = _ScriptOp | _PublishOp
_RETRY_ALONE = (NoScriptError, *TRANSIENT_ERRORS)  # a cluster pipeline's per-write errors worth repeating


class WriteBatcher:
    """Writes queued while a transaction is in flight go out together in the next one; each write is atomic on its
    own (and so is the batch). A batch is repeated until Redis answers, which is safe: the scripts are no-ops for
    entries already acked, and a repeated publish is a duplicate that consumers drop by (job id, sample index).

    On Redis Cluster a batch spans slots (partitions), so it goes out as a plain pipeline of scripts instead (each
    write still atomic: a publish is the PUBLISH script); writes the cluster answered with an error that is worth
    repeating (a node that failed over, a script the new primary never loaded) are repeated on their own."""

    def __init__(
        self, redis: aioredis.Redis, max_batch: int = 256, *, outage_s: float = float("inf"), url: str = ""
    ) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self.outage_s = outage_s  # past this, a batch fails with RedisUnavailable (its jobs stay pending: reclaimed)
        self.url = url
        self._queue: list[tuple[_Op, asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()
        self._cluster = is_cluster(redis)
        self._publish = redis.register_script(lua.PUBLISH)

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
                try:
                    await self._execute(batch)
                except Exception as exc:  # a bug must fail its writes, not leave their callers waiting forever
                    log.exception("writing a batch of %d failed", len(batch))
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)

    async def _execute(self, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> None:
        if self._cluster:
            await self._execute_scripts(batch)
            return
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

    async def _execute_scripts(self, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> None:
        """Redis Cluster: every write a script, in one non-transactional pipeline (redis-py sends each node its
        share); the writes that failed with a transient error or NOSCRIPT are repeated (after loading the scripts)."""
        pending = [(self._as_script(op), fut) for op, fut in batch]
        delay = 0.05
        clock = OutageClock(self.url, self.outage_s, f"publishing {len(batch)} results")
        while pending:
            try:
                pipe = self.redis.pipeline(transaction=False)
                for op, _ in pending:
                    op.queue_evalsha(pipe)
                replies = await pipe.execute(raise_on_error=False)
            except TRANSIENT_ERRORS as exc:
                replies = [exc] * len(pending)
            except Exception as exc:
                log.error("redis refused a batch of %d writes: %s: %s", len(pending), type(exc).__name__, exc)
                for _, fut in pending:
                    if not fut.done():
                        fut.set_exception(exc)
                return
            again: list[tuple[_ScriptOp, asyncio.Future[Any]]] = []
            for (op, fut), reply in zip(pending, replies, strict=True):
                if isinstance(reply, _RETRY_ALONE):
                    again.append((op, fut))
                elif not fut.done():
                    (fut.set_exception if isinstance(reply, Exception) else fut.set_result)(reply)
            if not again:
                return
            failure = next(r for r in replies if isinstance(r, _RETRY_ALONE))
            try:
                if not isinstance(failure, NoScriptError):
                    clock.failed(failure)
                    log.warning("redis unavailable for %d writes (%s); retrying in %.2fs", len(again), failure, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                for script in {id(op.script): op.script for op, _ in again}.values():
                    await self.redis.script_load(script.script)
            except RedisUnavailable as gone:
                for _, fut in again:
                    if not fut.done():
                        fut.set_exception(gone)
                return
            except TRANSIENT_ERRORS:
                pass  # loading the scripts failed as well: the next round finds out again
            pending = again

    def _as_script(self, op: _Op) -> _ScriptOp:
        if isinstance(op, _ScriptOp):
            return op
        return _ScriptOp(
            self._publish, [op.jobs, op.stream], [op.group, op.entry_id, op.payload, 1 if op.private else 0]
        )
