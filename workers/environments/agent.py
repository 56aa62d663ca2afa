"""EnvironmentAgent: the command agent a job's `verifiers:ENV_ID` / `openenv:NAME` becomes.

Its program is fixed by the operator: the environment's interpreter (the `verifiers_python` / `openenv_python`
setting) running rollq's driver for that kind (this folder's `<kind>_driver.py`). It runs as any command agent does
(rollq.workers.agents.command: a minimal environment without the worker's secrets, its own HOME, as agent_user, its
process group killed at the end), its stdin the payload

    {"name": ENV_ID or NAME, "kwargs": the job's workflow_kwargs, "data": the job's data,
     "server": the operator's URL or command (openenv only)}

and its last stdout line the episode's reward. Before the first episode of an agent (the worker builds one per
workflow and kwargs) the driver runs with `--check NAME` (bounded): a missing package or environment (exit 3) fails
the job as a WorkflowLoadError quoting the driver's message, dead-lettered at once; that verdict is kept for the
agent's life.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

from rollq.workers.agents.command import CommandAgent, CommandError
from rollq.workers.environments.naming import EnvironmentName
from rollq.workers.environments.settings import EnvironmentSettings
from rollq.workers.resolver import WorkflowLoadError

DRIVERS = Path(__file__).resolve().parent
CHECK_TIMEOUT_S = 120.0  # importing an environment's package (and verifiers with it) takes seconds, not minutes
CHECK_FAILED = 3  # the drivers' exit status for "cannot load this environment"
# The workflow_kwargs each kind takes (the drivers check their values): anything else is refused before a run.
KWARGS = {
    "verifiers": frozenset({"sampling", "env_args"}),
    "openenv": frozenset({"sampling", "max_turns", "system_prompt"}),
}

_UNCHECKED = object()  # an agent's verdict before its first check ran


def driver_path(kind: str) -> Path:
    return DRIVERS / f"{kind}_driver.py"


class EnvironmentAgent:
    """Runs one episode of environment `env` per call (an inline agent: `async def run(...)`)."""

    def __init__(self, env: EnvironmentName, kwargs: dict[str, Any], settings: EnvironmentSettings) -> None:
        self.env = env
        unknown = sorted(set(kwargs) - KWARGS[env.kind])
        if unknown:
            raise WorkflowLoadError(
                f"{env.workflow}: workflow_kwargs {', '.join(map(repr, unknown))} are not {env.kind} environment "
                f"options (it takes {', '.join(sorted(KWARGS[env.kind]))})"
            )
        for key in ("sampling", "env_args"):
            if key in kwargs and not isinstance(kwargs[key], dict):
                raise WorkflowLoadError(f"{env.workflow}: workflow_kwargs {key!r} must be a mapping")
        self.kwargs = dict(kwargs)
        python = settings.python(env.kind)
        found = shutil.which(python)
        if found is None or not os.path.isabs(python):
            raise WorkflowLoadError(
                f"{env.workflow}: the {env.kind}_python setting {python!r} is not an executable file given by its path"
            )
        self.python = python
        self.server = settings.server(env.name) if env.kind == "openenv" else None
        driver = driver_path(env.kind)
        if not driver.is_file():
            raise WorkflowLoadError(f"{env.workflow}: this rollq has no driver for {env.kind} environments ({driver})")
        self.driver = str(driver)
        self.command = CommandAgent([python, self.driver], env.workflow, executable=found)
        # The check's verdict, kept for the agent's life (the worker builds one agent per workflow and kwargs):
        # None when it loads, the driver's message when it cannot.
        self._verdict: object = _UNCHECKED
        self._check_lock: asyncio.Lock | None = None  # concurrent first episodes wait for one check
        self._check = CommandAgent(
            [python, self.driver, "--check", env.name], f"{env.workflow} --check", executable=found, reads_result=False
        )

    async def run(self, data: Any, base_url: str, api_key: str, anthropic_base_url: str) -> Any:
        await self.checked(base_url, api_key, anthropic_base_url)
        payload: dict[str, Any] = {"name": self.env.name, "kwargs": self.kwargs, "data": data}
        if self.server is not None:
            payload["server"] = self.server
        return await self.command.run(payload, base_url, api_key, anthropic_base_url)

    async def checked(self, base_url: str, api_key: str, anthropic_base_url: str) -> None:
        """Whether the driver can load the environment, asked once per agent (concurrent first episodes wait for
        one check); WorkflowLoadError quoting the driver when it cannot."""
        if self._verdict is _UNCHECKED:
            if self._check_lock is None:
                self._check_lock = asyncio.Lock()
            async with self._check_lock:
                if self._verdict is _UNCHECKED:
                    self._verdict = await self._run_check(base_url, api_key, anthropic_base_url)
        if isinstance(self._verdict, str):
            raise WorkflowLoadError(self._verdict)

    async def _run_check(self, base_url: str, api_key: str, anthropic_base_url: str) -> str | None:
        """None when it loads, the message when it cannot (kept); anything else (a crash, no answer in time)
        raises, kept by nobody, so a later episode asks again."""
        try:
            await asyncio.wait_for(self._check.run(None, base_url, api_key, anthropic_base_url), CHECK_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"{self.env.workflow}: `{self.python} {self.driver} --check` gave no answer in {CHECK_TIMEOUT_S:g}s"
            ) from None
        except CommandError as exc:
            if exc.code != CHECK_FAILED:
                raise
            said = exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else "(it said nothing on stderr)"
            return f"{self.env.workflow} cannot be loaded by {self.python}: {said}"
        return None


__all__ = ["CHECK_TIMEOUT_S", "DRIVERS", "KWARGS", "EnvironmentAgent", "driver_path"]
