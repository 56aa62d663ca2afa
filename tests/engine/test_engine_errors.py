"""An engine whose generations fail says so (issue 42, "failure is loud"): an abort caused by an engine error reaches
the client as that error with its status, and the client and the pool treat it as an engine that failed (fail over,
evict).

The engine fails for real through `rollq engine --fault` (engine/server/faults.py): each generation it hits fails
the way a model forward that raises does in the reference engine, an ERROR traceback and an abort with status_code
500. Real servers on loopback, real HTTP; no mocks."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from rollq.engine.client import EngineUnavailable
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.faults import FaultyBackend, StepFault
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import ModelRequest, SamplingParams

PROMPT = [5, 6, 7, 8]
ENGINE_ERROR = "engine error: InjectedStepError('injected step failure (fault step_error:{n})')"


def body(prompt: list[int] | None = None, **extra) -> dict:
    return {"input_ids": prompt or PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}, **extra}


async def faulty_engine(start_engine, min_prompt_tokens: int = 0, server: dict | None = None, **synthetic):
    fault = StepFault(min_prompt_tokens=min_prompt_tokens)
    backend = FaultyBackend(SyntheticBackend(SyntheticConfig(**synthetic)), fault)
    return await start_engine(server=server, backend=backend)


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
        with pytest.raises(EngineUnavailable, match=r"HTTP 500: .*engine error: InjectedStepError") as raised:
            await pool.members[bad.url].client.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert raised.value.url == bad.url and not raised.value.unreachable
        req = ModelRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert pool.route("") is pool.members[bad.url]  # the first choice: nothing outstanding anywhere
        response = await pool.agenerate(req)
        assert response.engine == good.url and len(response.output_tokens) == 8 and response.stop_reason == "length"
        assert response.resubmissions == 1 and not pool.members[bad.url].healthy and pool.members[good.url].healthy
