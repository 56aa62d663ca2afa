"""rollq's ArealOpenAI (AReaL's in-process OpenAI client) against a real EnginePool on a scripted engine server: what
a workflow gets back (openai ChatCompletion, interactions with the engine's ModelResponse), rewards, and the
{id: interaction} export the worker turns into sequences."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import NOT_GIVEN
from openai.types.chat import ChatCompletion

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.workers.api import ArealOpenAI, InteractionWithTokenLogpReward
from rollq.workers.chat_template import render
from rollq.workers.outputs import WorkflowOutputError, to_sequences
from tests.scripted import scripted_engine, tiny_tokenizer

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
RETRY = {"role": "user", "content": "Wrong. Try again."}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


@pytest.fixture
async def pool():
    async with scripted_engine(["The answer is 4.", "The answer is 5."]) as engine:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool:
            yield pool


def text(ids) -> str:
    return tiny_tokenizer().decode(list(ids), skip_special_tokens=True)


def trained_text(seq) -> str:
    return text(i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m)


async def two_turns(client: ArealOpenAI) -> tuple[ChatCompletion, ChatCompletion]:
    """multi_turn_v2.py's loop: wrong answer, its reply and a retry prompt appended, right answer."""
    messages = list(QUESTION)
    first = await client.chat.completions.create(messages=messages, max_completion_tokens=32, store=True)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, RETRY]
    second = await client.chat.completions.create(messages=messages, max_completion_tokens=32, store=True)
    return first, second


async def test_create_returns_a_chat_completion_and_records_the_engine_response(pool):
    tokenizer = tiny_tokenizer()
    client = ArealOpenAI(engine=pool, tokenizer=tokenizer)
    comp = await client.chat.completions.create(
        messages=QUESTION,
        frequency_penalty=0.0,
        max_completion_tokens=32,
        stop=None,
        store=True,
        temperature=1.0,
        top_p=1.0,
    )
    assert isinstance(comp, ChatCompletion) and comp.id.startswith("chatcmpl-")
    [choice] = comp.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        "The answer is 4.",
        "stop",
    )

    interaction = client.get_interaction(comp.id)
    assert isinstance(interaction, InteractionWithTokenLogpReward) and interaction.interaction_id == comp.id
    resp = interaction.model_response
    assert text(resp.input_tokens) == text(tokenizer.encode(render(tokenizer, QUESTION, add_generation_prompt=True)))
    assert tokenizer.decode(resp.output_tokens_without_stop) == "The answer is 4."  # how AReaL reads the reply
    assert resp.end_with_stop and resp.stop_reason == "stop" and resp.engine
    assert len(resp.output_logprobs) == len(resp.output_tokens) and all(lp < 0 for lp in resp.output_logprobs)
    assert comp.usage is not None
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens) == (resp.input_len, resp.output_len)
    assert interaction.messages == QUESTION and interaction.parent is None and interaction.reward is None
    assert interaction.output_message_list == [{"role": "assistant", "content": "The answer is 4."}]
    assert interaction.completion is comp and interaction.created_at == comp.created
    assert client.get_interaction("chatcmpl-unknown") is None


async def test_multi_turn_export_individual_by_default_without_propagating_rewards(pool):
    client = ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer())
    first, second = await two_turns(client)
    assert second.choices[0].message.content == "The answer is 5."
    assert client.get_interaction(second.id).parent is client.get_interaction(first.id)
    client.set_reward(second.id, 0.9)

    exported = client.export_interactions()
    assert list(exported) == [first.id, second.id]
    assert [i.reward for i in exported.values()] == [None, 0.9]
    seqs = to_sequences(exported)
    assert seqs is not None and [s.reward for s in seqs] == [0.0, pytest.approx(0.9)]
    assert [trained_text(s) for s in seqs] == ["The answer is 4.", "The answer is 5."]
    # AReaL's default "hf": turn 2's prompt is the whole conversation rendered again.
    resp_2 = client.get_interaction(second.id).model_response
    assert resp_2.input_tokens == list(seqs[1].input_ids[: resp_2.input_len])
    assert "The answer is 4." in text(resp_2.input_tokens) and "Try again." in text(resp_2.input_tokens)


async def test_reward_discount_once_along_the_conversation(pool):
    client = ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer())
    first, second = await two_turns(client)
    client.set_last_reward(1.0)
    exported = client.export_interactions("individual", reward_discount=0.5)
    assert [s.reward for s in to_sequences(exported) or []] == [0.5, 1.0]
    assert client.get_interaction(first.id).reward == 0.5  # applied in place, as AReaL's apply_reward_discount
    with pytest.raises(RuntimeError, match="only be called once"):
        client.apply_reward_discount(0.9)
    assert [i.reward for i in client.export_interactions(reward_discount=0.9).values()] == [0.5, 1.0]  # not again


async def test_concat_template_type_grows_one_token_sequence_and_exports_the_branch(pool):
    client = ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer(), chat_template_type="concat")
    first, second = await two_turns(client)
    r1, r2 = (client.get_interaction(c.id).model_response for c in (first, second))
    assert r2.input_tokens[: r1.input_len + r1.output_len] == r1.input_tokens + r1.output_tokens
    client.set_reward(second.id, 1.0)

    exported = client.export_interactions("concat")
    assert list(exported) == [second.id]  # the leaf, as AReaL's concat export
    [seq] = to_sequences(exported) or []
    assert list(seq.input_ids) == r2.input_tokens + r2.output_tokens and seq.reward == 1.0
    assert trained_text(seq) == "The answer is 4.The answer is 5."  # both replies trained, the rest masked
    [i1, i2] = client.export_interactions("individual").values()  # the latest export decides to_tensor_dict()
    assert i1.to_tensor_dict()["input_ids"] == r1.input_tokens + r1.output_tokens


async def test_sdk_markers_pydantic_messages_and_concurrent_requests(pool):
    """NOT_GIVEN means unset; the SDK's ChatCompletionMessage may be appended to the history as it is; concurrent
    requests of one client each get their own engine response."""
    client = ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer())
    first = await client.chat.completions.create(
        messages=QUESTION, temperature=NOT_GIVEN, stop=NOT_GIVEN, max_completion_tokens=NOT_GIVEN
    )
    follow_up = [*QUESTION, first.choices[0].message, RETRY]
    a, b = await asyncio.gather(
        client.chat.completions.create(messages=follow_up, max_completion_tokens=32),
        client.chat.completions.create(messages=[{"role": "user", "content": "And 3 + 4?"}], max_completion_tokens=32),
    )
    assert client.get_interaction(a.id).parent is client.get_interaction(first.id)
    assert client.get_interaction(b.id).parent is None
    for comp in (a, b):
        interaction = client.get_interaction(comp.id)
        assert interaction.model_response.input_tokens == interaction.record.prompt_ids
        assert text(interaction.model_response.output_tokens) == comp.choices[0].message.content
    assert "3 + 4" in text(client.get_interaction(b.id).model_response.input_tokens)


async def test_tool_calls_and_several_choices():
    async with scripted_engine([CALL, "The answer is 5."]) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        client = ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer())
        comp = await client.chat.completions.create(messages=QUESTION, tools=[ADD], n=2, max_completion_tokens=64)
        assert [c.finish_reason for c in comp.choices] == ["tool_calls", "tool_calls"]
        call = comp.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
        second = client.get_interaction(f"{comp.id}:1")  # choice 1 of an n > 1 request
        assert second is not None and second.model_response.stop_reason == "tool_calls"
        client.set_reward(comp.id, 1.0)  # a completion id rewards all its choices
        assert [i.reward for i in client.export_interactions().values()] == [1.0, 1.0]


async def test_what_it_refuses(pool):
    client = ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer())
    unstored = await client.chat.completions.create(messages=QUESTION, store=False)
    assert client.get_interaction(unstored.id) is None and client.export_interactions() == {}
    with pytest.raises(WorkflowOutputError, match="has no keys"):
        to_sequences(client.export_interactions())
    with pytest.raises(KeyError):
        client.set_reward(unstored.id, 1.0)
    with pytest.raises(RuntimeError, match="No interaction"):
        client.set_last_reward(1.0)
    with pytest.raises(NotImplementedError, match="stream"):
        await client.chat.completions.create(messages=QUESTION, stream=True)
    with pytest.raises(ValueError, match="temperature"):
        await client.chat.completions.create(messages=QUESTION, temperature=5.0)
    with pytest.raises(ValueError, match="cannot both be set"):
        await client.chat.completions.create(messages=QUESTION, max_tokens=8, max_completion_tokens=8)
    with pytest.raises(ValueError, match="unknown export style"):
        client.export_interactions("flat")
    with pytest.raises(ValueError, match="chat_template_type"):
        ArealOpenAI(engine=pool, tokenizer=tiny_tokenizer(), chat_template_type="jinja")
