"""The recording proxy through the real openai SDK: token exactness, parent links, tools, streaming, n, the
completions API, session isolation and 4xx answers."""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pytest

from rollq.workers.agents.export import assign_rewards, export
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from tests.agents import ADD_TOOL, ANSWER, CALL_ADD, run_tools
from tests.scripted import tiny_tokenizer

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


async def two_turns(stack, session, **kwargs):
    client = stack.openai(session.key)
    first = await client.chat.completions.create(
        model="policy", messages=QUESTION, tools=[ADD_TOOL], max_tokens=64, logprobs=True, **kwargs
    )
    msg = first.choices[0].message
    history = [*QUESTION, msg.model_dump(exclude_none=True), *run_tools(msg)]
    second = await client.chat.completions.create(
        model="policy", messages=history, tools=[ADD_TOOL], max_tokens=64, logprobs=True, **kwargs
    )
    return first, second


async def test_tool_call_turn_then_answer_are_recorded_token_exactly(stack):
    session = stack.proxy.sessions.open()
    first, second = await two_turns(stack, session)
    call = first.choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in call.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"

    r1, r2 = session.ordered()
    assert (r1.id, r2.id, r2.parent) == (first.id, second.id, first.id)
    tok = tiny_tokenizer()
    assert tok.decode(r1.output_ids, skip_special_tokens=True) == CALL_ADD
    for rec, resp in ((r1, first), (r2, second)):
        # What the engine returns for the recorded prompt is exactly what was recorded and what the client saw.
        ids, logprobs = await stack.direct(rec.prompt_ids, 64)
        assert rec.output_ids == ids and rec.output_logprobs == logprobs
        assert [t.logprob for t in resp.choices[0].logprobs.content] == logprobs
        assert resp.usage.completion_tokens == len(ids) and resp.usage.prompt_tokens == len(rec.prompt_ids)
    # Turn 2 is sent as turn 1's exact tokens + only the tool turn's tokens: nothing the model wrote is re-tokenized.
    assert r2.prompt_ids[: len(r1.full_ids)] == r1.full_ids
    tool_turn = tok.decode(r2.prompt_ids[len(r1.full_ids) :])
    assert tool_turn == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

    assign_rewards(session.ordered(), 1.0)
    [concat] = export(session.ordered(), "concat", 1.0)
    assert concat["input_ids"] == r2.full_ids
    trained = [t for t, m in zip(concat["input_ids"], concat["loss_mask"], strict=True) if m]
    assert trained == r1.output_ids + r2.output_ids
    assert [
        lp for lp, m in zip(concat["logprobs"], concat["loss_mask"], strict=True) if m
    ] == r1.output_logprobs + r2.output_logprobs


async def test_streaming_yields_the_same_message_and_logprobs(slow_stack):
    stack = slow_stack
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    first = await client.chat.completions.create(
        model="m",
        messages=QUESTION,
        tools=[ADD_TOOL],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls, finish, usage = [], None, None
    async for chunk in first:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["add"]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    [rec] = session.ordered()
    assert usage.completion_tokens == len(rec.output_ids)

    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "add", "arguments": calls[0].function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "5"},
    ]
    stream = await client.chat.completions.create(
        model="m", messages=history, tools=[ADD_TOOL], max_tokens=64, stream=True, logprobs=True
    )
    text, logprobs, chunks, live = "", [], 0, False
    async for chunk in stream:
        for choice in chunk.choices:
            chunks += 1
            if choice.delta.content and not text:
                live = len(session.records) == 1  # content arrives before the engine finished the answer
            text += choice.delta.content or ""
            logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []]
    second = session.ordered()[-1]
    assert text == ANSWER and live and chunks > 3  # as it is generated, not one blob at the end
    assert second.parent == rec.key and logprobs == second.output_logprobs


async def test_n_choices_are_separate_records_of_one_response(stack):
    session = stack.proxy.sessions.open()
    resp = await stack.openai(session.key).chat.completions.create(model="m", messages=QUESTION, n=2, max_tokens=8)
    assert [c.index for c in resp.choices] == [0, 1]
    records = session.ordered()
    assert [r.key for r in records] == [resp.id, f"{resp.id}:1"]
    assert all(len(r.output_ids) == 8 and r.finish_reason == "length" for r in records)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 16
    assign_rewards(records, {f"{resp.id}:1": 1.0, resp.id: 0.0})
    assert [r.reward for r in records] == [0.0, 1.0]


async def test_sessions_are_isolated_and_keys_expire(stack):
    a, b = stack.proxy.sessions.open(), stack.proxy.sessions.open()
    await two_turns(stack, a)
    a_before = msgspec.json.encode(a.ordered())
    # b sends the same turn-2 conversation: it must not attach to a's records, nor add to them.
    client_b = stack.openai(b.key)
    first_a = a.ordered()[0]
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_x", "content": "5"},
    ]
    await client_b.chat.completions.create(model="m", messages=history, tools=[ADD_TOOL], max_tokens=64)
    assert len(a.records) == 2 and len(b.records) == 1
    [rec_b] = b.ordered()
    assert rec_b.parent is None and rec_b.prompt_ids[: len(first_a.prompt_ids)] == first_a.prompt_ids
    assert msgspec.json.encode(a.ordered()) == a_before  # a's records are untouched, not merely as many
    stack.proxy.sessions.close(a)
    with pytest.raises(openai.AuthenticationError, match="unknown or finished session key"):
        await stack.openai(a.key).chat.completions.create(model="m", messages=QUESTION)
    with pytest.raises(openai.AuthenticationError, match="unknown or finished session key"):
        await stack.openai("made-up").chat.completions.create(model="m", messages=QUESTION)
    assert len(a.records) == 2


async def test_completions_api_and_models(stack):
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    tok = tiny_tokenizer()
    prompt = tok.apply_chat_template(QUESTION, tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True)
    resp = await client.completions.create(model="m", prompt=prompt, max_tokens=64, logprobs=1)
    assert resp.choices[0].text == CALL_ADD
    [rec] = session.ordered()
    assert resp.choices[0].logprobs.token_logprobs == rec.output_logprobs
    # Token-id prompts continue a recorded completion: the parent link is found by token prefix.
    follow = await client.completions.create(model="m", prompt=rec.full_ids + tok.encode("\n"), max_tokens=4)
    assert session.ordered()[-1].parent == rec.key and follow.usage.completion_tokens == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == ["rollq"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m"}', 400, "'messages' must be a non-empty list"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 7}', 400, "'temperature' must be a number"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "needs image_url"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "unsupported role"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"}', 400, "tool_choice"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', 400, "'n' must be an integer"),
    ],
)
async def test_bad_requests_get_a_400_that_says_why(stack, body, status, message):
    session = stack.proxy.sessions.open()
    resp = await stack.context.http_client().post(
        f"{stack.proxy.base_url}/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {session.key}", "Content-Type": "application/json"},
    )
    assert resp.status_code == status and message in resp.json()["error"]["message"]
    assert not session.records


async def test_missing_key_is_401(stack):
    resp = await stack.context.http_client().post(f"{stack.proxy.base_url}/chat/completions", json={"messages": []})
    assert resp.status_code == 401 and "missing API key" in resp.json()["error"]["message"]
    assert (await stack.context.http_client().get(f"{stack.proxy.root_url}/health")).status_code == 200
    assert isinstance(stack.context.http_client(), httpx.AsyncClient)


async def test_a_body_over_max_body_bytes_is_413_and_records_nothing(stack):
    proxy = await RecordingProxy(stack.proxy.engine, stack.proxy.tokenizer, ProxyConfig(max_body_bytes=4096)).start()
    try:
        session = proxy.sessions.open()
        client = stack.context.http_client()
        headers = {"Authorization": f"Bearer {session.key}"}
        big = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 5000}]}
        for path in ("chat/completions", "completions", "responses"):
            body = big if path == "chat/completions" else {"model": "m", "prompt": "x" * 5000, "input": "x" * 5000}
            resp = await client.post(f"{proxy.base_url}/{path}", json=body, headers=headers)
            assert resp.status_code == 413, (path, resp.status_code, resp.text)
        assert not session.records
        small = {**big, "messages": QUESTION}
        resp = await client.post(f"{proxy.base_url}/chat/completions", json=small, headers=headers)
        assert resp.status_code == 200 and len(session.records) == 1  # the same proxy serves bodies under the limit
    finally:
        await proxy.close()


def test_a_workers_proxy_body_bound_is_its_setting():
    from rollq.cli import parse
    from rollq.workers.worker import Worker

    (config,) = parse(["worker", "--proxy-max-body-bytes", "4096"], env={}).settings
    worker = Worker(config)
    assert worker.context.config.proxy.max_body_bytes == 4096
