"""rollq's weight-delta routes on the reference engine (docs/engines.md, "Weight deltas"): the next weight version is
prepared while generation goes on, so the pause covers only copying the changed tensors in.

- `POST /rollq/prepare_weights` (admin key). Disk form `{"model_path", "weight_version"}`: a delta directory
  (rollq.engine.weight_delta: delta.json + delta.bin) is read and applied to the served weights off the event loop,
  the rebuilt tensors kept in memory; a full weights directory is only checked (the swap reads it). Distributed form
  `{"group_name", "manifest", "weight_version"}`: the delta's blob arrives as one uint8 tensor of
  manifest.blob_bytes broadcast by rank 0 of that group, always received (a collective: the trainer's broadcast
  must not hang on one engine), then applied the same way. 200 `{"success", "message", "load_path",
  "prepare_seconds", "bytes_read"}`; 409 `{"success": false, "message", "weight_version"}` when the delta does not
  apply to what this engine holds (another base version or dtype, a checksum mismatch): the trainer gives it a full
  update; 400 for a malformed request; 404 on a backend that holds no weights (the synthetic one), as plain SGLang
  answers for a route it lacks.
- `/update_weights_from_disk` given a delta directory (app.py calls `swap_load`): swaps in what was staged for that
  directory and version, else applies the delta there (checked all the same: 400 and the weights unchanged when it
  does not apply).
- `POST /rollq/swap_prepared_weights {"weight_version", "flush_cache"}` (admin key): the distributed form's swap;
  409 when nothing is staged for that version.
- `GET /rollq/weights_checksum` (admin key): `{"weight_version", "dtype", "checksums": {name: xxh3-128 hex}}` of the
  served parameters (weights.served_parameters' names).

One version is staged at a time; a newer prepare replaces it. A staged version is built on the weights served at
the time: once any other load ran (a full update, a distributed one) it is stale and never swapped in.

Reading the served weights while generation goes on is safe because decode steps only read them and they change
only inside EngineServer.apply_weight_update: a reader takes the load count under the update lock (held only for
that), reads in a thread and starts over when a load ran meanwhile (EngineServer.weights_snapshot).

torch loads only when one of these routes is used (as in distributed_routes): the synthetic engine never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import msgspec
from aiohttp import web

from rollq.engine.server.backend import Backend
from rollq.engine.server.distributed_routes import ROUTES_KEY as DISTRIBUTED_ROUTES_KEY
from rollq.engine.server.weight_group import WeightGroups
from rollq.engine.server.weights_root import WeightsPathRefused, resolve_under
from rollq.http_server import BAD_JSON, read_body

if TYPE_CHECKING:
    from rollq.engine.weight_delta import DeltaManifest, WeightDelta

log = logging.getLogger("rollq.engine")

T = TypeVar("T")

DELTA_MANIFEST = "delta.json"  # weight_delta.MANIFEST_FILE, named here so that app.py's check imports no torch
SNAPSHOT_TRIES = 3  # reads of the served weights that a concurrent load voided before a reader gives up
BLOB_NAME = "weight_delta"  # the received tensor's name (in messages only)


def is_delta_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DELTA_MANIFEST))


class EngineServer(Protocol):
    """What the routes use of `rollq.engine.server.app.EngineServer` (app.py imports this module: no import back)."""

    backend: Backend
    weight_version: str
    weight_loads: int

    @property
    def config(self) -> Any: ...

    async def weights_snapshot(self) -> tuple[int, str]: ...

    def weights_unchanged(self, loads: int) -> bool: ...

    async def apply_weight_update(
        self, load: Callable[[], Awaitable[Any]], *, version: str | None, flush_cache: bool, abort_all: bool
    ) -> tuple[bool, str, int, float]: ...


class PrepareRequest(msgspec.Struct, kw_only=True):
    weight_version: str  # the version the delta builds (the manifest's `version`)
    model_path: str | None = None  # disk form: a delta directory or a full weights directory under weights_root
    group_name: str | None = None  # distributed form: the group the blob is broadcast on
    manifest: msgspec.Raw = msgspec.Raw()  # distributed form: the DeltaManifest (decoded once torch is loaded)


class SwapRequest(msgspec.Struct, kw_only=True):
    weight_version: str
    flush_cache: bool = True
    abort_all_requests: bool = False


class Staged(NamedTuple):
    """A prepared version: the changed tensors rebuilt, waiting for the swap."""

    version: str
    base_version: str
    source: str  # the resolved delta directory, "" for a delta received over a group
    tensors: dict[str, Any]  # the changed tensors only (name -> new CPU tensor)
    loads: int  # EngineServer.weight_loads when it was built: stale once another load ran


class NotTheBase(Exception):
    """The delta does not apply to the weights this engine serves (409: it needs a full update)."""


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _fail(message: str, status: int = 400, **extra: Any) -> web.Response:
    return _json({"success": False, "message": message, **extra}, status)


async def _decode(request: web.Request, kind: type[T]) -> T | web.Response:
    raw = await read_body(request)  # 408 for a body that trickles in
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        try:  # a typed decode may stop at a missing field before it meets bytes that are not JSON: say what is wrong
            msgspec.json.decode(raw or b"{}")
        except BAD_JSON as bad:
            return _fail(f"Invalid JSON body: {bad}")
        return _fail(str(exc))
    except BAD_JSON as exc:  # malformed, invalid UTF-8, too deep: the client's fault, never a 500
        return _fail(f"Invalid JSON body: {exc}")


def _dtypes(weights: Mapping[str, Any]) -> str:
    """The served dtype (torch's name), or the names joined when the parameters mix dtypes."""
    return ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})) or "none"


def _check_applies(manifest: DeltaManifest, held_version: str, served_dtype: str) -> None:
    """Raises NotTheBase when the delta is for another version or dtype than the one served (the checksums, checked
    while applying, catch the rest)."""
    if held_version != manifest.base_version:
        raise NotTheBase(
            f"this engine holds weight version {held_version!r}, not the delta's base {manifest.base_version!r}"
        )
    if served_dtype != manifest.dtype:
        raise NotTheBase(
            f"the delta is in {manifest.dtype}, this engine serves {served_dtype}: it is not the delta's base"
        )


class DeltaRoutes:
    def __init__(self, server: EngineServer, groups: WeightGroups) -> None:
        self.server = server
        self.groups = groups
        self.staged: Staged | None = None
        self._prepare_lock = asyncio.Lock()  # one prepare at a time: the later one replaces what the earlier staged

    # --- helpers ---

    def _no_weights(self) -> web.Response | None:
        backend = self.server.backend
        if backend.holds_weights:
            return None
        message = f"{type(backend).__name__} holds no weights: this engine takes full updates only"
        return _fail(message, 404)

    def _refused(self, exc: NotTheBase) -> web.Response:
        return _fail(str(exc), 409, weight_version=self.server.weight_version)

    async def _rebuild(self, delta: WeightDelta, source: str) -> Staged:
        """The delta applied to the served weights, in a thread while generation goes on. Raises NotTheBase."""
        from rollq.engine import weight_delta

        server, manifest = self.server, delta.manifest
        for _ in range(SNAPSHOT_TRIES):
            loads, held = await server.weights_snapshot()
            current = server.backend.served_weights()
            _check_applies(manifest, held, _dtypes(current))
            try:
                changed = await asyncio.to_thread(weight_delta.apply, current, delta)
            except weight_delta.DeltaMismatch as exc:
                if not server.weights_unchanged(loads):
                    continue  # read while a load changed them: read again
                raise NotTheBase(str(exc)) from None
            if server.weights_unchanged(loads):
                return Staged(manifest.version, manifest.base_version, source, changed, loads)
        raise NotTheBase(f"the weights changed under {SNAPSHOT_TRIES} reads in a row (concurrent updates)")

    async def _stage(
        self, delta: WeightDelta, version: str, source: str, started: float, bytes_read: int
    ) -> web.Response:
        manifest = delta.manifest
        if manifest.version != version:
            return _fail(f"weight_version {version!r} is not the delta's version {manifest.version!r}")
        try:
            staged = await self._rebuild(delta, source)
        except NotTheBase as exc:
            log.info("weight delta %s -> %s refused: %s", manifest.base_version, manifest.version, exc)
            return self._refused(exc)
        self.staged = staged
        seconds = time.monotonic() - started
        log.info(
            "weight version %s prepared from a delta of %d bytes (%d tensors changed) in %.2f s",
            version,
            bytes_read,
            len(staged.tensors),
            seconds,
        )
        return _json(
            {
                "success": True,
                "message": f"Prepared weight version {version}: {len(staged.tensors)} tensors changed.",
                "load_path": source,
                "prepare_seconds": round(seconds, 6),
                "bytes_read": bytes_read,
            }
        )

    # --- routes ---

    async def prepare(self, request: web.Request) -> web.Response:
        req = await _decode(request, PrepareRequest)
        if isinstance(req, web.Response):
            return req
        if (req.model_path is None) == (req.group_name is None):
            return _fail("give model_path (disk form) or group_name and manifest (distributed form), not both")
        if req.group_name is not None and not req.manifest:
            return _fail("the distributed form needs the delta's manifest")
        started = time.monotonic()
        async with self._prepare_lock:
            self.staged = None  # an older staged version is of no use once a newer one is coming: free it first
            if req.model_path is not None:
                return await self._prepare_from_disk(req.model_path, req.weight_version, started)
            assert req.group_name is not None
            return await self._prepare_from_group(req.group_name, req.manifest, req.weight_version, started)

    async def _prepare_from_disk(self, model_path: str, version: str, started: float) -> web.Response:
        if (missing := self._no_weights()) is not None:
            return missing
        try:
            resolved = str(resolve_under(self.server.config.weights_root, model_path))
        except WeightsPathRefused as exc:
            return _fail(str(exc))
        from rollq.engine import weight_delta
        from rollq.engine.server.weights import safetensors_files

        if not is_delta_dir(resolved):  # a full version: checked now, read by the swap
            try:
                await asyncio.to_thread(safetensors_files, resolved)
            except (OSError, ValueError) as exc:
                return _fail(f"{model_path} is neither a weight delta nor a weights directory: {exc}")
            seconds = round(time.monotonic() - started, 6)
            message = f"{model_path} holds full weights: the swap loads them"
            reply = {"success": True, "message": message, "load_path": resolved, "prepare_seconds": seconds}
            return _json({**reply, "bytes_read": 0})
        try:
            delta = await asyncio.to_thread(weight_delta.read, resolved)
        except weight_delta.DeltaMismatch as exc:
            return self._refused(NotTheBase(str(exc)))
        manifest_bytes = os.path.getsize(os.path.join(resolved, DELTA_MANIFEST))
        return await self._stage(delta, version, resolved, started, len(delta.blob) + manifest_bytes)

    async def _prepare_from_group(
        self, group_name: str, raw_manifest: msgspec.Raw, version: str, started: float
    ) -> web.Response:
        from rollq.engine import weight_delta

        try:
            manifest = msgspec.json.decode(raw_manifest, type=weight_delta.DeltaManifest)
        except BAD_JSON as exc:  # a ValidationError too
            return _fail(f"manifest is not a weight delta's manifest: {exc}")
        if manifest.blob_bytes < 0:
            return _fail("manifest.blob_bytes must not be negative")
        # Received whatever follows (another base, no weights here): the trainer broadcasts to every engine at once.
        try:
            received = await asyncio.to_thread(
                self.groups.receive, group_name, [BLOB_NAME], ["uint8"], [[manifest.blob_bytes]]
            )
        except Exception as exc:
            return _fail(f"Failed to receive the weight delta: {exc}")
        blob = received[0][1].numpy().tobytes()
        if (missing := self._no_weights()) is not None:
            return missing
        return await self._stage(weight_delta.WeightDelta(manifest, blob), version, "", started, len(blob))

    async def swap_load(self, resolved: str, version: str | None) -> tuple[Callable[[], Awaitable[None]], str]:
        """For /update_weights_from_disk given the delta directory `resolved`, before its pause: the load to run
        under the pause, and the weight version it builds. Raises ValueError (a 400, nothing changed) when the
        directory is not a readable delta, not the version asked for, or this engine holds no weights."""
        server = self.server
        if not server.backend.holds_weights:
            raise ValueError(f"{type(server.backend).__name__} holds no weights: it applies no weight deltas")
        from rollq.engine import weight_delta

        staged = self.staged
        delta: WeightDelta | None = None
        if staged is not None and staged.source == resolved and version in (None, staged.version):
            target = staged.version
        else:  # nothing staged for it: read it now, apply it under the pause
            delta = await asyncio.to_thread(weight_delta.read, resolved)  # DeltaMismatch is a ValueError
            target = delta.manifest.version
        if version is not None and version != target:
            raise ValueError(f"weight_version {version!r} is not the delta's version {target!r}")

        async def load() -> None:
            current = self.staged
            if current is not None and (current.source, current.version) == (resolved, target):
                self.staged = None
                if current.loads == server.weight_loads:  # built on the weights served now: swap it in
                    await server.backend.load_tensors(list(current.tensors.items()), adopt=True)
                    return
            ready = delta if delta is not None else await asyncio.to_thread(weight_delta.read, resolved)
            served = server.backend.served_weights()
            try:
                _check_applies(ready.manifest, server.weight_version, _dtypes(served))
            except NotTheBase as exc:
                raise weight_delta.DeltaMismatch(str(exc)) from None
            changed = await asyncio.to_thread(weight_delta.apply, served, ready)  # checked before anything changes
            await server.backend.load_tensors(list(changed.items()), adopt=True)

        return load, target

    async def swap(self, request: web.Request) -> web.Response:
        req = await _decode(request, SwapRequest)
        if isinstance(req, web.Response):
            return req
        if (missing := self._no_weights()) is not None:
            return missing
        server = self.server
        staged = self.staged
        nothing = f"nothing is staged for weight version {req.weight_version!r}"
        if staged is None or staged.version != req.weight_version:
            return _fail(nothing, 409, weight_version=server.weight_version)
        stale = False

        async def load() -> None:
            nonlocal stale
            if self.staged is not staged or staged.loads != server.weight_loads:
                stale = True
                raise RuntimeError(nothing)
            self.staged = None
            await server.backend.load_tensors(list(staged.tensors.items()), adopt=True)

        success, message, num_paused, load_s = await server.apply_weight_update(
            load,
            version=req.weight_version,
            flush_cache=req.flush_cache or server.config.compat == "0.5.5",  # as the disk path: 0.5.5 always flushes
            abort_all=req.abort_all_requests,
        )
        if stale:
            message = f"{nothing}: the weights changed since it was prepared"
            return _fail(message, 409, weight_version=server.weight_version)
        if success:
            message += f" Weight version updated to {req.weight_version}."
            log.info("prepared weight version %s swapped in in %.2f s", req.weight_version, load_s)
        reply = {"success": success, "message": message, "num_paused_requests": num_paused}
        return _json({**reply, "load_seconds": round(load_s, 6)}, 200 if success else 400)

    async def checksum(self, request: web.Request) -> web.Response:
        if (missing := self._no_weights()) is not None:
            return missing
        server = self.server
        for _ in range(SNAPSHOT_TRIES):
            loads, version = await server.weights_snapshot()
            served = dict(server.backend.served_weights())
            sums = await asyncio.to_thread(_checksums, served)
            if server.weights_unchanged(loads):
                return _json({"weight_version": version, "dtype": _dtypes(served), "checksums": sums})
        return _fail(f"the weights changed under {SNAPSHOT_TRIES} reads in a row (concurrent updates)", 503)


def _checksums(weights: Mapping[str, Any]) -> dict[str, str]:
    from rollq.engine.weight_delta import checksum

    return {n: checksum(t.detach().cpu()) for n, t in weights.items()}


ROUTES_KEY = web.AppKey("delta_routes", DeltaRoutes)


def add_delta_routes(app: web.Application, server: EngineServer) -> None:
    """After add_distributed_routes: the distributed form receives on its groups."""
    routes = DeltaRoutes(server, app[DISTRIBUTED_ROUTES_KEY].groups)
    app.router.add_post("/rollq/prepare_weights", routes.prepare)
    app.router.add_post("/rollq/swap_prepared_weights", routes.swap)
    app.router.add_get("/rollq/weights_checksum", routes.checksum)
    app[ROUTES_KEY] = routes


__all__ = ["DELTA_MANIFEST", "ROUTES_KEY", "DeltaRoutes", "Staged", "add_delta_routes", "is_delta_dir"]
