"""Hermes tool-call parsing and the tool registry (real callables, sync and async)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollq.workers.tool_calls import ToolCall, ToolRegistry, ToolSpec, parse_tool_calls


def schema(name: str, **props: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in props.items()},
                "required": list(props),
            },
        },
    }


def test_single_call():
    content, calls, errors = parse_tool_calls(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    assert content == "" and errors == []
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0].id


def test_several_calls_with_text_around_and_loose_whitespace():
    text = (
        'Let me look.\n<tool_call>{"name": "w", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>  \n\n {"name": "w", "arguments": {"city": "London"}}  \n</tool_call> done'
    )
    content, calls, errors = parse_tool_calls(text)
    assert [c.arguments["city"] for c in calls] == ["Paris", "London"]
    assert len({c.id for c in calls}) == 2
    assert content.startswith("Let me look.") and content.endswith("done") and "tool_call" not in content
    assert errors == []


def test_arguments_as_json_string_and_missing_arguments():
    _, calls, errors = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": [1, 2]}), ("g", {})]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"name": "f", "arguments": {"x": 1}', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": "f", "arguments": "{oops"}', "arguments of tool call 0 ('f') are not valid JSON"),
        ('{"name": "f", "arguments": [1]}', "must be a JSON object"),
    ],
)
def test_malformed_block_becomes_an_error_message(body, fragment):
    content, calls, errors = parse_tool_calls(f"before <tool_call>{body}</tool_call> after")
    assert calls == [] and len(errors) == 1 and fragment in errors[0] and errors[0].startswith("error:")
    assert content == "before  after"


def test_good_and_bad_blocks_mixed_and_unterminated_block():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nope</tool_call><tool_call>{"name": "b"'
    _, calls, errors = parse_tool_calls(text)
    assert [c.name for c in calls] == ["a"]
    assert len(errors) == 2 and "no closing </tool_call>" in errors[1]


def test_no_calls():
    assert parse_tool_calls("just an answer") == ("just an answer", [], [])


async def test_registry_runs_sync_tools_in_a_thread_and_async_tools_on_the_loop():
    threads: list[str] = []

    def add(a: int, b: int) -> int:
        threads.append(threading.current_thread().name)
        return a + b

    async def lookup(city: str) -> dict:
        await asyncio.sleep(0)
        return {"city": city, "temperature": 21}

    registry = ToolRegistry(
        [(schema("add", a="integer", b="integer"), add), ToolSpec(schema=schema("lookup", city="string"), fn=lookup)]
    )
    assert registry.names == ["add", "lookup"]
    assert [s["function"]["name"] for s in registry.schemas] == ["add", "lookup"]
    assert await registry.call(ToolCall(name="add", arguments={"a": 2, "b": 3}, id="1")) == "5"
    assert threads and threads[0] != threading.main_thread().name
    assert (
        await registry.call(ToolCall(name="lookup", arguments={"city": "Paris"}, id="2"))
        == '{"city": "Paris", "temperature": 21}'
    )


async def test_registry_errors_are_strings():
    def boom() -> str:
        raise RuntimeError("disk on fire")

    async def aboom() -> str:
        raise KeyError("k")

    registry = ToolRegistry(
        [(schema("boom"), boom), (schema("aboom"), aboom), (schema("add", a="integer"), lambda a: a)]
    )
    assert await registry.call(ToolCall(name="x", arguments={}, id="1")) == "error: unknown tool 'x'"
    assert (
        await registry.call(ToolCall(name="boom", arguments={}, id="2"))
        == "error: tool 'boom' raised RuntimeError: disk on fire"
    )
    assert (await registry.call(ToolCall(name="aboom", arguments={}, id="3"))).startswith(
        "error: tool 'aboom' raised KeyError"
    )
    # Wrong arguments are the model's mistake too.
    assert "TypeError" in await registry.call(ToolCall(name="add", arguments={"b": 1}, id="4"))


def test_registry_rejects_bad_schemas_and_duplicates():
    with pytest.raises(ValueError):
        ToolRegistry([({"name": "f"}, lambda: 1)])
    with pytest.raises(ValueError, match="twice"):
        ToolRegistry([(schema("f"), lambda: 1), (schema("f"), lambda: 2)])
