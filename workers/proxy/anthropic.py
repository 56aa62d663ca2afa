"""Anthropic Messages wire format (`POST /v1/messages`) <-> the proxy's normalised chat form.

Content blocks map onto OpenAI-style messages: `tool_use` blocks become assistant tool calls, `tool_result` blocks
become `tool` messages (placed before the user's text of the same turn), `system` becomes a system message, and so
does a `system` message among the messages (the per-turn instructions the claude CLI sends after the user's first
message), in its place.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rollq.workers.proxy.chat import BadRequest, ChoiceOut, GenerationParams, integer, model_name, number, stop_list


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return content
    raise BadRequest(f"{where}: content must be a string or a list of content blocks", "messages")


def _text_of(content: Any, where: str) -> str:
    parts = []
    for block in _blocks(content, where) if content is not None else []:
        if block.get("type") != "text":
            raise BadRequest(f"{where}: only text blocks are supported here, got {block.get('type')!r}", "messages")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def normalize_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"{where}: role must be 'user', 'assistant' or 'system'", "messages")
        if msg["role"] == "system":
            out.append({"role": "system", "content": _text_of(msg.get("content"), where)})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(msg.get("content"), where)):
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and msg["role"] == "assistant":
                if not isinstance(block.get("name"), str):
                    raise BadRequest(f"{where}.content[{j}]: tool_use needs a name", "messages")
                calls.append(
                    {"type": "function", "function": {"name": block["name"], "arguments": block.get("input") or {}}}
                )
            elif kind == "tool_result" and msg["role"] == "user":
                content = block.get("content")
                text = content if isinstance(content, str) else _text_of(content, f"{where}.content[{j}]")
                results.append({"role": "tool", "content": text, "tool_call_id": str(block.get("tool_use_id", ""))})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # not rendered by the template; the model's tokens live in the record anyway
            else:
                raise BadRequest(
                    f"{where}.content[{j}]: unsupported block type {kind!r} for role {msg['role']}", "messages"
                )
        if msg["role"] == "assistant":
            normalized: dict[str, Any] = {"role": "assistant", "content": "".join(texts).strip()}
            if calls:
                normalized["tool_calls"] = calls
            out.append(normalized)
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}] needs a name (and input_schema)", "tools")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_allows_calls(choice: Any, tools: list | None) -> bool:
    if choice is None:
        return tools is not None
    if isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool"):
        return tools is not None
    if isinstance(choice, dict) and choice.get("type") == "none":
        return False
    raise BadRequest("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")


def generation_params(body: dict[str, Any]) -> GenerationParams:
    max_tokens = integer(body, "max_tokens", None, 1)
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    return GenerationParams(
        model=model_name(body),
        max_new_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=integer(body, "top_k", -1, -1),
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        stream=stream,
    )


def _content_blocks(choice: ChoiceOut) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.reply.content:
        blocks.append({"type": "text", "text": choice.reply.content})
    for call in choice.reply.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"].replace("call_", "toolu_", 1),
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    return blocks


def _stop_reason(choice: ChoiceOut, stop: list[str] | None) -> tuple[str, str | None]:
    finish = choice.reply.finish_reason
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = next((s for s in stop or () if s in choice.raw_text), None)
    return ("stop_sequence", matched) if matched else ("end_turn", None)


def message(mid: str, model: str, choice: ChoiceOut, prompt_tokens: int, stop: list[str] | None) -> dict[str, Any]:
    reason, sequence = _stop_reason(choice, stop)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content_blocks(choice),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": choice.completion_tokens},
    }


async def stream_events(
    mid: str, model: str, deltas: AsyncIterator[Any], prompt_tokens: int, stop: list[str] | None
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of a streamed message, live: text deltas as the engine generates them, then the
    complete tool_use blocks, the stop reason and the usage."""
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            },
        },
    )
    index, text_open = 0, False
    async for d in deltas:
        if d.text:
            if not text_open:
                yield (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                )
                text_open = True
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": d.text}},
            )
        if d.final is None:
            continue
        if text_open:
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
            index += 1
        for block in _content_blocks(d.final):
            if block["type"] != "tool_use":
                continue
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}},
                },
            )
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                },
            )
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
            index += 1
        reason, sequence = _stop_reason(d.final, stop)
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": d.final.completion_tokens},
            },
        )
    yield "message_stop", {"type": "message_stop"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


__all__ = [
    "stream_events",
    "generation_params",
    "message",
    "new_message_id",
    "normalize_messages",
    "normalize_tools",
    "tool_choice_allows_calls",
]
