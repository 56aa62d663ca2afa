"""SGLang's gateway (`smg`, formerly `sglang-router`) in front of engines: recognised by its own routes, listed,
and joined and left by the engines.

A gateway forwards generation (`/generate` with `X-SMG-Routing-Key` keeps a key on one engine) but no control call:
pause, weights, LoRA loads, abort and resume answer 404 there. So a pool given a gateway URL generates through it
and sends every control call to each engine the gateway lists in `GET /workers`. A gateway is never recognised by
what it answers to engine routes: sglang-router 0.3.2 answers `/get_server_info` with its own dict, and smg 1.13
forwards `/get_server_info` and `/get_model_info` to one engine (its facts, not the fleet's).

Routes (smg 1.13.0 and sglang-router 0.3.2 alike): `GET /workers` -> `{"workers": [{"id", "url", ...}], ...}`;
`POST /workers {"url", "api_key"}` -> 202 `{"worker_id", ...}` (registration runs in the background);
`DELETE /workers/{id}` -> 202. With `--control-plane-api-keys ID:NAME:admin:KEY` every one of them needs
`Authorization: Bearer KEY` (401 otherwise); without, they answer anyone who reaches the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
import msgspec

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # smg's sticky key: the manual policy pins each key to one engine
WORKERS_ROUTE = "/workers"
REGISTER_TIMEOUT_S = 60.0  # how long an engine keeps trying to join a gateway that is not up yet
SNIPPET_CHARS = 300


class GatewayError(Exception):
    """The gateway refused or did not answer a membership call; the text names the gateway, the route, the status.
    `status`: the HTTP status of a refusal (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GatewayWorker(msgspec.Struct, frozen=True):
    """One engine a gateway lists."""

    id: str
    url: str


def listed_workers(body: Any) -> list[GatewayWorker] | None:
    """The engines in a `GET /workers` answer, or None when the body is not a gateway's worker list (an engine's
    404 page, a proxy's reply): `{"workers": [{"id": ..., "url": ...}, ...]}`."""
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        return None
    out: list[GatewayWorker] = []
    for w in body["workers"]:
        if not isinstance(w, dict) or not isinstance(w.get("url"), str):
            return None
        out.append(GatewayWorker(id=str(w.get("id", "")), url=w["url"].rstrip("/")))
    return out


class GatewayClient:
    """Membership calls on one gateway, with its admin key (smg's control-plane key) when it has one."""

    def __init__(self, url: str, http: aiohttp.ClientSession, *, admin_api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.http = http
        self.headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self.has_key = bool(admin_api_key)

    async def _call(
        self, method: str, path: str, json: Any = None, timeout_s: float = 10.0, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """`headers`: instead of the admin key's (a probe with other keys)."""
        try:
            async with self.http.request(
                method,
                self.url + path,
                json=json,
                headers=self.headers if headers is None else headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise GatewayError(f"{self.url}{path}: no answer ({type(exc).__name__}: {exc})") from None
        try:
            body: Any = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            body = raw.decode(errors="replace").strip()[:SNIPPET_CHARS]
        return status, body

    def _refused(self, path: str, status: int, body: Any) -> GatewayError:
        hint = ""
        if status in (401, 403):
            hint = (
                " (the gateway's admin key: smg --control-plane-api-keys ID:NAME:admin:KEY; give rollq the same KEY as "
                "gateway_admin_api_key)"
                if not self.has_key
                else " (the gateway refused the admin key sent: gateway_admin_api_key)"
            )
        return GatewayError(
            f"{self.url}{path}: HTTP {status}: {str(body)[:SNIPPET_CHARS] or '(empty body)'}{hint}", status
        )

    async def workers(self) -> list[GatewayWorker] | None:
        """The engines the gateway lists; None when the URL is no gateway (`GET /workers` is not a worker list: an
        engine answers 404). GatewayError when it did not answer, or refused (401: its admin key is needed)."""
        status, body = await self._call("GET", WORKERS_ROUTE)
        if status in (401, 403):
            raise self._refused(WORKERS_ROUTE, status, body)
        if status != 200:
            return None
        return listed_workers(body)

    async def lists_to(self, keys: Iterable[str | None]) -> bool:
        """Whether the gateway lists its engines to a caller holding one of `keys` (None: no key) rather than its admin
        key: then such a caller may also register a URL of theirs (`POST /workers` takes the same key), and whatever
        a pool sends the engines it lists (their keys) would reach that URL. smg without --control-plane-api-keys
        lists to anyone; with --api-key K alone, to every holder of K (its data plane's key)."""
        # Each probe names its own headers: the client's (its admin key) are never swapped, as a membership call of
        # another task may be under way on the same client.
        for key in dict.fromkeys(keys):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            status, body = await self._call("GET", WORKERS_ROUTE, headers=headers)
            if status == 200 and listed_workers(body) is not None:
                return True
        return False

    async def register(self, url: str, *, api_key: str | None = None) -> str:
        """`POST /workers`: the gateway probes the engine and routes to it once healthy (202: queued). `api_key`: what
        the gateway sends the engine (its generation key). Returns the worker id."""
        payload: dict[str, Any] = {"url": url.rstrip("/")}
        if api_key:
            payload["api_key"] = api_key
        status, body = await self._call("POST", WORKERS_ROUTE, payload)
        if status not in (200, 201, 202) or not isinstance(body, dict):
            raise self._refused(WORKERS_ROUTE, status, body)
        return str(body.get("worker_id", ""))

    async def deregister(self, url: str) -> int:
        """`DELETE /workers/{id}` for each listing of `url`; how many were removed."""
        url = url.rstrip("/")
        listed = await self.workers()
        removed = 0
        for worker in listed or []:
            if worker.url == url and worker.id:
                status, body = await self._call("DELETE", f"{WORKERS_ROUTE}/{worker.id}")
                if status not in (200, 202, 204, 404):
                    raise self._refused(f"{WORKERS_ROUTE}/{worker.id}", status, body)
                removed += status != 404
        return removed

    async def join(self, url: str, *, api_key: str | None = None, timeout_s: float = REGISTER_TIMEOUT_S) -> str:
        """`register`, tried again while the gateway does not answer (it may start after the engine), up to
        `timeout_s`; a refusal (a wrong key) fails at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.register(url, api_key=api_key)
            except GatewayError as exc:
                if "no answer" not in str(exc) or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.5)


__all__ = [
    "ROUTING_KEY_HEADER",
    "GatewayClient",
    "GatewayError",
    "GatewayWorker",
    "listed_workers",
]
