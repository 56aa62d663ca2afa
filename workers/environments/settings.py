"""The worker's `environments` settings: which interpreters run verifiers and OpenEnv environments and which OpenEnv
servers jobs may name. Declared once here, as fields of WorkerConfig (rollq.workers.config, the help group
"environments") and as EnvironmentSettings, what the worker hands its workflows (ContextConfig.environments)."""

from __future__ import annotations

import os
from typing import Annotated

import msgspec

from rollq.config import setting
from rollq.workers.environments.naming import OPENENV_NAME
from rollq.workers.resolver import WorkflowLoadError

GROUP = "environments"

VerifiersPython = Annotated[
    str,
    setting(
        "the Python of the virtualenv holding verifiers and the environments jobs may name (`verifiers:ENV_ID`, "
        "each allowed by a `verifiers:` pattern); empty: verifiers jobs are refused",
        metavar="PYTHON",
        group=GROUP,
    ),
]
OpenenvPython = Annotated[
    str,
    setting(
        "the Python of the virtualenv holding openenv (its client side, for `openenv:NAME` jobs); empty: OpenEnv "
        "jobs are refused",
        metavar="PYTHON",
        group=GROUP,
    ),
]
OpenenvServers = Annotated[
    dict[str, str],
    setting(
        "the OpenEnv servers jobs may name (`openenv:NAME`, each allowed by an `openenv:` pattern): NAME -> the "
        "http(s):// URL of a server the operator runs, or a command line that starts one, `{port}` replaced by a "
        "free loopback port (run as agents are). Only these settings name servers, never a job",
        metavar="{NAME: URL_OR_COMMAND}",
        group=GROUP,
    ),
]


class EnvironmentSettings(msgspec.Struct, kw_only=True, frozen=True):
    """What a worker's environment jobs run with (its settings of the same names)."""

    verifiers_python: VerifiersPython = ""
    openenv_python: OpenenvPython = ""
    openenv_servers: OpenenvServers = {}

    def __post_init__(self) -> None:
        for name, server in self.openenv_servers.items():
            if not OPENENV_NAME.match(name):
                raise ValueError(
                    f"openenv_servers: {name!r} is not a server name (letters, digits and _ . @ / -, starting with a "
                    "letter or digit)"
                )
            if not server.strip():
                raise ValueError(f"openenv_servers: {name!r} names no URL or command")

    def virtualenvs(self) -> list[str]:
        """The virtualenvs of the interpreters set (a python's `bin/..`): the code every episode of their
        environments runs, which agents must not be able to change (rollq.workers.agents.writable)."""
        pythons = [p for p in (self.verifiers_python, self.openenv_python) if p]
        return list(dict.fromkeys(os.path.dirname(os.path.dirname(os.path.abspath(p))) for p in pythons))

    def python(self, kind: str) -> str:
        """The interpreter of `kind`'s environments; WorkflowLoadError naming the setting when it is unset."""
        setting_name = f"{kind}_python"
        python = str(getattr(self, setting_name, ""))
        if not python:
            raise WorkflowLoadError(
                f"this worker runs no {kind} environments: its {setting_name} setting is empty (the operator sets it "
                f"to the Python of a virtualenv holding {kind}: --{setting_name.replace('_', '-')} PATH)"
            )
        return python

    def server(self, name: str) -> str:
        """The URL or command of OpenEnv server `name`; WorkflowLoadError naming the setting when none is listed."""
        server = self.openenv_servers.get(name)
        if server is None:
            listed = ", ".join(sorted(self.openenv_servers)) or "none"
            raise WorkflowLoadError(
                f"openenv:{name}: this worker's openenv_servers setting lists no server {name!r} (it lists: {listed})"
            )
        return server


__all__ = ["GROUP", "EnvironmentSettings", "OpenenvPython", "OpenenvServers", "VerifiersPython"]
