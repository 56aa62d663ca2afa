"""SGLang's LoRA adapter routes on rollq's engine server (srt/entrypoints/http_server.py:949-980 in 0.5.5):
/load_lora_adapter `{lora_name, lora_path, pinned}` and /unload_lora_adapter `{lora_name}`, each answering
`{success, error_message, loaded_adapters}` with 200 or 400.

As SGLang: loads and unloads run one at a time and never stop generation of other requests; an unload unregisters
the name first (requests naming it fail from then on) and returns once the requests in flight on it finished (none
is aborted). Unlike SGLang, rollq reads adapters only from under the engine's weights_root (the same rule as
/update_weights_from_disk) and guards both routes with the admin key: they read files and change what the model
serves."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from rollq.engine.server.backend import Backend
from rollq.engine.server.distributed_routes import validation_error
from rollq.engine.server.lora_registry import NOT_ENABLED, AdapterError, AdapterRegistry
from rollq.engine.server.weights_root import WeightsPathRefused, resolve_under
from rollq.http_server import BAD_JSON, read_body

T = TypeVar("T")


class EngineServer(Protocol):
    """What the routes use of `rollq.engine.server.app.EngineServer` (app.py imports this module: no import back)."""

    backend: Backend
    adapters: AdapterRegistry

    @property
    def config(self) -> Any: ...


class LoadAdapterRequest(msgspec.Struct, kw_only=True):
    """LoadLoRAAdapterReqInput (io_struct.py:1463-1481); unknown keys are ignored."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadAdapterRequest(msgspec.Struct, kw_only=True):
    """UnloadLoRAAdapterReqInput (io_struct.py:1483-1495)."""

    lora_name: str


def _reply(server: EngineServer, error: str | None = None, *, listed: bool = True) -> web.Response:
    """LoRAUpdateOutput (io_struct.py:1497-1504): `loaded_adapters` is null on the errors SGLang's tokenizer side
    raises (not enabled, too many, unknown name), the loaded set otherwise."""
    body = {
        "success": error is None,
        "error_message": error or "",
        "loaded_adapters": server.adapters.loaded() if listed else None,
    }
    return web.Response(
        body=msgspec.json.encode(body), status=200 if error is None else 400, content_type="application/json"
    )


async def _decode(request: web.Request, kind: type[T]) -> T | web.Response:
    raw = await read_body(request)
    try:
        body = msgspec.json.decode(raw or b"{}")  # every byte read: invalid UTF-8 anywhere is refused as such
    except BAD_JSON as exc:
        return validation_error(f"Invalid JSON body: {exc}")
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        return validation_error(str(exc))


class LoraRoutes:
    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.loads = 0  # adapters loaded since start (tests and /metrics read them)
        self.unloads = 0

    @property
    def enabled(self) -> bool:
        return bool(self.server.config.enable_lora)

    async def load(self, request: web.Request) -> web.Response:
        req = await _decode(request, LoadAdapterRequest)
        if isinstance(req, web.Response):
            return req
        return await self.load_adapter(req.lora_name, req.lora_path, req.pinned)

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> web.Response:
        server = self.server
        if not self.enabled:
            return _reply(server, NOT_ENABLED, listed=False)
        if not name:
            return validation_error("lora_name must not be empty")
        async with server.adapters.lock:
            try:
                server.adapters.check_room(name, path)
            except AdapterError as exc:
                return _reply(server, str(exc), listed="already loaded" in str(exc))
            try:
                resolved = resolve_under(server.config.weights_root, path)
            except WeightsPathRefused as exc:
                return _reply(server, f"Failed to load LoRA adapter {name}: {exc}")
            ref = server.adapters.new_ref(name, path, pinned)
            try:
                await server.backend.load_adapter(ref, str(resolved))
            except Exception as exc:  # a damaged or foreign adapter: SGLang answers the load with its message
                return _reply(server, f"Failed to load LoRA adapter {name}: {type(exc).__name__}: {exc}")
            server.adapters.register(ref)
            self.loads += 1
        return _reply(server)

    async def unload(self, request: web.Request) -> web.Response:
        req = await _decode(request, UnloadAdapterRequest)
        if isinstance(req, web.Response):
            return req
        server = self.server
        if not self.enabled:
            return _reply(server, NOT_ENABLED, listed=False)
        async with server.adapters.lock:
            try:
                ref = server.adapters.unregister(req.lora_name)
            except AdapterError as exc:
                return _reply(server, str(exc), listed=False)
            await server.adapters.wait_unused(ref)  # requests in flight on it finish on it
            await server.backend.unload_adapter(ref)
            self.unloads += 1
        return _reply(server)


ROUTES_KEY = web.AppKey("lora_routes", LoraRoutes)


def add_lora_routes(app: web.Application, server: EngineServer) -> LoraRoutes:
    routes = LoraRoutes(server)
    app.router.add_post("/load_lora_adapter", routes.load)
    app.router.add_post("/unload_lora_adapter", routes.unload)
    app[ROUTES_KEY] = routes
    return routes


__all__ = ["ROUTES_KEY", "LoadAdapterRequest", "LoraRoutes", "UnloadAdapterRequest", "add_lora_routes"]
