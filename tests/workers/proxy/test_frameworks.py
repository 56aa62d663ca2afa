"""The recording proxy behind real agent frameworks (the Anthropic SDK, LangChain + LangGraph, openai-agents): each
runs the scripted two-turn tool episode (a call to `add(2, 3)`, then the answer), and the session's records must be
token-exact, chained turn 1 -> turn 2, and export as one concatenated training sequence."""

from __future__ import annotations

import pytest

from rollq.workers.agents.export import assign_rewards, export
from tests.agents import ANSWER, CALL_ADD
from tests.scripted import tiny_tokenizer

QUESTION = "What is 2 + 3?"
SYSTEM = "You are a careful calculator. Use the add tool."
MAX_TOKENS = 64
# What the chat template renders for the tool's answer between turn 1's output and turn 2's generation.
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

pytestmark = pytest.mark.timeout(60)


async def assert_two_turn_chain(stack, session):
    """Two records, each token-exact against the engine, turn 2 extending turn 1's exact tokens by only the tool
    turn, and one concat sequence training exactly both turns' outputs."""
    r1, r2 = session.ordered()
    tok = tiny_tokenizer()
    assert tok.decode(r1.output_ids, skip_special_tokens=True) == CALL_ADD
    assert tok.decode(r2.output_ids, skip_special_tokens=True) == ANSWER
    for rec in (r1, r2):
        ids, logprobs = await stack.direct(rec.prompt_ids, MAX_TOKENS)
        assert rec.output_ids == ids and rec.output_logprobs == logprobs
    assert r1.parent is None and r2.parent == r1.key
    assert r2.prompt_ids[: len(r1.full_ids)] == r1.full_ids
    assert tok.decode(r2.prompt_ids[len(r1.full_ids) :]) == TOOL_TURN

    assign_rewards(session.ordered(), 1.0)
    [concat] = export(session.ordered(), "concat", 1.0)
    assert concat["input_ids"] == r2.full_ids and concat["reward"] == 1.0
    trained = [t for t, m in zip(concat["input_ids"], concat["loss_mask"], strict=True) if m]
    assert trained == r1.output_ids + r2.output_ids
    assert [
        lp for lp, m in zip(concat["logprobs"], concat["loss_mask"], strict=True) if m
    ] == r1.output_logprobs + r2.output_logprobs
    return r1, r2


# -- Anthropic SDK --------------------------------------------------------------------------------------------------

ANTHROPIC_ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


@pytest.fixture
async def anthropic_http():
    """anthropic 2.x is built on httpx2 and rejects an `httpx.AsyncClient` (such as the worker's shared
    `context.http_client()`), so the SDK gets its own httpx2 client."""
    import anthropic

    async with anthropic.DefaultAsyncHttpxClient() as http:
        yield http


def anthropic_client(stack, session, http):
    from anthropic import AsyncAnthropic

    return AsyncAnthropic(base_url=stack.proxy.root_url, api_key=session.key, http_client=http, max_retries=0)


def tool_results(content) -> list[dict]:
    return [
        {"type": "tool_result", "tool_use_id": b.id, "content": str(b.input["a"] + b.input["b"])}
        for b in content
        if b.type == "tool_use"
    ]


async def test_anthropic_sdk_tool_use_then_answer(stack, anthropic_http):
    session = stack.proxy.sessions.open()
    client = anthropic_client(stack, session, anthropic_http)
    messages = [{"role": "user", "content": QUESTION}]
    first = await client.messages.create(
        model="policy", max_tokens=MAX_TOKENS, system=SYSTEM, messages=messages, tools=[ANTHROPIC_ADD]
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("add", {"a": 2, "b": 3}) and use.id.startswith("toolu_")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": tool_results(first.content)},
    ]
    second = await client.messages.create(
        model="policy", max_tokens=MAX_TOKENS, system=SYSTEM, messages=messages, tools=[ANTHROPIC_ADD]
    )
    assert second.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in second.content] == [("text", ANSWER)]

    r1, r2 = await assert_two_turn_chain(stack, session)
    assert (r1.id, r2.id) == (first.id, second.id) and r1.messages[0] == {"role": "system", "content": SYSTEM}
    assert first.usage.output_tokens == len(r1.output_ids) and first.usage.input_tokens == len(r1.prompt_ids)
    assert second.usage.output_tokens == len(r2.output_ids) and second.usage.input_tokens == len(r2.prompt_ids)


async def test_anthropic_sdk_streaming(stack, anthropic_http):
    session = stack.proxy.sessions.open()
    client = anthropic_client(stack, session, anthropic_http)
    messages = [{"role": "user", "content": QUESTION}]
    async with client.messages.stream(
        model="policy", max_tokens=MAX_TOKENS, messages=messages, tools=[ANTHROPIC_ADD]
    ) as stream:
        first = await stream.get_final_message()
    assert first.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in first.content] == [("tool_use", "add", {"a": 2, "b": 3})]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": tool_results(first.content)},
    ]
    async with client.messages.stream(
        model="policy", max_tokens=MAX_TOKENS, messages=messages, tools=[ANTHROPIC_ADD]
    ) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        second = await stream.get_final_message()
    assert text == ANSWER and second.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in second.content] == [("text", ANSWER)]
    r1, r2 = await assert_two_turn_chain(stack, session)
    assert (r1.id, r2.id) == (first.id, second.id)


# -- LangChain + LangGraph --------------------------------------------------------------------------------------------


# langgraph 1.x deprecates create_react_agent in favour of langchain.agents.create_agent (the `langchain` package,
# not installed here); the prebuilt one is what the installed versions offer.
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
async def test_langgraph_react_agent_with_langchain_openai(stack):
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    session = stack.proxy.sessions.open()
    model = ChatOpenAI(
        base_url=stack.proxy.base_url,
        api_key=session.key,
        model="policy",
        max_tokens=MAX_TOKENS,
        http_async_client=stack.context.http_client(),
        max_retries=0,
    )
    agent = create_react_agent(model, [add], prompt=SYSTEM)
    result = await agent.ainvoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 6})
    messages = result["messages"]
    calls = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    assert [(c["name"], c["args"]) for m in calls for c in m.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert [m.content for m in messages if isinstance(m, ToolMessage)] == ["5"]
    final = messages[-1]
    assert isinstance(final, AIMessage) and final.content == ANSWER and not final.tool_calls
    await assert_two_turn_chain(stack, session)


# -- openai-agents ----------------------------------------------------------------------------------------------------


async def test_openai_agents_runner(stack, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing may try to export traces to the internet

    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    session = stack.proxy.sessions.open()
    client = AsyncOpenAI(
        base_url=stack.proxy.base_url, api_key=session.key, http_client=stack.context.http_client(), max_retries=0
    )
    agent = Agent(
        name="calculator",
        instructions=SYSTEM,
        tools=[add],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    result = await Runner.run(agent, QUESTION, max_turns=4)
    assert calls == [(2, 3)]
    assert "5" in result.final_output and result.final_output == ANSWER
    r1, r2 = await assert_two_turn_chain(stack, session)
    assert r1.messages[0] == {"role": "system", "content": SYSTEM}
    assert r2.messages[-1] == {"role": "tool", "content": "5", "tool_call_id": r2.messages[-1]["tool_call_id"]}
