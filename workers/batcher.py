"""Batches Lua script calls from many concurrent jobs into pipelines, retrying through Redis outages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from protocol.connection import TRANSIENT_ERRORS

log = logging.getLogger("rollq.worker")


class ScriptBatcher:
    """`await batcher.call(script, keys, args)` returns the script's reply. Calls queued while a pipeline is in flight
    go out together in the next one. A call is repeated until Redis answers, which the scripts make safe: each
    one is a no-op when its entry was already acked."""

    def __init__(self, redis: aioredis.Redis, max_batch: int = 256) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._queue: list[tuple[AsyncScript, list[Any], list[Any], asyncio.Future]] = []
        self._wake = asyncio.Event()

    def call(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((script, keys, args, fut))
        self._wake.set()
        return fut

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[: self.max_batch]
                del self._queue[: self.max_batch]
                await self._execute(batch)

    async def _execute(self, batch: list[tuple[AsyncScript, list[Any], list[Any], asyncio.Future]]) -> None:
        delay = 0.05
        while True:
            try:
                pipe = self.redis.pipeline(transaction=False)
                for script, keys, args, _ in batch:
                    await script(keys=keys, args=args, client=pipe)
                replies = await pipe.execute(raise_on_error=False)
                break
            except TRANSIENT_ERRORS as exc:
                log.warning("redis unavailable while publishing %d results (%s); retrying in %.2fs", len(batch), exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        for (_, _, _, fut), reply in zip(batch, replies):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
