"""A job's workflow naming an environment: `verifiers:ENV_ID` (a verifiers environment id as `vf-eval` takes it,
`my-env` or `owner/my-env@0.1`) or `openenv:NAME` (a name the operator gave an OpenEnv server in the worker's
`openenv_servers`)."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from rollq.workers.resolver import WorkflowLoadError

VERIFIERS_PREFIX = "verifiers:"
OPENENV_PREFIX = "openenv:"
# Shell-safe, no whitespace or control characters, no leading `-` (the drivers take it as an argument).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@/-]{0,127}\Z")

EnvironmentKind = Literal["verifiers", "openenv"]


class EnvironmentName(msgspec.Struct, frozen=True):
    kind: EnvironmentKind
    name: str

    @property
    def workflow(self) -> str:
        """As a job writes it: `verifiers:my-env`."""
        return f"{self.kind}:{self.name}"


def is_environment(workflow: str) -> bool:
    return workflow.startswith((VERIFIERS_PREFIX, OPENENV_PREFIX))


def parse_environment(workflow: str) -> EnvironmentName:
    """`verifiers:ENV_ID` / `openenv:NAME` -> its kind and name; WorkflowLoadError for a malformed one."""
    for prefix, kind in ((VERIFIERS_PREFIX, "verifiers"), (OPENENV_PREFIX, "openenv")):
        if workflow.startswith(prefix):
            name = workflow[len(prefix) :]
            if not NAME_PATTERN.match(name):
                raise WorkflowLoadError(
                    f"workflow {workflow!r}: {name!r} is not an environment name (1-128 characters: letters, digits "
                    "and _ . @ / -, starting with a letter or digit)"
                )
            return EnvironmentName(kind, name)  # type: ignore[arg-type]
    raise WorkflowLoadError(f"workflow {workflow!r} names no environment: write 'verifiers:ENV_ID' or 'openenv:NAME'")


__all__ = [
    "NAME_PATTERN",
    "OPENENV_PREFIX",
    "VERIFIERS_PREFIX",
    "EnvironmentKind",
    "EnvironmentName",
    "is_environment",
    "parse_environment",
]
