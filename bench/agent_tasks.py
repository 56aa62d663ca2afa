"""The agent of `bench.agents` (imported by the rollq worker by path: `bench.agent_tasks:WaitAgent`).

An OpenAI-SDK tool loop, written as users write agents: every assistant turn is a chat.completions call through the
base URL / API key / shared http client the worker hands in; every tool call is an async 200 ms wait (an
environment step: a sandbox command, a web request...). The scripted engine answers SCRIPT: three tool calls, then
the final answer, so an episode is 4 model turns and 3 tool calls. `LongTailAgent` (part 3): the same loop with
each tool call's latency drawn (lognormal) from the episode's index and the call's number.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

WAIT_TOOL = {
    "type": "function",
    "function": {
        "name": "wait",
        "description": "Run one environment step (takes a while).",
        "parameters": {"type": "object", "properties": {}},
    },
}
CALL_WAIT = '<tool_call>\n{"name": "wait", "arguments": {}}\n</tool_call>'
ANSWER = "All three steps finished without errors, so the task is complete. The final answer is 42."
SCRIPT = [CALL_WAIT, CALL_WAIT, CALL_WAIT, ANSWER]
TOOL_RESULT = "done"
QUESTION = "Run the environment step three times, then report the final answer."
MODEL_TURNS = len(SCRIPT)


def reward(text: str | None) -> float:
    return 1.0 if text and "42" in text else 0.0


class WaitAgent:
    """Tool loop: call the model; run each tool call it makes (asyncio.sleep(tool_s)); stop at a plain answer."""

    def __init__(self, tool_s: float = 0.2, max_turns: int = 8, max_tokens: int = 128) -> None:
        self.tool_s = tool_s
        self.max_turns = max_turns
        self.max_tokens = max_tokens

    async def run(self, data: dict, base_url: str, api_key: str, http_client: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": data.get("question", QUESTION)}]
        calls = 0
        for _ in range(self.max_turns):
            resp = await client.chat.completions.create(
                model="policy", messages=messages, tools=[WAIT_TOOL], max_tokens=self.max_tokens
            )
            message = resp.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return reward(message.content)
            for call in message.tool_calls:
                await asyncio.sleep(self.tool_seconds(data, calls))  # the environment step
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
        return 0.0

    def tool_seconds(self, data: dict, call: int) -> float:
        """How long tool call number `call` of the episode takes."""
        return self.tool_s


def tool_latency_s(episode: int, turn: int, median_s: float, sigma: float) -> float:
    """The long-tail workload's tool latency for tool call `turn` of episode `episode`: lognormal (median, sigma),
    seeded by (episode, turn), so every system waits exactly as long for the same call."""
    return random.Random(f"{episode}:{turn}").lognormvariate(math.log(median_s), sigma)


class LongTailAgent(WaitAgent):
    """WaitAgent whose tool calls take `tool_latency_s(data["i"], k, tool_median_s, tool_sigma)` seconds."""

    def __init__(self, tool_median_s: float = 0.2, tool_sigma: float = 1.0, max_turns: int = 8, max_tokens: int = 640):
        super().__init__(tool_median_s, max_turns, max_tokens)
        self.tool_sigma = tool_sigma

    def tool_seconds(self, data: dict, call: int) -> float:
        return tool_latency_s(data["i"], call, self.tool_s, self.tool_sigma)


class RawWaitAgent(WaitAgent):
    """The same loop over a raw aiohttp POST instead of the OpenAI SDK + httpx (a diagnostic: what the worker does
    when the agent's HTTP client is cheap). One aiohttp session per agent object, i.e. per worker process."""

    _http: Any = None

    async def run(self, data: dict, base_url: str, api_key: str, **_: Any) -> float:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        url, headers = base_url + "/chat/completions", {"Authorization": f"Bearer {api_key}"}
        messages: list[dict[str, Any]] = [{"role": "user", "content": data.get("question", QUESTION)}]
        for _ in range(self.max_turns):
            body = {"model": "policy", "messages": messages, "tools": [WAIT_TOOL], "max_tokens": self.max_tokens}
            async with self._http.post(url, json=body, headers=headers) as resp:
                resp.raise_for_status()
                message = (await resp.json())["choices"][0]["message"]
            messages.append(message)
            if not message.get("tool_calls"):
                return reward(message.get("content"))
            for call in message["tool_calls"]:
                await asyncio.sleep(self.tool_s)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT})
        return 0.0


__all__ = [
    "ANSWER",
    "CALL_WAIT",
    "MODEL_TURNS",
    "QUESTION",
    "SCRIPT",
    "TOOL_RESULT",
    "WAIT_TOOL",
    "LongTailAgent",
    "RawWaitAgent",
    "WaitAgent",
    "reward",
    "tool_latency_s",
]
