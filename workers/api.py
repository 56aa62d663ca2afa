"""AReaL's workflow API under rollq's names: what `areal.api` (and `areal.infra.workflow_context`) give a workflow
or agent file. Bring AReaL code over by changing only the imports:

    from areal.api import AsyncRewardWrapper, InferenceEngine, ModelRequest, ModelResponse, RolloutWorkflow
    from areal.api.cli_args import GenerationHyperparameters
    from areal import workflow_context
    from areal.utils import logging, stats_tracker
->
    from rollq.workers.api import (AsyncRewardWrapper, GenerationHyperparameters, InferenceEngine, ModelRequest,
                                   ModelResponse, RolloutWorkflow, workflow_context)
    from rollq.workers.api import logging, stats_tracker

Every `from areal... import NAME` of AReaL's shipped workflow and agent files has its NAME here (the areal.utils
helpers are in rollq.workers.areal_utils); tests/workers/areal_real/ runs those files from the real wheel.

(`from rollq.workers import workflow_context` works too.) What `arun_episode` may return is in rollq.workers.outputs:
AReaL's `[1, L]` tensor dict, the `{"input_ids", "output_ids", "reward"}` template, or rollq's own mapping.
"""

from __future__ import annotations

import abc
from typing import Any

from rollq.engine.types import GenerationHyperparameters, InferenceEngine, ModelRequest, ModelResponse
from rollq.workers.areal_openai import ArealOpenAI, InteractionWithTokenLogpReward
from rollq.workers.areal_utils import (
    apply_chat_template,
    atrace_session_phase,
    image2base64,
    import_from_string,
    load_hf_tokenizer,
    logging,
    session_context,
    trace_session,
    trace_session_phase,
)
from rollq.workers.context import EpisodeContext, stats_tracker, workflow_context
from rollq.workers.rewards.processes import AsyncRewardWrapper


class RolloutWorkflow(abc.ABC):
    """AReaL's base class (`areal.api.workflow_api.RolloutWorkflow`). rollq needs no base class (anything with an
    `async def arun_episode(self, engine, data)` is a workflow); this one is here so AReaL code imports unchanged."""

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        """One episode: a trajectory (see rollq.workers.outputs), a list of them, or None to reject the sample."""


class AgentWorkflow(abc.ABC):
    """AReaL's (deprecated there) base class of agents: any class with `async def run(self, data, **extra_kwargs)`
    returning a reward or {completion_id: reward} is an agent; this one is here so AReaL code imports unchanged."""

    @abc.abstractmethod
    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> dict[str, float] | float:
        """One episode against the proxy at extra_kwargs["base_url"] with extra_kwargs["api_key"]."""


WorkflowContext = EpisodeContext  # what AReaL's workflow_context.get() returns is called WorkflowContext there
# What AReaL accepts where a workflow is named: a workflow, its class, an import path, or an agent object.
WorkflowLike = RolloutWorkflow | type[RolloutWorkflow] | str | Any

__all__ = [
    "AgentWorkflow",
    "ArealOpenAI",
    "AsyncRewardWrapper",
    "GenerationHyperparameters",
    "InferenceEngine",
    "InteractionWithTokenLogpReward",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "WorkflowContext",
    "WorkflowLike",
    "apply_chat_template",
    "atrace_session_phase",
    "image2base64",
    "import_from_string",
    "load_hf_tokenizer",
    "logging",
    "session_context",
    "stats_tracker",
    "trace_session",
    "trace_session_phase",
    "workflow_context",
]
