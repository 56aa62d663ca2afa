"""A job's workflow name -> a ready workflow object, built once per (path, kwargs, agent options) per process.

Imports go through `rollq.workers.resolver` (the allowlist)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from typing import Any

import msgspec

from rollq.engine.types import InferenceEngine
from rollq.protocol.messages import AgentOptions
from rollq.workers.agents.command import is_command
from rollq.workers.builtin import BUILTIN_WORKFLOWS, resolve_agent_name
from rollq.workers.construct import KwargConverter
from rollq.workers.environments.naming import is_environment
from rollq.workers.resolver import ImportNotAllowed, WorkflowLoadError, active_allowlist, resolve

log = logging.getLogger("rollq.worker")


def workflow_path(workflow: str, data: Any) -> str:
    """The import path a job runs: its data's `agent_name` picks a built-in loop (verl's convention), a short
    built-in name stands for its class, `exec:PROGRAM ARGS...` a command agent, `verifiers:ENV_ID` / `openenv:NAME`
    an environment, anything else is an import path."""
    agent = data.get("agent_name") if isinstance(data, dict) else None
    if agent:
        try:
            return resolve_agent_name(str(agent))
        except ValueError as exc:
            raise WorkflowLoadError(str(exc)) from None
    return BUILTIN_WORKFLOWS.get(workflow, workflow)


class FunctionWorkflow:
    """Adapts `async def fn(engine, data)` to the RolloutWorkflow shape."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> Any:
        return await self.fn(engine, data)


class WorkflowCache:
    def __init__(self, converter: KwargConverter | None = None) -> None:
        self._instances: dict[tuple[str, str, str, AgentOptions | None, tuple[str, ...] | None], Any] = {}
        self.converter = converter or KwargConverter()  # a job's JSON kwargs -> constructor arguments

    def get(
        self,
        path: str,
        kwargs: dict[str, Any] | None,
        agent: AgentOptions | None = None,
        allow: list[str] | None = None,
        *,
        optional: dict[str, Any] | None = None,
    ) -> Any:
        """The workflow for (path, kwargs, agent options), built under the active allowlist once per job patterns
        `allow` (Job.allow): an instance built for one tenant is never handed to a job of narrower patterns.
        `optional` (Job.optional_kwargs) go over `kwargs` where the workflow's constructor names them."""
        key = (path, _key(kwargs), _key(optional), agent, _patterns(allow))
        wf = self._instances.get(key)
        if wf is None:
            wf = self._instances[key] = self._build(path, kwargs or {}, agent, optional or {})
        return wf

    async def close(self) -> None:
        """Give every workflow that has `async def aclose(self)` the chance to release what it holds (reward
        process pools, clients)."""
        instances, self._instances = list(self._instances.values()), {}
        closers = [wf.aclose() for wf in instances if inspect.iscoroutinefunction(getattr(wf, "aclose", None))]
        for result in await asyncio.gather(*closers, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("closing a workflow failed: %s: %s", type(result).__name__, result)

    def _build(self, path: str, kwargs: dict[str, Any], agent: AgentOptions | None, optional: dict[str, Any]) -> Any:
        from rollq.workers.agents.runner import AgentWorkflow, is_agent  # the agent stack loads only when used

        if is_command(path):
            return _command_workflow(path, kwargs, agent)
        if is_environment(path):
            return _environment_workflow(path, kwargs, agent)
        obj = resolve(path)
        kwargs = {**kwargs, **accepted_kwargs(obj, optional)}
        if is_agent(obj):
            if inspect.isclass(obj) and (agent is None or agent.mode == "inline"):
                obj = self._construct(obj, path, kwargs)  # subproc mode builds it in the child instead
            elif not inspect.isclass(obj) and kwargs:
                raise WorkflowLoadError(f"agent {path!r} is not a class, so it takes no workflow_kwargs")
            return AgentWorkflow(obj, path, kwargs, agent)
        if inspect.isclass(obj):
            obj = self._construct(obj, path, kwargs)
        elif kwargs:
            raise WorkflowLoadError(f"workflow {path!r} is not a class, so it takes no workflow_kwargs")
        if inspect.iscoroutinefunction(obj):
            return FunctionWorkflow(obj)
        if not inspect.iscoroutinefunction(getattr(obj, "arun_episode", None)):
            raise WorkflowLoadError(
                f"workflow {path!r} has neither 'async def arun_episode(self, engine, data)' nor an agent's "
                f"'async def run(self, data, **extra_kwargs)' (got {type(obj).__name__})"
            )
        return obj

    def _construct(self, cls: Any, path: str, kwargs: dict[str, Any]) -> Any:
        try:
            return cls(**self.converter.convert(cls, kwargs))
        except ImportNotAllowed:
            raise  # a kwarg named a path outside the allowlist: say so as it is
        except WorkflowLoadError:
            raise  # a kwarg the converter refused, with its reason
        except Exception as exc:
            raise WorkflowLoadError(f"cannot construct workflow {path!r}: {type(exc).__name__}: {exc}") from None


def accepted_kwargs(obj: Any, optional: dict[str, Any]) -> dict[str, Any]:
    """Those of `optional` that class `obj`'s constructor names as parameters (a `**kwargs` catch-all does not
    count: it may hand them to anything); none for a function or an object."""
    if not optional or not inspect.isclass(obj):
        return {}
    try:
        parameters = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return {}
    named = {
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in optional.items() if k in named}


def _key(kwargs: dict[str, Any] | None) -> str:
    return json.dumps(kwargs, sort_keys=True, default=str) if kwargs else ""


def _patterns(allow: list[str] | None) -> tuple[str, ...] | None:
    return None if allow is None else tuple(allow)


def _command_workflow(path: str, kwargs: dict[str, Any], agent: AgentOptions | None) -> Any:
    """`exec:PROGRAM ARGS...`: a command agent (rollq.workers.agents.command), after the allowlist allowed PROGRAM.

    Its only workflow_kwarg is `env`, variables added to its minimal environment, each allowed by an `env:NAME`
    pattern (a job that sets a command's environment freely, PATH, LD_PRELOAD..., could run what the allowlist
    refused); fixed arguments belong in the command line, per-sample inputs in the job's data (the program's stdin).
    Its mode is always its own process: `mode: subproc` is accepted and means the same."""
    from rollq.workers.agents.command import command_agent
    from rollq.workers.agents.runner import AgentWorkflow

    command = command_agent(path, kwargs, active_allowlist())
    if agent is not None and agent.mode != "inline":
        agent = msgspec.structs.replace(agent, mode="inline")  # the command is its own process already
    return AgentWorkflow(command, path, None, agent)


def _environment_workflow(path: str, kwargs: dict[str, Any], agent: AgentOptions | None) -> Any:
    """`verifiers:ENV_ID` / `openenv:NAME`: an environment (rollq.workers.environments), after the allowlist allowed
    it, run by the interpreter the worker's settings name. Like a command agent, it is always its own process."""
    from rollq.workers.agents.runner import AgentWorkflow
    from rollq.workers.context import workflow_context
    from rollq.workers.environments.agent import EnvironmentAgent
    from rollq.workers.environments.naming import parse_environment
    from rollq.workers.environments.settings import EnvironmentSettings

    env = parse_environment(path)
    allowlist = active_allowlist()
    if allowlist is not None:
        allowlist.check_environment(env.kind, env.name)
    try:
        settings = workflow_context().config.environments
    except RuntimeError:  # no worker around (a script, a test): nothing configured
        settings = EnvironmentSettings()
    if agent is not None and agent.mode != "inline":
        agent = msgspec.structs.replace(agent, mode="inline")  # the driver is its own process already
    return AgentWorkflow(EnvironmentAgent(env, kwargs, settings, allowlist), path, None, agent)
