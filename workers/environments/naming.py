"""A job's workflow naming an environment, parsed for the worker: `verifiers:ENV_ID` or `openenv:NAME` (the syntax is
the wire contract's, rollq.protocol.environments)."""

from __future__ import annotations

from typing import Literal

import msgspec

from rollq.protocol.environments import (
    OPENENV_NAME,
    OPENENV_PREFIX,
    VERIFIERS_NAME,
    VERIFIERS_PREFIX,
    environment_name_problem,
    is_environment,
)
from rollq.workers.resolver import WorkflowLoadError

EnvironmentKind = Literal["verifiers", "openenv"]


class EnvironmentName(msgspec.Struct, frozen=True):
    kind: EnvironmentKind
    name: str

    @property
    def workflow(self) -> str:
        """As a job writes it: `verifiers:my-env`."""
        return f"{self.kind}:{self.name}"


def parse_environment(workflow: str) -> EnvironmentName:
    """`verifiers:ENV_ID` / `openenv:NAME` -> its kind and name; WorkflowLoadError for a malformed one."""
    problem = environment_name_problem(workflow)
    if problem is not None:
        raise WorkflowLoadError(problem)
    kind: EnvironmentKind = "verifiers" if workflow.startswith(VERIFIERS_PREFIX) else "openenv"
    return EnvironmentName(kind, workflow.partition(":")[2])


__all__ = [
    "OPENENV_NAME",
    "OPENENV_PREFIX",
    "VERIFIERS_NAME",
    "VERIFIERS_PREFIX",
    "EnvironmentKind",
    "EnvironmentName",
    "is_environment",
    "parse_environment",
]
