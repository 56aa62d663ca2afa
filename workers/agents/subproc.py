"""What a subproc-mode agent episode runs in its pooled child process.

The agent sees the proxy through the environment (OPENAI_BASE_URL / OPENAI_API_KEY, and the ANTHROPIC_ pair), as an
unmodified script would; it may be synchronous. A child runs one episode at a time, so setting the environment per
call is safe. The child inherited the worker's environment (through the fork server): the worker's secrets (ROLLQ_*,
REDIS*) are removed from it before any agent code runs (rollq.workers.agents.environment). Each episode works in a
fresh folder of its own, never the worker's working directory; with the worker's agent_user the child switches to
that user before any agent code runs (rollq.workers.agents.agent_user).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
from typing import Any

from rollq.workers.agents.agent_user import enter_folder, parse_agent_user
from rollq.workers.agents.environment import drop_worker_secrets, proxy_variables
from rollq.workers.resolver import Allowlist, resolve
from rollq.workers.rewards.values import as_reward


@functools.lru_cache(maxsize=32)
def _agent(path: str, kwargs_json: str, allowlist: Allowlist | None) -> Any:
    obj = resolve(path, allowlist=allowlist)  # the worker's allowlist, checked again in the child
    return obj(**json.loads(kwargs_json)) if inspect.isclass(obj) else obj


def extra_kwargs_for(run: Any, offered: dict[str, Any]) -> dict[str, Any]:
    """The offered keyword arguments `run` accepts (all of them when it takes **kwargs)."""
    try:
        params = inspect.signature(run).parameters.values()
    except (TypeError, ValueError):
        return offered
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return offered
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}


def run_agent(
    path: str,
    kwargs_json: str,
    data: Any,
    urls: dict[str, str],
    api_key: str,
    allowlist: Allowlist | None = None,
    workdir: str = "",
    agent_user: str = "",
) -> Any:
    """One episode in this pooled child: as `agent_user` ("UID:GID", for good: the pool runs only agents) and in
    `workdir`, a folder created here for the episode (the worker removes it after), then the previous working
    directory again."""
    drop_worker_secrets(os.environ)  # before the agent is even imported
    os.environ.update(proxy_variables(urls["base_url"], api_key, urls["anthropic_base_url"]))
    previous = os.getcwd()
    if workdir:
        enter_folder(workdir, parse_agent_user(agent_user))
    try:
        agent = _agent(path, kwargs_json, allowlist)
        offered = {"base_url": urls["base_url"], "anthropic_base_url": urls["anthropic_base_url"], "api_key": api_key}
        result = agent.run(data, **extra_kwargs_for(agent.run, offered))
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        return result
    finally:
        try:
            os.chdir(previous)
        except OSError:  # the agents' user may not enter the worker's folder
            os.chdir("/")


async def _await(awaitable: Any) -> Any:
    return await awaitable


def agent_result(value: Any) -> tuple[str, Any] | None:
    """Runs in the child: what may cross back ("none" | "reward" | "rewards"), or None for anything else."""
    if value is None:
        return ("none", None)
    if isinstance(value, dict):
        out = {str(k): as_reward(v) for k, v in value.items()}
        return None if None in out.values() else ("rewards", out)
    reward = as_reward(value)
    return None if reward is None else ("reward", reward)


__all__ = ["agent_result", "extra_kwargs_for", "run_agent"]
