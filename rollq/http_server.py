"""rollq's HTTP servers with read timeouts: aiohttp apps started with a request-head timeout and request bodies read
under a deadline. (The /metrics servers, prometheus_client's, have a socket timeout: rollq.metrics_server.)

aiohttp's server has no read timeout of its own (aiohttp 3.14.5, web_protocol.py):
- The request head: the only timer is `keepalive_timeout` (default 3630 s, web_protocol.py:182). Since aiohttp 3.14.4
  it runs from the moment a connection opens (:366-373) and again after every response (:746-753), and closes the
  connection when it fires while no complete request head has arrived (`_process_keepalive`, :550-565). So it is the
  head timeout and the idle keep-alive timeout at once; `start_site(header_timeout_s=...)` sets it. While a handler
  runs the timer does nothing (the handler is not waiting for a head, :564): a minutes-long generation or an SSE
  stream is never cut.
- The body: nothing. A handler's `await request.read()` waits as long as the client trickles; `read_body` bounds it.

`header_timeout_s` is also how long an idle keep-alive connection stays open, so it must be longer than the
keep-alive of the server's clients: a client that reuses a pooled connection just as the server closes it sees a
disconnect, and aiohttp's client retries only idempotent methods (client.py:738-740), never a POST. rollq's engine
pool keeps idle connections 60 s (engine/http.py), aiohttp's client 15 s by default, httpx 5 s. (SGLang 0.5.23 also
uses one value for both: SGLANG_TIMEOUT_KEEP_ALIVE, 5 s, is uvicorn's keep-alive and granian's header read timeout;
entrypoints/http_server.py:2742-2752, environ.py:337.)

Use (the recording proxy and the engine server do; the ingress the same way):

    runner, port = await start_site(app, host, port, header_timeout_s=30.0, body_timeout_s=60.0,
                                    handler_cancellation=True, access_log=None)   # the rest goes to web.AppRunner
    ...
    raw = await read_body(request)  # 408 past start_site's body_timeout_s, 413 past the app's client_max_size
    try:
        body = msgspec.json.decode(raw)
    except BAD_JSON as exc:  # invalid UTF-8 and deep nesting included: answer 400
        ...
    await runner.cleanup()
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

DEFAULT_HEADER_TIMEOUT_S = 75.0  # nginx's keepalive_timeout; above every rollq client's keep-alive (60 s at most)
DEFAULT_BODY_TIMEOUT_S = 60.0

# What msgspec.json.decode raises for bytes that are not JSON: malformed or wrongly typed (DecodeError, ValidationError
# is one), a string that is not UTF-8 (UnicodeDecodeError) and nesting too deep (RecursionError).
BAD_JSON: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)

BODY_TIMEOUT_S = web.AppKey("rollq_body_timeout_s", float)  # set by start_site, read by read_body


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    backlog: int = 128,
    reuse_address: bool | None = None,
    **runner_kwargs: Any,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port; returns its runner (`await runner.cleanup()` stops it) and the bound port (a free
    one for port 0). A connection that has not sent a complete request head `header_timeout_s` after it opened or
    after its last response is closed; `read_body` answers 408 to a body not received within `body_timeout_s`.
    `runner_kwargs` go to `web.AppRunner` (access_log, handle_signals, handler_cancellation, shutdown_timeout...)."""
    if header_timeout_s <= 0 or body_timeout_s <= 0:
        raise ValueError(f"read timeouts must be positive, got {header_timeout_s=} {body_timeout_s=}")
    app[BODY_TIMEOUT_S] = body_timeout_s
    runner = web.AppRunner(app, keepalive_timeout=header_timeout_s, **runner_kwargs)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=reuse_address)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


async def read_body(request: web.Request, timeout_s: float | None = None) -> bytes:
    """The request's whole body, within `timeout_s` (default: the app's `body_timeout_s` from start_site, else
    DEFAULT_BODY_TIMEOUT_S). A client still sending after that gets 408 and the connection closes (after aiohttp's
    lingering_time, 10 s, in which it may drain the rest). Past the app's client_max_size: aiohttp's 413."""
    if timeout_s is None:
        timeout_s = request.config_dict.get(BODY_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        refusal = web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout_s:g} s")
        refusal.force_close()
        raise refusal from None


__all__ = [
    "BAD_JSON",
    "BODY_TIMEOUT_S",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "read_body",
    "start_site",
]
