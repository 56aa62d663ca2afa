"""Control calls an engine (or what stands in front of it) refuses: every failure names the engine, the route, the
HTTP status and the answer, never an empty reason, `{}` or a bare JSON decode error; a 206 partial flush is a failure.
A real synthetic engine behind a real gateway on loopback (tests/control_gateway.py), no mocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollq.engine.client import EngineError, EngineUnavailable
from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.types import ModelRequest, SamplingParams
from tests.control_gateway import ControlGateway

LONG_PAGE = "<html><body>Method Not Allowed" + " padding" * 100 + "</body></html>"
CYCLE_ROUTES = ("/pause_generation", "/update_weights_from_disk", "/continue_generation")
ROUTER_PARTIAL_FLUSH = (
    '{"status":"partial_success","message":"Cache flush: 0 succeeded, 2 failed","workers_flushed":0,'
    '"total_http_workers":2,"failed":[{"worker":"http://e1","error":"HTTP 400 Bad Request"}]}'
)


@pytest.mark.parametrize(
    ("status", "body", "content_type", "said"),
    [
        (404, "404 page not found\n", "text/plain", "HTTP 404: 404 page not found"),  # a proxy's plain-text page
        (404, "", "text/plain", "HTTP 404: Not Found"),  # sglang-router: an empty 404
        (404, "{}", "application/json", "HTTP 404: Not Found"),
        (405, LONG_PAGE, "text/html", f"HTTP 405: {LONG_PAGE[:300]}"),  # quoted, cut at 300 characters
        (503, "", "text/plain", "HTTP 503: Service Unavailable"),  # no answer worth retrying: EngineUnavailable
    ],
)
async def test_each_refused_call_of_a_cycle_names_the_engine_route_status_and_answer(
    start_engine, tmp_path: Path, status: int, body: str, content_type: str, said: str
) -> None:
    engine = await start_engine(server={"weight_version": "0"})
    (tmp_path / "v1").mkdir()
    async with (
        ControlGateway(engine.url, status=status, body=body, content_type=content_type) as gateway,
        EnginePool(PoolConfig(urls=[gateway.url], no_engine_timeout_s=5.0)) as pool,
    ):
        request = ModelRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4))
        assert len((await pool.agenerate(request)).output_tokens) == 4  # generation goes through
        fleet = FleetController(pool, retries=0)
        report = await fleet.run_cycle(lambda: fleet.update_weights(str(tmp_path / "v1"), 1))

    assert report.updated == [] and engine.server.weight_version == "0"
    assert report.failures() == {gateway.url: [f"{gateway.url}{route}: {said}" for route in CYCLE_ROUTES]}
    assert pool.members[gateway.url].stale  # out of the fleet's routing until reloaded
    assert report.phases["total_s"] < 5


async def test_a_cycle_through_the_gateway_once_it_forwards_updates_the_engine(start_engine, tmp_path: Path) -> None:
    engine = await start_engine(server={"weight_version": "0"})
    (tmp_path / "v1").mkdir()
    async with (
        ControlGateway(engine.url, refusals=0) as gateway,
        EnginePool(PoolConfig(urls=[gateway.url])) as pool,
    ):
        fleet = FleetController(pool, retries=0)
        report = await fleet.run_cycle(lambda: fleet.update_weights(str(tmp_path / "v1"), 1))
    assert report.updated == [gateway.url] and report.failures() == {}
    assert engine.server.weight_version == "1" and sum(gateway.forwarded[r] for r in CYCLE_ROUTES) == 3


async def test_answers_that_are_not_json_name_the_route_and_quote_the_body(start_engine, tmp_path: Path) -> None:
    engine = await start_engine(server={"weight_version": "0"})
    page = "<html><title>Welcome to nginx!</title></html>"
    routes = frozenset({"/model_info", "/get_model_info", "/update_weights_from_disk", "/begin_weight_update"})
    async with (
        ControlGateway(engine.url, status=200, body=page, content_type="text/html", routes=routes) as gateway,
        EnginePool(PoolConfig(urls=[gateway.url])) as pool,
    ):
        client = pool.members[gateway.url].client
        for call, route in (
            (lambda: client.update_weights_from_disk(str(tmp_path), weight_version="1"), "/update_weights_from_disk"),
            (client.begin_weight_update, "/begin_weight_update"),
            (client.model_info, "/model_info"),
            (client.weight_version, "/model_info"),
        ):
            with pytest.raises(EngineError) as raised:  # not a JSONDecodeError: that is no EngineError
                await call()
            assert str(raised.value).startswith(f"{gateway.url}{route}: HTTP 200: expected a JSON"), raised.value
            assert "Welcome to nginx!" in str(raised.value)
    assert engine.server.weight_version == "0"


async def test_a_5xx_names_the_route_and_a_refused_connection_says_so(start_engine) -> None:
    engine = await start_engine()
    async with (
        ControlGateway(engine.url, status=502, body="upstream connect error\n") as gateway,
        EnginePool(PoolConfig(urls=[gateway.url])) as pool,
    ):
        with pytest.raises(EngineUnavailable) as raised:
            await pool.members[gateway.url].client.pause_generation("retract")
    assert str(raised.value) == f"{gateway.url}/pause_generation: HTTP 502: upstream connect error"
    assert not raised.value.unreachable
    gone = gateway.url  # closed now: nothing listens there
    async with EnginePool(PoolConfig(urls=[gone])) as pool:
        with pytest.raises(EngineUnavailable, match=rf"^{gone}/continue_generation: Client\w+Error") as raised:
            await pool.members[gone].client.continue_generation()
    assert raised.value.unreachable


async def test_a_partial_flush_is_a_failure_and_a_whole_one_is_not(start_engine) -> None:
    engine = await start_engine()
    flush = frozenset({"/flush_cache"})
    async with (
        ControlGateway(
            engine.url, status=206, body=ROUTER_PARTIAL_FLUSH, content_type="application/json", routes=flush
        ) as partial,
        ControlGateway(
            engine.url,
            status=200,
            body='{"status":"success","message":"Successfully flushed cache on all 2 HTTP workers"}',
            content_type="application/json",
            routes=flush,
        ) as whole,
        EnginePool(PoolConfig(urls=[partial.url, whole.url, engine.url])) as pool,
    ):
        with pytest.raises(EngineError) as raised:
            await pool.members[partial.url].client.flush_cache()
        await pool.members[whole.url].client.flush_cache()  # sglang-router: every engine flushed
        await pool.members[engine.url].client.flush_cache()  # SGLang's and rollq's engines: 200, plain text
    assert raised.value.status == 206
    assert str(raised.value) == (
        f"{partial.url}/flush_cache: HTTP 206: partial_success: Cache flush: 0 succeeded, 2 failed"
    )
