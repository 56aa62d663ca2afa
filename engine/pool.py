"""EnginePool: routing with affinity, health checks, failover, and generation that survives pauses, weight updates
and dead engines (the `engine` handed to workflows)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from rollq.engine.client import EngineError, EngineUnavailable, SGLangClient
from rollq.engine.http import shared_http_session
from rollq.engine.types import GenerateResult, ModelRequest, ModelResponse, ProgressCallback

if TYPE_CHECKING:
    from rollq.engine.registry import EngineRegistry

log = logging.getLogger("rollq.engine")

_NONE: frozenset[str] = frozenset()
_TRAILING_INT = re.compile(r"(\d+)$")


@functools.lru_cache(maxsize=4096)
def version_number(weight_version: str) -> int:
    """Policy version as an int: "3" -> 3, "step-3" -> 3; anything else (SGLang's "default") -> -1."""
    m = _TRAILING_INT.search(weight_version or "")
    return int(m.group(1)) if m else -1


def token_versions(result: GenerateResult) -> list[int]:
    """Per-token versions of one answer. 0.5.23 (and rollq's engines) report `weight_versions` ranges when a
    request spans an in-place update; otherwise every token gets the version at completion."""
    n = len(result.output_ids)
    ranges = result.meta_info.get("weight_versions")
    if not ranges:
        return [version_number(result.weight_version)] * n
    out = [version_number(result.weight_version)] * n
    for r in ranges:
        v = version_number(str(r.get("version", "")))
        for i in range(max(0, int(r.get("start", 0))), min(n, int(r.get("end", n)))):
            out[i] = v
    return out


class NoEngineAvailable(Exception):
    pass


async def _abort_quietly(client: SGLangClient, rid: str) -> None:
    try:
        await client.abort_request(rid)
    except (EngineError, EngineUnavailable):
        pass


class PoolConfig(msgspec.Struct, kw_only=True):
    urls: list[str] = []
    api_key: str | None = None
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    fail_threshold: int = 2  # consecutive failed health checks before an engine leaves routing
    no_engine_timeout_s: float = 60.0  # how long a request waits for any healthy engine
    max_failovers: int = 8  # engines a request may die on before it fails
    max_resubmissions: int = 64  # aborted segments of one request before it is returned as aborted
    affinity_capacity: int = 100_000


class EngineMember:
    __slots__ = ("url", "client", "healthy", "stale", "outstanding", "failures", "weight_version")

    def __init__(self, url: str, client: SGLangClient) -> None:
        self.url = url
        self.client = client
        self.healthy = True  # optimistic until a check or a request says otherwise
        self.stale = False  # failed a weight update: out of routing until reloaded
        self.outstanding = 0
        self.failures = 0
        self.weight_version = ""

    @property
    def routable(self) -> bool:
        return self.healthy and not self.stale


class EnginePool:
    def __init__(self, config: PoolConfig, *, http: aiohttp.ClientSession | None = None) -> None:
        self.config = config
        self._own_http = http is None
        self.http = http  # created in start(): a ClientSession needs the running loop
        self.members: dict[str, EngineMember] = {}
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._changed = asyncio.Event()
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._rid_counter = itertools.count()
        self._target_version: str | None = None  # the fleet's weights; engines on another version are stale
        self._updating = False  # a fleet update is under way: versions read now say nothing about staleness
        self.static_urls = {u.rstrip("/") for u in config.urls}  # never removed by the registry
        self._registry_task: asyncio.Task | None = None
        for url in config.urls:
            self.add(url)

    # -- membership --------------------------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        if self.http is None:
            self.http = shared_http_session()
        return self.http

    def add(self, url: str) -> EngineMember:
        url = url.rstrip("/")
        member = self.members.get(url)
        if member is None:
            member = self.members[url] = EngineMember(
                url, SGLangClient(url, self._session(), api_key=self.config.api_key)
            )
            log.info("engine %s joined the pool", url)
            self._signal()
        return member

    def remove(self, url: str) -> None:
        if self.members.pop(url.rstrip("/"), None) is not None:
            log.info("engine %s left the pool", url)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def start(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    def follow(self, registry: EngineRegistry, interval_s: float = 1.0) -> None:
        """Keep membership in step with a Redis engine registry (engines join and leave live)."""
        self._registry_task = asyncio.create_task(self._follow(registry, interval_s), name="engine-registry")

    async def sync_registry(self, registry: EngineRegistry) -> None:
        live = set(await registry.live())
        for url in live - set(self.members):
            self.add(url)
        for url in set(self.members) - live - self.static_urls:
            self.remove(url)

    async def _follow(self, registry: EngineRegistry, interval_s: float) -> None:
        while True:
            try:
                await self.sync_registry(registry)
            except Exception as exc:  # Redis away: keep the last known membership
                log.warning("engine registry unavailable: %s", exc)
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for task in (self._health_task, self._registry_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._health_task = self._registry_task = None
        if self._own_http and self.http is not None:
            await self.http.close()
            self.http = None

    async def __aenter__(self) -> EnginePool:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- weight versions (driven by the FleetController) --------------------------------------------------------

    @property
    def target_version(self) -> str | None:
        """The weight version the fleet moved to last; an engine reporting another one is stale."""
        return self._target_version

    @property
    def updating(self) -> bool:
        return self._updating

    def engines(self, *, stale_only: bool = False) -> list[EngineMember]:
        """The current members (a snapshot)."""
        return [m for m in self.members.values() if m.stale or not stale_only]

    @contextlib.contextmanager
    def weight_update(self, version: str) -> Iterator[None]:
        """While the fleet loads `version`: engines' reported versions say nothing about staleness yet."""
        self._target_version = version
        self._updating = True
        try:
            yield
        finally:
            self._updating = False

    def mark_loaded(self, url: str, version: str) -> None:
        """`url` serves `version` (the fleet's): back in routing if it was stale."""
        member = self.members.get(url)
        if member is not None:
            member.weight_version = version
            if member.stale:
                member.stale = False
                self._signal()  # requests waiting for an engine may go there now

    def mark_stale(self, url: str) -> None:
        """`url` failed to load the fleet's weights: out of routing until reloaded."""
        member = self.members.get(url)
        if member is not None:
            member.stale = True

    async def check_health(self) -> None:
        members = list(self.members.values())
        results = await asyncio.gather(
            *(m.client.health_generate(timeout=self.config.health_timeout_s) for m in members)
        )
        if self.target_version is not None:
            await self._check_versions([m for m, ok in zip(members, results, strict=True) if ok])
        for member, ok in zip(members, results, strict=True):
            if ok:
                if not member.healthy:
                    log.info("engine %s is healthy again", member.url)
                    member.healthy = True
                    self._signal()
                member.failures = 0
            else:
                member.failures += 1
                if member.healthy and member.failures >= self.config.fail_threshold:
                    self._evict(member, "failed health checks")

    async def _check_versions(self, members: list[EngineMember]) -> None:
        target = self._target_version
        if self._updating:
            return
        versions = await asyncio.gather(*(m.client.weight_version() for m in members), return_exceptions=True)
        if self._updating or self._target_version != target:  # an update began or ended meanwhile: look next time
            return
        for member, version in zip(members, versions, strict=True):
            if isinstance(version, str):
                member.weight_version = version
                stale = version != self.target_version
                if stale != member.stale:
                    log.info(
                        "engine %s is %s (version %s, fleet at %s)",
                        member.url,
                        "stale" if stale else "current again",
                        version,
                        self.target_version,
                    )
                    member.stale = stale
                    if not stale:
                        self._signal()

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # a bug here must not stop health checking
                log.exception("health check failed")
            await asyncio.sleep(self.config.health_interval_s)

    def _evict(self, member: EngineMember, why: str) -> None:
        if member.healthy:
            log.warning("engine %s leaves routing: %s", member.url, why)
        member.healthy = False
        for key in [k for k, url in self._affinity.items() if url == member.url]:
            del self._affinity[key]

    # -- routing -----------------------------------------------------------------------------------------------------

    def route(
        self, affinity: str, exclude: frozenset[str] = frozenset(), prefer: EngineMember | None = None
    ) -> EngineMember | None:
        """The engine this affinity key sticks to while it is routable (else `prefer`, e.g. the engine that holds a
        resubmitted request's prefix); else the one with least outstanding work."""
        if prefer is not None and not affinity and prefer.routable and prefer.url not in exclude:
            return prefer
        url = self._affinity.get(affinity) if affinity else None
        if url is not None:
            member = self.members.get(url)
            if member is not None and member.routable and url not in exclude:
                self._affinity.move_to_end(affinity)
                return member
        candidates = [m for m in self.members.values() if m.routable and m.url not in exclude]
        if not candidates:
            return None
        member = min(candidates, key=lambda m: m.outstanding)
        if affinity:
            self._affinity[affinity] = member.url
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > self.config.affinity_capacity:
                self._affinity.popitem(last=False)
        return member

    async def _wait_for_engine(
        self, affinity: str, exclude: frozenset[str], deadline: float, prefer: EngineMember | None = None
    ) -> EngineMember:
        while True:
            member = self.route(affinity, exclude, prefer) or self.route(affinity)
            if member is not None:
                return member
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoEngineAvailable(
                    f"no healthy engine among {len(self.members)} for {self.config.no_engine_timeout_s}s"
                )
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, self.config.health_interval_s))
            except TimeoutError:
                if self._health_task is None:
                    await self.check_health()

    # -- generation --------------------------------------------------------------------------------------------------

    async def agenerate(self, req: ModelRequest, on_tokens: ProgressCallback | None = None) -> ModelResponse:
        """Generate `req.sampling.max_new_tokens` at most, across pauses and failures: an aborted or failed segment is
        resubmitted as prompt + tokens so far with the remaining budget. No token is lost or repeated; each keeps
        the weight version that produced it.

        `on_tokens(ids, logprobs)` streams the request: it sees every token once, in order, as the engine produces
        it (tokens a dying engine streamed are kept, so the caller never sees a token taken back)."""
        started = time.monotonic()
        rid = req.rid or f"{self._rid_prefix}-{next(self._rid_counter)}"
        affinity = req.affinity  # without one, a resubmission still prefers the engine of its last segment
        budget = req.sampling.max_new_tokens
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        failed: set[str] = set()
        segments = 0
        deadline = time.monotonic() + self.config.no_engine_timeout_s
        member: EngineMember | None = None
        while True:
            exclude = frozenset(failed) if failed else _NONE
            member = self.route(affinity, exclude, member) or await self._wait_for_engine(
                affinity, exclude, deadline, member
            )
            sampling = req.sampling
            if tokens or sampling.n != 1:  # a resubmission asks only for what is left
                sampling = msgspec.structs.replace(
                    sampling,
                    max_new_tokens=budget - len(tokens),
                    min_new_tokens=max(0, sampling.min_new_tokens - len(tokens)),
                    n=1,
                )
            member.outstanding += 1
            streamed: tuple[list[int], list[float]] = ([], [])
            progress = None
            if on_tokens is not None:

                def progress(ids: list[int], lps: list[float], streamed=streamed) -> None:
                    streamed[0].extend(ids)
                    streamed[1].extend(lps)
                    on_tokens(ids, lps)

            try:
                result = await member.client.generate(
                    req.input_ids + tokens if tokens else req.input_ids,
                    sampling,
                    rid=f"{rid}-{segments}",
                    return_logprob=True,
                    on_progress=progress,
                )
            except asyncio.CancelledError:
                # The caller gave up: free the engine's slot too (a closed connection alone may not abort it).
                task = asyncio.get_running_loop().create_task(_abort_quietly(member.client, f"{rid}-{segments}"))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                raise
            except EngineUnavailable as exc:
                if streamed[0]:  # already shown to the caller: keep them and resubmit only the rest
                    tokens += streamed[0]
                    logprobs += streamed[1]
                    versions += [version_number(member.weight_version)] * len(streamed[0])
                    if len(tokens) >= budget:
                        return self._response(req, rid, tokens, logprobs, versions, "length", member, segments, started)
                failed.add(member.url)
                self._evict(member, exc.reason)
                if len(failed) > self.config.max_failovers:
                    raise
                log.warning("request %s failed over from %s: %s", rid, member.url, exc.reason)
                segments += 1
                deadline = time.monotonic() + self.config.no_engine_timeout_s
                continue
            finally:
                member.outstanding -= 1
            segments += 1
            tokens += result.output_ids
            logprobs += result.output_logprobs or [0.0] * len(result.output_ids)
            versions += token_versions(result)
            member.weight_version = result.weight_version
            if result.aborted and len(tokens) < budget and segments <= self.config.max_resubmissions:
                # Aborted by a pause (or an operator): resubmit. A paused engine holds the call until it resumes.
                deadline = time.monotonic() + self.config.no_engine_timeout_s
                continue
            if result.aborted:
                reason = "length" if len(tokens) >= budget else "abort"
            elif result.finish_reason is not None:
                reason = result.finish_reason.type
            else:
                reason = "length" if len(tokens) >= budget else "stop"
            return self._response(req, rid, tokens, logprobs, versions, reason, member, segments, started)

    @staticmethod
    def _response(
        req: ModelRequest,
        rid: str,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
        reason: str,
        member: EngineMember,
        segments: int,
        started: float,
    ) -> ModelResponse:
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=reason,  # type: ignore[arg-type]
            rid=rid,
            engine=member.url,
            resubmissions=segments - 1,
            latency_s=time.monotonic() - started,
        )


__all__ = ["EngineError", "EnginePool", "NoEngineAvailable", "PoolConfig", "version_number"]
