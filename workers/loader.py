"""Resolves a job's workflow import path to a workflow object, once per (path, kwargs) per process."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
from typing import Any

from protocol.messages import AgentOptions
from workers.builtin import BUILTIN_WORKFLOWS, resolve_agent_name

log = logging.getLogger("rollq.worker")


class WorkflowLoadError(Exception):
    """The import path does not name a usable workflow. Deterministic: the job is dead-lettered at once."""


def split_import_path(path: str) -> tuple[str, str]:
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise WorkflowLoadError(f"workflow {path!r} is not an import path like 'package.module:Class' or 'package.module.Class'")
    return module, attr


def resolve(path: str) -> Any:
    module_name, attr_path = split_import_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import can raise anything
        raise WorkflowLoadError(f"cannot import module {module_name!r} for workflow {path!r}: {type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WorkflowLoadError(f"module {module_name!r} has no attribute {attr_path!r} (workflow {path!r})") from None
    return obj


def workflow_path(workflow: str, data: Any) -> str:
    """The import path a job runs: its data's `agent_name` picks a built-in loop (verl's convention), a short
    built-in name stands for its class, anything else is an import path."""
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

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        return await self.fn(engine, data)


class WorkflowCache:
    def __init__(self) -> None:
        self._instances: dict[tuple[str, str, AgentOptions | None], Any] = {}

    def get(self, path: str, kwargs: dict[str, Any] | None, agent: AgentOptions | None = None) -> Any:
        key = (path, json.dumps(kwargs, sort_keys=True, default=str) if kwargs else "", agent)
        wf = self._instances.get(key)
        if wf is None:
            wf = self._instances[key] = self._build(path, kwargs or {}, agent)
        return wf

    async def close(self) -> None:
        """Give every workflow that has `async def aclose(self)` the chance to release what it holds (reward
        process pools, clients)."""
        instances, self._instances = list(self._instances.values()), {}
        closers = [wf.aclose() for wf in instances if inspect.iscoroutinefunction(getattr(wf, "aclose", None))]
        for result in await asyncio.gather(*closers, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("closing a workflow failed: %s: %s", type(result).__name__, result)

    @staticmethod
    def _build(path: str, kwargs: dict[str, Any], agent: AgentOptions | None) -> Any:
        from workers.agents.runner import AgentWorkflow, is_agent  # the agent stack loads only when used

        obj = resolve(path)
        if is_agent(obj):
            if inspect.isclass(obj) and (agent is None or agent.mode == "inline"):
                obj = _construct(obj, path, kwargs)  # subproc mode builds it in the child instead
            elif not inspect.isclass(obj) and kwargs:
                raise WorkflowLoadError(f"agent {path!r} is not a class, so it takes no workflow_kwargs")
            return AgentWorkflow(obj, path, kwargs, agent)
        if inspect.isclass(obj):
            obj = _construct(obj, path, kwargs)
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


def _construct(cls: Any, path: str, kwargs: dict[str, Any]) -> Any:
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise WorkflowLoadError(f"cannot construct workflow {path!r}: {type(exc).__name__}: {exc}") from None
