"""How a job names an environment (the workflow field, part of the wire contract): `verifiers:ENV_ID`, the id of a
verifiers environment installed in the workers' verifiers virtualenv (`my-env`), or `openenv:NAME`, a name the
operator gave an OpenEnv server in the workers' `openenv_servers`. The workers run them (rollq.workers.environments);
the ingress checks them against tenants' patterns as written.

A verifiers id is the installed package's name and nothing else. verifiers imports an environment by
`name.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()` (verifiers 0.4.0, verifiers/v1/utils/loaders.py
_import_plugin), so a Hub id's owner and version (`owner/my-env@0.1`) choose nothing: a pattern over them
(`verifiers:trusted/*`) would allow whatever package the last part names. rollq takes only names that verifiers
imports as written: lowercase letters, digits, `-` and `_`, no `/`, `@` or `.` (a dotted name imports a submodule
of any package)."""

from __future__ import annotations

import re

VERIFIERS_PREFIX = "verifiers:"
OPENENV_PREFIX = "openenv:"
# verifiers: the package name verifiers imports, as written (see above). No leading `-` (the drivers take the name
# as an argument).
VERIFIERS_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,127}\Z")
# openenv: a key of the operator's openenv_servers, looked up as written. Shell-safe, no whitespace or control
# characters, no leading `-`.
OPENENV_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@/-]{0,127}\Z")


def is_environment(workflow: str) -> bool:
    return workflow.startswith((VERIFIERS_PREFIX, OPENENV_PREFIX))


# Each kind's prefix, its names, and what a name of it is (said when a name does not match).
KINDS = (
    (
        VERIFIERS_PREFIX,
        VERIFIERS_NAME,
        "a verifiers environment id (the installed package's name: 1-128 lowercase letters, digits, - and _, starting "
        "with a letter or digit; no Hub owner or @version, which verifiers ignores when it imports an environment)",
    ),
    (
        OPENENV_PREFIX,
        OPENENV_NAME,
        "an OpenEnv server name (1-128 characters: letters, digits and _ . @ / -, starting with a letter or digit)",
    ),
)


def environment_name_problem(workflow: str) -> str | None:
    """Why `workflow` (`verifiers:ENV_ID` / `openenv:NAME`) is no environment name, or None when it is one."""
    for prefix, pattern, what in KINDS:
        if workflow.startswith(prefix):
            name = workflow[len(prefix) :]
            return None if pattern.match(name) else f"workflow {workflow!r}: {name!r} is not {what}"
    return f"workflow {workflow!r} names no environment: write 'verifiers:ENV_ID' or 'openenv:NAME'"


__all__ = [
    "OPENENV_NAME",
    "OPENENV_PREFIX",
    "VERIFIERS_NAME",
    "VERIFIERS_PREFIX",
    "environment_name_problem",
    "is_environment",
]
