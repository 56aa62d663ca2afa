"""Hermes/Qwen-format tool calls: parsing them out of generated text, and a registry that runs them.

The model writes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5/Qwen3, Hermes).
A malformed block never raises: it becomes an error string the agent loop hands back to the model as the tool
response, so a policy is told what it got wrong instead of the episode failing.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# Non-greedy so several blocks in one message stay separate; a trailing open tag without a close (generation cut
# off mid-call) is caught by the second alternative.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    arguments: dict[str, Any]
    id: str


class ToolSpec(msgspec.Struct, kw_only=True, frozen=True):
    """An OpenAI function schema bound to the Python callable (sync or async) that implements it."""

    schema: dict[str, Any]
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def _parse_block(body: str, index: int) -> ToolCall | str:
    """One block's JSON -> ToolCall, or an error message."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"error: tool call {index} is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
    if not isinstance(obj, dict):
        return f"error: tool call {index} must be a JSON object with 'name' and 'arguments'"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"error: tool call {index} has no 'name' string"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models (and the OpenAI wire format) send arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"error: arguments of tool call {index} ({name!r}) are not valid JSON: {exc.msg}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"error: arguments of tool call {index} ({name!r}) must be a JSON object"
    return ToolCall(name=name, arguments=args, id=f"call_{uuid.uuid4().hex[:12]}")


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """`text` -> (the text with every tool-call block removed and stripped, the parsed calls in order, one error
    message per malformed block)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, m in enumerate(_BLOCK.finditer(text)):
        closed = m.group(1)  # group 2 matches an unclosed block
        if closed is None:
            errors.append(f"error: tool call {i} has no closing {TOOL_CALL_CLOSE} tag")
            continue
        parsed = _parse_block(closed.strip(), i)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
    content = _BLOCK.sub("", text).strip()
    return content, calls, errors


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class ToolRegistry:
    """Tools by name. `schemas` go to the chat template; `await call(tool_call)` always returns a string."""

    def __init__(self, tools: Iterable[ToolSpec | tuple[dict[str, Any], Callable[..., Any]]] = ()) -> None:
        self._tools: dict[str, ToolSpec] = {}
        for tool in tools:
            self.register(*((tool.schema, tool.fn) if isinstance(tool, ToolSpec) else tool))

    def register(self, schema: dict[str, Any], fn: Callable[..., Any]) -> ToolSpec:
        if schema.get("type") != "function" or not isinstance(schema.get("function", {}).get("name"), str):
            raise ValueError('a tool schema must look like {"type": "function", "function": {"name": ..., ...}}')
        spec = ToolSpec(schema=schema, fn=fn)
        if spec.name in self._tools:
            raise ValueError(f"tool {spec.name!r} is registered twice")
        self._tools[spec.name] = spec
        return spec

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    async def call(self, tool_call: ToolCall) -> str:
        spec = self._tools.get(tool_call.name)
        if spec is None:
            return f"error: unknown tool {tool_call.name!r}"
        try:
            if inspect.iscoroutinefunction(spec.fn):
                result = await spec.fn(**tool_call.arguments)
            else:
                # A thread: a slow sync tool must not stall the worker's other episodes.
                result = await asyncio.to_thread(spec.fn, **tool_call.arguments)
                if inspect.isawaitable(result):
                    result = await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # tool code is user code: its failure is the model's feedback, not ours
            return f"error: tool {tool_call.name!r} raised {type(exc).__name__}: {exc}"
        return _as_text(result)


__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCall", "ToolRegistry", "ToolSpec", "parse_tool_calls"]
