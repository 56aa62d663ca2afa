"""What the built-in loops share: the growing token sequence of an episode and the generation settings."""

from __future__ import annotations

from typing import Any

import msgspec

from rollq.engine.types import ModelRequest, ModelResponse, SamplingParams


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


__all__ = ["GenerationConfig", "TokenSequence", "group_affinity"]
