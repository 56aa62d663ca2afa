"""OpenAI Responses wire format (`POST /v1/responses`) <-> the proxy's normalised chat form.

Input items map onto chat messages: `message` items by role (`developer` is a system message), `function_call`
items become the assistant turn's tool calls (joined to the assistant message before them, as the API returns
them: text first, then calls), `function_call_output` items become `tool` messages, and `reasoning` items passed
back are skipped (the template does not render them; the model's tokens are in the record anyway). `instructions`
is a system message in front. So a conversation sent as Responses input renders, and continues token by token,
exactly as the same conversation sent to chat completions.

What the proxy cannot honour is refused with a 400 that names it (hosted tools, structured output formats, stored
conversations, background mode); fields that don't change generation are accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from rollq.workers.proxy.chat import (
    BadRequest,
    ChoiceOut,
    GenerationParams,
    integer,
    model_name,
    normalize_message,
    number,
    token_logprobs,
    tool_choice_allows_calls,
    tool_list,
)
from rollq.workers.proxy.chat import normalize_tools as chat_tools

_LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """A validated /v1/responses request."""

    input: list[dict[str, Any]]  # normalised chat messages, without the instructions
    instructions: str | None
    tools: list[dict[str, Any]] | None  # chat form: {"type": "function", "function": {...}}
    parse_tools: bool
    params: GenerationParams
    previous_response_id: str | None
    echo: dict[str, Any]  # request settings the response object repeats

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The whole conversation to render: instructions, an earlier response's conversation, this input."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        return head + history + self.input


# -- the request ------------------------------------------------------------------------------------------------------


def _refuse(name: str, why: str) -> BadRequest:
    return BadRequest(f"'{name}' {why}", name)


def parse_request(body: dict[str, Any], default_max_tokens: int) -> ResponsesRequest:
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise _refuse(
                name,
                "is not supported: the proxy keeps no stored conversations or prompt templates; send "
                "the conversation as 'input' (or continue one with 'previous_response_id')",
            )
    if body.get("background"):
        raise _refuse("background", "mode is not supported: leave it unset or false")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text")):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise BadRequest(
                f"'text.format' of type {kind!r} is not supported: the proxy generates plain text (format 'text')",
                "text.format",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _refuse("stream", "must be a boolean")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _refuse("include", "must be a list")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _refuse("instructions", "must be a string")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _refuse("previous_response_id", "must be a string")
    tools = normalize_tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"))
    params = GenerationParams(
        model=model_name(body),
        max_new_tokens=integer(body, "max_output_tokens", None, 1) or default_max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        stream=stream,
        logprobs=_LOGPROBS_INCLUDE in include,
    )
    return ResponsesRequest(
        input=normalize_input(body.get("input")),
        instructions=instructions,
        tools=tools,
        parse_tools=tool_choice_allows_calls(choice, tools),
        params=params,
        previous_response_id=previous,
        echo={
            "instructions": instructions,
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": previous,
            "metadata": body.get("metadata") or {},
            "store": bool(body.get("store", True)),
            "text": {"format": {"type": "text"}},
            "truncation": body.get("truncation") or "disabled",
        },
    )


def normalize_input(items: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items) as normalised chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    chat: list[dict[str, Any]] = []  # chat-completions form, validated by normalize_message below
    open_assistant = False  # whether function calls now join the last assistant message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object (a message or an item)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            chat.append({"role": role, "content": item.get("content")})
            open_assistant = role == "assistant"
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}: a function_call item needs 'name', 'call_id' and 'arguments'", "input")
            call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item.get("arguments")}}
            if not open_assistant:
                chat.append({"role": "assistant", "content": ""})
                open_assistant = True
            chat[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}: a function_call_output item needs 'call_id' and 'output'", "input")
            chat.append({"role": "tool", "content": item.get("output"), "tool_call_id": item["call_id"]})
            open_assistant = False
        elif kind == "reasoning":
            continue  # the template doesn't render it; the recorded tokens hold what the model wrote
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item references are not supported: send the item itself", "input")
        else:
            raise BadRequest(
                f"{where}: unsupported item type {kind!r} (message, function_call, function_call_output, reasoning)",
                "input",
            )
    return [normalize_message(m, i) for i, m in enumerate(chat)]


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools (flat in the Responses API) in the chat-completions form the template renders; hosted tools
    are refused."""
    wrapped = []
    for i, tool in enumerate(tool_list(tools)):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(
                f"tools[{i}]: tool type {kind!r} is not supported: only function tools (type 'function'); hosted "
                "tools such as web search run on OpenAI's servers",
                "tools",
            )
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}]: a function tool needs a 'name'", "tools")
        wrapped.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return chat_tools(wrapped)


def tool_choice(choice: Any) -> Any:
    """Responses' tool_choice in chat-completions form (for tool_choice_allows_calls)."""
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        if kind == "allowed_tools":
            return choice.get("mode", "auto")
        raise BadRequest(f"'tool_choice' of type {kind!r} is not supported (only function tools)", "tool_choice")
    return choice


# -- the response -----------------------------------------------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
    }


def output_items(choice: ChoiceOut, with_logprobs: bool) -> list[dict[str, Any]]:
    """A reply as Responses output: its text as one message (when there is text or nothing else), then a
    function_call item per tool call."""
    reply = choice.reply
    items: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        logprobs = token_logprobs(choice.pieces, choice.logprobs) if with_logprobs else None
        items.append(_message_item(_item_id("msg"), reply.content or "", _status(choice), logprobs))
    items += [_call_item(_item_id("fc"), call, "completed") for call in reply.tool_calls]
    return items


def _status(choice: ChoiceOut) -> str:
    return "incomplete" if choice.reply.finish_reason == "length" else "completed"


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    rid: str,
    model: str,
    req: ResponsesRequest,
    created_at: float,
    *,
    output: list[dict[str, Any]] | None = None,
    choice: ChoiceOut | None = None,
    prompt_tokens: int = 0,
) -> dict[str, Any]:
    """The Response object: in progress (no choice yet) or finished."""
    status = "in_progress" if choice is None else _status(choice)
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output or [],
        "usage": usage(prompt_tokens, choice.completion_tokens) if choice is not None else None,
        **req.echo,
    }


def response(rid: str, model: str, req: ResponsesRequest, choice: ChoiceOut, prompt_tokens: int) -> dict[str, Any]:
    output = output_items(choice, req.params.logprobs)
    return response_object(rid, model, req, time.time(), output=output, choice=choice, prompt_tokens=prompt_tokens)


async def stream_events(
    rid: str,
    model: str,
    req: ResponsesRequest,
    deltas: AsyncIterator[Any],
    prompt_tokens: int,
    on_final: Callable[[ChoiceOut], None],
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event type, data) of a streamed response, live: created, the text as it is generated, then each complete
    function call (arguments in one delta), the finished response last (`response.completed`, or
    `response.incomplete` when max_output_tokens cut it off)."""
    created = time.time()
    seq = 0

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        nonlocal seq
        seq += 1
        return kind, {"type": kind, "sequence_number": seq - 1, **data}

    yield event("response.created", response=response_object(rid, model, req, created))
    yield event("response.in_progress", response=response_object(rid, model, req, created))
    msg_id, text, lps = _item_id("msg"), "", []
    output: list[dict[str, Any]] = []
    opened = False

    def open_message() -> list[tuple[str, dict[str, Any]]]:
        return [
            event("response.output_item.added", output_index=0, item=_message_item(msg_id, "", "in_progress", None)),
            event(
                "response.content_part.added",
                item_id=msg_id,
                output_index=0,
                content_index=0,
                part=_text_part("", None),
            ),
        ]

    final: ChoiceOut | None = None
    async for d in deltas:
        piece_lps = token_logprobs(d.pieces, d.logprobs) if req.params.logprobs and d.ids else []
        lps += piece_lps
        if d.final is not None:
            final = d.final
        if not d.text:
            continue
        if not opened:
            for e in open_message():
                yield e
            opened = True
        text += d.text
        yield event(
            "response.output_text.delta",
            item_id=msg_id,
            output_index=0,
            content_index=0,
            delta=d.text,
            logprobs=piece_lps,
        )
    assert final is not None  # stream_deltas ends with every choice's final delta
    reply = final.reply
    if not opened and (reply.content or not reply.tool_calls):
        for e in open_message():
            yield e
        opened = True
    if opened:
        part = _text_part(text, lps if req.params.logprobs else None)
        yield event(
            "response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text, logprobs=lps
        )
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        item = {**_message_item(msg_id, text, _status(final), None), "content": [part]}
        yield event("response.output_item.done", output_index=0, item=item)
        output.append(item)
    for call in reply.tool_calls:
        index, fc_id, args = len(output), _item_id("fc"), call["function"]["arguments"]
        yield event("response.output_item.added", output_index=index, item=_call_item(fc_id, call, "in_progress", ""))
        yield event("response.function_call_arguments.delta", item_id=fc_id, output_index=index, delta=args)
        yield event(
            "response.function_call_arguments.done",
            item_id=fc_id,
            output_index=index,
            name=call["function"]["name"],
            arguments=args,
        )
        item = _call_item(fc_id, call, "completed")
        yield event("response.output_item.done", output_index=index, item=item)
        output.append(item)
    on_final(final)
    done = response_object(rid, model, req, created, output=output, choice=final, prompt_tokens=prompt_tokens)
    yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)


def error_frame(message: str, client_fault: bool = False) -> bytes:
    code = "invalid_request_error" if client_fault else "server_error"
    body = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": 0}
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


__all__ = [
    "ResponsesRequest",
    "error_frame",
    "new_response_id",
    "normalize_input",
    "normalize_tools",
    "parse_request",
    "response",
    "stream_events",
]
