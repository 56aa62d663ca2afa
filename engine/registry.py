"""Engine membership through Redis: engines register with a TTL and renew it; pools follow the live set."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from rollq.protocol.keys import RunKeys, fleet_engines_key
from rollq.redis_client import TRANSIENT_ERRORS

log = logging.getLogger("rollq.engine")


class EngineRegistry:
    def __init__(self, redis: aioredis.Redis, run: str, *, ttl_s: float = 10.0, fleet: str = "") -> None:
        """The engines of `run`, or with `fleet` those of the fleet several runs share (protocol.keys)."""
        self.redis = redis
        self.key = fleet_engines_key(fleet) if fleet else RunKeys(run).engines
        self.ttl_s = ttl_s

    async def register(self, url: str) -> None:
        await self.redis.zadd(self.key, {url.rstrip("/"): time.time() + self.ttl_s})

    async def deregister(self, url: str) -> None:
        await self.redis.zrem(self.key, url.rstrip("/"))

    async def live(self) -> list[str]:
        now = time.time()
        await self.redis.zremrangebyscore(self.key, "-inf", now)
        return [u.decode() for u in await self.redis.zrangebyscore(self.key, now, "+inf")]

    async def keep_registered(self, url: str) -> None:
        """Engine side: renew the registration every ttl/3 until cancelled, then deregister."""
        try:
            while True:
                try:
                    await self.register(url)
                except TRANSIENT_ERRORS as exc:
                    log.warning("cannot renew engine registration (%s)", exc)
                await asyncio.sleep(self.ttl_s / 3)
        finally:
            try:
                await asyncio.shield(self.deregister(url))
            except TRANSIENT_ERRORS:
                pass
