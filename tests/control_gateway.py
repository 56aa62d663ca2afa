"""A front for a real engine that serves generation and refuses control calls, as sglang-router 0.3.2 does: it
forwards /generate, /health_generate and the info routes to the engine, and answers /pause_generation,
/update_weights_from_disk, /continue_generation, ... itself (404 with a plain-text body, by default). Real HTTP on
loopback, for tests of what the fleet and the trainer do when weight updates cannot reach an engine.

`refusals` bounds how many control calls it refuses (None: all of them), after letting `forward_first` through: a
front that fails for a while and then recovers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from rollq.engine.types import ADMIN_ROUTES
from rollq.http_server import start_site

HOP_HEADERS = ("Authorization", "Content-Type", "Accept")  # what the engine needs of a request's headers


class ControlGateway:
    def __init__(
        self,
        engine_url: str,
        *,
        status: int = 404,
        body: str = "404 page not found\n",
        content_type: str = "text/plain",
        routes: frozenset[str] = ADMIN_ROUTES,
        refusals: int | None = None,
        forward_first: int = 0,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.answer = (status, body, content_type)
        self.routes = routes
        self.refusals = refusals
        self.forward_first = forward_first
        self.refused: Counter[str] = Counter()  # route -> calls answered by the gateway itself
        self.forwarded: Counter[str] = Counter()  # route -> calls passed to the engine
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ControlGateway:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._http = aiohttp.ClientSession()
        self._runner, port = await start_site(app, "127.0.0.1", 0, access_log=None)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    def _refuses(self, path: str) -> bool:
        if path not in self.routes:
            return False
        if self.forward_first > 0:
            self.forward_first -= 1
            return False
        if self.refusals is None:
            return True
        if self.refusals > 0:
            self.refusals -= 1
            return True
        return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self._refuses(request.path):
            self.refused[request.path] += 1
            status, body, content_type = self.answer
            return web.Response(status=status, text=body, content_type=content_type)
        self.forwarded[request.path] += 1
        assert self._http is not None
        headers = {h: request.headers[h] for h in HOP_HEADERS if h in request.headers}
        async with self._http.request(
            request.method, self.engine_url + request.path_qs, data=await request.read(), headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            if "Content-Type" in upstream.headers:
                response.headers["Content-Type"] = upstream.headers["Content-Type"]
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # streamed /generate chunks as they come
                await response.write(chunk)
            await response.write_eof()
            return response
