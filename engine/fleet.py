"""Fleet control: pause -> update weights -> resume on every engine at once (the router does not forward these)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rollq.engine.client import EngineError, EngineUnavailable, SGLangClient
from rollq.engine.pool import EngineMember, EnginePool
from rollq.engine.types import PauseMode

log = logging.getLogger("rollq.engine")


class FleetResult(msgspec.Struct):
    ok: list[str]
    failed: dict[str, str]  # url -> error
    seconds: float
    load_seconds: float = 0.0  # longest weight load reported by an engine (rollq engines report it)


class FleetController:
    """Idempotent, retried control calls on every engine of a pool, concurrently. An engine that fails a weight update
    is marked stale (out of routing) and reloaded to the current version by `reconcile()`."""

    def __init__(self, pool: EnginePool, *, retries: int = 3, retry_delay_s: float = 0.2) -> None:
        self.pool = pool
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.weights_path: str | None = None

    async def _on_all(
        self, what: str, call: Callable[[SGLangClient], Awaitable[Any]], members: list[EngineMember] | None = None
    ) -> FleetResult:
        started = time.monotonic()
        members = self.pool.engines() if members is None else members

        loads: list[float] = []

        async def one(member: EngineMember) -> str | None:
            for attempt in range(self.retries + 1):
                try:
                    reply = await call(member.client)
                    if isinstance(reply, dict) and "load_seconds" in reply:
                        loads.append(float(reply["load_seconds"]))
                    return None
                except EngineUnavailable as exc:
                    error = exc.reason
                except EngineError as exc:
                    return exc.message  # the engine refused: retrying the same call won't help
                if attempt < self.retries:
                    await asyncio.sleep(self.retry_delay_s * (attempt + 1))
            return error

        errors = await asyncio.gather(*(one(m) for m in members))
        result = FleetResult(
            ok=[m.url for m, e in zip(members, errors, strict=True) if e is None],
            failed={m.url: e for m, e in zip(members, errors, strict=True) if e is not None},
            seconds=time.monotonic() - started,
            load_seconds=max(loads, default=0.0),
        )
        if result.failed:
            log.warning("%s failed on %d engines: %s", what, len(result.failed), result.failed)
        return result

    async def pause(self, mode: PauseMode = "retract") -> FleetResult:
        return await self._on_all(f"pause({mode})", lambda c: c.pause_generation(mode))

    async def resume(self) -> FleetResult:
        return await self._on_all("resume", lambda c: c.continue_generation())

    async def update_weights(self, path: str, version: str | int) -> FleetResult:
        version = str(version)
        self.weights_path = path
        with self.pool.weight_update(version):
            result = await self._on_all(
                f"update_weights({version})", lambda c: c.update_weights_from_disk(path, weight_version=version)
            )
        for url in result.failed:
            self.pool.mark_stale(url)
        for url in result.ok:
            self.pool.mark_loaded(url, version)
        return result

    async def reconcile(self) -> FleetResult:
        """Reload stale engines to the fleet's current weights; they rejoin routing when that succeeds."""
        stale = self.pool.engines(stale_only=True)
        if not stale or self.weights_path is None or self.pool.target_version is None:
            return FleetResult([], {}, 0.0)
        path, version = self.weights_path, self.pool.target_version
        result = await self._on_all(
            f"reload({version})", lambda c: c.update_weights_from_disk(path, weight_version=version), stale
        )
        for url in result.ok:
            self.pool.mark_loaded(url, version)
        return result

    async def cycle(self, path: str, version: str | int, *, mode: PauseMode = "retract") -> dict[str, float]:
        """pause -> update -> resume. Returns seconds per phase; `control_s` is the total minus the slowest engine's
        weight load (what the control plane itself costs). Generation resumes right after the load."""
        t0 = time.monotonic()
        await self.pause(mode)
        t1 = time.monotonic()
        update = await self.update_weights(path, version)
        t2 = time.monotonic()
        await self.resume()
        t3 = time.monotonic()
        return {
            "pause_s": t1 - t0,
            "update_s": t2 - t1,
            "resume_s": t3 - t2,
            "total_s": t3 - t0,
            "load_s": update.load_seconds,
            "control_s": t3 - t0 - update.load_seconds,
        }
