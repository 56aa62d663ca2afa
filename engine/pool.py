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
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import msgspec

from rollq.engine.client import EngineError, EngineUnavailable, SGLangClient
from rollq.engine.gateway import ROUTING_KEY_HEADER, GatewayClient, GatewayError
from rollq.engine.http import shared_http_session
from rollq.engine.types import (
    GenerateResult,
    ModelRequest,
    ModelResponse,
    ProgressCallback,
    SamplingParams,
    as_model_request,
)

if TYPE_CHECKING:
    from rollq.engine.registry import EngineRegistry

log = logging.getLogger("rollq.engine")

_NONE: frozenset[str] = frozenset()
_TRAILING_INT = re.compile(r"(\d+)$")
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")
STREAMING_SINCE = (0, 5, 23)  # 0.5.5 streams output_ids as deltas and may drop chunks: no streaming before this


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


ADAPTER_NOT_LOADED = "LoRA adapters are not loaded"  # SGLang's words for an unknown lora_path (lora_registry.py:124)


def _version_of(adapter: str | None, weight_version: str) -> int:
    return version_number(adapter) if adapter else version_number(weight_version)


def release(version: str) -> tuple[int, int, int] | None:
    """SGLang's `version` ("0.5.23", "0.5.5.post3", "0.5.24rc0") as (0, 5, 23); None when unknown."""
    m = _RELEASE.match(version or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


class EngineFacts(msgspec.Struct, frozen=True):
    """What a request needs to know about one engine (read once from /server_info, forgotten on eviction)."""

    skip_tokenizer_init: bool = False
    version: str = ""

    @property
    def streams(self) -> bool:
        """Streamed chunks carry cumulative output_ids (0.5.23 on; unknown versions are not streamed)."""
        r = release(self.version)
        return r is not None and r >= STREAMING_SINCE


class NoEngineAvailable(Exception):
    pass


class UnsupportedRequest(EngineError):
    """rollq refused the request before sending it: this engine cannot serve it as asked (4xx semantics)."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, 400, message)


Decode = Callable[[list[int]], str]
STOP_TAIL_TOKENS = 32  # tokens decoded to look for a stop string while streaming (plus what a chunk brought)


def stop_cut(decode: Decode, ids: list[int], checked: int, stops: list[str]) -> tuple[int, str] | None:
    """(k, stop) for the shortest output ids[:k] whose text holds a stop string, where ids[:checked] holds none;
    None when ids holds none. Binary search: a few decodes rather than one per token."""

    def hit(k: int) -> str | None:
        text = decode(ids[:k])
        return next((stop for stop in stops if stop in text), None)

    if hit(len(ids)) is None:
        return None
    lo, hi = checked, len(ids)  # hit(lo) is None, hit(hi) is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hit(mid) is None:
            lo = mid
        else:
            hi = mid
    found = hit(hi)
    assert found is not None
    return hi, found


class PoolConfig(msgspec.Struct, kw_only=True):
    urls: list[str] = []
    api_key: str | None = None
    admin_api_key: str | None = None  # for the control routes, when the engines run with --admin-api-key
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    fail_threshold: int = 2  # consecutive failed health checks before an engine leaves routing
    no_engine_timeout_s: float = 60.0  # how long a request waits for any healthy engine
    # Failovers (an engine dying under a request) before the request fails; also how many aborts in a row that
    # brought no new token a request takes before it is returned as aborted. Every loop in agenerate is bounded.
    max_failovers: int = 8
    max_resubmissions: int = 64  # aborted segments of one request before it is returned as aborted
    affinity_capacity: int = 100_000
    # A gateway's admin key (smg --control-plane-api-keys ...:admin:KEY): lists the engines behind a gateway URL
    gateway_admin_api_key: str | None = None
    # Host agents (`rollq weight-agent`) by engine URL: where the fleet prepares those engines' weight deltas (static
    # engines, those a gateway lists; a registered engine's entry may name its own, which this overrides)
    agent_urls: dict[str, str] = {}


# What a member is, found by probing its `GET /workers` (engine/gateway.py): an engine (generation and control), a
# gateway (generation only: its engines take the control calls), an engine behind a gateway (control only: its
# generation goes through the gateway), or not known yet (not answering: treated as an engine until it does).
# A gateway whose list anyone may change, while the pool holds engine keys, is "refused": neither used nor followed.
MemberKind = Literal["unknown", "engine", "gateway", "behind", "refused"]


class EngineMember:
    __slots__ = (
        "url",
        "client",
        "healthy",
        "stale",
        "outstanding",
        "failures",
        "weight_version",
        "paused",
        "holds",
        "hold_epoch",
        "facts",
        "_facts_task",
        "out_because",
        "last_error",
        "kind",
        "gateway",
        "agent_url",
    )

    def __init__(self, url: str, client: SGLangClient) -> None:
        self.url = url
        self.client = client
        self.healthy = True  # optimistic until a check or a request says otherwise
        self.stale = False  # failed a weight update: out of routing until reloaded
        self.outstanding = 0
        self.failures = 0
        self.weight_version = ""
        self.paused = False  # the fleet paused it (pause_generation .. continue_generation)
        self.holds = 0  # fleet weight loads under way on it
        self.hold_epoch = 0  # bumped when a pause or load ends: a health check that straddled it saw it held
        self.facts: EngineFacts | None = None
        self._facts_task: asyncio.Task[EngineFacts] | None = None
        self.out_because = ""  # why it last left routing
        self.last_error = ""  # the last engine failure a request met on it (EngineUnavailable)
        self.kind: MemberKind = "unknown"
        self.gateway: GatewayClient | None = None  # a gateway's membership client (kind "gateway")
        # Where this engine's weight deltas are prepared when it cannot do it itself (an SGLang engine's host agent,
        # `rollq weight-agent`); '' = the engine itself (rollq's engines serve /rollq/prepare_weights)
        self.agent_url = ""

    def why_out(self) -> str:
        """Why it is out of routing, with the last failure a request met on it (an engine error of a generation:
        what a health check's 503 does not say)."""
        why = "stale (failed a weight update)" if self.stale and self.healthy else self.out_because
        if not self.last_error or self.last_error == why:
            return why
        return f"{why}; a request's last failure there: {self.last_error}"

    @property
    def routable(self) -> bool:
        """Generation may go to it: an engine behind a gateway gets its generation through the gateway."""
        return self.healthy and not self.stale and self.kind not in ("behind", "refused")

    @property
    def controlled(self) -> bool:
        """Control calls go to it: a gateway forwards none (each engine it lists gets them)."""
        return self.kind not in ("gateway", "refused")

    @property
    def held(self) -> bool:
        """Paused or loading weights by the fleet's doing: a slow or 503 /health_generate is expected, not death
        (SGLang blocks it up to 20 s then answers 503), and /generate calls wait rather than fail."""
        return self.paused or self.holds > 0


class EnginePool:
    def __init__(
        self, config: PoolConfig, *, http: aiohttp.ClientSession | None = None, decode: Decode | None = None
    ) -> None:
        self.config = config
        # Token ids -> text, to apply stop strings on engines started with --skip-tokenizer-init (they refuse them).
        self.decode = decode
        self._own_http = http is None
        self.http = http  # created in start(): a ClientSession needs the running loop
        self.members: dict[str, EngineMember] = {}
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._changed = asyncio.Event()
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._abort_refusal_said = False  # a refused /abort_request (no admin key) is logged once, not per request
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._rid_counter = itertools.count()
        self._target_version: str | None = None  # the fleet's weights; engines on another version are stale
        self._updating = False  # a fleet update is under way: versions read now say nothing about staleness
        self.static_urls = {u.rstrip("/") for u in config.urls}  # never removed by the registry
        self.agent_urls = {e.rstrip("/"): a.rstrip("/") for e, a in config.agent_urls.items() if a}
        self._registry_task: asyncio.Task | None = None
        self._listed: dict[str, set[str]] = {}  # gateway URL -> the engine URLs it listed last
        self._undecided: set[str] = set()  # members whose probe was refused (said once each)
        for url in config.urls:
            self.add(url)

    # -- membership --------------------------------------------------------------------------------------------------

    async def _abort_quietly(self, member: EngineMember, rid: str) -> None:
        """Free an engine's slot for a request nobody waits for; a failure costs only the engine's time. A refused key
        says so once: /abort_request is a control route (SGLang's admin key when the engine has one). Behind a
        gateway (which forwards no abort) every engine it lists is asked: the rid is unique, the others ignore it."""
        clients = [m.client for m in self.behind(member)] if member.kind == "gateway" else [member.client]
        await asyncio.gather(*(self._abort_one(client, rid) for client in clients))

    async def _abort_one(self, client: SGLangClient, rid: str) -> None:
        try:
            await client.abort_request(rid)
        except EngineError as exc:
            if exc.status in (401, 403) and not self._abort_refusal_said:
                self._abort_refusal_said = True
                log.warning("aborts are refused, so engines run abandoned requests to the end: %s", exc)
        except EngineUnavailable:
            pass

    def _session(self) -> aiohttp.ClientSession:
        if self.http is None:
            self.http = shared_http_session()
        return self.http

    def add(self, url: str, *, behind: bool = False) -> EngineMember:
        """`url` joins (an engine, or a gateway: its kind is probed). `behind`: an engine a gateway lists, which takes
        the fleet's control calls and gets its generation through the gateway."""
        url = url.rstrip("/")
        member = self.members.get(url)
        if member is None:
            member = self.members[url] = EngineMember(
                url,
                SGLangClient(
                    url, self._session(), api_key=self.config.api_key, admin_api_key=self.config.admin_api_key
                ),
            )
            # Joining after the fleet moved to a version: out of routing until a health check reads that version (or
            # the fleet loads it), so a late engine never serves older weights.
            member.stale = self._target_version is not None
            if behind:
                member.kind = "behind"
            member.agent_url = self.agent_urls.get(url, "")
            agent = f", its weight agent {member.agent_url}" if member.agent_url else ""
            log.info("engine %s joined the pool%s%s", url, " (behind a gateway)" if behind else "", agent)
            self._signal()
        return member

    def remove(self, url: str) -> None:
        if self.members.pop(url.rstrip("/"), None) is not None:
            self._listed.pop(url.rstrip("/"), None)
            log.info("engine %s left the pool", url)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def start(self) -> None:
        if self._health_task is None:
            await self.follow_gateways()  # before the first request: a gateway's generation needs its header
            self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    # -- gateways (engine/gateway.py) ----------------------------------------------------------------------------------

    async def follow_gateways(self) -> None:
        """Probe the members not known yet (`GET /workers`: a gateway lists its engines, an engine answers 404), and
        bring each gateway's engines into step with its list: new ones join (control calls reach them), removed ones
        leave. Called at start and with every health check."""
        unknown = [m for m in self.members.values() if m.kind == "unknown"]
        await asyncio.gather(*(self._probe(m) for m in unknown))
        for gateway in self.gateways():
            await self._relist(gateway)

    def _gateway_client(self, member: EngineMember) -> GatewayClient:
        if member.gateway is None:
            member.gateway = GatewayClient(member.url, self._session(), admin_api_key=self.config.gateway_admin_api_key)
        return member.gateway

    async def _probe(self, member: EngineMember) -> None:
        failure: GatewayError | None = None
        try:
            listed = await self._gateway_client(member).workers()
        except GatewayError as exc:
            member.gateway, failure, listed = None, exc, None
            engine_key = self.config.api_key or self.config.admin_api_key
            if exc.status in (401, 403) and engine_key:
                # An engine with keys refuses a route it does not know to a caller without its key (rollq's and
                # SGLang's auth come before routing): asked with its key, an engine answers 404, while a gateway
                # whose admin key this pool lacks refuses again.
                try:
                    listed = await GatewayClient(member.url, self._session(), admin_api_key=engine_key).workers()
                    failure = None
                except GatewayError as again:
                    failure = again
        if failure is not None:
            if failure.status is not None and member.url not in self._undecided:  # once per member, not each check
                self._undecided.add(member.url)
                log.warning("cannot tell whether %s is an engine or a gateway: %s", member.url, failure)
            return  # still unknown: probed again with the next health check
        if listed is None:
            member.kind, member.gateway = "engine", None
            return
        if await self._open_list(member):
            return
        member.kind = "gateway"
        member.facts = None
        log.info("%s is a gateway: generation goes through it, control calls to each engine it lists", member.url)

    async def _open_list(self, member: EngineMember) -> bool:
        """True (and `member` refused, said why) when the pool holds engine keys and the gateway's engine list is open
        to callers without its own admin key: to anyone (smg without --control-plane-api-keys), or to every holder of
        the engines' api key (smg --api-key alone, or that key given as its admin key). Such a caller could list a
        URL of theirs, and the engines' keys would go there with the fleet's control calls. Checked when the gateway
        is recognised and again each time its list is read (the gateway at that URL may have been replaced)."""
        engine_keys = [k for k in (self.config.api_key, self.config.admin_api_key) if k]
        if not engine_keys:
            return False  # no key to give away
        why = ""
        if self.config.gateway_admin_api_key and self.config.gateway_admin_api_key == self.config.api_key:
            why = "its admin key (gateway_admin_api_key) is the engines' api key, which every generation caller holds"
        elif await self._gateway_client(member).lists_to([None, *engine_keys]):
            why = "it answers GET /workers without its own admin key"
        if not why:
            return False
        log.error(
            "%s is a gateway whose engine list others may change (%s): rollq neither routes to it nor sends the "
            "engines' keys to any engine it lists. Start it with --control-plane-api-keys ID:NAME:admin:KEY (a key of "
            "its own) and give rollq KEY as gateway_admin_api_key",
            member.url,
            why,
        )
        for url in self._listed.pop(member.url, set()):
            if not any(url in urls for urls in self._listed.values()):
                self.remove(url)
        member.kind, member.gateway, member.facts = "refused", None, None
        return True

    async def _relist(self, gateway: EngineMember) -> None:
        if await self._open_list(gateway):
            return
        try:
            listed = await self._gateway_client(gateway).workers()
        except GatewayError as exc:
            log.warning("gateway %s: cannot list its engines (%s); keeping the last list", gateway.url, exc)
            return
        if listed is None:  # it stopped answering its list: keep what it listed last
            return
        urls = {w.url for w in listed}
        self._listed[gateway.url] = urls
        for url in urls:
            if url not in self.members:
                self.add(url, behind=True)
        still = set().union(*self._listed.values())
        for member in [m for m in self.members.values() if m.kind == "behind" and m.url not in still]:
            self.remove(member.url)

    def behind(self, gateway: EngineMember) -> list[EngineMember]:
        """The engines `gateway` listed last."""
        urls = self._listed.get(gateway.url, set())
        return [m for m in self.members.values() if m.url in urls]

    def follow(self, registry: EngineRegistry, interval_s: float = 1.0) -> None:
        """Keep membership in step with a Redis engine registry (engines join and leave live)."""
        self._registry_task = asyncio.create_task(self._follow(registry, interval_s), name="engine-registry")

    async def sync_registry(self, registry: EngineRegistry) -> None:
        members = await registry.live_members()
        live = set(members)
        for url in live - set(self.members):
            self.add(url)
        for url, agent_url in members.items():  # what the engine's own (signed) entry says, unless configured here
            member = self.members[url]
            member.agent_url = self.agent_urls.get(url) or agent_url
        behind = {m.url for m in self.members.values() if m.kind == "behind"}  # a gateway's list keeps those
        for url in set(self.members) - live - self.static_urls - behind:
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
        """The engines the fleet's control calls go to (a snapshot): every member but a gateway, so the engines a
        gateway lists rather than the gateway itself."""
        return [m for m in self.members.values() if m.controlled and (m.stale or not stale_only)]

    def gateways(self) -> list[EngineMember]:
        return [m for m in self.members.values() if m.kind == "gateway"]

    @contextlib.contextmanager
    def weight_update(self, version: str, members: Iterable[EngineMember] | None = None) -> Iterator[None]:
        """While the fleet loads `version` on `members` (default: all): engines' reported versions say nothing about
        staleness yet, and the members are held (see `hold`)."""
        self._target_version = version
        self._updating = True
        try:
            with self.hold(self.engines() if members is None else members):
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

    def set_paused(self, members: Iterable[EngineMember], paused: bool) -> None:
        """The fleet paused (or resumed) these engines: while paused, failed health checks that only say "slow" or
        "503" neither evict them nor drop their affinity; requests keep routing to them and wait there."""
        for member in members:
            if member.paused and not paused:
                member.hold_epoch += 1
            member.paused = paused

    @contextlib.contextmanager
    def hold(self, members: Iterable[EngineMember]) -> Iterator[None]:
        """The fleet loads weights on these engines (paused or not: an update waits for in-flight requests and
        blocks /health_generate meanwhile): treated like `set_paused` for the duration."""
        held = list(members)
        for member in held:
            member.holds += 1
        try:
            yield
        finally:
            for member in held:
                member.holds -= 1
                member.hold_epoch += 1

    def evict(self, url: str, why: str) -> None:
        """Out of routing now (a control call found it unreachable); a passing health check brings it back."""
        member = self.members.get(url)
        if member is not None:
            self._evict(member, why)

    async def check_health(self) -> None:
        await self.follow_gateways()
        members = [m for m in self.members.values() if m.kind != "refused"]  # nothing, keys included, goes there
        before = [(m.held, m.hold_epoch) for m in members]
        results = await asyncio.gather(*(m.client.health_status(timeout=self.config.health_timeout_s) for m in members))
        if self.target_version is not None:
            # a gateway's own version is one engine's (smg forwards /get_model_info to one): its engines are checked
            ok = [m for m, r in zip(members, results, strict=True) if r == "ok" and m.kind != "gateway"]
            await self._check_versions(ok)
        for member, status, (held, epoch) in zip(members, results, before, strict=True):
            if status == "ok":
                if not member.healthy:
                    log.info("engine %s is healthy again", member.url)
                    member.healthy = True
                    member.last_error = ""
                    self._signal()
                member.failures = 0
            elif status == "busy" and (held or member.held or member.hold_epoch != epoch):
                continue  # paused or loading by the fleet's doing (during some of this check): not a failure
            else:
                member.failures += 1
                if member.healthy and member.failures >= self.config.fail_threshold:
                    self._evict(member, "failed health checks" if status == "busy" else "unreachable")

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
            member.out_because = why
        member.healthy = False
        member.facts = None  # it may come back as another process, started with other flags
        for key in [k for k, url in self._affinity.items() if url == member.url]:
            del self._affinity[key]

    async def facts(self, member: EngineMember) -> EngineFacts:
        """The engine's /server_info facts, read once per member (one read shared by concurrent requests). A gateway's
        are those of an engine it lists (what it answers itself describes the gateway, or one engine at random)."""
        if member.facts is not None:
            return member.facts
        if member.kind == "gateway":
            engines = [m for m in self.behind(member) if m.healthy] or self.behind(member)
            if not engines:
                return EngineFacts()  # nothing listed yet: read again next time
            member.facts = await self.facts(engines[0])
            return member.facts
        task = member._facts_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = member._facts_task = asyncio.get_running_loop().create_task(self._read_facts(member.client))
        facts = await asyncio.shield(task)
        member.facts = facts
        member._facts_task = None
        return facts

    @staticmethod
    async def _read_facts(client: SGLangClient) -> EngineFacts:
        try:
            info = await client.server_info()
        except EngineError:  # neither /server_info nor /get_server_info: assume a tokenizer, no streaming
            return EngineFacts()
        if not isinstance(info, dict):
            return EngineFacts()
        return EngineFacts(
            skip_tokenizer_init=bool(info.get("skip_tokenizer_init")), version=str(info.get("version", ""))
        )

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
                out = "; ".join(f"{m.url}: {m.why_out()}" for m in self.members.values() if not m.routable)
                raise NoEngineAvailable(
                    f"no healthy engine among {len(self.members)} for {self.config.no_engine_timeout_s}s"
                    + (f" ({out})" if out else "")
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
        it (tokens a dying engine streamed are kept, so the caller never sees a token taken back). Against an engine
        that cannot stream faithfully (SGLang before 0.5.23), or when rollq applies stop strings itself, a segment is
        generated whole and its tokens reported once when it ends.

        Raises EngineError (the request is wrong: no failover, no eviction), EngineUnavailable (engines died under it
        more than `max_failovers` times) or NoEngineAvailable."""
        started = time.monotonic()
        req = as_model_request(req)  # AReaL's own ModelRequest too, by its shape
        rid = req.rid or f"{self._rid_prefix}-{next(self._rid_counter)}"
        affinity = req.affinity  # without one, a resubmission still prefers the engine of its last segment
        budget = req.sampling.max_new_tokens
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        failed: set[str] = set()
        failovers = 0
        idle_aborts = 0  # aborted segments in a row that brought no token
        segments = 0
        deadline = time.monotonic() + self.config.no_engine_timeout_s
        needs_facts = on_tokens is not None or bool(req.sampling.stop) or req.sampling.min_new_tokens > 0
        member: EngineMember | None = None
        adapters: dict[str, str] = {}  # engine -> the adapter it serves this request with, when not req.lora_path
        while True:
            exclude = frozenset(failed) if failed else _NONE
            member = self.route(affinity, exclude, member) or await self._wait_for_engine(
                affinity, exclude, deadline, member
            )
            member.outstanding += 1
            streamed: tuple[list[int], list[float]] = ([], [])
            adapter = adapters.get(member.url, req.lora_path)
            try:
                facts = await self.facts(member) if needs_facts else None
                sampling, local_stop = self._segment_sampling(req.sampling, len(tokens), member.url, facts)
                progress: ProgressCallback | None = None
                if on_tokens is not None and local_stop is None and facts is not None and facts.streams:

                    def progress(ids: list[int], lps: list[float], streamed=streamed) -> None:
                        streamed[0].extend(ids)
                        streamed[1].extend(lps)
                        on_tokens(ids, lps)

                elif local_stop is not None and self.decode is not None and facts is not None and facts.streams:
                    # Stop strings applied here: stream the segment and abort it as soon as a stop shows up, rather
                    # than let the engine run to max_new_tokens (the output is cut at the stop below).
                    progress = self._stop_watch(member, f"{rid}-{segments}", local_stop, self.decode)

                result = await member.client.generate(
                    req.input_ids + tokens if tokens else req.input_ids,
                    sampling,
                    rid=f"{rid}-{segments}",
                    return_logprob=True,
                    on_progress=progress,
                    priority=req.priority,
                    lora_path=adapter,
                    image_data=req.image_data,  # a resubmitted remainder keeps its images: its ids hold their tokens
                    # through a gateway: the group's key pins it to one engine there (its prefix cache)
                    headers={ROUTING_KEY_HEADER: affinity} if affinity and member.kind == "gateway" else None,
                )
            except asyncio.CancelledError:
                # The caller gave up: free the engine's slot too (a closed connection alone may not abort it).
                task = asyncio.get_running_loop().create_task(self._abort_quietly(member, f"{rid}-{segments}"))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                raise
            except EngineError as exc:
                if not (adapter and ADAPTER_NOT_LOADED in str(exc)) or failovers >= self.config.max_failovers:
                    raise
                # The adapter the job was admitted under is gone from this engine (restarted, or it missed the
                # load): its newest adapter of the same run serves the rest, each token keeping that version.
                failovers += 1
                newest = await self._newest_adapter(member, adapter)
                if newest is None:
                    failed.add(member.url)
                else:
                    adapters[member.url] = newest
                log.warning("request %s: adapter %s not on %s; using %s", rid, adapter, member.url, newest or "another")
                continue
            except EngineUnavailable as exc:
                if streamed[0]:  # already shown to the caller: keep them and resubmit only the rest
                    tokens += streamed[0]
                    logprobs += streamed[1]
                    versions += [_version_of(adapter, member.weight_version)] * len(streamed[0])
                    if len(tokens) >= budget:
                        return self._response(req, rid, tokens, logprobs, versions, "length", member, segments, started)
                failovers += 1
                member.last_error = exc.reason
                if member.kind == "gateway" and not exc.unreachable:
                    # An engine behind it failed (a 5xx, the gateway's "no healthy worker"): the gateway itself is
                    # up and routes the resubmission to another engine; it leaves routing only when it is gone.
                    if failovers > self.config.max_failovers:
                        raise
                    log.warning("request %s: through gateway %s: %s; resubmitting", rid, member.url, exc.reason)
                    segments += 1
                    await asyncio.sleep(min(1.0, 0.1 * failovers))  # the gateway's health checks need a moment
                    continue
                failed.add(member.url)
                self._evict(member, exc.reason)
                if failovers > self.config.max_failovers:
                    raise
                log.warning("request %s failed over from %s: %s", rid, member.url, exc.reason)
                segments += 1
                deadline = time.monotonic() + self.config.no_engine_timeout_s
                continue
            finally:
                member.outstanding -= 1
            segments += 1
            checked = len(tokens)
            tokens += result.output_ids
            logprobs += result.output_logprobs or [0.0] * len(result.output_ids)
            # A LoRA adapter is never changed in place: every token of the segment is its version
            versions += [version_number(adapter)] * len(result.output_ids) if adapter else token_versions(result)
            member.weight_version = result.weight_version
            stopped: str | None = None
            if local_stop is not None and self.decode is not None:
                cut = stop_cut(self.decode, tokens, checked, local_stop)
                if cut is not None:
                    del tokens[cut[0] :], logprobs[cut[0] :], versions[cut[0] :]
                    stopped = cut[1]
            if on_tokens is not None and (progress is None or local_stop is not None) and len(tokens) > checked:
                on_tokens(tokens[checked:], logprobs[checked:])  # a segment generated whole: reported once
            if stopped is not None:
                return self._response(req, rid, tokens, logprobs, versions, "stop", member, segments, started)
            idle_aborts = idle_aborts + 1 if result.aborted and len(tokens) == checked else 0
            if (
                result.aborted
                and len(tokens) < budget
                and segments <= self.config.max_resubmissions
                and idle_aborts <= self.config.max_failovers
            ):
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

    async def _newest_adapter(self, member: EngineMember, wanted: str) -> str | None:
        """The newest adapter `member` serves of `wanted`'s family (`<family>-v<N>`), or None."""
        family = wanted.rsplit("-v", 1)[0] + "-v"
        try:
            names = await member.client.adapters()
        except (EngineError, EngineUnavailable):
            return None
        ours = [n for n in names if n.startswith(family) and n[len(family) :].isdigit()]
        return max(ours, key=version_number, default=None)

    def _segment_sampling(
        self, sampling: SamplingParams, done: int, url: str, facts: EngineFacts | None
    ) -> tuple[SamplingParams, list[str] | None]:
        """What to send for the next segment, and the stop strings rollq applies itself (None: the engine does).
        A resubmission asks only for what is left. An engine started with --skip-tokenizer-init rejects stop strings
        and min_new_tokens (SGLang 0.5.23 answers 400; 0.5.5's scheduler crashes): refuse or take them over here."""
        if done or sampling.n != 1:
            sampling = msgspec.structs.replace(
                sampling,
                max_new_tokens=sampling.max_new_tokens - done,
                min_new_tokens=max(0, sampling.min_new_tokens - done),
                n=1,
            )
        if facts is None or not facts.skip_tokenizer_init:
            return sampling, None
        if sampling.min_new_tokens > 0:
            raise UnsupportedRequest(
                url,
                f"min_new_tokens={sampling.min_new_tokens} is unavailable: the engine runs with --skip-tokenizer-init "
                "(it needs the tokenizer's eos ids); drop min_new_tokens or start the engine with its tokenizer",
            )
        stops = [s for s in sampling.stop or [] if s]
        if not stops:
            return sampling, None
        if self.decode is None:
            raise UnsupportedRequest(
                url,
                f"stop={stops!r} needs a tokenizer: the engine runs with --skip-tokenizer-init, and rollq applies "
                "stop strings itself only when the pool has one (EnginePool(..., decode=tokenizer.decode))",
            )
        return msgspec.structs.replace(sampling, stop=None), stops

    def _stop_watch(self, member: EngineMember, rid: str, stops: list[str], decode: Decode) -> ProgressCallback:
        """A progress callback that aborts `rid` (once) when the decoded tail of its output holds a stop string."""
        ids: list[int] = []
        tail = max(STOP_TAIL_TOKENS, 4 * max(map(len, stops)))  # a stop string spans at most this many tokens here
        aborted = False

        def watch(new: list[int], _lps: list[float]) -> None:
            nonlocal aborted
            ids.extend(new)
            if aborted or not any(stop in decode(ids[-(tail + len(new)) :]) for stop in stops):
                return
            aborted = True
            task = asyncio.get_running_loop().create_task(self._abort_quietly(member, rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        return watch

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
            tokenizer=req.tokenizer,
            input_images=list(req.image_data or ()),
            processor=req.processor,
        )


__all__ = [
    "EngineError",
    "EngineFacts",
    "EnginePool",
    "NoEngineAvailable",
    "PoolConfig",
    "UnsupportedRequest",
    "stop_cut",
    "version_number",
]
