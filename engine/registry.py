"""Engine membership through Redis: engines register with a TTL and renew it; pools follow the live set.

Registrations are signed. A pool sends every member its engine keys (the api key on generation, the admin key on
aborts and weight updates), so a URL planted in the registry by anyone who can write Redis would harvest them. An
entry is `URL EXPIRES SIGNATURE`, the signature an HMAC-SHA256 of the registry's key, the URL and the expiry under the
engines' control key (their admin key, else their api key): only a holder of that key can make an entry a pool
accepts, and what the pool then sends it, it holds already. The expiry is signed too, so a copied entry dies with it
(a planted URL can't reuse a stopped engine's entry for longer than its TTL). A pool without keys sends no secret and
accepts every entry (a Redis writer is trusted with the run's data: docs/security.md).

An SGLang engine's entry may name its host agent (`rollq weight-agent`, which prepares its weight deltas): `URL
EXPIRES SIGNATURE agent=AGENT_URL` (unsigned: `URL agent=AGENT_URL`). The trainer sends the agent the engines' admin
key as it sends the engine, so the agent URL is signed with the rest: a Redis writer can neither add one to an
engine's entry nor change it. Entries without an agent are signed as before (pools of earlier releases accept them;
they refuse an entry naming an agent as unsigned).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time

import redis.asyncio as aioredis

from rollq.protocol.keys import RunKeys, fleet_engines_key
from rollq.redis_client import TRANSIENT_ERRORS

log = logging.getLogger("rollq.engine")

_CONTEXT = b"rollq engine registry v1"  # keeps these signatures from meaning anything elsewhere
_MAX_REFUSALS_SAID = 1024  # refused entries are logged once each, up to this many
AGENT_FIELD = "agent="  # the field of an entry naming the engine's host agent


def control_key(api_key: str | None, admin_api_key: str | None) -> str | None:
    """The key registrations are signed and checked with: the one that opens the engines' control routes (the admin
    key when there is one, else the api key, SGLang's rule); None without keys."""
    return admin_api_key or api_key or None


class EngineRegistry:
    def __init__(
        self, redis: aioredis.Redis, run: str, *, ttl_s: float = 10.0, fleet: str = "", key: str | None = None
    ) -> None:
        """The engines of `run`, or with `fleet` those of the fleet several runs share (protocol.keys). `key`: the
        engines' control key (`control_key`): an engine signs its entry with it, a pool accepts only entries signed
        with it; None: entries are unsigned, and a pool accepts any."""
        self.redis = redis
        self.key = fleet_engines_key(fleet) if fleet else RunKeys(run).engines
        self.ttl_s = ttl_s
        self._signing_key = key.encode() if key else None
        self._entries: dict[str, str] = {}  # each URL registered here: its entry in Redis (renewals write new ones)
        self._refusals_said: set[str] = set()

    def signature(self, url: str, expires: str, agent_url: str = "") -> str:
        assert self._signing_key is not None
        parts = [_CONTEXT, self.key.encode(), url.encode(), expires.encode()]
        if agent_url:  # signed with the rest; an entry without one is signed as before this field existed
            parts.append((AGENT_FIELD + agent_url).encode())
        return hmac.new(self._signing_key, b"\n".join(parts), hashlib.sha256).hexdigest()

    def entry(self, url: str, expires: float, agent_url: str = "") -> str:
        """What registers `url` (and its host agent, `agent_url`) until `expires` (epoch seconds): signed when this
        registry has a key."""
        url, agent_url = url.rstrip("/"), agent_url.rstrip("/")
        if agent_url and (not agent_url.startswith(("http://", "https://")) or any(c.isspace() for c in agent_url)):
            raise ValueError(f"an agent URL is http(s)://HOST:PORT, got {agent_url!r}")
        agent = f" {AGENT_FIELD}{agent_url}" if agent_url else ""
        if self._signing_key is None:
            return url + agent
        stamp = f"{expires:.3f}"
        return f"{url} {stamp} {self.signature(url, stamp, agent_url)}{agent}"

    def accepted(self, entry: str, now: float) -> str | None:
        """The URL of `entry` when this pool may send it its keys, else None (said once per entry)."""
        found = self.accepted_member(entry, now)
        return found[0] if found else None

    def accepted_member(self, entry: str, now: float) -> tuple[str, str] | None:
        """(engine URL, agent URL or '') of `entry` when this pool may send them its keys, else None (said once per
        entry)."""
        url, *signed = entry.split(" ")
        agent_url = ""
        if signed and signed[-1].startswith(AGENT_FIELD):
            agent_url = signed.pop().removeprefix(AGENT_FIELD)
        if self._signing_key is None:
            return url, agent_url  # no key to give away
        if len(signed) != 2:
            self._refuse(entry, url, "unsigned")
            return None
        stamp, signature = signed
        expected = self.signature(url, stamp, agent_url)
        if not hmac.compare_digest(signature.encode(), expected.encode()):  # any bytes: no raise
            self._refuse(entry, url, "signed with another key than this process's engine keys")
            return None
        try:
            expired = float(stamp) <= now
        except ValueError:
            self._refuse(entry, url, "its expiry is not a number")
            return None
        return None if expired else (url, agent_url)

    def _refuse(self, entry: str, url: str, why: str) -> None:
        if entry not in self._refusals_said and len(self._refusals_said) < _MAX_REFUSALS_SAID:
            self._refusals_said.add(entry)
            log.warning(
                "engine registry entry %r ignored: %s (an engine registers with its own keys; a URL written there "
                "by anyone else gets no request)",
                url[:200],
                why,
            )

    async def register(self, url: str, agent_url: str = "") -> None:
        """`url` is live for ttl_s; `agent_url`: the host agent that prepares its weight deltas (an SGLang engine's
        `rollq weight-agent`), '' for an engine that prepares its own."""
        url = url.rstrip("/")
        expires = time.time() + self.ttl_s
        entry = self.entry(url, expires, agent_url)
        await self.redis.zadd(self.key, {entry: expires})
        previous, self._entries[url] = self._entries.get(url), entry
        if previous is not None and previous != entry:  # after the new one is in: the URL is never missing
            await self.redis.zrem(self.key, previous)

    async def deregister(self, url: str) -> None:
        url = url.rstrip("/")
        previous = self._entries.pop(url, None)
        await self.redis.zrem(self.key, *{url, *([previous] if previous else [])})

    async def live(self) -> list[str]:
        """The registered engines this process may call with its keys."""
        return list(await self.live_members())

    async def live_members(self) -> dict[str, str]:
        """The registered engines this process may call with its keys, each with its host agent's URL ('' = none)."""
        now = time.time()
        await self.redis.zremrangebyscore(self.key, "-inf", now)
        entries = [e.decode(errors="replace") for e in await self.redis.zrangebyscore(self.key, now, "+inf")]
        members: dict[str, str] = {}
        for entry in entries:
            found = self.accepted_member(entry, now)
            if found and (found[1] or found[0] not in members):  # a renewal's two entries: the same agent
                members[found[0]] = found[1]
        return members

    async def keep_registered(self, url: str, agent_url: str = "") -> None:
        """Engine side: renew the registration (with its host agent's URL, if any) every ttl/3 until cancelled, then
        deregister."""
        try:
            while True:
                try:
                    await self.register(url, agent_url)
                except TRANSIENT_ERRORS as exc:
                    log.warning("cannot renew engine registration (%s)", exc)
                await asyncio.sleep(self.ttl_s / 3)
        finally:
            try:
                await asyncio.shield(self.deregister(url))
            except TRANSIENT_ERRORS:
                pass


__all__ = ["AGENT_FIELD", "EngineRegistry", "control_key"]
