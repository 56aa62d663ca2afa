"""Live streaming: tokens go out to the client while the engine generates them.

The engine pool reports each choice's new token ids as they arrive; `TextStream` turns them into text that is safe
to send now — never half a UTF-8 character, never the start of a `<tool_call>` block (sent as structured tool calls
once complete) or of a stop string (OpenAI leaves it out). What is held back goes out when the choice finishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from rollq.workers.proxy.chat import ChoiceOut, ParsedReply
from rollq.workers.tool_calls import TOOL_CALL_OPEN


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may turn into the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None, parse_tools: bool) -> None:
        self.tokenizer = tokenizer  # Hugging Face tokenizer
        self.stop = stop or []
        self.parse_tools = parse_tools
        self.ids: list[int] = []
        self.sent = ""

    def feed(self, ids: list[int]) -> str:
        """New text that can be sent, after `ids` were generated."""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = text.rstrip("\ufffd")  # a multi-byte character that is not complete yet
        safe = len(text)
        for marker in ([TOOL_CALL_OPEN] if self.parse_tools else []) + self.stop:
            at = text.find(marker)
            safe = min(safe, at if at >= 0 else len(text) - _held_suffix(text, marker))
        return self._advance(text[:safe])

    def finish(self, reply: ParsedReply) -> str:
        """The rest of the content once the choice is done (tool calls are sent separately)."""
        return "" if reply.tool_calls else self._advance(reply.content or "")

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding changed earlier text (rare): send nothing contradictory
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


class Delta(msgspec.Struct, kw_only=True):
    index: int  # the choice
    text: str  # content to send now
    ids: list[int]
    logprobs: list[float]
    pieces: list[str] = []  # each id's own text (logprobs entries), when asked for
    final: ChoiceOut | None = None  # set once, on the choice's last delta


async def stream_deltas(
    generate: Callable[[list[Callable[[list[int], list[float]], None]]], Awaitable[list[ChoiceOut]]],
    streams: list[TextStream],
    *,
    with_pieces: bool = False,
) -> AsyncIterator[Delta]:
    """Run `generate(callbacks)` (one callback per choice) and yield what to send, as it is generated; then each
    choice's final delta. Raises what generation raised. Cancels generation if the consumer goes away."""
    queue: asyncio.Queue[tuple[int, list[int], list[float]] | None] = asyncio.Queue()

    def callback(index: int) -> Callable[[list[int], list[float]], None]:
        return lambda ids, lps: queue.put_nowait((index, ids, lps))

    task = asyncio.ensure_future(generate([callback(i) for i in range(len(streams))]))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            index, ids, lps = item
            stream = streams[index]
            pieces = stream.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True) if with_pieces else []
            yield Delta(index=index, text=stream.feed(ids), ids=ids, logprobs=lps, pieces=pieces)
        choices = task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    for index, choice in enumerate(choices):
        yield Delta(index=index, text=streams[index].finish(choice.reply), ids=[], logprobs=[], final=choice)


__all__ = ["Delta", "TextStream", "stream_deltas"]
