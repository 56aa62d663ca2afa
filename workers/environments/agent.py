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
worker process's life (rollq.workers.context WorkflowContext.environment_checks).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

from rollq.workers.agents.command import CommandAgent, CommandError
from rollq.workers.agents.environment import command_options
from rollq.workers.context import workflow_context
from rollq.workers.environments import openenv_driver, verifiers_driver
from rollq.workers.environments.naming import EnvironmentName
from rollq.workers.environments.settings import EnvironmentSettings
from rollq.workers.resolver import Allowlist, WorkflowLoadError

DRIVERS = Path(__file__).resolve().parent
CHECK_TIMEOUT_S = 120.0  # importing an environment's package (and verifiers with it) takes seconds, not minutes
CHECK_FAILED = verifiers_driver.CHECK_FAILED  # the drivers' exit status for "cannot load this environment"
# The workflow_kwargs each kind takes (the drivers check their values): anything else is refused before a run.
KWARGS = {
    "verifiers": frozenset({"sampling", "env_args", "env"}),
    "openenv": frozenset({"sampling", "max_turns", "system_prompt", "env"}),
}
# The drivers' own limits (they are modules of this package too, importing only the standard library at the top):
# what the worker can check before anything runs, it checks the same way.
INVALID_JOB = verifiers_driver.INVALID_JOB  # the drivers' exit status for "this job's own values are wrong"
MAX_TURNS_LIMIT = openenv_driver.MAX_TURNS_LIMIT
# The sampling settings a job may give: the rest of a model request (its messages, tools, model) is the
# environment's, and both verifiers and the OpenEnv driver would pass any other key into it.
SAMPLING_KEYS = {"verifiers": verifiers_driver.SAMPLING_KEYS, "openenv": openenv_driver.SAMPLING_KEYS}

_UNCHECKED = object()  # an agent's verdict before its first check ran


def driver_path(kind: str) -> Path:
    return DRIVERS / f"{kind}_driver.py"


class EnvironmentAgent:
    """Runs one episode of environment `env` per call (an inline agent: `async def run(...)`)."""

    def __init__(
        self,
        env: EnvironmentName,
        kwargs: dict[str, Any],
        settings: EnvironmentSettings,
        allowlist: Allowlist | None = None,
    ) -> None:
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
        other = sorted(set(kwargs.get("sampling") or {}) - SAMPLING_KEYS[env.kind])
        if other:
            raise WorkflowLoadError(
                f"{env.workflow}: workflow_kwargs sampling may not set {', '.join(other)} (it takes "
                f"{', '.join(sorted(SAMPLING_KEYS[env.kind]))}: the rest of a model request is the environment's)"
            )
        if env.kind == "openenv":
            _check_openenv_kwargs(env, kwargs)
        # `env`: variables for the driver (and a server it starts), each allowed by an `env:NAME` pattern, as a
        # command agent's (rollq.workers.agents.environment); the driver never sees them as kwargs.
        variables = command_options({"env": kwargs["env"]}, allowlist).env if "env" in kwargs else {}
        self.kwargs = {k: v for k, v in kwargs.items() if k != "env"}
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
        self.command = CommandAgent([python, self.driver], env.workflow, executable=found, env=variables)
        self._own_checks: dict[tuple[str, str, str], Any] = {}  # outside a worker: its checks' verdicts
        self._check = CommandAgent(
            [python, self.driver, "--check", env.name], f"{env.workflow} --check", executable=found, reads_result=False
        )

    async def run(self, data: Any, base_url: str, api_key: str, anthropic_base_url: str) -> Any:
        await self.checked(base_url, api_key, anthropic_base_url)
        payload: dict[str, Any] = {"name": self.env.name, "kwargs": self.kwargs, "data": data}
        if self.server is not None:
            payload["server"] = self.server
        try:
            return await self.command.run(payload, base_url, api_key, anthropic_base_url)
        except CommandError as exc:
            if exc.code != INVALID_JOB:
                raise
            raise WorkflowLoadError(
                f"{self.env.workflow}: the job does not fit the environment: {_last_line(exc)}"
            ) from None

    async def checked(self, base_url: str, api_key: str, anthropic_base_url: str) -> None:
        """Whether the driver can load the environment, asked once per worker process (the workflow context's
        `environment_checks`; concurrent first episodes wait for one check); WorkflowLoadError quoting the driver
        when it cannot."""
        try:
            checks = workflow_context().environment_checks
        except RuntimeError:  # no worker around (a script, a test): this agent's own
            checks = self._own_checks
        key = (self.python, self.driver, self.env.name)
        verdict = checks.get(key, _UNCHECKED)
        if verdict is _UNCHECKED:
            running = checks[key] = asyncio.ensure_future(self._run_check(base_url, api_key, anthropic_base_url))
            try:
                verdict = checks[key] = await asyncio.shield(running)
            except BaseException:
                if checks.get(key) is running:
                    del checks[key]  # a crash or no answer is kept by nobody: a later episode asks again
                raise
        elif isinstance(verdict, asyncio.Future):
            verdict = await asyncio.shield(verdict)
        if isinstance(verdict, str):
            raise WorkflowLoadError(verdict)

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
            return f"{self.env.workflow} cannot be loaded by {self.python}: {_last_line(exc)}"
        return None


def _last_line(exc: CommandError) -> str:
    """The driver's own message: the last line it wrote on stderr."""
    lines = exc.stderr.strip().splitlines()
    return lines[-1] if lines else "(it said nothing on stderr)"


def _check_openenv_kwargs(env: EnvironmentName, kwargs: dict[str, Any]) -> None:
    """What openenv_driver.py would refuse, refused before anything runs (a dead letter at once, not retries)."""
    max_turns = kwargs.get("max_turns", 1)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 1 <= max_turns <= MAX_TURNS_LIMIT:
        raise WorkflowLoadError(
            f"{env.workflow}: workflow_kwargs max_turns must be a whole number from 1 to {MAX_TURNS_LIMIT}, "
            f"not {max_turns!r}"
        )
    if not isinstance(kwargs.get("system_prompt", ""), str):
        raise WorkflowLoadError(f"{env.workflow}: workflow_kwargs system_prompt must be a string")


__all__ = ["CHECK_TIMEOUT_S", "DRIVERS", "KWARGS", "EnvironmentAgent", "driver_path"]
