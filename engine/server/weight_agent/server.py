"""The weight agent's HTTP routes: the disk form of `POST /rollq/prepare_weights` (docs/engines.md) and `GET /health`.

    POST /rollq/prepare_weights  {"model_path": "<d{N}/ or v{N}/ under weights_root>", "weight_version": "N"}
      200 {"success": true, "message", "load_path", "weight_version", "prepare_seconds", "bytes_read"}
      409 {"success": false, "message": "... not the delta's base ...", "weight_version": "<what it holds>"}
      400 a malformed request, a path outside weights_root; 401 without the admin key

One prepare at a time: a second waits for the first (a trainer's retry of the same version then finds it built and
is answered at once), and each sees the base the one before left. The handler is never cancelled midway (aiohttp's
default): a client that gives up does not leave a half-made version behind, nor the lock held by nobody."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from rollq.engine.server.weight_agent.versions import LocalVersions, Refused
from rollq.http_server import BAD_JSON, read_body

log = logging.getLogger("rollq.weight_agent")

PREPARE_ROUTE = "/rollq/prepare_weights"
MAX_BODY_BYTES = 1 << 20  # a path and a version
VERSIONS = web.AppKey("weight_agent_versions", LocalVersions)
LOCK = web.AppKey("weight_agent_lock", asyncio.Lock)


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def _refusal(message: str, status: int = 400, **extra: Any) -> web.Response:
    return _json({"success": False, "message": message, **extra}, status)


def bearer_ok(header: str, key: str) -> bool:
    """The engines' check (engine/server/app.py): `Bearer KEY`, compared in constant time."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def _auth(admin_api_key: str):
    @web.middleware
    async def auth(request: web.Request, handler):
        header = request.headers.get("Authorization", "")
        if request.path.startswith("/rollq/") and not bearer_ok(header, admin_api_key):
            return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    return auth


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok", "weight_version": request.app[VERSIONS].version})


async def prepare_weights(request: web.Request) -> web.Response:
    raw = await read_body(request)
    try:
        body = msgspec.json.decode(raw)
    except BAD_JSON as exc:
        return _refusal(f"Invalid JSON body: {exc}")
    if not isinstance(body, dict):
        return _refusal("the request body must be a JSON object")
    if "model_path" not in body and ("manifest" in body or "group_name" in body):
        return _refusal("this agent prepares from disk only: send model_path (a delta or full weights directory)")
    model_path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(model_path, str) or not model_path:
        return _refusal("model_path is required (a delta or full weights directory under the agent's weights_root)")
    if not isinstance(version, str) or not version:
        return _refusal("weight_version is required (a string)")
    versions = request.app[VERSIONS]
    async with request.app[LOCK]:
        started = time.perf_counter()
        try:
            prepared = await asyncio.to_thread(versions.prepare, model_path, version)
        except Refused as exc:
            if exc.status == 409:
                log.warning("prepare of version %s refused: %s", version, exc)
                return _refusal(str(exc), 409, weight_version=versions.version)
            return _refusal(str(exc), exc.status)
        except OSError as exc:  # the agent's own disk (full, unwritable): not the caller's fault, said as it is
            log.exception("prepare of version %s failed", version)
            return _refusal(f"the agent could not write version {version}: {exc}", 500, weight_version=versions.version)
        seconds = time.perf_counter() - started
    log.info("prepared %s in %.2f s (%d bytes read): %s", version, seconds, prepared.bytes_read, prepared.message)
    return _json(
        {
            "success": True,
            "message": prepared.message,
            "load_path": prepared.load_path,
            "weight_version": prepared.version,
            "prepare_seconds": round(seconds, 6),
            "bytes_read": prepared.bytes_read,
        }
    )


def build_app(versions: LocalVersions, admin_api_key: str | None) -> web.Application:
    """The agent's app; `admin_api_key` None: /rollq/prepare_weights is open (insecure_no_auth)."""
    app = web.Application(middlewares=[_auth(admin_api_key)] if admin_api_key else [], client_max_size=MAX_BODY_BYTES)
    app[VERSIONS] = versions
    app[LOCK] = asyncio.Lock()
    app.router.add_get("/health", health)
    app.router.add_post(PREPARE_ROUTE, prepare_weights)
    return app


__all__ = ["PREPARE_ROUTE", "bearer_ok", "build_app"]
