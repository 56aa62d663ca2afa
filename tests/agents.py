"""Agents used by the tests, written as users write them: against the OpenAI SDK with a base URL and API key
(imported by workers by path, e.g. `tests.agents:CalculatorAgent`)."""

from __future__ import annotations

import json
import os
from typing import Any

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
# What a scripted engine answers: a tool call, then the final answer.
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
SCRIPT = [CALL_ADD, ANSWER]


def run_tools(message: Any) -> list[dict[str, Any]]:
    out = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        out.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return out


def score(text: str | None) -> float:
    return 1.0 if text and "5" in text else 0.0


class CalculatorAgent:
    """Multi-turn tool loop with openai.AsyncOpenAI and the worker's shared http client."""

    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = max_turns

    async def run(self, data: dict, **extra_kwargs: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"], http_client=extra_kwargs["http_client"]
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": data["question"]}]
        for _ in range(self.max_turns):
            resp = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=64, logprobs=True
            )
            message = resp.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return score(message.content)
            messages += run_tools(message)
        return 0.0


class DictRewardAgent(CalculatorAgent):
    """Rewards every completion by id: the tool call 0.5, the answer 1.0."""

    async def run(self, data: dict, base_url: str, api_key: str, http_client: Any) -> dict[str, float]:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        messages: list[dict[str, Any]] = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], max_tokens=64)
        messages += [first.choices[0].message.model_dump(exclude_none=True), *run_tools(first.choices[0].message)]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], max_tokens=64)
        return {first.id: 0.5, second.id: 1.0}


class SyncEnvAgent:
    """A synchronous agent that finds the proxy only through the environment (subproc mode)."""

    def run(self, data: dict) -> float:
        from openai import OpenAI

        client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY
        messages: list[dict[str, Any]] = [{"role": "user", "content": data["question"]}]
        for _ in range(4):
            resp = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], max_tokens=64)
            message = resp.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return score(message.content) + (0.0 if os.environ["OPENAI_API_KEY"] else -1.0)
            messages += run_tools(message)
        return 0.0


class TwoTurnAgent:
    """Asks, then asks again on the same conversation; rewards only the second answer, so the first gets
    `turn_discount` times it. Its constructor takes no `temperature` (nor any sampling argument)."""

    def __init__(self, max_tokens: int = 16) -> None:
        self.max_tokens = max_tokens

    async def run(self, data: dict, base_url: str, api_key: str, http_client: Any) -> dict[str, float]:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        messages: list[dict[str, Any]] = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=self.max_tokens)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=self.max_tokens)
        return {first.id: 0.0, second.id: 1.0}


class RaisingAgent:
    async def run(self, data: dict, **extra_kwargs: Any) -> float:
        raise RuntimeError("the agent's environment crashed")


class NotANumberAgent(CalculatorAgent):
    async def run(self, data: dict, **extra_kwargs: Any) -> Any:
        await super().run(data, **extra_kwargs)
        return "very good"


class SilentAgent:
    """Never calls the model."""

    async def run(self, data: dict, **extra_kwargs: Any) -> float:
        return 1.0


class HangingSyncAgent:
    def run(self, data: dict) -> float:
        import time

        time.sleep(3600)
        return 0.0


class ImageAgent:
    """Asks about the job's image (`data["image"]`: the worker hands an image in a job's data to agents as a data
    URI) in an `image_url` part, then asks again in a second turn that repeats the conversation, image included."""

    async def run(self, data: dict, base_url: str, api_key: str, http_client: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        image = {"type": "image_url", "image_url": {"url": data["image"]}}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [image, {"type": "text", "text": "Which colour is it?"}]}
        ]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        return 1.0 if "red" in (second.choices[0].message.content or "") else 0.0


# -- agents for agent host processes (tests/workers/agents/test_agent_hosts.py) ----------------------------------------


def _record(path: str, line: str) -> None:
    """One line appended to a side-channel file the test reads (written whole, so a reader never sees half)."""
    with open(path, "a") as f:
        f.write(line + "\n")


class PidAgent(CalculatorAgent):
    """CalculatorAgent that records the pid of the process it ran in, and the pids of an AsyncRewardWrapper it
    builds per run (AReaL's agents do): `pid reward_pid...` per episode, in `record`."""

    def __init__(self, record: str, max_turns: int = 4) -> None:
        super().__init__(max_turns)
        self.record = record

    async def run(self, data: dict, **extra_kwargs: Any) -> float:
        from rollq.workers.api import AsyncRewardWrapper
        from tests import reward_fns

        reward = await super().run(data, **extra_kwargs)
        grade = AsyncRewardWrapper(reward_fns.sleepy, max_workers=1)
        reward = await grade(0.0, value=reward)
        _record(self.record, " ".join(map(str, [os.getpid(), *grade.pids])))
        return reward


class StuckAgent:
    """One model call (unless `model` is false), records its pid, then never finishes: `how` = "sleep"
    (cooperative: an await that a cancel ends; records `<record>.cancelled` then) or "spin" (CPU-bound: blocks its
    event loop, so only killing its process ends it)."""

    def __init__(self, record: str, how: str = "sleep", model: bool = True) -> None:
        self.record = record
        self.how = how
        self.model = model

    async def run(self, data: dict, base_url: str, api_key: str, http_client: Any) -> float:
        import asyncio

        from openai import AsyncOpenAI

        if self.model:
            client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": data["question"]}]
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=64)
        _record(self.record, str(os.getpid()))
        if self.how == "spin":
            while True:
                pass
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            _record(self.record + ".cancelled", str(os.getpid()))
            raise
        return 1.0
