"""The async Producer: how the trainer and other services submit jobs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from rollq.producer.results import ResultConsumer
from rollq.protocol import scripts
from rollq.protocol.codec import Codec
from rollq.protocol.keys import WORKER_GROUP, RunKeys, inflight_key
from rollq.protocol.messages import AgentOptions, Job, Trajectory
from rollq.redis_client import ensure_group

DEFAULT_SEEN_TTL_S = 7 * 24 * 3600


class JobRequest(msgspec.Struct, kw_only=True):
    """What a caller submits: one prompt, run n times."""

    workflow: str
    data: Any = None
    n: int = 1
    job_id: str | None = None  # give one to make the submission idempotent
    workflow_kwargs: dict[str, Any] | None = None
    agent: AgentOptions | None = None  # how an agent workflow is run and exported
    is_eval: bool = False  # an evaluation sample (the workflow reads it as workflow_context.get().is_eval)


class SubmitResult(msgspec.Struct, frozen=True):
    job_id: str
    admitted: bool  # False: the job id was submitted before; nothing was queued
    reply_to: str  # where the results of this job id go


class BackpressureError(ValueError):
    """A request that can never be admitted (more samples than the in-flight bound)."""


class Producer:
    """Submits jobs to a run's queue.

    Idempotent by job id: a job id seen before (within ``seen_ttl_s``) is never queued again. With ``max_inflight``
    set, submission waits while that many samples for this reply stream are admitted but not yet consumed.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        run: str,
        *,
        reply_to: str | None = None,
        max_inflight: int = 0,
        seen_ttl_s: int = DEFAULT_SEEN_TTL_S,
        chunk_size: int = 256,
        poll_interval_s: float = 0.02,
    ) -> None:
        self.redis = redis
        self.keys = RunKeys(run)
        self.reply_to = reply_to or self.keys.results
        if not self.keys.owns(self.reply_to):
            raise ValueError(
                f"reply stream {self.reply_to!r} is not in run {run!r} (must start with {self.keys.prefix}:)"
            )
        self.max_inflight = max_inflight
        self.seen_ttl_s = seen_ttl_s
        self.chunk_size = chunk_size
        self.poll_interval_s = poll_interval_s
        self.codec = Codec()
        self._submit = redis.register_script(scripts.SUBMIT)
        self._group_ready = False

    async def inflight(self) -> int:
        return int(await self.redis.get(inflight_key(self.reply_to)) or 0)

    async def submit(
        self,
        workflow: str,
        data: Any = None,
        *,
        n: int = 1,
        job_id: str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
    ) -> SubmitResult:
        req = JobRequest(workflow=workflow, data=data, n=n, job_id=job_id, workflow_kwargs=workflow_kwargs)
        return (await self.submit_many([req]))[0]

    async def submit_many(self, requests: Iterable[JobRequest]) -> list[SubmitResult]:
        """Submit in chunks (one atomic SUBMIT call each), in order; waits (backpressure) where the in-flight bound
        is reached."""
        reqs = list(requests)
        for req in reqs:
            self._check(req)
        if not self._group_ready:
            await ensure_group(self.redis, self.keys.jobs, WORKER_GROUP)
            self._group_ready = True
        out: list[SubmitResult] = []
        pending = [(req, req.job_id or uuid.uuid4().hex) for req in reqs]
        while pending:
            chunk = pending[: self.chunk_size]
            replies = await self._submit_chunk(chunk)
            done = 0
            for (_, job_id), status, info in zip(chunk, replies[0::2], replies[1::2], strict=True):
                status = int(status)
                if status == -1:  # full: this job and the later ones wait, so order is kept
                    break
                out.append(SubmitResult(job_id, status == 1, info.decode() if status == 0 else self.reply_to))
                done += 1
            pending = pending[done:]
            if pending and done < len(chunk):
                await self._wait_for_room(pending[0][0].n)
        return out

    def _check(self, req: JobRequest) -> None:
        if req.n < 1:
            raise ValueError(f"n must be >= 1, got {req.n}")
        if not req.workflow:
            raise ValueError("workflow import path is empty")
        if self.max_inflight and req.n > self.max_inflight:
            raise BackpressureError(f"a job of n={req.n} samples can never fit max_inflight={self.max_inflight}")
        if req.job_id is not None and (not req.job_id or len(req.job_id) > 512):
            raise ValueError("job_id must be a non-empty string of at most 512 characters")

    async def _submit_chunk(self, chunk: list[tuple[JobRequest, str]]) -> list[Any]:
        """One SUBMIT call for a chunk of jobs: idempotency marker, in-flight bound and n XADDs each, atomically."""
        now = time.time()
        keys: list[str] = [self.keys.jobs, inflight_key(self.reply_to)]
        args: list[Any] = [self.seen_ttl_s, self.max_inflight, self.reply_to]
        for req, job_id in chunk:
            keys.append(self.keys.job_seen(job_id))
            args.append(req.n)
            args.extend(
                self.codec.encode(
                    Job(
                        job_id=job_id,
                        workflow=req.workflow,
                        data=req.data,
                        sample_index=i,
                        n=req.n,
                        workflow_kwargs=req.workflow_kwargs,
                        agent=req.agent,
                        is_eval=req.is_eval,
                        reply_to=self.reply_to,
                        submitted_at=now,
                    )
                )
                for i in range(req.n)
            )
        replies: list[Any] = await self._submit(keys=keys, args=args)  # one reply per job of the chunk
        return replies

    async def _wait_for_room(self, n: int) -> None:
        delay = self.poll_interval_s
        while await self.inflight() + n > self.max_inflight:
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def consumer(self, *, group: str = "producer", name: str | None = None, **kwargs: Any) -> ResultConsumer:
        """A consumer of this producer's reply stream."""
        return ResultConsumer(
            self.redis, self.reply_to, group=group, name=name or f"producer-{uuid.uuid4().hex[:8]}", **kwargs
        )

    async def wait_for(
        self, expected: dict[str, int], *, timeout_s: float | None = None, consumer: ResultConsumer | None = None
    ) -> AsyncIterator[Trajectory]:
        """Yield each expected trajectory once ({job_id: n} -> n samples per job) and commit it after the caller
        resumes the generator. Raises TimeoutError when they have not all arrived in time."""
        consumer = consumer or self.consumer()
        missing = {(job_id, i) for job_id, n in expected.items() for i in range(n)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while missing:
            block_ms = 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(missing)} of the expected trajectories did not arrive in {timeout_s} s")
                block_ms = max(1, min(block_ms, int(left * 1000)))
            batch = await consumer.read(count=256, block_ms=block_ms)
            for item in batch:
                key = (item.trajectory.job_id, item.trajectory.sample_index)
                if key in missing:
                    missing.discard(key)
                    yield item.trajectory
            await consumer.commit(batch)
