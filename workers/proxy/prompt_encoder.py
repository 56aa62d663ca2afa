"""Chat prompts -> token ids, fast enough to sit on every agent request.

Tokenizing a rendered prompt costs about a microsecond per token, and most of a root prompt is the same on every
request of a run (the system prompt and the tool schemas). Special tokens cut a text into pieces that Hugging Face
tokenizers encode independently, so each piece between special tokens is cached on its own: the exact ids of a
full encode, with the repeated pieces looked up. The equivalence is checked once per tokenizer; where it does not
hold (a normalizer that rewrites across pieces) every prompt is encoded whole.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from rollq.workers.chat_template import anchor_text, continuation_ids, continuation_text, encode, render

_PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": " Hi  there\n"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2 + 2 = ?"},
]


class PromptEncoder:
    def __init__(self, tokenizer: Any, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        specials = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        self._special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        probe = render(tokenizer, _PROBE, add_generation_prompt=True)
        self.piecewise = self._split is not None and self._encode_pieces(probe) == encode(tokenizer, probe)
        self._pieces.clear()
        self._anchor = anchor_text(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._encode_pieces(text) if self.piecewise else encode(self.tokenizer, text)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """A root prompt: the whole conversation rendered by the chat template, plus the generation prompt."""
        return self.encode(self.chat_text(messages, tools))

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return render(self.tokenizer, messages, tools=tools, add_generation_prompt=True)

    def continuation(self, last_output: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """The new turns after a recorded completion (see chat_template.continuation_ids)."""
        return continuation_ids(self.tokenizer, last_output, messages, base=self._anchor)

    def continuation_text(self, last_output: list[int], messages: list[dict[str, Any]]) -> str:
        return continuation_text(self.tokenizer, last_output, messages, base=self._anchor)

    def _encode_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):  # type: ignore[union-attr]
            if not piece:
                continue
            special = self._special_ids.get(piece)
            if special is not None:
                ids.append(special)
                continue
            cached = self._pieces.get(piece)
            if cached is None:
                cached = self._pieces[piece] = encode(self.tokenizer, piece)
                if len(self._pieces) > self.cache_size:
                    self._pieces.popitem(last=False)
            else:
                self._pieces.move_to_end(piece)
            ids += cached
        return ids


__all__ = ["PromptEncoder"]
