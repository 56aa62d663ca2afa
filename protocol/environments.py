"""How a job names an environment (the workflow field, part of the wire contract): `verifiers:ENV_ID`, a verifiers
environment id as `vf-eval` takes it (`my-env`, `owner/my-env@0.1`), or `openenv:NAME`, a name the operator gave an
OpenEnv server in the workers' `openenv_servers`. The workers run them (rollq.workers.environments); the ingress checks
them against tenants' patterns as written."""

from __future__ import annotations

import re

VERIFIERS_PREFIX = "verifiers:"
OPENENV_PREFIX = "openenv:"
# Shell-safe, no whitespace or control characters, no leading `-` (the drivers take it as an argument).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@/-]{0,127}\Z")


def is_environment(workflow: str) -> bool:
    return workflow.startswith((VERIFIERS_PREFIX, OPENENV_PREFIX))


def environment_name_problem(workflow: str) -> str | None:
    """Why `workflow` (`verifiers:ENV_ID` / `openenv:NAME`) is no environment name, or None when it is one."""
    for prefix in (VERIFIERS_PREFIX, OPENENV_PREFIX):
        if workflow.startswith(prefix):
            name = workflow[len(prefix) :]
            if NAME_PATTERN.match(name):
                return None
            return (
                f"workflow {workflow!r}: {name!r} is not an environment name (1-128 characters: letters, digits and "
                "_ . @ / -, starting with a letter or digit)"
            )
    return f"workflow {workflow!r} names no environment: write 'verifiers:ENV_ID' or 'openenv:NAME'"


__all__ = ["NAME_PATTERN", "OPENENV_PREFIX", "VERIFIERS_PREFIX", "environment_name_problem", "is_environment"]
