"""HTTP hardening of the recording proxy and the engine server (issue 24: F8, F9, F14 of the security probe):
read timeouts on request heads and bodies that never cut a long answer, 400 (never 500) for bytes that are not JSON,
400 for requests the engine refuses, and nothing unauthenticated that tells about the episodes served.

Real servers on loopback, real sockets: a slow client is a socket that sends part of a request and stops."""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time

import httpx
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, ServerHandle, build_app, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.metrics_server import MetricsServer
from rollq.workers.context import WorkflowContext
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from tests.agents import SCRIPT
from tests.producer.ingress_helpers import running_ingress
from tests.workers.proxy.helpers import Stack, make_stack

HEAD_S = 0.2  # the servers' header and body timeouts in these tests
BOUND_S = 5.0  # how long a test waits for the server to act (each timeout is well under it)
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


# -- raw sockets ------------------------------------------------------------------------------------------------------


async def _eof_after(url: str, sent: bytes, *, trickle: bytes = b"") -> tuple[bytes, float]:
    """Send `sent`, then one byte of `trickle` every 50 ms while the connection stays open; returns what the server
    sent before closing and how long that took. Fails (TimeoutError) when the server keeps it open past BOUND_S."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(sent)
    await writer.drain()
    started = time.monotonic()

    async def drip() -> None:
        for i in range(len(trickle)):
            await asyncio.sleep(0.05)  # the slow client's pace, not a wait for the server
            writer.write(trickle[i : i + 1])
            await writer.drain()

    dripping = asyncio.create_task(drip())
    try:
        try:
            got = await asyncio.wait_for(reader.read(), BOUND_S)  # everything up to EOF
        except ConnectionResetError:
            got = b""
        return got, time.monotonic() - started
    finally:
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        writer.close()


async def _answer_head(url: str, sent: bytes) -> bytes:
    """Send `sent` (a request whose body stops short) and return the status line and headers of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    finally:
        writer.close()


def _short_body(path: str, headers: str = "") -> bytes:
    """A POST announcing 1000 bytes of body and sending 10."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n{headers}\r\n"
        '{"a": "b",'
    ).encode()


def _no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


# -- servers ----------------------------------------------------------------------------------------------------------


@pytest.fixture
async def start_engine():
    handles: list[ServerHandle] = []

    async def start(**server) -> ServerHandle:
        backend = SyntheticBackend(SyntheticConfig(per_token_latency_s=server.pop("per_token_latency_s", 0.0)))
        config = {"host": "127.0.0.1", "port": 0, "header_timeout_s": HEAD_S, "body_timeout_s": HEAD_S, **server}
        handle = await serve(backend, EngineServerConfig(**config))
        handles.append(handle)
        return handle

    yield start
    for h in handles:
        await h.close()


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # unused on loopback; built once rather than by every client (0.15 s)


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=httpx.Timeout(BOUND_S * 2), verify=_tls()) as client:
        yield client


async def _proxy(stack: Stack, **config) -> RecordingProxy:
    """A second proxy on the stack's engine pool, with the test's timeouts."""
    proxy_config = ProxyConfig(header_timeout_s=HEAD_S, body_timeout_s=HEAD_S, **config)
    return await RecordingProxy(stack.proxy.engine, stack.proxy.tokenizer, proxy_config).start()


@pytest.fixture
async def stack():
    async with make_stack() as s:
        yield s


@pytest.fixture
async def proxy(stack):
    p = await _proxy(stack)
    yield p
    await p.close()


def _auth(proxy: RecordingProxy) -> dict[str, str]:
    return {"Authorization": f"Bearer {proxy.sessions.open().key}"}


# -- F8: read timeouts ------------------------------------------------------------------------------------------------

HEADS = {
    "nothing": (b"", b""),
    "half a request line": (b"POST /gener", b""),
    "headers that never end": (b"POST /generate HTTP/1.1\r\nHost: x\r\n", b""),
    "headers trickled a byte at a time": (b"POST /generate HTTP/1.1\r\n", b"X-Slow: " + b"a" * 100),
}


@pytest.mark.parametrize("sent, trickle", HEADS.values(), ids=HEADS.keys())
async def test_the_engine_closes_a_connection_without_a_complete_head(start_engine, sent, trickle):
    engine = await start_engine()
    got, took = await _eof_after(engine.url, sent, trickle=trickle)
    assert got == b"" and took < BOUND_S


@pytest.mark.parametrize("sent, trickle", HEADS.values(), ids=HEADS.keys())
async def test_the_proxy_closes_a_connection_without_a_complete_head(proxy, sent, trickle):
    got, took = await _eof_after(proxy.root_url, sent.replace(b"/generate", b"/v1/chat/completions"), trickle=trickle)
    assert got == b"" and took < BOUND_S


@pytest.mark.parametrize("sent, trickle", HEADS.values(), ids=HEADS.keys())
async def test_the_ingress_closes_a_connection_without_a_complete_head(redis_url, run_name, sent, trickle):
    async with running_ingress(redis_url, run_name, header_timeout=HEAD_S, body_timeout=HEAD_S) as (_, url):
        got, took = await _eof_after(url, sent.replace(b"/generate", b"/v1/jobs"), trickle=trickle)
    assert got == b"" and took < BOUND_S


async def test_the_ingress_answers_408_to_a_body_that_stops(redis_url, run_name):
    async with running_ingress(redis_url, run_name, header_timeout=HEAD_S, body_timeout=HEAD_S) as (app, url):
        head = await _answer_head(url, _short_body("/v1/jobs", "Authorization: Bearer tok-acme\r\n"))
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, head
        assert app.stats.requests == 1


async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(start_engine):
    engine = await start_engine()
    got, took = await _eof_after(engine.url, b"GET /model_info HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200") and took < BOUND_S


@pytest.mark.parametrize("path", ["/generate", "/update_weight_version", "/init_weights_update_group"])
async def test_the_engine_answers_408_to_a_body_that_stops(start_engine, path):
    engine = await start_engine()
    assert (await _answer_head(engine.url, _short_body(path))).startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
async def test_the_proxy_answers_408_to_a_body_that_stops(proxy, path):
    key = _auth(proxy)["Authorization"]
    head = await _answer_head(proxy.root_url, _short_body(path, f"Authorization: {key}\r\n"))
    assert head.startswith(b"HTTP/1.1 408")


async def test_a_generation_longer_than_the_timeouts_is_not_cut(start_engine, http):
    engine = await start_engine(per_token_latency_s=0.02)  # 40 tokens: about 0.8 s, over 2 header timeouts
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    for stream in (False, True):  # on one kept-alive connection
        started = time.monotonic()
        resp = await http.post(f"{engine.url}/generate", json={**body, "stream": stream})
        assert resp.status_code == 200 and time.monotonic() - started > 2 * HEAD_S
        last = resp.json() if not stream else msgspec.json.decode(resp.text.split("data: ")[-2])
        assert len(last["output_ids"]) == 40


async def test_a_proxy_answer_longer_than_the_timeouts_is_not_cut(http):
    async with make_stack(per_token_latency_s=0.03) as stack:  # 27 tokens of the scripted reply: about 0.8 s
        proxy = await _proxy(stack)
        try:
            body = {"model": "m", "messages": QUESTION, "max_tokens": 30}
            started = time.monotonic()
            resp = await http.post(f"{proxy.base_url}/chat/completions", json=body, headers=_auth(proxy))
            assert resp.status_code == 200 and time.monotonic() - started > 2 * HEAD_S
            assert resp.json()["usage"]["completion_tokens"] > 20
        finally:
            await proxy.close()


async def test_the_metrics_server_closes_a_silent_connection():
    server = MetricsServer(CollectorRegistry(), 0, "127.0.0.1", timeout_s=HEAD_S)  # every service's /metrics
    try:
        got, took = await _eof_after(f"http://127.0.0.1:{server.port}", b"GET /metr")
        assert b" 200 " not in got and took < BOUND_S
    finally:
        server.close()


# -- F9: bytes that are not JSON --------------------------------------------------------------------------------------

# One body for every route: an invalid UTF-8 string in a field each route reads (typed routes skip unknown fields).
NOT_UTF8 = (
    b'{"text": "\xff", "model_path": "\xff", "new_version": "\xff", "mode": "\xff", "rid": "\xff",'
    b' "group_name": "\xff", "selector": "\xff", "master_address": "\xff", "names": ["\xff"], "dtypes": [],'
    b' "shapes": []}'
)
_DEEP = b"[" * 20_000 + b"]" * 20_000
TOO_DEEP = b"{" + b", ".join(b'"%s": %s' % (k, _DEEP) for k in (b"text", b"selector", b"group_name", b"names")) + b"}"
BAD_BODIES = {"invalid UTF-8": NOT_UTF8, "nesting too deep": TOO_DEEP}
ENGINE_JSON_ROUTES = [
    ("POST", "/generate"),
    ("PUT", "/generate"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("POST", "/abort_request"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/update_weight_version"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/begin_weight_update"),
    ("POST", "/end_weight_update"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/unload_lora_adapter"),
    ("POST", "/rollq/prepare_weights"),
    ("POST", "/rollq/swap_prepared_weights"),
]
BODYLESS = {("POST", "/flush_cache")}  # reads no body


def test_every_engine_route_with_a_body_is_covered():
    app = build_app(SyntheticBackend(SyntheticConfig()), EngineServerConfig())
    with_body = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method in ("POST", "PUT")}
    assert with_body - BODYLESS == set(ENGINE_JSON_ROUTES)


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
@pytest.mark.parametrize("method, path", ENGINE_JSON_ROUTES, ids=[f"{m} {p}" for m, p in ENGINE_JSON_ROUTES])
async def test_the_engine_answers_400_to_bytes_that_are_not_json(start_engine, http, caplog, method, path, body):
    engine = await start_engine()
    resp = await http.request(method, engine.url + path, content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "Invalid JSON body" in resp.json()["message"] or "Expected" in resp.json()["message"]
    assert engine.server.weight_version == "default" and not engine.server.paused  # nothing was done
    _no_errors_logged(caplog)


PROXY_ROUTES = {"/v1/chat/completions": "openai", "/v1/completions": "openai", "/v1/responses": "openai",
                "/v1/messages": "anthropic"}  # fmt: skip


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
@pytest.mark.parametrize("path, shape", PROXY_ROUTES.items(), ids=PROXY_ROUTES.keys())
async def test_the_proxy_answers_400_to_bytes_that_are_not_json(proxy, http, caplog, path, shape, body):
    resp = await http.post(proxy.root_url + path, content=body, headers=_auth(proxy))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("the body is not valid JSON")
    if shape == "anthropic":
        assert resp.json()["type"] == "error"
    _no_errors_logged(caplog)


async def test_the_engine_refuses_a_body_over_max_body_bytes(start_engine, http):
    engine = await start_engine(max_body_bytes=4096)
    resp = await http.post(f"{engine.url}/generate", json={"input_ids": [1] * 3000})
    assert resp.status_code == 413
    assert EngineServerConfig().max_body_bytes < 256 << 20  # was 256 MiB on every route


# -- F14: the engine's refusals are 400s; nothing unauthenticated about the episodes ----------------------------------


async def test_out_of_vocabulary_token_ids_are_400_before_reaching_the_engine(stack, proxy, http):
    vocab = len(proxy.tokenizer)
    for ids in ([1, vocab], [-1], [10**7]):
        body = {"prompt": ids, "max_tokens": 4}
        resp = await http.post(f"{proxy.base_url}/completions", json=body, headers=_auth(proxy))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "prompt" and f"out of the vocabulary range [0, {vocab})" in error["message"]
    metrics = (await http.get(f"{stack.engine_url}/metrics")).text
    assert [line for line in metrics.splitlines() if line.startswith("sglang:num_requests_total")][0].endswith(" 0.0")


TOO_LONG = {
    "/v1/chat/completions": {"messages": QUESTION, "max_tokens": 10**9},
    "/v1/responses": {"input": "What is 2 + 3?", "max_output_tokens": 10**9},
    "/v1/messages": {"messages": QUESTION, "max_tokens": 10**9},
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 10**9},
}


@pytest.mark.parametrize("path, body", TOO_LONG.items(), ids=TOO_LONG.keys())
async def test_max_tokens_past_the_context_is_400_naming_the_problem(proxy, http, path, body):
    resp = await http.post(proxy.root_url + path, json={"model": "m", **body}, headers=_auth(proxy))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "maximum context length" in error["message"]
    assert "http://" not in error["message"]  # the engine's reason, not its address


async def test_a_streamed_refusal_is_an_invalid_request_event(proxy, http):
    body = {"model": "m", "messages": QUESTION, "max_tokens": 10**9, "stream": True}
    resp = await http.post(f"{proxy.base_url}/chat/completions", json=body, headers=_auth(proxy))
    assert resp.status_code == 200  # the stream had begun
    assert '"type":"invalid_request_error"' in resp.text and "maximum context length" in resp.text


async def test_an_engine_failure_is_still_502(http):
    """401 from the engine is the worker's configuration, not the agent's request: a server error."""
    backend = SyntheticBackend(SyntheticConfig(tokenizer="tiny", replies=SCRIPT))
    engine = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0, api_key="engine-key"))
    try:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool, WorkflowContext() as ctx:
            proxy = await ctx.proxy(pool)
            resp = await http.post(
                f"{proxy.base_url}/chat/completions", json={"messages": QUESTION}, headers=_auth(proxy)
            )
            assert resp.status_code == 502 and resp.json()["error"]["type"] == "server_error"
    finally:
        await engine.close()


async def test_health_says_only_ok(proxy, http):
    proxy.sessions.open()
    resp = await http.get(f"{proxy.root_url}/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


async def test_an_unknown_model_is_404_and_the_served_one_is_listed(proxy, http):
    resp = await http.get(f"{proxy.base_url}/models/<script>x")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found" and resp.json()["error"]["param"] == "model"
    resp = await http.get(f"{proxy.base_url}/models/{proxy.config.model_name}")
    assert resp.status_code == 200 and resp.json()["id"] == proxy.config.model_name
