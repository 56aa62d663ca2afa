"""A CAMEL-AI `ChatAgent` as a rollq agent: CAMEL's own model backend, pointed at the worker's recording proxy.

Install CAMEL beside rollq with mcp pinned below 2 (camel-ai 0.2.90 asks for `mcp>=1.3.0` with no upper bound, and
mcp 2 removed `mcp.server.FastMCP`, so with mcp 2 `from camel.agents import ChatAgent` fails with ImportError):

    pip install camel-ai==0.2.90 "mcp<2"

Run it with this folder on the worker's path (tests/workers/agents/test_camel.py runs this very file):

    rollq worker --allow camel_agent --module-path examples ...
    job: workflow "camel_agent:CamelAgent", data {"question": "...", "answer": "..."}, workflow_kwargs {"steps": 2}

Each `astep` is one chat completion through the proxy; the agent rewards each one by its id (CAMEL's
`response.info["id"]` is the proxy's completion id), so a conversation's completions are trained with their own
rewards (plus `turn_discount` times the next one's, see docs/agents.md).
"""

from __future__ import annotations

import json
from typing import Any

from camel.agents import ChatAgent
from camel.messages import OpenAIMessage
from camel.models import ModelFactory
from camel.types import ModelPlatformType
from camel.utils import BaseTokenCounter

SYSTEM = "You are a careful math tutor. End with the final answer."
FOLLOW_UP = "Check your answer, then state the final answer again."


# Counts UTF-8 bytes, which needs no download. CAMEL's default counter for an OpenAI-compatible model is tiktoken's
# o200k_base, fetched from the internet the first time a ChatAgent is built: offline, every episode fails with a
# ConnectionError before any request is sent. Bytes overestimate a BPE tokenizer's count, so CAMEL's context-window
# checks stay on the safe side. (Or pre-seed TIKTOKEN_CACHE_DIR with the encoding.)
class ByteTokenCounter(BaseTokenCounter):
    def count_tokens_from_messages(self, messages: list[OpenAIMessage]) -> int:
        return len(json.dumps(messages, default=str).encode())

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


def score(text: str, answer: str) -> float:
    return 1.0 if answer in text else 0.0


class CamelAgent:
    """A `steps`-turn CAMEL conversation: the question, then `steps - 1` follow-ups in the same ChatAgent (its
    memory re-sends the history, which the proxy records as one growing conversation)."""

    def __init__(self, steps: int = 1, max_tokens: int = 256) -> None:
        self.steps = steps
        self.max_tokens = max_tokens

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> dict[str, float]:
        model = ModelFactory.create(
            model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL,
            model_type="policy",  # any name: the worker's engine serves the policy being trained
            url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            token_counter=ByteTokenCounter(),  # not CAMEL's default: that one downloads a tiktoken encoding
            model_config_dict={"max_tokens": self.max_tokens},
        )
        agent = ChatAgent(system_message=SYSTEM, model=model)
        rewards: dict[str, float] = {}
        prompt = data["question"]
        for _ in range(self.steps):
            response = await agent.astep(prompt)
            rewards[response.info["id"]] = score(response.msgs[0].content, data["answer"])
            prompt = FOLLOW_UP
        return rewards
