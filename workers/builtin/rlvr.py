"""RLVRWorkflow: one prompt, one generation, one verifiable reward (AReaL's RLVRWorkflow shape).

Also the pieces the other built-in workflows share: the lazily loaded tokenizer, reward-function calls and the
token-sequence builder that keeps input_ids / loss_mask / logprobs / versions aligned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from engine.types import ModelRequest, ModelResponse, SamplingParams
# Re-exported: the reward-call helpers used to live here and the other workflows import them from this module.
from workers.builtin.reward_call import RewardCaller, call_reward, load_callable, reward_caller, reward_kwargs


def load_tokenizer(name: str) -> Any:
    """"tiny" (the offline test model, built into the cache on first use) or an HF tokenizer directory."""
    from transformers import AutoTokenizer  # heavy import: only when a built-in workflow runs

    from engine.tiny_model import model_dir

    return AutoTokenizer.from_pretrained(model_dir(name))


class LazyTokenizer:
    """Loads once per workflow instance (the worker builds one instance per process), off the event loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tokenizer: Any = None
        self._lock: asyncio.Lock | None = None  # created inside the running loop

    async def get(self) -> Any:
        if self._tokenizer is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(load_tokenizer, self.name)
        return self._tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    # The chat template already wrote every special token; don't let the tokenizer add a BOS of its own.
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: skip ~50 µs of Python wrapping
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer: Any, data: dict[str, Any], *, tools: list[dict] | None = None) -> list[int]:
    """The episode's prompt tokens from `data`: `messages` (chat), `prompt` (a user message) or `input_ids`."""
    if data.get("input_ids") is not None:
        return [int(t) for t in data["input_ids"]]
    if data.get("messages") is not None:
        messages = list(data["messages"])
    elif data.get("prompt") is not None:
        messages = [{"role": "user", "content": str(data["prompt"])}]
    else:
        raise ValueError("data needs 'messages', 'prompt' or 'input_ids'")
    return encode(tokenizer, render(tokenizer, messages, tools=tools, add_generation_prompt=True))


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
        return {"input_ids": list(self.input_ids), "loss_mask": list(self.loss_mask), "logprobs": list(self.logprobs),
                "versions": list(self.versions), "reward": reward}


class GenerationConfig(msgspec.Struct, kw_only=True, frozen=True):
    max_new_tokens: int = 64
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")

    def request(self, input_ids: list[int], data: dict[str, Any], max_new_tokens: int | None = None) -> ModelRequest:
        # One affinity per group: every sample and turn of a group shares the engine's prefix cache.
        return ModelRequest(
            input_ids=input_ids,
            sampling=SamplingParams(max_new_tokens=max_new_tokens or self.max_new_tokens, temperature=self.temperature),
            affinity=str(data.get("group_id") or ""),
        )


class RLVRWorkflow:
    def __init__(self, reward_fn: str | Callable[..., Any], tokenizer: str = "tiny", max_new_tokens: int = 64,
                 temperature: float = 1.0, reward_mode: str = "inline", reward_timeout: float = 15.0,
                 reward_workers: int = 2, reward_run: str = "default") -> None:
        # Resolved now: a bad path or mode fails at construction (dead-letter). See reward_call for the modes.
        self.reward = reward_caller(reward_fn, reward_mode, reward_timeout, reward_workers, reward_run)
        if self.reward is None:
            raise ValueError("RLVRWorkflow needs a reward_fn")
        self.reward_fn = self.reward.fn
        self.tokenizer = LazyTokenizer(tokenizer)
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)

    async def aclose(self) -> None:
        """Stops reward child processes / connections (process and remote modes)."""
        await self.reward.close()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        tok = await self.tokenizer.get()
        prompt = prompt_ids(tok, data)
        resp = await engine.agenerate(self.generation.request(prompt, data))
        seq = TokenSequence()
        seq.add_context(prompt)
        seq.add_generated(resp)
        reward = await self.reward(
            tok.decode(prompt), tok.decode(resp.output_tokens, skip_special_tokens=True), prompt,
            list(resp.output_tokens), data,
        )
        return seq.trajectory(reward)


__all__ = ["GenerationConfig", "LazyTokenizer", "RLVRWorkflow", "RewardCaller", "TokenSequence", "call_reward",
           "encode", "load_callable", "load_tokenizer", "prompt_ids", "render", "reward_caller", "reward_kwargs"]
