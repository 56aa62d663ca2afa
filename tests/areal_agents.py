"""Agents and a RolloutWorkflow in the shapes AReaL's own files and docs use, written against rollq's imports: the
single-turn and multi-turn math agents and the OpenAI Agents SDK calculator agent of AReaL's
areal/workflow/openai/math_agent.py (same constructor and `run` signatures, the same SDK calls and return values:
a reward, or `{response.id: reward}`), the RolloutWorkflow of AReaL's add-a-workflow guide
(.agents/skills/add-workflow/SKILL.md: ModelRequest with gconfig/tokenizer, the short `output_ids` template) and the
`[1, L]` tensor dict of areal/workflow/rlvr.py. Written here, not copied; what is checked is that code using AReaL's
API this way runs unchanged but for the imports. Workers import them by path (`tests.areal_agents:MathAgent`);
tests/workers/agents/test_areal_parity.py runs them. A substring check stands in for math_verify (offline)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import torch
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

# AReaL: from areal.api.reward_api import AsyncRewardWrapper; from areal.api.cli_args import
# GenerationHyperparameters; from areal.api.workflow_api import RolloutWorkflow; from areal import workflow_context
from rollq.workers import workflow_context
from rollq.workers.api import (
    AsyncRewardWrapper,
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    RolloutWorkflow,
)

RETRY_PROMPT = "That answer is wrong or could not be parsed. Read the question again and give the final answer."
CALCULATOR_INSTRUCTIONS = "Use the calculator tools for every computation, then state the result."


def math_reward_fn(completions: str, answer: str) -> float:
    return float(answer in (completions or ""))


def _client(extra_kwargs: dict[str, Any]) -> AsyncOpenAI:
    """What AReaL's agents build from the injected kwargs (falling back to the environment in subproc mode)."""
    return AsyncOpenAI(
        base_url=extra_kwargs.get("base_url") or os.getenv("OPENAI_BASE_URL"),
        api_key=extra_kwargs.get("api_key") or os.getenv("OPENAI_API_KEY", "DUMMY"),
        http_client=extra_kwargs.get("http_client"),
        max_retries=0,
    )


# -- agents (areal/workflow/openai/math_agent.py's shapes) ------------------------------------------------------------


class MathAgent:
    """One chat completion; the reward function runs in AReaL's AsyncRewardWrapper with its default pool size."""

    def __init__(self, **kwargs: Any) -> None:
        self.create_kwargs = {k: v for k, v in kwargs.items() if k not in ("max_tokens", "max_turns")}

    async def run(self, data: dict, **extra_kwargs: Any) -> float:
        completion: ChatCompletion = await _client(extra_kwargs).chat.completions.create(
            messages=data["messages"], model="default", **self.create_kwargs
        )
        grade = AsyncRewardWrapper(math_reward_fn, max_workers=None)
        return await grade(completions=completion.choices[0].message.content, answer=data["answer"])


class MultiTurnMathAgent:
    """Retries with feedback until right; every completion gets its own reward by response id."""

    def __init__(self, max_turns: int = 8, **kwargs: Any) -> None:
        self.max_turns = max_turns
        self.create_kwargs = {k: v for k, v in kwargs.items() if k != "max_tokens"}

    async def run(self, data: dict, **extra_kwargs: Any) -> dict[str, float]:
        client = _client(extra_kwargs)
        conversation = list(data["messages"])
        per_completion: dict[str, float] = {}
        grade = AsyncRewardWrapper(math_reward_fn)
        for _ in range(self.max_turns):
            completion: ChatCompletion = await client.chat.completions.create(
                messages=conversation, model="default", **self.create_kwargs
            )
            reply = completion.choices[0].message
            conversation.append(reply.model_dump(exclude_none=True))
            per_completion[completion.id] = await grade(completions=reply.content, answer=data["answer"])
            if per_completion[completion.id] == 1:
                break
            conversation.append({"role": "user", "content": RETRY_PROMPT})
        return per_completion


def _calculator_tools() -> list[Any]:
    from agents import function_tool

    @function_tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    @function_tool
    def multiply(a: float, b: float) -> float:
        """Multiply two numbers."""
        return a * b

    return [add, multiply]


class MathToolAgent:
    """The OpenAI Agents SDK with its default model provider (the Responses API), function tools and an SQLite
    session, as AReaL's calculator agent runs it."""

    def __init__(self, **kwargs: Any) -> None:
        self.settings = {k: v for k, v in kwargs.items() if k != "max_tokens"}

    async def run(self, data: dict, **extra_kwargs: Any) -> float:
        from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, SQLiteSession

        config = RunConfig(
            model_provider=OpenAIProvider(openai_client=_client(extra_kwargs)),
            model="default",
            tracing_disabled=True,
            model_settings=ModelSettings(**self.settings),
        )
        agent = Agent(name="calculator", instructions=CALCULATOR_INSTRUCTIONS, tools=_calculator_tools())
        result = await Runner.run(
            agent, input=data["messages"][-1]["content"], session=SQLiteSession("math"), run_config=config
        )
        grade = AsyncRewardWrapper(math_reward_fn)
        return await grade(completions=result.final_output, answer=data["answer"])


# -- a RolloutWorkflow in the add-a-workflow guide's shape -------------------------------------------------------------


def guide_reward_fn(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    """AReaL's reward_fn signature (areal/api/reward_api.py): texts, ids, then the sample's data as keywords."""
    return float(kwargs["answer"] in completions)


class MyWorkflow(RolloutWorkflow):
    """gconfig + tokenizer + reward function in; one ModelRequest per episode; the short template out (rollq fills
    in loss mask, logprobs and versions from the engine's response)."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer, reward_fn: Callable):
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        # return_dict=False: transformers 5's apply_chat_template returns a dict by default
        prompt = self.tokenizer.apply_chat_template(
            data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        request = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(prompt),
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        response: ModelResponse = await engine.agenerate(request)
        reward = await self.async_reward_fn(
            self.tokenizer.decode(prompt),
            self.tokenizer.decode(response.output_tokens),
            response.input_tokens,
            response.output_tokens,
            **data,
        )
        return {
            "input_ids": torch.tensor(response.input_tokens),
            "output_ids": torch.tensor(response.output_tokens),
            "reward": torch.tensor(reward),
        }


class TensorWorkflow(MyWorkflow):
    """The same episode returning areal/workflow/rlvr.py's `[1, L]` tensor dict, with workflow_context read."""

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=input_ids,
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)
        reward = await self.async_reward_fn(
            self.tokenizer.decode(input_ids),
            self.tokenizer.decode(resp.output_tokens),
            resp.input_tokens,
            resp.output_tokens,
            **data,
        )
        # Not AReaL's: the episode's place, to check what workflow_context.get() says in a worker.
        ctx = workflow_context.get()
        session = await workflow_context.get_aiohttp_session()
        client = await workflow_context.get_httpx_client()
        assert not session.closed and not client.is_closed
        reward += 10 * ctx.sample_index + 100 * ctx.group_size + 1000 * ctx.is_eval
        assert workflow_context.stat_scope() == ("eval-rollout" if ctx.is_eval else "rollout")

        # Build result tensor dict with batch dim 1
        seq = resp.input_tokens + resp.output_tokens
        logprobs = [0.0] * resp.input_len + resp.output_logprobs
        loss_mask = [0] * resp.input_len + [1] * resp.output_len
        versions = [-1] * resp.input_len + resp.output_versions
        res = {
            "input_ids": torch.tensor(seq, dtype=torch.int32),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.int32),
            "logprobs": torch.tensor(logprobs, dtype=torch.float32),
            "versions": torch.tensor(versions, dtype=torch.int32),
            "attention_mask": torch.ones(len(seq), dtype=torch.bool),
            "rewards": torch.tensor(reward, dtype=torch.float32),
        }
        return {k: v.unsqueeze(0) for k, v in res.items()}


class TamperingWorkflow(MyWorkflow):
    """Returns the template with output ids the engine never produced."""

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        out = await super().arun_episode(engine, data)
        assert out is not None
        return {**out, "output_ids": out["output_ids"][:-1]}


def _tokenizer() -> Any:
    from tests.scripted import tiny_tokenizer

    return tiny_tokenizer()


# rollq builds a workflow from JSON workflow_kwargs; these give the guide's classes their objects.
class GuideWorkflow(MyWorkflow):
    def __init__(self, max_new_tokens: int = 32) -> None:
        super().__init__(GenerationHyperparameters(max_new_tokens=max_new_tokens), _tokenizer(), guide_reward_fn)


class GuideTensorWorkflow(TensorWorkflow):
    def __init__(self, max_new_tokens: int = 32) -> None:
        super().__init__(GenerationHyperparameters(max_new_tokens=max_new_tokens), _tokenizer(), guide_reward_fn)


class GuideTamperingWorkflow(TamperingWorkflow):
    def __init__(self) -> None:
        super().__init__(GenerationHyperparameters(max_new_tokens=32), _tokenizer(), guide_reward_fn)
