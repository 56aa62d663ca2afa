"""What SDKs do to the proxy: time out and retry, send the same request twice, call during a weight update. Only
completions whose responses reached the client count; versions are the engine's; a paused fleet makes requests
wait, never fail."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.workers.agents.export import assign_rewards, export
from rollq.workers.context import WorkflowContext
from tests.agents import CALL_ADD, SCRIPT
from tests.helpers import wait_until
from tests.scripted import scripted_engine

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def stack(**engine_config):
    async with scripted_engine(SCRIPT, **engine_config) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        async with WorkflowContext() as ctx:
            yield engine, pool, await ctx.proxy(pool), ctx


@asynccontextmanager
async def loading_stack(weights_root: Path, **engine_config):
    """`stack` whose engine loads weights from under `weights_root`."""
    backend = SyntheticBackend(SyntheticConfig(tokenizer="tiny", replies=SCRIPT, **engine_config))
    engine = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0, weights_root=str(weights_root)))
    try:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool, WorkflowContext() as ctx:
            yield engine, pool, await ctx.proxy(pool), ctx
    finally:
        await engine.close()


def chat_body(max_tokens: int = 64) -> dict:
    return {"model": "m", "messages": QUESTION, "max_tokens": max_tokens}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_the_client_never_got_is_not_recorded(stream):
    """An SDK that times out closes the connection and retries: the first completion is never delivered, so it is
    not rewarded, trained, or a parent; the retry is the episode's one completion."""
    async with stack(per_token_latency_s=0.01) as (engine, _, proxy, ctx):
        session = proxy.sessions.open()
        headers = {"Authorization": f"Bearer {session.key}"}
        body = {**chat_body(), "stream": stream}
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.05)) as impatient:
            url = f"{proxy.base_url}/chat/completions"
            if stream:  # the client reads the first chunks, then goes away mid-answer
                async with impatient.stream("POST", url, json=body, headers=headers) as resp:
                    async for _ in resp.aiter_lines():
                        break
            else:  # the client gives up before the answer is ready
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post(url, json=body, headers=headers)
        # The proxy's handler is cancelled with the connection, and the engine request with it.
        await wait_until(lambda: not engine.server.states, what="the abandoned generation is aborted")
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client())
        retry = await client.chat.completions.create(**chat_body())
        [rec] = session.ordered()
        assert rec.id == retry.id and rec.parent is None
        messages = [*QUESTION, retry.choices[0].message.model_dump(exclude_none=True)]
        messages.append({"role": "user", "content": "and then?"})
        follow = await client.chat.completions.create(model="m", messages=messages, max_tokens=64)
        assert [(r.id, r.parent) for r in session.ordered()] == [(retry.id, None), (follow.id, retry.id)]
        assign_rewards(session.ordered(), 1.0)
        assert len(export(session.ordered(), "concat", 1.0)) == 1


async def test_a_finished_response_whose_client_is_gone_is_not_delivered():
    """The generation finished, but the connection closed before the answer went out: not delivered."""
    async with stack() as (_, _, proxy, ctx):
        session = proxy.sessions.open()
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client())
        first = await client.chat.completions.create(**chat_body())
        [rec] = session.ordered()
        assert rec.id == first.id and rec.delivered
        rec.delivered = False  # as _deliver leaves it when writing the response fails
        assert (
            session.ordered() == []
            and session.chat_parent(
                [*QUESTION, first.choices[0].message.model_dump(exclude_none=True), QUESTION[0]], None
            )
            is None
        )


async def test_identical_requests_that_both_completed_are_both_kept():
    async with stack() as (_, _, proxy, ctx):
        session = proxy.sessions.open()
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client())
        a, b = await asyncio.gather(*(client.chat.completions.create(**chat_body()) for _ in range(2)))
        records = session.ordered()
        assert {r.id for r in records} == {a.id, b.id} and len(records) == 2
        assert records[0].output_ids == records[1].output_ids and all(r.parent is None for r in records)
        assign_rewards(records, {a.id: 1.0, b.id: 0.0})
        assert sorted(s["reward"] for s in export(records, "individual", 1.0)) == [0.0, 1.0]


async def test_a_request_during_a_weight_update_waits_and_carries_the_engines_versions(tmp_path: Path):
    """A request arriving while the fleet is paused for an update waits (no 5xx, no retry) and finishes under the
    new weights; its tokens carry the version the engine reported for each of them."""
    async with loading_stack(tmp_path, per_token_latency_s=0.002) as (engine, pool, proxy, ctx):
        session = proxy.sessions.open()
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client(), max_retries=0)
        fleet = FleetController(pool)
        await fleet.pause("abort")
        call = asyncio.ensure_future(client.chat.completions.create(**chat_body()))
        await wait_until(lambda: engine.server.states, what="the request waits at the paused engine")
        (tmp_path / "v1").mkdir()
        assert not (await fleet.update_weights(str(tmp_path / "v1"), 1)).failed
        assert not call.done()
        await fleet.resume()
        resp = await asyncio.wait_for(call, 10)
        assert resp.choices[0].message.content == CALL_ADD  # no tools offered: the scripted call is plain text
        [rec] = session.ordered()
        assert rec.output_versions == [1] * len(rec.output_ids)
