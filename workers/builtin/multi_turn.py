"""MultiTurnWorkflow: answer, get feedback when the reward is below 1, answer again, in one token sequence.

The sequence grows incrementally: assistant turns are the engine's output ids verbatim, and only the new turn's text
(user feedback here, tool responses in tool_agent) is rendered and tokenized. Re-rendering the whole conversation
would re-tokenize generated text, which can yield other ids than the model sampled and so wrong logprobs.
"""

from __future__ import annotations

from typing import Any

from rollq.engine.types import InferenceEngine
from rollq.workers.builtin.episode import GenerationConfig, TokenSequence, episode_prompt_ids
from rollq.workers.chat_template import LazyTokenizer, continuation_ids, stop_token_ids
from rollq.workers.rewards.call import RewardedWorkflow


class MultiTurnWorkflow(RewardedWorkflow):
    def __init__(
        self,
        reward_fn: Any,
        tokenizer: str = "tiny",
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        max_turns: int = 2,
        feedback: str = "Try again.",
        **reward_options: Any,
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        super().__init__(reward_fn, **reward_options)  # reward_mode, reward_timeout, ...: see RewardedWorkflow
        self.tokenizer = LazyTokenizer(tokenizer)
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)
        self.max_turns = max_turns
        self.feedback = feedback

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        tok = await self.tokenizer.get()
        prompt = episode_prompt_ids(tok, data)
        prompt_text = tok.decode(prompt)
        seq = TokenSequence()
        seq.add_context(prompt)
        reward = 0.0
        for turn in range(self.max_turns):
            resp = await engine.agenerate(
                self.generation.request(seq.input_ids, data, stop_token_ids=stop_token_ids(tok))
            )
            seq.add_generated(resp)
            reward = await self.score(
                prompt_text,
                tok.decode(resp.output_tokens, skip_special_tokens=True),
                prompt,
                list(resp.output_tokens),
                {**data, "turn": turn},
            )
            if reward >= 1.0 or turn + 1 == self.max_turns:
                break
            seq.add_context(continuation_ids(tok, resp.output_tokens, [{"role": "user", "content": self.feedback}]))
        return seq.trajectory(reward)


__all__ = ["MultiTurnWorkflow"]
