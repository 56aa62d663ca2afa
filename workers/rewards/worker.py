"""The reward worker (`rollq reward-worker`): serves a run's remote reward calls from its arq queue.

Each call names a reward function by import path (checked against this worker's allowlist before anything is
imported); it runs in killable child processes (AsyncRewardWrapper), so a hanging grader is killed and reported as a
timeout without taking the reward worker down. The arq job never raises for a reward failure: it returns a tagged
result that rollq.workers.rewards.remote turns back into the exception.

Jobs and results are msgpack (rollq.workers.rewards.arq_codec), never pickle. A job whose payload is not (a pickle
planted in `arq:job:*`, garbage) is refused unread: arq fails it without running anything or retrying it, and
RewardQueueWorker first copies it to the run's dead-letter stream (`rollq status` counts it) with a readable error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from typing import Any

import redis.asyncio as aioredis
from arq.constants import job_key_prefix
from arq.jobs import DeserializationError, deserialize_job_raw
from arq.worker import Worker, func

from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.messages import DeadLetter, ErrorRecord
from rollq.redis_client import TRANSIENT_ERRORS, arq_settings, redis_client, ride_out, safe_url
from rollq.workers.resolver import Allowlist, resolve
from rollq.workers.rewards import arq_codec
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

RAW_PREFIX_BYTES = 4096  # what a dead letter keeps of a refused payload: enough to tell what it was
REFUSED = "RefusedArqPayload"  # the dead letter's error type, and the refused calls' outcome in the metrics
DEAD_LETTER_TIMEOUT_S = 5.0  # a run Redis that does not answer must not hold arq's failed-job handling for long


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
                wrapper = AsyncRewardWrapper(
                    fn, timeout_seconds=self.timeout_seconds, max_workers=self.max_workers, max_retries=0
                )
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
        "job_serializer": arq_codec.encode,
        "job_deserializer": arq_codec.decode,
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


class RefusedJobs:
    """Dead-letters arq jobs whose payload was refused (not msgpack) to the run's dead-letter stream."""

    def __init__(self, run_redis: aioredis.Redis, run: str, outcomes: Counter[str] | None = None) -> None:
        self.redis = run_redis  # the run's Redis (redis_url), where `rollq status` reads dead letters
        self.stream = RunKeys(run).dead
        self.outcomes: Counter[str] = Counter() if outcomes is None else outcomes  # the metrics' reward results
        self.codec = Codec()
        self.worker_id = f"reward-worker {socket.gethostname()}:{os.getpid()}"

    async def dead_letter(self, job_id: str, raw: bytes, why: str) -> None:
        self.outcomes[REFUSED] += 1
        message = f"arq job {job_id}: {why}"
        letter = DeadLetter(
            entry_id=job_key_prefix + job_id,
            error=ErrorRecord(type=REFUSED, message=message, worker_id=self.worker_id, at=time.time()),
            raw=raw[:RAW_PREFIX_BYTES],
        )
        try:
            await asyncio.wait_for(
                self.redis.xadd(self.stream, {PAYLOAD_FIELD: self.codec.encode(letter)}), DEAD_LETTER_TIMEOUT_S
            )
        except Exception as exc:  # refused either way; the log line is then the only record
            log.error("%s (not dead-lettered: %s: %s)", message, type(exc).__name__, exc)
        else:
            log.error("%s; dead-lettered to %s", message, self.stream)


class RewardQueueWorker(Worker):
    """arq's Worker, plus: a job whose payload is refused is dead-lettered (RefusedJobs) before arq drops it."""

    def __init__(self, *, refused: RefusedJobs, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refused = refused

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        # arq calls this for a job that fails before it runs (payload unreadable, expired, aborted, unknown function,
        # retries used up) and deletes the job's key in it: the payload is still there to read and keep.
        with contextlib.suppress(*TRANSIENT_ERRORS):
            raw = await self.pool.get(job_key_prefix + job_id)
            if raw:
                try:
                    deserialize_job_raw(raw, deserializer=arq_codec.decode)
                except DeserializationError as exc:
                    refused = arq_codec.refusal(exc)
                    why = str(refused) if refused else f"payload is not an arq job ({_cause(exc)}): refused"
                    await self.refused.dead_letter(job_id, raw, why)
        await super().finish_failed_job(job_id, result_data)


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {cause}"


async def serve(cfg: RewardWorkerConfig) -> int:
    """Serve until SIGTERM / SIGINT. arq's worker stops at the first connection error, so a Redis that goes away is
    ridden out here: wait for it (up to redis_outage_s, then RedisUnavailable: the CLI exits 3 naming the URL) and
    start arq's worker again; calls in flight are retried by arq (max_tries) or time out at their callers."""
    outcomes: Counter[str] = Counter()
    metrics = None
    collector = None
    ping = redis_client(cfg.rewards_url, retries=0)
    refused = RefusedJobs(redis_client(cfg.redis_url), cfg.run, outcomes)
    try:
        await ping.ping()  # no Redis at start: the CLI's one-line hint at once, not a wait
        while True:
            # Built inside the running loop: arq binds its SIGTERM/SIGINT handlers to the loop it finds.
            worker = RewardQueueWorker(**worker_settings(cfg, outcomes), refused=refused)
            if cfg.metrics_port and metrics is None:
                from rollq.metrics_server import MetricsServer
                from rollq.workers.metrics import reward_worker_registry

                registry, collector = reward_worker_registry(
                    worker, RunKeys(cfg.run).rewards, cfg.rewards_url, outcomes
                )
                metrics = MetricsServer(registry, cfg.metrics_port, cfg.metrics_host)
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
        await refused.redis.aclose()
        if metrics is not None:
            metrics.close()


__all__ = ["RefusedJobs", "RewardFunctions", "RewardQueueWorker", "compute_reward", "serve", "worker_settings"]
