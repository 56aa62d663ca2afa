"""What a subproc-mode agent episode runs in its pooled child process.

The agent sees the proxy through the environment (OPENAI_BASE_URL / OPENAI_API_KEY, and the ANTHROPIC_ pair), as an
unmodified script would; it may be synchronous. A child runs one episode at a time, so setting the environment per
call is safe.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import numbers
import os
from typing import Any


@functools.lru_cache(maxsize=32)
def _agent(path: str, kwargs_json: str) -> Any:
    from workers.loader import resolve  # imported in the child, after the pool started it

    obj = resolve(path)
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


def run_agent(path: str, kwargs_json: str, data: Any, urls: dict[str, str], api_key: str) -> Any:
    os.environ.update({
        "OPENAI_BASE_URL": urls["base_url"], "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": urls["anthropic_base_url"], "ANTHROPIC_API_KEY": api_key,
    })
    agent = _agent(path, kwargs_json)
    offered = {"base_url": urls["base_url"], "anthropic_base_url": urls["anthropic_base_url"], "api_key": api_key}
    result = agent.run(data, **extra_kwargs_for(agent.run, offered))
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def agent_result(value: Any) -> tuple[str, Any] | None:
    """Runs in the child: what may cross back ("none" | "reward" | "rewards"), or None for anything else."""
    if value is None:
        return ("none", None)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                return None
            out[str(k)] = float(v)
        return ("rewards", out)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return None
    return ("reward", float(value))


__all__ = ["agent_result", "extra_kwargs_for", "run_agent"]
