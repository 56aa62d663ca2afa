"""AReaL's workflow API under rollq's names: what `areal.api` (and `areal.infra.workflow_context`) give a workflow
or agent file. Bring AReaL code over by changing only the imports:

    from areal.api import AsyncRewardWrapper, InferenceEngine, ModelRequest, ModelResponse, RolloutWorkflow
    from areal.api.cli_args import GenerationHyperparameters
    from areal import workflow_context
->
    from rollq.workers.api import (AsyncRewardWrapper, GenerationHyperparameters, InferenceEngine, ModelRequest,
                                   ModelResponse, RolloutWorkflow, workflow_context)

(`from rollq.workers import workflow_context` works too.) What `arun_episode` may return is in rollq.workers.outputs:
AReaL's `[1, L]` tensor dict, the `{"input_ids", "output_ids", "reward"}` template, or rollq's own mapping.
"""

from __future__ import annotations

import abc
from typing import Any

from rollq.engine.types import GenerationHyperparameters, InferenceEngine, ModelRequest, ModelResponse
from rollq.workers.context import EpisodeContext, workflow_context
from rollq.workers.rewards.processes import AsyncRewardWrapper


class RolloutWorkflow(abc.ABC):
    """AReaL's base class (`areal.api.workflow_api.RolloutWorkflow`). rollq needs no base class (anything with an
    `async def arun_episode(self, engine, data)` is a workflow); this one is here so AReaL code imports unchanged."""

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        """One episode: a trajectory (see rollq.workers.outputs), a list of them, or None to reject the sample."""


WorkflowContext = EpisodeContext  # what AReaL's workflow_context.get() returns is called WorkflowContext there

__all__ = [
    "AsyncRewardWrapper",
    "GenerationHyperparameters",
    "InferenceEngine",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "WorkflowContext",
    "workflow_context",
]
