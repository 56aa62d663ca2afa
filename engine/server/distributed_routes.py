"""SGLang 0.5.23's distributed weight update routes on rollq's engine server (http_server.py:1404-1506):
/init_weights_update_group, /destroy_weights_update_group, /begin_weight_update, /end_weight_update,
/update_weights_from_distributed. Each answers `{"success", "message"}`, 200 or 400.

The update goes through `EngineServer.apply_weight_update` like a disk update (model-update lock, decode frozen,
flush_cache, weight version); only the source differs: the tensors come from the trainer's broadcast. On a server that
is not paused the receive starts only once in-flight requests finished (the model-update lock), while the trainer's
broadcast is bounded by its timeout: pause first, as rollq's trainer does (FleetController.cycle_with)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import msgspec
from aiohttp import web

from rollq.engine.server.backend import Backend
from rollq.engine.server.weight_group import InitGroupRequest, WeightGroups
from rollq.http_server import BAD_JSON, read_body

T = TypeVar("T")


class EngineServer(Protocol):
    """What the routes use of `rollq.engine.server.app.EngineServer` (app.py imports this module: no import back)."""

    backend: Backend

    @property
    def config(self) -> Any: ...

    async def apply_weight_update(
        self, load: Callable[[], Awaitable[Any]], *, version: str | None, flush_cache: bool, abort_all: bool
    ) -> tuple[bool, str, int, float]: ...


OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


class UpdateFromDistributedRequest(msgspec.Struct, kw_only=True):
    """UpdateWeightsFromDistributedReqInput (io_struct.py); unknown keys (selector, torch_empty_cache) are ignored."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyGroupRequest(msgspec.Struct, kw_only=True):
    group_name: str = "weight_update_group"


class SessionRequest(msgspec.Struct, kw_only=True):
    selector: Literal["target", "draft", "all"] = "all"


def _reply(success: bool, message: str, **extra: Any) -> web.Response:
    body = msgspec.json.encode({"success": success, "message": message, **extra})
    return web.Response(body=body, status=200 if success else 400, content_type="application/json")


def validation_error(message: str) -> web.Response:
    """A request-shape error as SGLang's FastAPI answers it (400; the LoRA routes answer the same)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.Response(body=msgspec.json.encode(body), status=400, content_type="application/json")


async def _decode(request: web.Request, kind: type[T]) -> T | web.Response:
    raw = await read_body(request)  # 408 for a body that trickles in
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        return validation_error(str(exc))
    except BAD_JSON as exc:  # malformed, invalid UTF-8 in a field read, too deep: the client's fault, never a 500
        return validation_error(f"Invalid JSON body: {exc}")


class DistributedRoutes:
    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.groups = WeightGroups()
        self.session_open = False  # SGLang's `_session` (scheduler_components/weight_updater.py:309-340)
        # 0.5.5 has no begin/end routes: its update_weights_from_distributed runs whenever it is called.
        self.sessions = server.config.compat != "0.5.5"

    async def init_group(self, request: web.Request) -> web.Response:
        req = await _decode(request, InitGroupRequest)
        if isinstance(req, web.Response):
            return req
        # Joining blocks until every rank joined: a thread keeps generation (and /health) served meanwhile.
        ok, message = await asyncio.to_thread(self.groups.join, req)
        return _reply(ok, message)

    async def destroy_group(self, request: web.Request) -> web.Response:
        req = await _decode(request, DestroyGroupRequest)
        if isinstance(req, web.Response):
            return req
        ok, message = await asyncio.to_thread(self.groups.destroy, req.group_name)
        return _reply(ok, message)

    async def begin(self, request: web.Request) -> web.Response:
        return await self._session(request, opening=True)

    async def end(self, request: web.Request) -> web.Response:
        return await self._session(request, opening=False)

    async def _session(self, request: web.Request, *, opening: bool) -> web.Response:
        """Open (begin) or close (end) the weight-update session; refused when it already is in that state."""
        req = await _decode(request, SessionRequest)
        if isinstance(req, web.Response):
            return req
        if self.session_open == opening:
            return _reply(False, SESSION_OPEN if opening else NO_SESSION)
        self.session_open = opening
        return _reply(True, "Success")

    async def update(self, request: web.Request) -> web.Response:
        req = await _decode(request, UpdateFromDistributedRequest)
        if isinstance(req, web.Response):
            return req
        if self.sessions and not self.session_open:
            return _reply(False, OUTSIDE_SESSION)
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            return validation_error("names, dtypes and shapes must have the same length")
        if req.load_format not in (None, "auto"):
            return _reply(False, f"Failed to receive weights: load_format {req.load_format!r} is not supported.")
        from rollq.engine.weight_group import parse_dtype  # imports torch: only when a distributed update comes

        try:
            for d in req.dtypes:
                parse_dtype(d)
        except ValueError as exc:
            return validation_error(str(exc))
        if any(n < 0 for shape in req.shapes for n in shape):
            return validation_error("shapes must not have negative sizes")
        server = self.server

        async def load() -> None:
            try:
                named = await asyncio.to_thread(self.groups.receive, req.group_name, req.names, req.dtypes, req.shapes)
            except Exception as exc:
                raise RuntimeError(f"Failed to receive weights: {exc}") from exc
            await server.backend.load_tensors(named)

        success, message, num_paused, load_s = await server.apply_weight_update(
            load,
            version=req.weight_version,
            flush_cache=req.flush_cache or server.config.compat == "0.5.5",  # as the disk path: 0.5.5 always flushes
            abort_all=req.abort_all_requests,
        )
        if success:
            message = "Succeeded to update parameter online."  # SGLang's words for this path
        else:
            # a failed receive keeps SGLang's words ("Failed to receive weights: ..."), without the disk path's prefix
            message = message.replace("Failed to update weights: Failed to receive", "Failed to receive", 1)
        # load_seconds / num_paused_requests: rollq's additions, as on the disk path (clients ignore unknown keys).
        return _reply(success, message, num_paused_requests=num_paused, load_seconds=round(load_s, 6))

    async def on_cleanup(self, app: web.Application) -> None:
        await asyncio.to_thread(self.groups.destroy_all)


ROUTES_KEY = web.AppKey("distributed_routes", DistributedRoutes)


def add_distributed_routes(app: web.Application, server: EngineServer) -> None:
    routes = DistributedRoutes(server)
    r = app.router
    r.add_post("/init_weights_update_group", routes.init_group)
    r.add_post("/destroy_weights_update_group", routes.destroy_group)
    if routes.sessions:
        r.add_post("/begin_weight_update", routes.begin)
        r.add_post("/end_weight_update", routes.end)
    r.add_post("/update_weights_from_distributed", routes.update)
    app.on_cleanup.append(routes.on_cleanup)
    app[ROUTES_KEY] = routes  # tests and tools reach the groups and the session through it


__all__ = ["ROUTES_KEY", "DistributedRoutes", "add_distributed_routes", "validation_error"]
