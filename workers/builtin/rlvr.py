"""RLVRWorkflow: one prompt, one generation, one verifiable reward (AReaL's RLVRWorkflow shape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollq.engine.types import InferenceEngine
from rollq.workers.builtin.episode import GenerationConfig, TokenSequence, episode_prompt_ids
from rollq.workers.chat_template import LazyTokenizer, stop_token_ids
from rollq.workers.rewards.call import RewardedWorkflow


class RLVRWorkflow(RewardedWorkflow):
    def __init__(
        self,
        reward_fn: str | Callable[..., Any],
        tokenizer: str = "tiny",
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        **reward_options: Any,
    ) -> None:
        super().__init__(reward_fn, **reward_options)  # reward_mode, reward_timeout, ...: see RewardedWorkflow
        self.tokenizer = LazyTokenizer(tokenizer)
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        tok = await self.tokenizer.get()
        prompt = episode_prompt_ids(tok, data)
        resp = await engine.agenerate(self.generation.request(prompt, data, stop_token_ids=stop_token_ids(tok)))
        seq = TokenSequence()
        seq.add_context(prompt)
        seq.add_generated(resp)
        reward = await self.score(
            tok.decode(prompt),
            tok.decode(resp.output_tokens, skip_special_tokens=True),
            prompt,
            list(resp.output_tokens),
            data,
        )
        return seq.trajectory(reward)


__all__ = ["RLVRWorkflow"]
