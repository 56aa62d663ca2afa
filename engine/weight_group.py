"""New weights onto engines without a shared disk: SGLang's distributed update path, over torch's gloo on CPU.

The trainer is rank 0 of a process group it builds with the engines (`/init_weights_update_group`, rank_offset 1..N);
an update is `/begin_weight_update` on every engine, then `/update_weights_from_distributed` (names, dtypes, shapes)
on every engine while the trainer broadcasts each tensor from rank 0 in that order, then `/end_weight_update`
(SGLang 0.5.23: model_runner_components/weight_updater.py, scheduler_components/weight_updater.py).

The group is built without touching torch's default process group (a TCPStore + PrefixStore + ProcessGroupGloo
per build), so one process can build and drop groups any number of times. The store keys follow
`init_custom_process_group` (PrefixStore(group_name) over the TCP store, then torch's own "<group>/" and "cpu/"),
so the layout is the one an SGLang engine asked for backend "gloo" would use.

Every collective and the join are bounded by `timeout_s`: a dead engine closes its sockets and fails the broadcast at
once; a hung one fails it after the timeout. The group is then dropped (`abort()` closes the trainer's sockets, so
the other engines' receives fail fast too) and rebuilt over the engines that still answer.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rollq.engine.client import EngineError, EngineUnavailable
from rollq.engine.fleet import FleetResult
from rollq.engine.pool import EngineMember, EnginePool

log = logging.getLogger("rollq.engine")
ANSWER_GRACE_S = 5.0  # see _transfer

RETRY_ROUNDS = 1  # after a failed round, one more over the engines that still answer (a dead one must not cost a step)


# --- shared by both ends (the engine server imports these) -----------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire form of a dtype: "float32", "bfloat16" (getattr(torch, name) on the engine)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def local_address(peer_host: str, peer_port: int) -> str:
    """The address of this host's interface that routes to `peer_host` (no packet is sent: a UDP connect only picks
    the route). Gloo connects every pair of ranks, so each binds where the others can reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, peer_port or 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def gloo_group(store: Any, rank: int, world_size: int, group_name: str, host: str, timeout_s: float) -> Any:
    """A gloo ProcessGroup of `world_size` ranks over `store`, outside torch's default group. Blocks until every rank
    joined (or `timeout_s` passed: RuntimeError). `host`: the address this rank's gloo device binds to."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    gloo = dist.ProcessGroupGloo
    options_cls = getattr(gloo, "_Options", None)
    if options_cls is None:  # torch without the options binding: its default device (the hostname's address)
        return gloo(prefixed, rank, world_size, timeout)
    options = options_cls()
    options._devices = [gloo.create_device(hostname=host)]  # bind deterministically, not by hostname lookup
    options._timeout = timeout
    return gloo(prefixed, rank, world_size, options)


def abort_group(group: Any) -> None:
    """Drop a group now: close its sockets so peers blocked in a collective fail at once instead of at their timeout."""
    for method in ("abort", "shutdown"):
        fn = getattr(group, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # already broken: nothing more to close
                continue


# --- the trainer's side: rank 0 ---------------------------------------------------------------------------------------


class TrainerGroup:
    """Rank 0: the TCPStore master (port 0: a free one, see `.port`) and, after `join()`, the gloo group."""

    def __init__(self, address: str, port: int, world_size: int, group_name: str, timeout_s: float) -> None:
        self.address = address
        self.world_size = world_size
        self.group_name = group_name
        self.timeout_s = timeout_s
        # wait_for_workers=False: the engines connect while the trainer joins; the join itself waits for them.
        self.store: dist.TCPStore | None = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self.port = int(self.store.port)  # the one picked when port was 0
        self.group: Any = None

    def join(self) -> None:
        """Blocks until every engine joined (run it in a thread)."""
        assert self.store is not None, "closed"
        self.group = gloo_group(self.store, 0, self.world_size, self.group_name, self.address, self.timeout_s)

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> int:
        """Send every tensor from rank 0, in order (blocking; run it in a thread). Returns the bytes sent once (each
        engine receives that many). Each op is bounded by the group's timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        # All ops queued before the first wait (as SGLang's receive does): gloo's worker threads pipeline them.
        works = [(self.group.broadcast([t], opts), t) for t in tensors]
        sent = 0
        for work, t in works:
            work.wait()
            sent += t.numel() * t.element_size()
        return sent

    def close(self) -> None:
        if self.group is not None:
            abort_group(self.group)
            self.group = None
        self.store = None  # the master's listening socket goes with it


# --- the update, fleet-wide -------------------------------------------------------------------------------------------


class DistributedSyncConfig(msgspec.Struct, kw_only=True, frozen=True):
    master_address: str = ""  # '' = this host's address on the route to the first engine
    master_port: int = 0  # 0 = a free port, picked at each group build
    timeout_s: float = 60.0  # the group join, each broadcast op and each control call; a dead engine fails faster


class SyncResult(FleetResult):
    bytes_sent: int = 0  # tensor bytes broadcast (each engine received this much)
    rebuilt: int = 0  # group builds this update needed


def _wire_tensor(t: torch.Tensor) -> torch.Tensor:
    """What gloo can send: a contiguous CPU tensor (the parameter itself when it already is one: no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


class DistributedWeightSync:
    """One instance per trainer: keeps the group across updates and rebuilds it when membership changed, an engine
    failed, or this process is new (group names carry a per-instance token and a generation counter, so a restarted
    trainer never collides with the groups its previous life left on the engines)."""

    def __init__(self, pool: EnginePool, config: DistributedSyncConfig | None = None) -> None:
        self.pool = pool
        self.config = config or DistributedSyncConfig()
        self._token = uuid.uuid4().hex[:8]
        self._generation = 0
        self._group: TrainerGroup | None = None
        self._ranks: list[str] = []  # engine URLs in rank order (rank i + 1)
        self._retired: list[tuple[str, set[str]]] = []  # dropped groups the engines may still hold: (name, URLs)
        self._lock = asyncio.Lock()
        self.builds = 0

    @property
    def group_name(self) -> str | None:
        return self._group.group_name if self._group is not None else None

    async def update(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: str | int,
        *,
        flush_cache: bool = True,
        members: list[EngineMember] | None = None,
    ) -> SyncResult:
        """Every engine (or `members`) to these weights, tagged `version`. Engines that fail are marked stale (out of
        routing) and get the weights at the next update, over a rebuilt group."""
        version = str(version)
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        names = [n for n, _ in items]
        wire = [_wire_tensor(t) for _, t in items]
        payload = {
            "names": names,
            "dtypes": [dtype_name(t.dtype) for t in wire],
            "shapes": [list(t.shape) for t in wire],
            "weight_version": version,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        started = time.monotonic()
        async with self._lock:
            targets = self.pool.engines() if members is None else members
            failed: dict[str, str] = {}
            ok: list[EngineMember] = []
            loads: list[float] = []
            sent = rebuilt = 0
            with self.pool.weight_update(version, targets):
                pending = list(targets)
                for round_ in range(RETRY_ROUNDS + 1):
                    done, errors, dead, round_sent, built = await self._round(pending, payload, wire, loads)
                    ok += done
                    sent = max(sent, round_sent)
                    rebuilt += built
                    failed.update(errors)
                    pending = [m for m in pending if m.url in errors and m.url not in dead]
                    if not pending or round_ == RETRY_ROUNDS:
                        break
                    log.warning("weight update %s: retrying on %d engines over a new group", version, len(pending))
                    for m in pending:
                        failed.pop(m.url, None)
            for m in ok:
                failed.pop(m.url, None)
                self.pool.mark_loaded(m.url, version)
            for url in failed:
                self.pool.mark_stale(url)
        result = SyncResult(
            ok=[m.url for m in ok],
            failed=failed,
            seconds=time.monotonic() - started,
            load_seconds=max(loads, default=0.0),
            bytes_sent=sent,
            rebuilt=rebuilt,
        )
        if failed:
            log.warning("distributed weight update %s failed on %d engines: %s", version, len(failed), failed)
        return result

    async def _round(
        self, members: list[EngineMember], payload: dict[str, Any], wire: list[torch.Tensor], loads: list[float]
    ) -> tuple[list[EngineMember], dict[str, str], set[str], int, int]:
        """begin -> (re)build the group if needed -> update + broadcast -> end. Returns (ok members, errors by URL,
        URLs that did not answer at all, bytes sent, 1 if the group was rebuilt)."""
        errors: dict[str, str] = {}
        dead: set[str] = set()

        def fail(member: EngineMember, exc: BaseException) -> None:
            errors[member.url] = str(exc)  # engine, route and HTTP status (or why nothing answered)
            if isinstance(exc, EngineUnavailable):
                dead.add(member.url)
                if exc.unreachable:  # gone, not slow: out of routing now, as FleetController does
                    self.pool.evict(member.url, f"weight update: {exc.reason}")

        # begin first: it is fast and proves the engine alive, so a dead one never stalls the group's join.
        began: list[EngineMember] = []
        for member, res in zip(members, await self._gather(self._begin, members), strict=True):
            if isinstance(res, BaseException):
                fail(member, res)
            else:
                began.append(member)
        if not began:
            return [], errors, dead, 0, 0
        built = 0
        try:
            if self._group is None or [m.url for m in began] != self._ranks:
                built = 1
                joins = await self._build(began)
                for member, exc in joins.items():
                    if exc is not None:
                        fail(member, exc)
                if self._group is None:
                    return [], errors, dead, 0, built
            sent, results, aborted = await self._transfer(began, payload, wire)
            ok: list[EngineMember] = []
            for member, res in zip(began, results, strict=True):
                if isinstance(res, BaseException):
                    fail(member, res)
                else:
                    ok.append(member)
                    if isinstance(res, dict) and "load_seconds" in res:
                        loads.append(float(res["load_seconds"]))
            if aborted or len(ok) != len(began):
                self._drop_group()  # a collective failed or was aborted: the group is unusable for everyone
            return ok, errors, dead, sent if ok else 0, built
        finally:
            await self._gather(lambda c: c.end_weight_update(timeout=self.config.timeout_s), began)

    async def _gather(self, call: Any, members: list[EngineMember]) -> list[Any]:
        return list(await asyncio.gather(*(call(m.client) for m in members), return_exceptions=True))

    async def _begin(self, client: Any) -> Any:
        try:
            return await client.begin_weight_update(timeout=self.config.timeout_s)
        except EngineError as exc:
            if "already open" not in exc.message:
                raise
            # A session left open by a trainer that died mid-update: close it and open ours.
            await client.end_weight_update(timeout=self.config.timeout_s)
            return await client.begin_weight_update(timeout=self.config.timeout_s)

    async def _build(self, members: list[EngineMember]) -> dict[EngineMember, BaseException | None]:
        """A new group over `members` (ranks 1..N in this order); `self._group` is set when all of them joined.
        Returns each member's join error (None: joined)."""
        self._drop_group()
        await self._destroy_retired()
        self._generation += 1
        self.builds += 1
        cfg = self.config
        address = cfg.master_address or _route_to(members[0].url)
        name = f"rollq-{self._token}-{self._generation}"
        world = len(members) + 1
        group = await asyncio.to_thread(TrainerGroup, address, cfg.master_port, world, name, cfg.timeout_s)
        join = asyncio.create_task(asyncio.to_thread(group.join))
        inits = await asyncio.gather(
            *(
                m.client.init_weights_update_group(
                    address, group.port, i + 1, world, name, backend="gloo", timeout_s=cfg.timeout_s
                )
                for i, m in enumerate(members)
            ),
            return_exceptions=True,
        )
        joins = {m: r if isinstance(r, BaseException) else None for m, r in zip(members, inits, strict=True)}
        try:
            await join  # bounded by timeout_s: the store and the gloo rendezvous both time out
        except Exception as exc:
            log.warning("weight update group %s: the trainer could not join: %s", name, exc)
            self._retire(group, members)
            return {m: e or RuntimeError(f"group {name} failed: {exc}") for m, e in joins.items()}
        if any(e is not None for e in joins.values()):
            # Whoever joined holds a group nobody will use: every member fails this round (and is retried).
            self._retire(group, members)
            return {
                m: e or RuntimeError(f"group {name} not built: another engine failed to join") for m, e in joins.items()
            }
        self._group, self._ranks = group, [m.url for m in members]
        log.info("weight update group %s: %d engines at %s:%d", name, len(members), address, group.port)
        return joins

    async def _transfer(
        self,
        members: list[EngineMember],
        payload: dict[str, Any],
        wire: list[torch.Tensor],
        post: Callable[[EngineMember, str], Coroutine[Any, Any, Any]] | None = None,
    ) -> tuple[int, list[Any], bool]:
        """POST the update to every engine (`post(member, group_name)`: update_weights_from_distributed with
        `payload` unless told) while broadcasting. An engine answering with a failure before the broadcast ended is
        waiting for nothing: the group is aborted so the broadcast (and the other engines) fail at once.
        Returns (bytes sent, each engine's answer or error, whether the group was aborted)."""
        group = self._group
        assert group is not None
        if post is None:
            body = {**payload, "group_name": group.group_name}
            posts = [asyncio.create_task(m.client.update_weights_from_distributed(body, timeout=None)) for m in members]
        else:
            posts = [asyncio.create_task(post(m, group.group_name)) for m in members]
        cast = asyncio.create_task(asyncio.to_thread(group.broadcast, wire))
        pending: set[asyncio.Task[Any]] = {cast, *posts}
        aborted = False
        while not cast.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t is not cast and t.exception() is not None for t in done):
                abort_group(group.group)
                aborted = True
                break
        sent = 0
        try:
            sent = await cast
        except Exception as exc:
            log.warning("broadcast over %s failed: %s", group.group_name, exc)
            abort_group(group.group)
            aborted = True
        # After the broadcast an engine loads and answers, or its own receive times out (bounded by timeout_s, from
        # when it started receiving: an engine waiting on data relayed through a dead rank notices only then). The
        # grace on top keeps that answer from racing our own give-up; an engine silent past it is hung.
        _, late = await asyncio.wait(posts, timeout=self.config.timeout_s + ANSWER_GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)  # let the cancellations land before reading the tasks
        results: list[Any] = []
        for member, task in zip(members, posts, strict=True):
            if task.cancelled():
                results.append(EngineUnavailable(member.url, "no answer within timeout_s after the broadcast"))
            else:
                results.append(task.exception() or task.result())
        return sent, results, aborted

    async def prepare_delta(
        self, manifest: Any, blob: bytes, version: str | int, members: list[EngineMember]
    ) -> dict[str, Any]:
        """Delta sync, before the pause: every engine of `members` is asked to stage `version` from the delta that
        `manifest` (a weight_delta.DeltaManifest) describes (/rollq/prepare_weights, distributed form) and receives
        its blob as ONE uint8 tensor broadcast from rank 0 over the group (rebuilt when the members changed).
        Generation goes on meanwhile; the swap comes under the pause (FleetController.swap_prepared). Returns each
        engine's answer (a dict) or error by URL; a failure anywhere drops the group (the full broadcast that
        follows rebuilds it)."""
        version = str(version)
        # bytearray: torch wants a writable buffer; one copy of the (small) blob
        wire = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)]

        async def post(member: EngineMember, group_name: str) -> Any:
            return await member.client.prepare_weights(version, group_name=group_name, manifest=manifest, timeout=None)

        async with self._lock:
            if self._group is None or [m.url for m in members] != self._ranks:
                joins = await self._build(members)
                if self._group is None:
                    return {m.url: e or RuntimeError("the weight update group was not built") for m, e in joins.items()}
            _, results, aborted = await self._transfer(members, {}, wire, post)
            answers = {m.url: r for m, r in zip(members, results, strict=True)}
            if aborted or any(isinstance(r, BaseException) for r in results):
                self._drop_group()
        failed = {u: str(r) for u, r in answers.items() if isinstance(r, BaseException)}
        if failed:
            log.info("prepare of delta %s failed on %d engines: %s", version, len(failed), failed)
        return answers

    def _retire(self, group: TrainerGroup, members: list[EngineMember]) -> None:
        """Close our side now; the engines' side is destroyed at the next build or close (best effort)."""
        group.close()
        self._retired.append((group.group_name, {m.url for m in members}))

    def _drop_group(self) -> None:
        if self._group is not None:
            self._retire(self._group, [m for m in self.pool.engines() if m.url in self._ranks])
        self._group, self._ranks = None, []

    async def _destroy_retired(self) -> None:
        """Engines that received over a group we dropped still hold it: ask them to free its sockets."""
        retired, self._retired = self._retired, []
        for name, urls in retired:
            holders = [m for m in self.pool.engines() if m.url in urls]
            await self._gather(lambda c, name=name: c.destroy_weights_update_group(name, timeout=5.0), holders)

    async def close(self) -> None:
        """Destroy the group on the engines (best effort) and here."""
        async with self._lock:
            self._drop_group()
            await self._destroy_retired()


def _route_to(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return local_address(parts.hostname or "127.0.0.1", parts.port or 80)


__all__ = [
    "DistributedSyncConfig",
    "DistributedWeightSync",
    "SyncResult",
    "TrainerGroup",
    "dtype_name",
    "gloo_group",
    "local_address",
    "parse_dtype",
]
