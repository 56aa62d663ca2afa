"""How a built-in workflow runs its reward function: inline, in killable child processes, or on reward workers.

- "inline": in the rollout worker (async functions on the loop, sync ones in a thread); cheapest, but a hung grader
  can't be stopped.
- "process": AsyncRewardWrapper; each call in a pooled child process, killed past `timeout` (RewardTimeout).
- "remote": RemoteReward; `rollq reward-worker --run RUN` processes elsewhere run it (same child-process timeout).

Every failure raises (RewardTimeout, RewardNotANumber, RewardError, or TypeError inline): the rollout worker retries
the job and then dead-letters it with the message. A failed reward is never turned into 0.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from typing import Any, overload

import msgspec

import rollq.tracing as tracing
from rollq.config import DEFAULT_RUN, ENV_PREFIX
from rollq.redis_client import redis_url_from_env
from rollq.workers.context import workflow_context
from rollq.workers.resolver import active_allowlist, resolve
from rollq.workers.rewards.processes import AsyncRewardWrapper
from rollq.workers.rewards.remote import RemoteReward
from rollq.workers.rewards.values import as_reward

REWARD_MODES = ("inline", "process", "remote")


@overload
def load_callable(spec: str | Callable[..., Any]) -> Callable[..., Any]: ...
@overload
def load_callable(spec: None) -> None: ...
def load_callable(spec: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    """An import path ("module:function") or the callable itself."""
    if spec is None or callable(spec):
        return spec
    fn = resolve(spec)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn


def reward_kwargs(fn: Callable[..., Any] | None, data: dict[str, Any]) -> dict[str, Any]:
    """`data` without the keys that name one of `fn`'s first four (positionally passed) parameters; a Python
    call would otherwise fail with "got multiple values". All of `data` when `fn` is unknown or not inspectable."""
    if fn is None:
        return dict(data)
    try:
        positional = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][:4]
    except (TypeError, ValueError):
        positional = []
    return {k: v for k, v in data.items() if k not in positional}


async def call_reward(
    fn: Callable[..., Any],
    prompt_text: str,
    completion_text: str,
    input_ids: list[int],
    output_ids: list[int],
    data: dict[str, Any],
) -> float:
    """`fn(prompt_text, completion_text, input_ids, output_ids, **data)`, sync (in a thread) or async -> float.

    Data keys that would collide with the first four parameters (whatever the function calls them, e.g. AReaL's
    `prompt`) are left out of the keyword arguments."""
    kwargs = reward_kwargs(fn, data)
    args = (prompt_text, completion_text, input_ids, output_ids)
    if inspect.iscoroutinefunction(fn):
        value = await fn(*args, **kwargs)
    else:
        value = await asyncio.to_thread(fn, *args, **kwargs)  # graders can be slow; keep the loop free
        if inspect.isawaitable(value):
            value = await value
    reward = as_reward(value)
    if reward is None:
        raise TypeError(f"reward function returned {value!r}, not a finite number")
    return reward


class RewardCallConfig(msgspec.Struct, kw_only=True, frozen=True):
    mode: str = "inline"
    timeout_seconds: float = 15.0  # process / remote: per call
    workers: int = 2  # process: child processes of this workflow instance
    run: str = ""  # remote: the run whose reward workers serve the calls ("" = the rollout worker's own run)

    def __post_init__(self) -> None:
        if self.mode not in REWARD_MODES:
            raise ValueError(f"reward_mode {self.mode!r} is not one of {', '.join(REWARD_MODES)}")
        if not self.timeout_seconds > 0:
            raise ValueError("reward_timeout must be > 0")
        if self.workers < 1:
            raise ValueError("reward_workers must be >= 1")


def import_path(fn: str | Callable[..., Any]) -> str:
    """The import path a reward worker can resolve, for a path or a module-level function."""
    if isinstance(fn, str):
        return fn
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not module or not qualname or "<" in qualname:  # <lambda>, <locals>: nothing another process can import
        raise ValueError(f"reward_mode='remote' needs an import path or a module-level function, got {fn!r}")
    return f"{module}:{qualname}"


def _worker_redis() -> tuple[str, str]:
    """The running worker's Redis URL and run; outside a worker, ROLLQ_REDIS_URL / ROLLQ_RUN or the defaults."""
    try:
        config = workflow_context().config
    except RuntimeError:
        return redis_url_from_env(), os.environ.get(f"{ENV_PREFIX}RUN") or DEFAULT_RUN
    return config.redis_url, config.run


class RewardCaller:
    """`await caller(prompt_text, completion_text, input_ids, output_ids, data) -> float`, in the configured mode."""

    def __init__(self, fn: str | Callable[..., Any], config: RewardCallConfig | None = None) -> None:
        self.config = config = config or RewardCallConfig()
        self._runner: AsyncRewardWrapper | RemoteReward | None = None
        self.fn: Callable[..., Any] | None  # None only in remote mode, for a function not importable here
        if config.mode == "remote":
            path = import_path(fn)
            allowlist = active_allowlist()
            if allowlist is not None:  # a tenant's job may hand the reward workers only what its patterns allow
                allowlist.check_within(path)
            # Imported here too when possible, only to drop data keys colliding with its positional parameters;
            # a function that exists only on the reward workers gets all of data as keyword arguments.
            try:
                self.fn = load_callable(fn)
            except Exception:
                self.fn = None
            redis_url, worker_run = _worker_redis()
            self._runner = RemoteReward(
                path, redis_url=redis_url, run=config.run or worker_run, timeout_seconds=config.timeout_seconds
            )
            return
        self.fn = load_callable(fn)  # resolved now: a bad path fails at construction (dead-letter)
        if config.mode == "process":
            if inspect.iscoroutinefunction(self.fn):
                raise ValueError("reward_mode='process' runs sync reward functions; use 'inline' for async ones")
            self._runner = AsyncRewardWrapper(
                self.fn, timeout_seconds=config.timeout_seconds, max_workers=config.workers, max_retries=0
            )

    async def __call__(
        self, prompt_text: str, completion_text: str, input_ids: list[int], output_ids: list[int], data: dict[str, Any]
    ) -> float:
        return await tracing.reward(
            self.config.mode, self._call(prompt_text, completion_text, input_ids, output_ids, data)
        )

    async def _call(
        self, prompt_text: str, completion_text: str, input_ids: list[int], output_ids: list[int], data: dict[str, Any]
    ) -> float:
        if self._runner is None:
            assert self.fn is not None  # inline mode: __init__ resolved it (a bad path raised there)
            return await call_reward(self.fn, prompt_text, completion_text, input_ids, output_ids, data)
        runner = self._runner.untraced if isinstance(self._runner, AsyncRewardWrapper) else self._runner
        return await runner(
            prompt_text, completion_text, list(input_ids), list(output_ids), **reward_kwargs(self.fn, data)
        )

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()


class RewardedWorkflow:
    """Base of the built-in loops: the reward parameters they all take (as workflow kwargs), in one place.

    `reward_fn`: import path or callable, `fn(prompt_text, completion_text, input_ids, output_ids, **data)`;
    `reward_mode`: inline | process | remote; `reward_timeout`: seconds per call (process / remote);
    `reward_workers`: child processes (process); `reward_run`: the run whose reward workers serve it (remote; default
    the rollout worker's own run)."""

    reward_required = True  # a loop that can do without a reward (0) says so

    def __init__(
        self,
        reward_fn: str | Callable[..., Any] | None = None,
        *,
        reward_mode: str = "inline",
        reward_timeout: float = 15.0,
        reward_workers: int = 2,
        reward_run: str = "",
    ) -> None:
        # Validated and resolved now: a bad mode or path fails at construction (the job is dead-lettered).
        config = RewardCallConfig(
            mode=reward_mode, timeout_seconds=reward_timeout, workers=reward_workers, run=reward_run
        )
        if reward_fn is None and self.reward_required:
            raise ValueError(f"{type(self).__name__} needs a reward_fn")
        self.reward = None if reward_fn is None else RewardCaller(reward_fn, config)
        self.reward_fn = None if self.reward is None else self.reward.fn

    async def score(
        self, prompt_text: str, completion_text: str, input_ids: list[int], output_ids: list[int], data: dict[str, Any]
    ) -> float:
        """The reward of one completion (0 without a reward function)."""
        if self.reward is None:
            return 0.0
        return await self.reward(prompt_text, completion_text, input_ids, output_ids, data)

    async def aclose(self) -> None:
        """Stops reward child processes / connections (process and remote modes)."""
        if self.reward is not None:
            await self.reward.close()


__all__ = [
    "REWARD_MODES",
    "RewardCallConfig",
    "RewardCaller",
    "RewardedWorkflow",
    "call_reward",
    "import_path",
    "load_callable",
    "reward_kwargs",
]
