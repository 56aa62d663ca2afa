"""The reward worker (`rollq reward-worker`): serves a run's remote reward calls from its arq queue.

Each call names a reward function by import path (checked against this worker's allowlist before anything is
imported); it runs in killable child processes (AsyncRewardWrapper), so a hanging grader is killed and reported as a
timeout without taking the reward worker down. The arq job never raises for a reward failure: it returns a tagged
result that rollq.workers.rewards.remote turns back into the exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

from arq.worker import func

from rollq.protocol.keys import RunKeys
from rollq.redis_client import TRANSIENT_ERRORS, arq_settings, redis_client, ride_out, safe_url
from rollq.workers.resolver import Allowlist, resolve
from rollq.workers.rewards.config import RewardWorkerConfig
from rollq.workers.rewards.processes import (
    STARTUP_TIMEOUT_S,
    AsyncRewardWrapper,
    RewardError,
    RewardNotANumber,
    RewardTimeout,
)
from rollq.workers.rewards.remote import COMPUTE_REWARD, MAX_TRIES, RESULT_TTL_S, RUN_MARGIN_S, WORKER_POLL_S

log = logging.getLogger("rollq.rewards")


class RewardFunctions:
    """One AsyncRewardWrapper per reward function import path, created on first use (lives in the arq ctx)."""

    def __init__(
        self,
        max_workers: int,
        timeout_seconds: float,
        allowlist: Allowlist | None = None,
        outcomes: Counter[str] | None = None,
    ) -> None:
        self.max_workers = max_workers
        self.timeout_seconds = timeout_seconds
        self.allowlist = allowlist or Allowlist()
        self.outcomes: Counter[str] = Counter() if outcomes is None else outcomes  # "ok" or the error type, per call
        self._wrappers: dict[str, AsyncRewardWrapper] = {}

    def get(self, fn_path: str) -> AsyncRewardWrapper:
        wrapper = self._wrappers.get(fn_path)
        if wrapper is None:
            try:
                fn = resolve(fn_path, allowlist=self.allowlist)
            except Exception as exc:  # WorkflowLoadError, or anything a module import raises
                raise RewardError(f"cannot load reward function {fn_path!r}: {exc}") from None
            if not callable(fn):
                raise RewardError(f"reward function {fn_path!r} is not callable (got {type(fn).__name__})")
            try:
                wrapper = AsyncRewardWrapper(fn, timeout_seconds=self.timeout_seconds, max_workers=self.max_workers)
            except TypeError as exc:  # not picklable by reference
                raise RewardError(str(exc)) from None
            self._wrappers[fn_path] = wrapper
        return wrapper

    async def close(self) -> None:
        wrappers, self._wrappers = list(self._wrappers.values()), {}
        await asyncio.gather(*(w.close() for w in wrappers))


async def compute_reward(ctx: dict[str, Any], fn_path: str, args: list[Any], kwargs: dict[str, Any]) -> dict:
    """The arq job: a tagged result, never an exception for a reward failure (so arq does not retry it)."""
    rewards: RewardFunctions = ctx["rewards"]
    try:
        value = await rewards.get(fn_path)(*args, **kwargs)
    except (RewardTimeout, RewardNotANumber, RewardError) as exc:
        rewards.outcomes[type(exc).__name__] += 1
        return {"error": type(exc).__name__, "message": str(exc), "traceback": getattr(exc, "remote_traceback", "")}
    rewards.outcomes["ok"] += 1
    return {"ok": value}


def worker_settings(cfg: RewardWorkerConfig, outcomes: Counter[str] | None = None) -> dict[str, Any]:
    """Keyword arguments for arq.worker.Worker serving run `cfg.run` (`outcomes` counts the calls' results)."""

    async def on_startup(ctx: dict[str, Any]) -> None:
        ctx["rewards"] = RewardFunctions(
            cfg.max_workers,
            cfg.timeout,
            Allowlist(
                patterns=tuple(cfg.allow), setting="--allow PATTERN (reward_worker.allow, ROLLQ_REWARD_WORKER_ALLOW)"
            ),
            outcomes,
        )

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        await ctx["rewards"].close()

    redis_settings = arq_settings(cfg.rewards_url)
    redis_settings.conn_retries = 0  # unreachable Redis at start: fail at once with rollq's one-line hint
    return {
        # arq's timeout is only a backstop behind the wrapper's (which also excludes the child's start-up).
        "functions": [
            func(
                compute_reward,
                name=COMPUTE_REWARD,
                max_tries=MAX_TRIES,
                timeout=cfg.timeout + STARTUP_TIMEOUT_S + RUN_MARGIN_S,
            )
        ],
        "queue_name": RunKeys(cfg.run).rewards,
        "redis_settings": redis_settings,
        "on_startup": on_startup,
        "on_shutdown": on_shutdown,
        "max_jobs": cfg.max_jobs or cfg.max_workers,
        "keep_result": RESULT_TTL_S,
        "poll_delay": WORKER_POLL_S,
        "allow_abort_jobs": True,
        "log_results": False,  # rewards are one number each; the job log line says enough
    }


async def serve(cfg: RewardWorkerConfig) -> int:
    """Serve until SIGTERM / SIGINT. arq's worker stops at the first connection error, so a Redis that goes away is
    ridden out here: wait for it (up to redis_outage_s, then RedisUnavailable: the CLI exits 3 naming the URL) and
    start arq's worker again; calls in flight are retried by arq (max_tries) or time out at their callers."""
    from arq.worker import Worker

    outcomes: Counter[str] = Counter()
    metrics = None
    collector = None
    ping = redis_client(cfg.rewards_url, retries=0)
    try:
        await ping.ping()  # no Redis at start: the CLI's one-line hint at once, not a wait
        while True:
            # Built inside the running loop: arq binds its SIGTERM/SIGINT handlers to the loop it finds.
            worker = Worker(**worker_settings(cfg, outcomes))
            if cfg.metrics_port and metrics is None:
                from rollq.engine.metrics import MetricsServer
                from rollq.workers.metrics import reward_worker_registry

                registry, collector = reward_worker_registry(
                    worker, RunKeys(cfg.run).rewards, cfg.rewards_url, outcomes
                )
                metrics = MetricsServer(registry, cfg.metrics_port)
            elif collector is not None:
                collector.arq_worker = worker
            try:
                await worker.async_run()
                return 0
            except asyncio.CancelledError:  # arq's signal handler cancels its main task: a normal stop
                return 0
            except TRANSIENT_ERRORS as exc:
                log.warning("redis at %s went away (%s); waiting for it", safe_url(cfg.rewards_url), exc)
            finally:
                with contextlib.suppress(*TRANSIENT_ERRORS):
                    await worker.close()  # waits for cancelled jobs, then on_shutdown stops the reward children
            await ride_out(ping.ping, what="serving remote rewards", limit_s=cfg.redis_outage_s, url=cfg.rewards_url)
    finally:
        await ping.aclose()
        if metrics is not None:
            metrics.close()


__all__ = ["RewardFunctions", "compute_reward", "serve", "worker_settings"]
