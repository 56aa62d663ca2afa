"""An engine whose generations fail says so (issue 42, "failure is loud"): an abort caused by an engine error reaches
the client as that error with its status, the client and the pool treat it as an engine that failed (fail over,
evict), and the health routes answer 503 while generations fail, but not for aborts by a pause.

The engine fails for real through `rollq engine --fault` (engine/server/faults.py): each generation it hits fails
the way a model forward that raises does in the reference engine, an ERROR traceback and an abort with status_code
500. Real servers on loopback, real HTTP; no mocks."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from rollq.engine.client import EngineUnavailable
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import ServerHandle
from rollq.engine.server.faults import FaultyBackend, StepFault
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import ModelRequest, SamplingParams
from tests.helpers import wait_until

PROMPT = [5, 6, 7, 8]
ENGINE_ERROR = "engine error: InjectedStepError('injected step failure (fault step_error:{n})')"
HEALTH_ROUTES = ("/health", "/health_generate", "/ready")


def body(prompt: list[int] | None = None, **extra) -> dict:
    return {"input_ids": prompt or PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}, **extra}


async def faulty_engine(start_engine, min_prompt_tokens: int = 0, server: dict | None = None, **synthetic):
    fault = StepFault(min_prompt_tokens=min_prompt_tokens)
    backend = FaultyBackend(SyntheticBackend(SyntheticConfig(**synthetic)), fault)
    return await start_engine(server=server, backend=backend)


async def statuses(http: httpx.AsyncClient, handle: ServerHandle) -> list[int]:
    return [(await http.get(handle.url + route, timeout=10)).status_code for route in HEALTH_ROUTES]


async def test_every_request_aborted_by_an_engine_error_carries_it_with_its_status(start_engine, http, caplog):
    """8 concurrent requests fail before their first token. Each one says so: non-streamed, SGLang's HTTP error
    for an abort with a status_code (500, the engine's message); streamed, the abort chunk with its message,
    status_code and err_type. None comes back as a plain "Abort in waiting queue"."""
    caplog.set_level(logging.ERROR, "rollq.engine")
    handle = await faulty_engine(start_engine)
    plain = await asyncio.gather(*(http.post(handle.url + "/generate", json=body(rid=f"r{i}")) for i in range(8)))
    assert [r.status_code for r in plain] == [500] * 8, [r.text for r in plain]
    error = {"object": "error", "message": ENGINE_ERROR.format(n=0), "type": "500", "param": None, "code": 500}
    assert all(r.json() == error for r in plain), plain[0].text

    streamed = await asyncio.gather(
        *(http.post(handle.url + "/generate", json=body(rid=f"s{i}", stream=True)) for i in range(8))
    )
    for r in streamed:
        assert r.status_code == 200  # a stream has begun: the abort is its last chunk (tokenizer_manager.py:1922)
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finish = json.loads(events[-2])["meta_info"]["finish_reason"]
        assert finish == {
            "type": "abort",
            "message": ENGINE_ERROR.format(n=0),
            "status_code": 500,
            "err_type": "InjectedStepError",
        }
    # the engine's own log has the traceback of each failed step
    failed = [r for r in caplog.records if r.getMessage() == "engine step failed; aborting the running batch"]
    assert len(failed) == 16 and all(r.exc_info for r in failed)


async def test_the_client_and_the_pool_treat_an_engine_error_abort_as_a_failed_engine(start_engine):
    """SGLangClient raises EngineUnavailable (5xx: the engine's fault, not the request's); the pool evicts that engine
    and fails the request over to a healthy one, which generates all of it."""
    bad = await faulty_engine(start_engine)
    good = await start_engine()
    pool = EnginePool(PoolConfig(urls=[bad.url, good.url], health_interval_s=60))
    async with pool:
        with pytest.raises(EngineUnavailable) as raised:
            await pool.members[bad.url].client.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert str(raised.value) == f"{bad.url}/generate: HTTP 500: {ENGINE_ERROR.format(n=0)}"  # the message, no JSON
        assert raised.value.url == bad.url and not raised.value.unreachable
        req = ModelRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert pool.route("") is pool.members[bad.url]  # the first choice: nothing outstanding anywhere
        response = await pool.agenerate(req)
        assert response.engine == good.url and len(response.output_tokens) == 8 and response.stop_reason == "length"
        assert response.resubmissions == 1 and not pool.members[bad.url].healthy and pool.members[good.url].healthy


async def test_an_engine_whose_generations_fail_answers_503_until_one_succeeds(start_engine, http):
    """Prompts of 2 tokens or more fail; the one-token health probe does not (a failure of long prompts only, as a
    shared-prefix bug makes). Healthy before any traffic; 503 on every health route once 4 generations in a row
    failed with engine errors (unhealthy_after_errors); healthy again once one succeeds."""
    handle = await faulty_engine(start_engine, min_prompt_tokens=2)
    assert await statuses(http, handle) == [200, 200, 200]
    for i in range(3):
        assert (await http.post(handle.url + "/generate", json=body(rid=f"f{i}"))).status_code == 500
    assert await statuses(http, handle) == [200, 200, 200]  # 3 in a row: not yet
    assert (await http.post(handle.url + "/generate", json=body(rid="f3"))).status_code == 500
    assert await statuses(http, handle) == [503, 503, 503]
    ok = await http.post(handle.url + "/generate", json=body([9], rid="short"))
    assert ok.status_code == 200 and ok.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert await statuses(http, handle) == [200, 200, 200]


async def test_an_engine_failing_every_generation_is_unhealthy_from_its_probe_and_for_a_while_after(start_engine, http):
    """The probe's own generation failing with an engine error is a 503 without any traffic. After unhealthy_for_s
    with no new engine error the probe decides again: an engine that only fails long prompts comes back, goes out
    again at its next failure, for twice as long, and is itself again once a generation succeeds."""
    always = await faulty_engine(start_engine)
    assert await statuses(http, always) == [503, 503, 503]

    server = {"unhealthy_after_errors": 2, "unhealthy_for_s": 0.5}
    handle = await faulty_engine(start_engine, min_prompt_tokens=2, server=server)
    health = handle.server.generation_health
    for i in range(2):
        await http.post(handle.url + "/generate", json=body(rid=f"f{i}"))
    assert await statuses(http, handle) == [503, 503, 503] and health.hold_s == 0.5
    await wait_until(lambda: not health.failing, 10, what="the engine errors to age out")
    assert await statuses(http, handle) == [200, 200, 200]
    await http.post(handle.url + "/generate", json=body(rid="f2"))  # still broken: out again at once
    assert await statuses(http, handle) == [503, 503, 503] and health.hold_s == 1.0
    await wait_until(lambda: not health.failing, 10, what="the engine errors to age out again")
    assert (await http.post(handle.url + "/generate", json=body([9], rid="ok"))).status_code == 200
    assert health.hold_s == 0.5 and health.streak == 0 and await statuses(http, handle) == [200, 200, 200]


async def test_aborts_by_a_pause_keep_an_engine_healthy(start_engine, http):
    """SGLang's rule, which readiness probes rely on: requests aborted by a pause (running, or waiting in the
    queue) are neither failures nor errors; once generation continues the engine is healthy."""
    handle = await start_engine(per_token_latency_s=0.005, max_running_requests=2)
    running = [asyncio.create_task(http.post(handle.url + "/generate", json=body(rid=f"p{i}"))) for i in range(6)]
    await wait_until(lambda: len(handle.server.states) == 6 and handle.server.running == 6, what="6 requests in")
    assert (await http.post(handle.url + "/pause_generation", json={"mode": "abort"})).status_code == 200
    answers = [(await r).json()["meta_info"]["finish_reason"] for r in running]
    assert all(a["type"] == "abort" and "status_code" not in a for a in answers), answers
    assert any(a == {"type": "abort", "message": "Abort in waiting queue"} for a in answers)  # SGLang's shape
    assert (await http.get(handle.url + "/ready")).status_code == 503  # paused: not ready, as SGLang
    await http.post(handle.url + "/continue_generation")
    assert await statuses(http, handle) == [200, 200, 200]
    assert handle.server.generation_health.streak == 0
