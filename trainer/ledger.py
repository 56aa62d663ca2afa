"""The staleness ledger: samples admitted for generation, against the policy version, kept in Redis.

AReaL's rule, enforced atomically (Lua): by policy version v at most (eta + v + 1) * B samples are admitted, B being
the samples one step trains on. Admission is per group (all n samples of a prompt or none), a group id counts once
however often it is offered (a restarted trainer re-offering its groups admits nothing twice), and a dropped group
gives its samples back. Because the ledger lives in Redis it survives a trainer restart; the trainer's consumption
check (oldest token version >= v - eta) makes the bound exact when completions arrive out of order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from rollq.protocol.keys import RunKeys
from rollq.redis_client import ReplicaWait

# KEYS: ledger, groups. ARGV: group id, samples, B, eta. -> {admitted 1/0, version, samples admitted, limit}
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

# KEYS: ledger, groups. ARGV: group id, reason. Gives a dropped group's samples back, once, and counts them under
# `released:<reason>` in the same step (so the run's drops by reason are as durable as the give-backs: a trainer
# that dies before its next checkpoint loses its own count of them, not this one).
_RELEASE = """
local n = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if n > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], 0)
  redis.call('HINCRBY', KEYS[1], 'admitted', -n)
  redis.call('HINCRBY', KEYS[1], 'released', n)
  redis.call('HINCRBY', KEYS[1], 'released:' .. ARGV[2], n)
end
return n
"""

# KEYS: ledger, groups, partial. ARGV: group id, samples, reason, field. Part of a group goes back, once per field:
# a partial group's failed samples (field: the group id), or what a split group had not trained yet when it was
# dropped (field: `<group id>|rest`; its parts trained earlier stay counted). The group then holds the rest.
_RELEASE_PART = """
if redis.call('HSETNX', KEYS[3], ARGV[4], ARGV[2]) == 0 then return 0 end
local n = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local k = math.min(n, tonumber(ARGV[2]))
if k > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -k)
  redis.call('HINCRBY', KEYS[1], 'admitted', -k)
  redis.call('HINCRBY', KEYS[1], 'released', k)
  redis.call('HINCRBY', KEYS[1], 'released:' .. ARGV[3], k)
end
return k
"""

# KEYS: ledger, groups. ARGV: group id, samples. Records an admission Redis lost (a failover's or an AOF everysec
# restart's last writes) for a group the trainer queued: counted once, whatever the limit (it is in flight already).
# -> 1 if it had to be recorded
_READMIT = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'admitted', ARGV[2])
return 1
"""

# KEYS: ledger. ARGV: version. The trainer's version moves forward only (restore() is the exception).
_SET_VERSION = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local new = tonumber(ARGV[1])
if new > v then redis.call('HSET', KEYS[1], 'version', new) return new end
return v
"""

# KEYS: ledger, groups. ARGV: version, admitted (used only when the ledger is gone), B, eta.
# -> 1 if it had to be rebuilt
_RESTORE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'version', ARGV[1], 'batch', ARGV[3], 'eta', ARGV[4])
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'admitted', ARGV[2], 'released', 0, 'batch', ARGV[3], 'eta', ARGV[4])
return 1
"""


T = TypeVar("T")


def rest_field(group_id: str) -> str:
    """The partial hash's field for what a split group gave back when it was dropped."""
    return f"{group_id}|rest"


class Ride(Protocol):
    """How the trainer's parts make a Redis call: `Trainer.ride` rides out an outage (rollq.redis_client.ride_out)."""

    async def __call__(self, op: Callable[[], Awaitable[T]], what: str) -> T: ...


async def direct(op: Callable[[], Awaitable[T]], what: str) -> T:
    """A Ride that just calls (tests that drive a feeder or collector alone)."""
    return await op()


class Admission(msgspec.Struct, frozen=True):
    admitted: bool
    version: int
    samples_admitted: int  # in the ledger after this call
    limit: int  # (eta + version + 1) * B


class LedgerState(msgspec.Struct, frozen=True):
    version: int
    admitted: int  # samples admitted and not given back (in flight, waiting, or trained)
    released: int  # samples given back by dropped groups
    released_by_reason: dict[str, int] = {}  # the same, per drop reason (stale, failed, future, invalid)


class StalenessLedger:
    """The ledger's writes are Lua scripts, each safe to repeat. With `wait` (the trainer's ReplicaWait) each write
    waits for the replicas of its Redis Cluster node, so a failover keeps it; what one loses anyway, the trainer
    writes again (Trainer._recover)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        run: str,
        batch_samples: int,
        max_staleness: int,
        *,
        wait: ReplicaWait | None = None,
    ) -> None:
        self.redis = redis
        self.keys = RunKeys(run)
        self.batch_samples = batch_samples
        self.max_staleness = max_staleness
        self.wait = wait
        self.published: int | None = None  # the version this ledger object last wrote (set_version, restore, reset)
        self._admit = redis.register_script(_ADMIT)
        self._release = redis.register_script(_RELEASE)
        self._set_version = redis.register_script(_SET_VERSION)
        self._restore = redis.register_script(_RESTORE)
        self._readmit = redis.register_script(_READMIT)
        self._release_part = redis.register_script(_RELEASE_PART)

    def limit(self, version: int) -> int:
        return (self.max_staleness + version + 1) * self.batch_samples

    async def _write(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        if self.wait is not None:
            return await self.wait.script(script, keys, args)
        return await script(keys=keys, args=args)

    async def admit(self, group_id: str, samples: int) -> Admission:
        """Admit a whole group or nothing. A group admitted before is admitted again without counting."""
        ok, version, admitted, limit = await self._write(
            self._admit,
            [self.keys.ledger, self.keys.ledger_groups],
            [group_id, samples, self.batch_samples, self.max_staleness],
        )
        return Admission(bool(ok), int(version), int(admitted), int(limit))

    async def release(self, group_id: str, reason: str = "dropped") -> int:
        """Give a dropped group's samples back (once), counted under its drop reason. Returns how many."""
        return int(await self._write(self._release, [self.keys.ledger, self.keys.ledger_groups], [group_id, reason]))

    async def release_part(self, group_id: str, samples: int, reason: str) -> int:
        """A partial group gives back `samples` (its failed ones), once, counted under `reason`."""
        keys = [self.keys.ledger, self.keys.ledger_groups, self.keys.ledger_partial]
        return int(await self._write(self._release_part, keys, [group_id, samples, reason, group_id]))

    async def release_rest(self, group_id: str, samples: int, reason: str) -> int:
        """A split group, dropped after parts of it trained, gives back the `samples` it had not trained, once."""
        keys = [self.keys.ledger, self.keys.ledger_groups, self.keys.ledger_partial]
        return int(await self._write(self._release_part, keys, [group_id, samples, reason, rest_field(group_id)]))

    async def readmit(self, group_id: str, samples: int) -> bool:
        """Record again the admission of a group the trainer queued, if Redis lost it. True if it had to."""
        return bool(await self._write(self._readmit, [self.keys.ledger, self.keys.ledger_groups], [group_id, samples]))

    async def set_version(self, version: int) -> int:
        """Publish the trainer's version (it only moves forward); returns the ledger's."""
        current = int(await self._write(self._set_version, [self.keys.ledger], [version]))
        self.published = max(version, self.published or 0)
        return current

    async def restore(self, version: int, trained_samples: int) -> bool:
        """A restarted trainer's version (from its checkpoint). If Redis lost the ledger, it is rebuilt from what
        the checkpoint knows (the samples trained so far); returns True then."""
        rebuilt = bool(
            await self._write(
                self._restore,
                [self.keys.ledger, self.keys.ledger_groups],
                [version, trained_samples, self.batch_samples, self.max_staleness],
            )
        )
        self.published = version
        return rebuilt

    async def state(self) -> LedgerState:
        raw = await self.redis.hgetall(self.keys.ledger)  # type: ignore[misc]  # redis-py stub: sync|async union
        return LedgerState(
            version=int(raw.get(b"version", 0)),
            admitted=int(raw.get(b"admitted", 0)),
            released=int(raw.get(b"released", 0)),
            released_by_reason={
                k.decode().removeprefix("released:"): int(v) for k, v in raw.items() if k.startswith(b"released:")
            },
        )

    async def reset(self) -> None:
        """A fresh run: version 0, nothing admitted."""
        await self.redis.delete(self.keys.ledger_groups, self.keys.ledger_partial)
        await self.redis.hset(  # type: ignore[misc]  # redis-py stub: sync|async union
            self.keys.ledger,
            mapping={
                "version": 0,
                "admitted": 0,
                "released": 0,
                "batch": self.batch_samples,
                "eta": self.max_staleness,
            },
        )
        self.published = 0


__all__ = ["Admission", "LedgerState", "Ride", "StalenessLedger", "direct", "rest_field"]
