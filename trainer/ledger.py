"""The staleness ledger: how many samples have been admitted for generation, against the policy version, in Redis.

Admission is atomic (Lua) and bounded: by policy version v, at most (eta + v + 1) * B samples are admitted, B being
the samples one step trains on. A sample admitted at version v therefore trains at a version of at most v + eta —
which the trainer also checks at consumption, dropping anything older. A job id is admitted at most once (a
restarted trainer re-submitting the same jobs counts nothing twice); a dropped group gives its capacity back.
The ledger lives in Redis, so it survives a trainer restart.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis

from protocol.keys import RunKeys

# KEYS: ledger hash, admitted-jobs hash. ARGV: job id, samples, B, eta.
# -> {admitted (1/0), version, samples admitted, limit}
_ADMIT = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local admitted = tonumber(redis.call('HGET', KEYS[1], 'admitted') or '0')
local limit = (tonumber(ARGV[4]) + v + 1) * tonumber(ARGV[3])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return {1, v, admitted, limit}
end
local n = tonumber(ARGV[2])
if admitted + n > limit then
  return {0, v, admitted, limit}
end
redis.call('HSET', KEYS[2], ARGV[1], n)
redis.call('HINCRBY', KEYS[1], 'admitted', n)
return {1, v, admitted + n, limit}
"""

# KEYS: ledger hash, admitted-jobs hash. ARGV: job id. Gives a dropped job's samples back (once).
_RELEASE = """
local n = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if n > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], 0)
  redis.call('HINCRBY', KEYS[1], 'admitted', -n)
  redis.call('HINCRBY', KEYS[1], 'dropped', n)
end
return n
"""

# KEYS: ledger hash. ARGV: version. Versions only move forward.
_SET_VERSION = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if tonumber(ARGV[1]) > v then redis.call('HSET', KEYS[1], 'version', ARGV[1]) end
return math.max(v, tonumber(ARGV[1]))
"""


class Admission(msgspec.Struct, frozen=True):
    admitted: bool
    version: int
    samples_admitted: int
    limit: int


class LedgerState(msgspec.Struct, frozen=True):
    version: int
    admitted: int
    dropped: int


class StalenessLedger:
    def __init__(self, redis: aioredis.Redis, run: str, batch_samples: int, max_staleness: int) -> None:
        self.redis = redis
        self.keys = RunKeys(run)
        self.jobs_key = f"{self.keys.ledger}:jobs"
        self.batch_samples = batch_samples
        self.max_staleness = max_staleness
        self._admit = redis.register_script(_ADMIT)
        self._release = redis.register_script(_RELEASE)
        self._set_version = redis.register_script(_SET_VERSION)

    async def admit(self, job_id: str, samples: int) -> Admission:
        ok, version, admitted, limit = await self._admit(
            keys=[self.keys.ledger, self.jobs_key], args=[job_id, samples, self.batch_samples, self.max_staleness])
        return Admission(bool(ok), int(version), int(admitted), int(limit))

    async def release(self, job_id: str) -> int:
        return int(await self._release(keys=[self.keys.ledger, self.jobs_key], args=[job_id]))

    async def set_version(self, version: int) -> int:
        return int(await self._set_version(keys=[self.keys.ledger], args=[version]))

    async def restore_version(self, version: int) -> None:
        """A restarted trainer's version (from its checkpoint), even if the ledger had moved past it."""
        await self.redis.hset(self.keys.ledger, "version", version)

    async def state(self) -> LedgerState:
        raw = await self.redis.hgetall(self.keys.ledger)
        get = lambda k: int(raw.get(k.encode(), 0))  # noqa: E731
        return LedgerState(version=get("version"), admitted=get("admitted"), dropped=get("dropped"))

    async def reset(self) -> None:
        await self.redis.delete(self.keys.ledger, self.jobs_key)


__all__ = ["Admission", "LedgerState", "StalenessLedger"]
