"""What the built-in loops share: the growing token sequence of an episode and the generation settings."""

from __future__ import annotations

from typing import Any

import msgspec

from rollq.engine.types import ModelRequest, ModelResponse, SamplingParams
from rollq.workers.chat_template import encode, prompt_ids


def _text_content(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of parts (OpenAI / AReaL `messages_chat`) with its text parts joined."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"message content part of type {kind!r}: the built-in workflows take text only")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "".join(texts)}


def episode_prompt_ids(tokenizer: Any, data: dict[str, Any], *, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt tokens from `data`, with AReaL's data keys too: `input_ids`; `messages` as a chat (a list), or as
    the already-templated prompt text (a str, as AReaL's vision datasets store it); `messages_chat` (the chat list
    beside such a text); `prompt` (one user message)."""
    if data.get("input_ids") is None:
        messages = data.get("messages")
        if isinstance(messages, str):
            if tools:
                raise ValueError("data['messages'] is already-templated text, so tools can't be added to it")
            return encode(tokenizer, messages)
        if messages is None and data.get("messages_chat") is not None:
            messages = data["messages_chat"]
        if messages is not None:
            data = {**data, "messages": [_text_content(m) for m in messages]}
    return prompt_ids(tokenizer, data, tools=tools)


class TokenSequence:
    """One growing episode: every token with its loss mask, behaviour logprob and policy version."""

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_context(self, ids: list[int]) -> None:
        """Tokens the model did not generate (prompt, user feedback, tool responses): never trained on."""
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, resp: ModelResponse) -> None:
        """The engine's output, verbatim (re-tokenizing decoded text could change the ids and break the logprobs)."""
        n = len(resp.output_tokens)
        self.input_ids += resp.output_tokens
        self.loss_mask += [1] * n
        self.logprobs += list(resp.output_logprobs)
        self.versions += list(resp.output_versions)

    def trajectory(self, reward: float) -> dict[str, Any]:
        return {
            "input_ids": list(self.input_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "reward": reward,
        }


class GenerationConfig(msgspec.Struct, kw_only=True, frozen=True):
    max_new_tokens: int = 64
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")

    def request(
        self,
        input_ids: list[int],
        data: dict[str, Any],
        max_new_tokens: int | None = None,
        *,
        stop_token_ids: tuple[int, ...] | list[int] = (),  # chat_template.stop_token_ids(tokenizer)
    ) -> ModelRequest:
        return ModelRequest(
            input_ids=input_ids,
            sampling=SamplingParams(
                max_new_tokens=max_new_tokens or self.max_new_tokens,
                temperature=self.temperature,
                stop_token_ids=list(stop_token_ids) or None,
            ),
            affinity=group_affinity(data),
        )


def group_affinity(data: dict[str, Any]) -> str:
    """One affinity per group: every sample and turn of a group shares the engine's prefix cache."""
    return str(data.get("group_id") or "")


__all__ = ["GenerationConfig", "TokenSequence", "episode_prompt_ids", "group_affinity"]
