"""A RolloutWorkflow in the shapes AReaL's docs use, written against rollq's imports: the RolloutWorkflow of AReaL's
add-a-workflow guide (.agents/skills/add-workflow/SKILL.md: ModelRequest with gconfig/tokenizer, the short
`output_ids` template) and the `[1, L]` tensor dict of areal/workflow/rlvr.py. Written here, not copied; what is
checked is that code using AReaL's API this way runs unchanged but for the imports. Workers import them by path
(`tests.areal_agents:GuideWorkflow`); tests/workers/agents/test_areal_parity.py runs them. AReaL's own agent files run
from the real wheel in tests/workers/areal_real/."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch

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
