"""The client side of remote rewards: run a reward function on the run's reward workers (`rollq reward-worker`,
rollq.workers.rewards.worker), reached through an arq queue in Redis.

Graders that need their own machine (a GPU verifier, a sandbox farm, heavy dependencies) should not live in every
rollout worker. A rollout worker enqueues `compute_reward(fn_path, args, kwargs)` on the run's reward queue; a reward
worker imports `fn_path` and runs it in killable child processes (AsyncRewardWrapper), so a hanging grader is killed
and reported as a timeout without taking the reward worker down.

The arq job never raises for a reward failure: it returns a tagged result ({"ok": reward} or {"error": type name,
"message": ..., "traceback": ...}). The exception type thus crosses the queue explicitly (no pickled user exception
classes), and arq retries a job only when its worker died (in-progress key expired) or shut down mid-job.

Jobs and results travel as msgpack (rollq.workers.rewards.arq_codec), never pickle: a call's arguments must be plain
data (NotPlainData otherwise, before anything is enqueued), and a result that is not msgpack (a pickle planted in
`arq:result:*`) is refused unread: the call fails with RewardError, as a failed reward does.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
from arq.connections import ArqRedis, create_pool
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, result_key_prefix
from arq.jobs import DeserializationError, Job, JobResult, JobStatus, SerializationError
from arq.utils import timestamp_ms
from redis.exceptions import WatchError

from rollq.protocol.keys import RunKeys
from rollq.redis_client import arq_settings
from rollq.workers.resolver import split_import_path
from rollq.workers.rewards import arq_codec
from rollq.workers.rewards.processes import RewardError, RewardNotANumber, RewardTimeout

COMPUTE_REWARD = "compute_reward"  # the arq function name, shared by both sides
RUN_MARGIN_S = 5.0  # client-side slack past the reward timeout once a worker has the job (Redis round trips)
MAX_POLL_S = 0.2  # result polling backs off to this; fast rewards are seen within milliseconds
WORKER_POLL_S = 0.05  # reward workers look for new jobs and aborts this often: a reward is on the episode's path
RESULT_TTL_S = 300  # the caller deletes a result once read; this only bounds results nobody came back for
MAX_TRIES = 3  # runs of one job; only worker death or shutdown mid-job uses a retry

_ERRORS: dict[str, type[Exception]] = {
    "RewardTimeout": RewardTimeout,
    "RewardNotANumber": RewardNotANumber,
    "RewardError": RewardError,
}


class NoRewardWorker(RewardTimeout):
    """No reward worker took the call within the pickup window; it was withdrawn from the queue unrun."""


class RemoteRewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    fn: str  # import path, resolved on the reward worker
    redis_url: str
    run: str = "default"
    timeout_seconds: float = 15.0  # how long the reward may run once a reward worker has it
    # How long a call may wait in the queue for a free reward worker before it fails as "no reward worker answered".
    pickup_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        split_import_path(self.fn)  # a malformed path fails here, not on the reward worker
        RunKeys(self.run)
        if not self.timeout_seconds > 0 or not self.pickup_timeout_seconds > 0:
            raise ValueError("timeout_seconds and pickup_timeout_seconds must be > 0")


class RemoteReward:
    """`await rr(*args, **kwargs) -> float`: `fn(*args, **kwargs)` on a reward worker of the run.

    Raises RewardTimeout (the reward overran and was killed, or no reward worker answered in time), RewardNotANumber
    or RewardError, each with the remote message."""

    def __init__(
        self,
        fn: str,
        *,
        redis_url: str,
        run: str = "default",
        timeout_seconds: float = 15.0,
        pickup_timeout_seconds: float = 30.0,
    ) -> None:
        self.config = RemoteRewardConfig(
            fn=fn,
            redis_url=redis_url,
            run=run,
            timeout_seconds=timeout_seconds,
            pickup_timeout_seconds=pickup_timeout_seconds,
        )
        self.queue = RunKeys(run).rewards
        self._pool: ArqRedis | None = None
        self._pool_lock: asyncio.Lock | None = None  # created inside the running loop, like the pool

    async def _get_pool(self) -> ArqRedis:
        if self._pool is None:
            self._pool_lock = self._pool_lock or asyncio.Lock()
            async with self._pool_lock:
                if self._pool is None:
                    self._pool = await create_pool(
                        arq_settings(self.config.redis_url),
                        default_queue_name=self.queue,
                        job_serializer=arq_codec.encode,
                        job_deserializer=arq_codec.decode,
                    )
        return self._pool

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        c = self.config
        try:  # here, to name the argument as the caller knows it (arq's record nests them)
            arq_codec.check_plain(args, "args")
            arq_codec.check_plain(kwargs, "kwargs")
        except arq_codec.NotPlainData as exc:
            raise arq_codec.NotPlainData(f"remote reward call of {c.fn}: {exc}") from None
        pool = await self._get_pool()
        # Positional (fn_path, args, kwargs) so reward kwargs never collide with arq's own `_`-prefixed options.
        # _expires: a job nobody took within the pickup window is dropped by arq instead of running for no one.
        try:
            job = await pool.enqueue_job(
                COMPUTE_REWARD,
                c.fn,
                list(args),
                kwargs,
                _queue_name=self.queue,
                _expires=c.pickup_timeout_seconds + RUN_MARGIN_S,
            )
        except SerializationError as exc:  # nothing was written (e.g. an int beyond 64 bits)
            if isinstance(exc.__cause__, arq_codec.NotPlainData):
                raise arq_codec.NotPlainData(f"remote reward call of {c.fn}: {exc.__cause__}") from None
            raise
        assert job is not None  # only None for a duplicate _job_id, and ids here are fresh uuids
        try:
            info = await self._wait(pool, job)
        except NoRewardWorker:
            raise  # withdrawn, nothing to abort
        except DeserializationError as exc:  # the result is there but unreadable: the job is over, nothing to abort
            with contextlib.suppress(Exception):
                await pool.delete(result_key_prefix + job.job_id)
            refused = arq_codec.refusal(exc)
            why = str(refused) if refused else arq_codec.exception_record(exc)["message"]
            raise RewardError(f"reward job {job.job_id} for {c.fn}: unreadable result: {why}") from None
        except BaseException:
            # Timed out or cancelled (the rollout worker is draining): stop the reward run for no one.
            await asyncio.shield(_abort(pool, job.job_id))
            raise
        with contextlib.suppress(Exception):
            await pool.delete(result_key_prefix + job.job_id)  # read once; don't leave it to the TTL
        return self._unpack(info)

    async def _wait(self, pool: ArqRedis, job: Job) -> JobResult:
        c = self.config
        loop = asyncio.get_running_loop()
        enqueued = loop.time()
        started: float | None = None
        delay = 0.005
        while True:
            info = await job.result_info()
            if info is not None:
                return info
            now = loop.time()
            if started is None:
                status = await job.status()
                if status in (JobStatus.in_progress, JobStatus.complete):
                    started = now
                elif status == JobStatus.not_found:
                    info = await job.result_info()  # it may have finished between the two reads
                    if info is not None:
                        return info
                    raise RewardError(f"reward job for {c.fn} disappeared from queue {self.queue}")
                elif now - enqueued > c.pickup_timeout_seconds:
                    if await _withdraw(pool, self.queue, job.job_id):
                        raise NoRewardWorker(
                            f"no reward worker answered on queue {self.queue} within "
                            f"{c.pickup_timeout_seconds:g}s (is `rollq reward-worker --run {c.run}` running?)"
                        )
                    started = now  # a reward worker took it at the last moment
            elif now - started > c.timeout_seconds + RUN_MARGIN_S:
                # The reward worker's own timeout should have answered first; it died or is stuck.
                raise RewardTimeout(
                    f"reward worker did not answer for {c.fn} within {c.timeout_seconds + RUN_MARGIN_S:g}s "
                    "of taking the job"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)

    def _unpack(self, info: JobResult) -> float:
        if not info.success:  # arq-level failure: function timeout, aborted, retries used up by dying workers
            why = arq_codec.describe_failure(info.result)
            raise RewardError(f"reward job for {self.config.fn} failed on the reward worker: {why}")
        tagged = info.result
        if isinstance(tagged, dict) and "ok" in tagged:
            return float(tagged["ok"])
        if isinstance(tagged, dict) and "error" in tagged:
            error = _ERRORS.get(tagged["error"], RewardError)
            message = f"remote: {tagged.get('message', '')}"
            if error is RewardError:
                raise RewardError(message, remote_traceback=tagged.get("traceback", ""))
            raise error(message)
        raise RewardError(f"reward worker sent an unexpected result for {self.config.fn}: {tagged!r:.200}")

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.aclose(close_connection_pool=True)

    async def __aenter__(self) -> RemoteReward:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _withdraw(pool: ArqRedis, queue: str, job_id: str) -> bool:
    """Take a job that no worker has started off the queue. False when a worker started it meanwhile."""
    in_progress = in_progress_key_prefix + job_id
    try:
        async with pool.pipeline(transaction=True) as pipe:
            await pipe.watch(in_progress)  # the key a worker sets, also under WATCH, when it takes the job
            if await pipe.exists(in_progress):
                return False
            pipe.multi()
            pipe.zrem(queue, job_id)
            pipe.delete(job_key_prefix + job_id)
            await pipe.execute()
    except WatchError:
        return False
    return True


async def _abort(pool: ArqRedis, job_id: str) -> None:
    # Best effort and without waiting: reward workers run with allow_abort_jobs, so the job's task is cancelled
    # (which kills its reward child) or skipped if not started.
    with contextlib.suppress(Exception):
        await pool.zadd(abort_jobs_ss, {job_id: timestamp_ms()})


__all__ = ["COMPUTE_REWARD", "RUN_MARGIN_S", "NoRewardWorker", "RemoteReward", "RemoteRewardConfig"]
