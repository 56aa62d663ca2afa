"""The recording proxy's OpenAI Responses API (`POST /v1/responses`) through the real openai SDK and the OpenAI
Agents SDK's default (Responses) provider: token exactness, parent links by input items and by
previous_response_id, streaming events, and 400s naming what can't be honoured."""

from __future__ import annotations

import json

import pytest

from tests.agents import ADD_TOOL, ANSWER
from tests.workers.proxy.test_frameworks import MAX_TOKENS, QUESTION, SYSTEM, assert_two_turn_chain

RESPONSES_ADD = {"type": "function", **ADD_TOOL["function"]}  # Responses tools are flat: no "function" wrapper

pytestmark = pytest.mark.timeout(60)


def tool_outputs(output) -> list[dict]:
    return [
        {
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": str(sum(json.loads(item.arguments).values())),
        }
        for item in output
        if item.type == "function_call"
    ]


async def responses_episode(stack, session, *, previous: bool = False, **kwargs):
    """Turn 1: the model calls add(2, 3); turn 2: its output goes back (as items, or by previous_response_id)."""
    client = stack.openai(session.key)
    common = {"model": "policy", "instructions": SYSTEM, "tools": [RESPONSES_ADD], "max_output_tokens": MAX_TOKENS}
    first = await client.responses.create(input=QUESTION, **common, **kwargs)
    if previous:
        second = await client.responses.create(
            input=tool_outputs(first.output), previous_response_id=first.id, **common, **kwargs
        )
    else:
        items = [{"role": "user", "content": QUESTION}, *(o.model_dump(exclude_none=True) for o in first.output)]
        second = await client.responses.create(input=[*items, *tool_outputs(first.output)], **common, **kwargs)
    return first, second


async def test_responses_tool_call_then_answer_are_token_exact_and_chained(stack):
    session = stack.proxy.sessions.open()
    first, second = await responses_episode(stack, session)
    [call] = first.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert first.status == "completed" and second.status == "completed"
    assert second.output_text == ANSWER
    r1, r2 = await assert_two_turn_chain(stack, session)
    assert (r1.id, r2.id) == (first.id, second.id)
    assert r1.messages[0] == {"role": "system", "content": SYSTEM}
    for rec, resp in ((r1, first), (r2, second)):
        assert resp.usage.input_tokens == len(rec.prompt_ids) and resp.usage.output_tokens == len(rec.output_ids)
        assert resp.usage.total_tokens == len(rec.full_ids)

    # The same conversation through chat completions renders to the very same prompt tokens.
    chat = stack.proxy.sessions.open()
    client = stack.openai(chat.key)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    one = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], max_tokens=MAX_TOKENS)
    msg = one.choices[0].message
    [tc] = msg.tool_calls
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
    await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], max_tokens=MAX_TOKENS)
    assert [r.prompt_ids for r in chat.ordered()] == [r1.prompt_ids, r2.prompt_ids]


async def test_previous_response_id_continues_the_recorded_response(stack):
    by_items = stack.proxy.sessions.open()
    await responses_episode(stack, by_items)
    session = stack.proxy.sessions.open()
    first, second = await responses_episode(stack, session, previous=True)
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    await assert_two_turn_chain(stack, session)
    assert [r.prompt_ids for r in session.ordered()] == [r.prompt_ids for r in by_items.ordered()]

    # Only a response of the same episode can be continued.
    other = stack.proxy.sessions.open()
    resp = await stack.context.http_client().post(
        f"{stack.proxy.base_url}/responses",
        headers={"Authorization": f"Bearer {other.key}"},
        json={"model": "m", "input": "hi", "previous_response_id": first.id},
    )
    assert resp.status_code == 400 and "previous_response_id" in resp.json()["error"]["message"]


async def test_streamed_response_events_and_final_response(slow_stack):
    stack = slow_stack
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    common = {"model": "m", "tools": [RESPONSES_ADD], "max_output_tokens": MAX_TOKENS, "stream": True}
    kinds, args_deltas, final = [], [], None
    async for event in await client.responses.create(input=QUESTION, **common):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            args_deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds  # a tool call is never streamed as text
    assert json.loads("".join(args_deltas)) == {"a": 2, "b": 3}
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 2, "b": 3}

    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), *tool_outputs(final.output)]
    text, seqs, second = [], [], None
    async for event in await client.responses.create(input=items, **common):
        seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        if event.type == "response.completed":
            second = event.response
    assert len(text) > 1 and "".join(text) == ANSWER == second.output_text  # streamed as generated, in pieces
    assert seqs == list(range(len(seqs)))
    r1, r2 = session.ordered()
    assert r2.parent == r1.key == final.id and second.usage.output_tokens == len(r2.output_ids)


async def test_max_output_tokens_cut_is_incomplete(stack):
    session = stack.proxy.sessions.open()
    resp = await stack.openai(session.key).responses.create(model="m", input="hello", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [rec] = session.ordered()
    assert len(rec.output_ids) == 3 and rec.finish_reason == "length"


async def test_reasoning_items_and_ignored_fields_are_accepted(stack):
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    first = await client.responses.create(model="m", input=QUESTION, tools=[RESPONSES_ADD], max_output_tokens=64)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "use the tool"}]},
        *(o.model_dump(exclude_none=True) for o in first.output),
        *tool_outputs(first.output),
    ]
    second = await client.responses.create(
        model="m",
        input=items,
        tools=[RESPONSES_ADD],
        max_output_tokens=64,
        store=False,
        include=["reasoning.encrypted_content"],
        parallel_tool_calls=False,
        metadata={"run": "x"},
        truncation="auto",
        text={"format": {"type": "text"}},
        tool_choice="auto",
    )
    assert second.output_text == ANSWER
    r1, r2 = session.ordered()
    assert r2.parent == r1.key


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools", "needs a 'name'"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format", "'json_schema'"),
        ({"conversation": "conv_1"}, "conversation", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item references"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "'web_search_call'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "messages", "image"),
        ({"input": []}, "input", "non-empty"),
        ({"max_output_tokens": 0}, "max_output_tokens", "integer"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search'"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(stack, body, param, words):
    session = stack.proxy.sessions.open()
    resp = await stack.context.http_client().post(
        f"{stack.proxy.base_url}/responses",
        headers={"Authorization": f"Bearer {session.key}"},
        json={"model": "m", "input": "hi", **body},
    )
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == param and words in error["message"], error
    assert session.ordered() == []


# -- the OpenAI Agents SDK's default provider: Responses ---------------------------------------------------------------


def _agent_with_default_provider(stack, session, calls):
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing may try to export traces to the internet

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = AsyncOpenAI(
        base_url=stack.proxy.base_url, api_key=session.key, http_client=stack.context.http_client(), max_retries=0
    )
    provider = OpenAIProvider(openai_client=client)  # use_responses: the SDK's default
    agent = Agent(
        name="calculator",
        instructions=SYSTEM,
        tools=[add],
        model=provider.get_model("policy"),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    return agent


@pytest.mark.parametrize("streamed", [False, True])
async def test_openai_agents_default_responses_provider(stack, monkeypatch, streamed):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import Runner
    from agents.models.openai_responses import OpenAIResponsesModel

    calls: list[tuple[int, int]] = []
    session = stack.proxy.sessions.open()
    agent = _agent_with_default_provider(stack, session, calls)
    assert isinstance(agent.model, OpenAIResponsesModel)
    if streamed:
        result = Runner.run_streamed(agent, QUESTION, max_turns=4)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, QUESTION, max_turns=4)
    assert calls == [(2, 3)] and result.final_output == ANSWER
    r1, r2 = await assert_two_turn_chain(stack, session)
    assert r1.messages[0] == {"role": "system", "content": SYSTEM}
    assert r2.messages[-1]["role"] == "tool" and r2.messages[-1]["content"] == "5"
