"""ToolAgentWorkflow: verl's tool agent loop over hermes-format tool calls.

generate -> parse tool calls from the assistant's tokens -> none, or turns/budget spent: stop -> else run the tools
concurrently, append their responses (tool role, masked) -> generate again. `max_response_tokens` bounds everything
after the prompt (assistant and tool tokens), as the trainer's response length does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from rollq.engine.types import InferenceEngine, ModelRequest, SamplingParams
from rollq.workers.builtin.episode import TokenSequence, episode_prompt_ids, group_affinity
from rollq.workers.chat_template import LazyTokenizer, continuation_ids, encode, stop_token_ids
from rollq.workers.resolver import resolve
from rollq.workers.rewards.call import RewardedWorkflow
from rollq.workers.tool_calls import ToolRegistry, parse_tool_calls


class ToolAgentConfig(msgspec.Struct, kw_only=True, frozen=True):
    max_turns: int = 4  # assistant turns
    max_response_tokens: int = 256
    max_tool_response_tokens: int = 64
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_response_tokens < 1 or self.max_tool_response_tokens < 0:
            raise ValueError("max_turns and max_response_tokens must be >= 1, max_tool_response_tokens >= 0")


def load_tools(spec: str | ToolRegistry | list) -> ToolRegistry:
    """An import path of a module attribute holding a ToolRegistry or a list of (schema, callable) pairs."""
    obj = resolve(spec) if isinstance(spec, str) else spec
    return obj if isinstance(obj, ToolRegistry) else ToolRegistry(obj)


def truncate_tokens(tokenizer: Any, text: str, limit: int) -> str:
    """`text` cut to its first `limit` tokens (a character cut would let a dense tool output blow the budget)."""
    ids = encode(tokenizer, text)
    return text if len(ids) <= limit else tokenizer.decode(ids[:limit])


class ToolAgentWorkflow(RewardedWorkflow):
    reward_required = False  # without a reward_fn an episode's reward is 0

    def __init__(
        self,
        tools: str | ToolRegistry | list,
        tokenizer: str = "tiny",
        max_turns: int = 4,
        max_response_tokens: int = 256,
        max_tool_response_tokens: int = 64,
        reward_fn: Any = None,
        temperature: float = 1.0,
        **reward_options: Any,
    ) -> None:
        super().__init__(reward_fn, **reward_options)  # reward_mode, reward_timeout, ...: see RewardedWorkflow
        self.registry = load_tools(tools)
        self.tokenizer = LazyTokenizer(tokenizer)
        self.config = ToolAgentConfig(
            max_turns=max_turns,
            max_response_tokens=max_response_tokens,
            max_tool_response_tokens=max_tool_response_tokens,
            temperature=temperature,
        )

    async def _tool_messages(self, tok: Any, text: str) -> list[dict[str, Any]]:
        _, calls, errors = parse_tool_calls(text)
        results = await asyncio.gather(*(self.registry.call(c) for c in calls))
        limit = self.config.max_tool_response_tokens
        return [{"role": "tool", "content": truncate_tokens(tok, r, limit)} for r in [*results, *errors]]

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        c = self.config
        tok = await self.tokenizer.get()
        prompt = episode_prompt_ids(tok, data, tools=self.registry.schemas)
        seq = TokenSequence()
        seq.add_context(prompt)
        completion_ids: list[int] = []  # assistant tokens only, for the reward function
        for turn in range(c.max_turns):
            budget = c.max_response_tokens - (len(seq) - len(prompt))
            resp = await engine.agenerate(
                ModelRequest(
                    input_ids=list(seq.input_ids),
                    sampling=SamplingParams(
                        max_new_tokens=budget, temperature=c.temperature, stop_token_ids=list(stop_token_ids(tok))
                    ),
                    affinity=group_affinity(data),
                )
            )
            seq.add_generated(resp)
            completion_ids += resp.output_tokens
            text = tok.decode(resp.output_tokens, skip_special_tokens=True)
            if turn + 1 == c.max_turns or resp.stop_reason != "stop" or "<tool_call>" not in text:
                break
            messages = await self._tool_messages(tok, text)
            if not messages:
                break
            suffix = continuation_ids(tok, resp.output_tokens, messages)
            # Tool responses that would leave no room for another assistant token end the episode (as in verl).
            if len(seq) - len(prompt) + len(suffix) >= c.max_response_tokens:
                break
            seq.add_context(suffix)
        reward = await self.score(
            tok.decode(prompt), tok.decode(completion_ids, skip_special_tokens=True), prompt, completion_ids, data
        )
        return seq.trajectory(reward)


__all__ = ["ToolAgentConfig", "ToolAgentWorkflow", "load_tools", "truncate_tokens"]
