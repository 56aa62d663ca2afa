"""OpenAI chat wire format <-> the proxy's internal form: request validation, message normalisation, parsing the
model's text into content + tool calls, and the response / SSE chunk bodies.

Normalised messages are what the chat template renders and what parent matching compares: text content, a user
message with images as a list of `{"type": "text", "text"}` and `{"type": "image", "image": data URI}` parts (what
vision chat templates render as image placeholders; comparing the URIs keeps a conversation with other images from
matching), assistant tool calls as `{"type": "function", "function": {"name", "arguments": dict}}` without ids
(clients echo ids back, but comparing them would gain nothing and some frameworks rewrite them).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, overload

import msgspec

from rollq.protocol.media import ImageError, image_from_string
from rollq.workers.tool_calls import parse_tool_calls


class BadRequest(Exception):
    """Invalid request: answered with 400 and this message (and the offending parameter)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def model_name(body: dict[str, Any]) -> str:
    """The request's `model`, as a client named it (cut to 200 characters; "" when it is no string)."""
    model = body.get("model")
    return model[:200] if isinstance(model, str) else ""


class GenerationParams(msgspec.Struct, kw_only=True):
    """What one chat / completions / messages request asks the engine for."""

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = ""  # what the client named (the proxy serves the policy whatever it is): for traces only


class ParsedReply(msgspec.Struct, kw_only=True):
    """The model's text split the way the client sees it."""

    text: str  # everything the model wrote (special tokens skipped, stop string trimmed)
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI wire form, with ids
    finish_reason: str  # stop | length | tool_calls

    def normalized(self) -> dict[str, Any]:
        """The assistant message as normalise_message() would read it back from a client."""
        msg: dict[str, Any] = {"role": "assistant", "content": (self.content or "").strip()}
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                }
                for c in self.tool_calls
            ]
        return msg


# -- request fields ---------------------------------------------------------------------------------------------------


def number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


@overload
def integer(body: dict[str, Any], name: str, default: int, low: int, high: int = ...) -> int: ...
@overload
def integer(body: dict[str, Any], name: str, default: None, low: int, high: int = ...) -> int | None: ...
def integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int = 1 << 30) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def stop_list(value: Any, name: str = "stop") -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value] if value else None
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 16:
        return [s for s in value if s] or None
    raise BadRequest(f"'{name}' must be a string or a list of at most 16 strings", name)


def generation_params(
    body: dict[str, Any], default_max_tokens: int, *, max_tokens_keys: tuple[str, ...]
) -> GenerationParams:
    max_tokens: int | None = None
    for key in max_tokens_keys:
        max_tokens = max_tokens if max_tokens is not None else integer(body, key, None, 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return GenerationParams(
        model=model_name(body),
        max_new_tokens=max_tokens or default_max_tokens,
        n=integer(body, "n", 1, 1, 16),
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=integer(body, "top_k", -1, -1),
        stop=stop_list(body.get("stop")),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


# -- messages ---------------------------------------------------------------------------------------------------------


IMAGE_PARTS = ("image_url", "input_image")  # chat completions' and the Responses API's image content parts


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    text = content_parts(content, where, images=False)
    assert isinstance(text, str)  # images=False refuses image parts, so the content is text
    return text


def content_parts(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content: its text (a string, or text parts joined) when it has no images, else its parts in
    order, adjacent text joined and each image as `{"type": "image", "image": data URI}`. `images`: whether the
    message may hold images (user messages: OpenAI takes them nowhere else)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of content parts", "messages")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if isinstance(part, str) or kind in ("text", "input_text", "output_text"):
            text = part if isinstance(part, str) else str(part.get("text", ""))
            if parts and parts[-1]["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
            else:
                parts.append({"type": "text", "text": text})
        elif kind in IMAGE_PARTS and images:
            parts.append(image_part(part, f"{where}.content[{j}]"))
        elif kind in IMAGE_PARTS:
            raise BadRequest(f"{where}: images are supported in user messages only, got an {kind!r} part", "messages")
        else:
            raise BadRequest(f"{where}: only text and image content is supported, got a {kind!r} part", "messages")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # as before images: text-only prompts render and match unchanged
    return parts


def image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An `image_url` (chat: `{"url": ...}`) or `input_image` (Responses: the URL itself) part as a normalised image
    part. Only data URIs: the proxy needs the image's pixels (for the processor's image tokens and the trajectory)
    and fetches no URLs, which would let an agent make the worker reach any address."""
    raw = part.get("image_url")
    url = raw.get("url") if isinstance(raw, dict) else raw
    if url is None and part.get("file_id") is not None:
        raise BadRequest(
            f"{where}: images by file_id are not supported (the proxy keeps no files): send the image as a "
            "data:image/<type>;base64, URI",
            "messages",
        )
    if not isinstance(url, str):
        raise BadRequest(f"{where}: an image part needs image_url, a data:image/<type>;base64, URI", "messages")
    if url.startswith(("http://", "https://")):
        raise BadRequest(
            f"{where}: image URLs are not supported: the recording proxy fetches no URLs; send the image inline as a "
            "data:image/<type>;base64, URI",
            "messages",
        )
    if not url.startswith("data:"):
        raise BadRequest(f"{where}: an image_url must be a data:image/<type>;base64, URI", "messages")
    try:
        image_from_string(url)  # refused here, by name, rather than by the processor or the engine later
    except ImageError as exc:
        raise BadRequest(f"{where}: {exc}", "messages") from None
    return {"type": "image", "image": url}


def message_images(messages: list[dict[str, Any]]) -> list[str]:
    """The normalised messages' images (data URIs), in order: one per image placeholder their rendering holds."""
    return [
        part["image"]
        for msg in messages
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part["type"] == "image"
    ]


def _arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return raw  # rendered as written; the model wrote it, the template shows it back
    raise BadRequest(f"{where}: tool call arguments must be a JSON string", "messages")


def normalize_message(msg: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise BadRequest(f"{where} must be an object with 'role' and 'content'", "messages")
    role = msg.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"{where}: unsupported role {role!r} (system, developer, user, assistant, tool)", "messages")
    if role == "user":
        return {"role": role, "content": content_parts(msg.get("content"), where, images=True)}
    text = content_text(msg.get("content"), where)
    if role != "assistant":
        out: dict[str, Any] = {"role": role, "content": text}
        if role == "tool" and msg.get("tool_call_id") is not None:
            out["tool_call_id"] = str(msg["tool_call_id"])
        return out
    out = {"role": "assistant", "content": text.strip()}
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadRequest(f"{where}: tool_calls must be a list", "messages")
    normalized_calls = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{j}] needs function.name and function.arguments", "messages")
        normalized_calls.append(
            {
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}]"),
                },
            }
        )
    if normalized_calls:
        out["tool_calls"] = normalized_calls
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def tool_list(tools: Any) -> list[Any]:
    """A request's `tools` as a list ([] for none)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", "tools")
    return tools


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tool_list(tools)):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
        out.append({"type": "function", "function": fn})
    return out or None


def tool_choice_allows_calls(choice: Any, tools: list | None) -> bool:
    if choice is None or choice in ("auto", "required"):
        return tools is not None
    if choice == "none":
        return False
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return tools is not None
    raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', ...}", "tool_choice")


# -- the model's reply ------------------------------------------------------------------------------------------------


def trim_stop(text: str, stop: list[str] | None) -> str:
    """OpenAI leaves the stop sequence out of the text (the ids keep it: they are what the model sampled)."""
    for s in stop or ():
        cut = text.find(s)
        if cut >= 0:
            text = text[:cut]
    return text


def parse_reply(text: str, stop_reason: str, *, parse_tools: bool) -> ParsedReply:
    finish = "length" if stop_reason == "length" else "stop"
    if parse_tools and "<tool_call>" in text:
        content, calls, errors = parse_tool_calls(text)
        if calls and not errors:
            wire = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in calls
            ]
            return ParsedReply(
                text=text,
                content=content or None,
                tool_calls=wire,
                finish_reason="tool_calls" if finish == "stop" else finish,
            )
    return ParsedReply(text=text, content=text, tool_calls=[], finish_reason=finish)


# -- response bodies ---------------------------------------------------------------------------------------------------


def token_logprobs(pieces: list[str], logprobs: list[float]) -> list[dict[str, Any]]:
    return [
        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
        for p, lp in zip(pieces, logprobs, strict=True)
    ]


def chat_message(reply: ParsedReply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        msg["tool_calls"] = reply.tool_calls
    return msg


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChoiceOut(msgspec.Struct, kw_only=True):
    """One generated choice, ready to be written in any wire format."""

    reply: ParsedReply
    pieces: list[str]  # each output token's text (for logprobs and streaming)
    logprobs: list[float]
    completion_tokens: int
    raw_text: str = ""  # the decoded output before the stop string was trimmed
    record: Any = None  # its CompletionRecord, marked delivered once the response is handed to the client


def chat_completion(rid: str, model: str, choices: list[ChoiceOut], prompt_tokens: int, with_logprobs: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": chat_message(c.reply),
                "finish_reason": c.reply.finish_reason,
                "logprobs": {"content": token_logprobs(c.pieces, c.logprobs)} if with_logprobs else None,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
    }


async def chat_stream(
    rid: str, model: str, deltas: AsyncIterator[Any], n: int, prompt_tokens: int, params: GenerationParams
) -> AsyncIterator[dict[str, Any]]:
    """chat.completion.chunk objects, live: a role delta per choice, content as the engine generates it (each
    chunk with its tokens' logprobs when asked), complete tool calls, the finish reason; usage last when asked."""
    created = int(time.time())

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    completion_tokens = 0
    async for d in deltas:
        lp = {"content": token_logprobs(d.pieces, d.logprobs)} if params.logprobs and d.ids else None
        if d.text or lp:
            yield chunk(d.index, {"content": d.text}, logprobs=lp)
        if d.final is not None:
            completion_tokens += d.final.completion_tokens
            for j, call in enumerate(d.final.reply.tool_calls):
                yield chunk(d.index, {"tool_calls": [{"index": j, **call}]})
            yield chunk(d.index, {}, d.final.reply.finish_reason)
    if params.include_usage:
        yield {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }


def text_completion(rid: str, model: str, choices: list[ChoiceOut], prompt_tokens: int, with_logprobs: bool) -> dict:
    out = []
    for i, c in enumerate(choices):
        lp = None
        if with_logprobs:
            offsets, pos = [], 0
            for p in c.pieces:
                offsets.append(pos)
                pos += len(p)
            lp = {
                "tokens": c.pieces,
                "token_logprobs": c.logprobs,
                "top_logprobs": [{} for _ in c.pieces],
                "text_offset": offsets,
            }
        out.append({"index": i, "text": c.reply.text, "finish_reason": c.reply.finish_reason, "logprobs": lp})
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
    }


async def text_stream(rid: str, model: str, deltas: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    created = int(time.time())
    async for d in deltas:
        if d.text or d.final is not None:
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": d.index,
                        "text": d.text,
                        "logprobs": None,
                        "finish_reason": d.final.reply.finish_reason if d.final is not None else None,
                    }
                ],
            }


__all__ = [
    "BadRequest",
    "ChoiceOut",
    "GenerationParams",
    "ParsedReply",
    "chat_completion",
    "chat_stream",
    "generation_params",
    "message_images",
    "normalize_messages",
    "normalize_tools",
    "parse_reply",
    "stop_list",
    "text_completion",
    "text_stream",
    "tool_choice_allows_calls",
    "trim_stop",
]
