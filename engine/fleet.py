"""Fleet control: pause -> update weights -> resume on every engine at once (the router does not forward these)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec

from rollq.engine.client import EngineError, EngineUnavailable, SGLangClient
from rollq.engine.pool import EngineMember, EnginePool
from rollq.engine.types import PauseMode
from rollq.engine.update_counts import counted, read_counts

log = logging.getLogger("rollq.engine")


class FleetResult(msgspec.Struct):
    ok: list[str]
    # url -> "<url><route>: HTTP <status>: <the engine's message or body>", or why nothing answered
    failed: dict[str, str]
    seconds: float
    load_seconds: float = 0.0  # longest weight load reported by an engine (rollq engines report it)


class LoadResult(FleetResult):
    """A weight update in which engines loaded different paths (delta sync): which of them loaded the full weights
    (the others swapped in the delta they prepared)."""

    full: list[str] = []


class CycleReport(msgspec.Struct):
    """One pause -> update -> resume over the fleet: each phase's result, and the seconds per phase (`phases`: what
    `cycle_with` returns)."""

    pause: FleetResult
    update: FleetResult
    resume: FleetResult
    phases: dict[str, float]

    @property
    def updated(self) -> list[str]:
        """The engines that loaded the new weights and were resumed: those that serve the new version now."""
        return [url for url in self.update.ok if url not in self.resume.failed]

    def failures(self) -> dict[str, list[str]]:
        """Each engine's failed calls in this cycle, phase by phase (a failed pause alone does not keep an engine
        from being updated)."""
        out: dict[str, list[str]] = {}
        for result in (self.pause, self.update, self.resume):
            for url, error in result.failed.items():
                out.setdefault(url, []).append(error)
        return out


class FleetController:
    """Idempotent, retried control calls on every engine of a pool, concurrently. An engine that fails a weight update
    is marked stale (out of routing) and reloaded to the current version by `reconcile()`; one whose control calls
    cannot connect is dead and leaves routing at once (its requests fail over).

    The pool is told which engines the fleet paused or is loading: their health checks then block and answer 503
    (SGLang's /health_generate while paused or updating), which must not read as death."""

    def __init__(self, pool: EnginePool, *, retries: int = 3, retry_delay_s: float = 0.2) -> None:
        self.pool = pool
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.weights_path: str | None = None
        self.pause_mode: PauseMode | None = None  # the mode of the pause in force, None when running

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
                except EngineUnavailable as exc:  # engine, route, and the HTTP status or why nothing answered
                    error, unreachable = str(exc), exc.unreachable
                except EngineError as exc:  # the engine refused: retrying the same call won't help
                    return str(exc)  # engine, route, HTTP status and the engine's message (a 401 names the setting)
                if attempt < self.retries:
                    await asyncio.sleep(self.retry_delay_s * (attempt + 1))
            if unreachable:  # dead, not paused: out of routing now so its requests fail over
                self.pool.evict(member.url, f"{what}: {error}")
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
        members = self.pool.engines()
        self.pool.set_paused(members, True)  # before the call: health checks from now on may block and 503
        self.pause_mode = mode
        return await self._on_all(f"pause({mode})", lambda c: c.pause_generation(mode), members)

    async def resume(self) -> FleetResult:
        try:
            return await self._on_all("resume", lambda c: c.continue_generation())
        finally:
            self.pool.set_paused(self.pool.engines(), False)
            self.pause_mode = None

    def _load(self, path: str, version: str) -> Callable[[SGLangClient], Awaitable[Any]]:
        # 0.5.23 flushes the prefix cache after a load by default, and answers 400 (weights loaded, version not
        # updated) when the running batch still holds requests, which an in_place pause leaves there. Never
        # abort_all_requests: the pause already decided what happens to in-flight work.
        flush = self.pause_mode != "in_place"
        return lambda c: c.update_weights_from_disk(
            path, weight_version=version, flush_cache=flush, abort_all_requests=False
        )

    async def update_weights(self, path: str, version: str | int) -> FleetResult:
        version = str(version)
        self.weights_path = path
        members = self.pool.engines()
        with self.pool.weight_update(version, members):
            result = await self._on_all(f"update_weights({version})", self._load(path, version), members)
        for url in result.failed:
            self.pool.mark_stale(url)
        for url in result.ok:
            self.pool.mark_loaded(url, version)
        return result

    async def update_weights_each(
        self,
        version: str | int,
        paths: Mapping[str, str],
        full_path: str,
        *,
        full: Callable[[], Awaitable[str]] | None = None,
    ) -> LoadResult:
        """`update_weights`, each engine loading its own path: `paths[url]` (the load_path a delta's prepare
        answered) or else `full_path` (the full version, which `reconcile` reloads later). An engine that refuses its
        delta (it no longer holds the delta's base) loads the full version at once: `full()` returns its path
        (writing it first when it is not on disk yet)."""
        version = str(version)
        self.weights_path = full_path
        members = self.pool.engines()
        loaded_full: set[str] = set()

        async def load(client: SGLangClient) -> Any:
            path = paths.get(client.url)
            if path is not None:
                try:
                    return await self._load(path, version)(client)
                except EngineError as exc:
                    log.warning("engine %s refused its delta (%s): it loads the full version", client.url, exc)
            loaded_full.add(client.url)
            return await self._load(await full() if full is not None else full_path, version)(client)

        with self.pool.weight_update(version, members):
            result = await self._on_all(f"update_weights({version})", load, members)
        for url in result.failed:
            self.pool.mark_stale(url)
        for url in result.ok:
            self.pool.mark_loaded(url, version)
        return LoadResult(
            ok=result.ok,
            failed=result.failed,
            seconds=result.seconds,
            load_seconds=result.load_seconds,
            full=[m.url for m in members if m.url in loaded_full],
        )

    async def swap_prepared(self, version: str | int, members: list[EngineMember]) -> FleetResult:
        """Distributed delta sync, under the pause: each engine serves the version it staged at
        /rollq/prepare_weights. Engines that fail are left to the caller (it sends them the full weights)."""
        version = str(version)
        flush = self.pause_mode != "in_place"  # as _load: an in_place pause keeps requests that a flush refuses
        with self.pool.weight_update(version, members):
            result = await self._on_all(
                f"swap_prepared_weights({version})",
                lambda c: c.swap_prepared_weights(version, flush_cache=flush),
                members,
            )
        for url in result.ok:
            self.pool.mark_loaded(url, version)
        return result

    async def reconcile(self) -> FleetResult:
        """Reload stale engines to the fleet's current weights; they rejoin routing when that succeeds."""
        stale = self.pool.engines(stale_only=True)
        if not stale or self.weights_path is None or self.pool.target_version is None:
            return FleetResult([], {}, 0.0)
        path, version = self.weights_path, self.pool.target_version
        with self.pool.hold(stale):
            result = await self._on_all(f"reload({version})", self._load(path, version), stale)
        for url in result.ok:
            self.pool.mark_loaded(url, version)
        return result

    async def cycle(self, path: str, version: str | int, *, mode: PauseMode = "retract") -> dict[str, float]:
        """pause -> update_weights(path) -> resume (see `cycle_with`)."""
        return await self.cycle_with(lambda: self.update_weights(path, version), mode=mode)

    async def cycle_with(
        self, update_weights: Callable[[], Awaitable[FleetResult]], *, mode: PauseMode = "retract"
    ) -> dict[str, float]:
        """pause -> `update_weights()` (from disk, or a broadcast) -> resume. Returns seconds per phase; `control_s`
        is the total minus the slowest engine's weight load (what the control plane itself costs). Generation
        resumes right after the load. Failures are only logged: `run_cycle` reports them."""
        return (await self.run_cycle(update_weights, mode=mode)).phases

    async def run_cycle(
        self, update_weights: Callable[[], Awaitable[FleetResult]], *, mode: PauseMode = "retract"
    ) -> CycleReport:
        """`cycle_with`, reporting which engines each phase reached (`CycleReport.updated`: those serving the new
        weights), so a caller can refuse to go on with too few. `aborted` and `retracted` are the requests the engines
        aborted and retracted meanwhile (engine/update_counts.py: their counters read before the pause and after the
        resume, outside the timed phases)."""
        counters = self.pool.engines()
        before = await read_counts(counters)
        t0 = time.monotonic()
        try:
            paused = await self.pause(mode)
            t1 = time.monotonic()
            update = await update_weights()
            t2 = time.monotonic()
        finally:
            resumed = await self.resume()  # whatever happened: never leave the fleet paused, nor marked paused
        t3 = time.monotonic()
        phases = {
            "pause_s": t1 - t0,
            "update_s": t2 - t1,
            "resume_s": t3 - t2,
            "total_s": t3 - t0,
            "paused_s": t3 - t0,  # generation held: from the pause call until the resume answered
            "load_s": update.load_seconds,
            "control_s": t3 - t0 - update.load_seconds,
        }
        phases.update(counted(before, await read_counts(counters)))
        return CycleReport(pause=paused, update=update, resume=resumed, phases=phases)

    # -- LoRA adapters: loaded beside the others, never a pause --------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> CycleReport:
        """Load adapter `name` on every engine, generation going on (SGLang loads adapters without pausing). An
        engine that has it already counts as updated (a retried cycle, a resumed trainer). Reported as a cycle with
        no pause and no resume, so the trainer's update requirement (trainer/publish.py) applies as to a full one."""
        t0 = time.monotonic()

        async def load(client: SGLangClient) -> None:
            try:
                await client.load_lora_adapter(name, path)
            except EngineError as exc:
                if "already loaded" not in str(exc):
                    raise

        update = await self._on_all(f"load_lora_adapter({name})", load)
        seconds = time.monotonic() - t0
        none = FleetResult([], {}, 0.0)
        phases = {"pause_s": 0.0, "update_s": seconds, "resume_s": 0.0, "total_s": seconds, "load_s": seconds}
        phases["paused_s"] = 0.0  # generation goes on while an adapter loads
        return CycleReport(pause=none, update=update, resume=none, phases={**phases, "control_s": 0.0})

    async def unload_adapter(self, name: str) -> FleetResult:
        """Unload `name` wherever it is loaded; each engine answers once its requests on it finished (SGLang waits,
        never aborts), so this takes as long as the longest of them."""

        async def unload(client: SGLangClient) -> None:
            try:
                await client.unload_lora_adapter(name)
            except EngineError as exc:
                if "does not exist" not in str(exc):
                    raise

        return await self._on_all(f"unload_lora_adapter({name})", unload)
