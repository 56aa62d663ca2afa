"""The async Producer: how the trainer and other services submit jobs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from rollq.producer.results import PartitionedConsumer, ResultConsumer
from rollq.protocol import scripts
from rollq.protocol.blobs import BLOB_MIN_BYTES, DEFAULT_BLOB_TTL_S, DataBlob, data_blob
from rollq.protocol.codec import Codec
from rollq.protocol.keys import (
    DEFAULT_CLASS,
    WORKER_GROUP,
    RunKeys,
    inflight_key,
    partition_of,
    partition_share,
    validate_class_name,
)
from rollq.protocol.limits import MAX_JOB_BYTES, describe_bytes
from rollq.protocol.messages import AgentOptions, Job, JobClass, Trajectory, class_bound, job_classes
from rollq.redis_client import ensure_group, run_partitions
from rollq.tracing import INVALID_SPAN, Span, SpanKind, Tracing, traceparent

DEFAULT_SEEN_TTL_S = DEFAULT_BLOB_TTL_S


class JobRequest(msgspec.Struct, kw_only=True):
    """What a caller submits: one prompt, run n times."""

    workflow: str
    data: Any = None
    n: int = 1
    job_id: str | None = None  # give one to make the submission idempotent
    workflow_kwargs: dict[str, Any] | None = None
    optional_kwargs: dict[str, Any] | None = None  # passed only to a workflow that takes them (Job.optional_kwargs)
    agent: AgentOptions | None = None  # how an agent workflow is run and exported
    is_eval: bool = False  # an evaluation sample (the workflow reads it as workflow_context.get().is_eval)
    job_class: str = DEFAULT_CLASS  # its job class (`rollq classes set`): stream, priority, share, admission budget
    priority: int | None = None  # its engine requests' priority (larger first); None: its class's
    lora: str = ""  # the LoRA adapter its generation names (the trainer's versioned adapter); "" = none
    traceparent: str = ""  # W3C traceparent of the caller's span: the submit span (rollq.tracing) is its child
    text: bool = False  # its trajectories' sequences carry their decoded text (Sequence.text); costs bytes


class SubmitResult(msgspec.Struct, frozen=True):
    job_id: str
    admitted: bool  # False: the job id was submitted before; nothing was queued
    reply_to: str  # where the results of this job id go


class BackpressureError(ValueError):
    """A request that can never be admitted (more samples than the in-flight bound)."""


class QueueFull(Exception):
    """`submit_many(..., wait=False)`: an in-flight bound (the reply stream's or the job class's) has no room now.
    `admitted` holds the results of the jobs submitted before the one that did not fit (none with atomic=True)."""

    def __init__(self, message: str, *, bound: str, job_class: str, admitted: list[SubmitResult]) -> None:
        super().__init__(message)
        self.bound = bound  # "reply" or "class"
        self.job_class = job_class
        self.admitted = admitted


class Producer:
    """Submits jobs to a run's queue.

    Idempotent by job id: a job id seen before (within ``seen_ttl_s``) is never queued again. With ``max_inflight``
    set, submission waits while that many samples for this reply stream are admitted but not yet consumed. Each job
    goes to its class's stream (`JobRequest.job_class`, default `train`); a class with `max_inflight` admits at most
    that many samples not yet finished by a worker, whoever submits them.

    A private ``reply_to`` (any stream but the run's shared results) is created before the first submission:
    workers publish to a private stream only while it exists. With ``reply_ttl_s`` it and its in-flight counter
    expire unless `keep_reply_stream()` is called again within that time (the caller's keep-alive).

    A job whose encoding is over ``max_job_bytes`` is refused (ValueError) before anything of the call is queued;
    workers dead-letter larger payloads (their own `max_job_bytes`), so keep the two alike. Data of
    ``blob_min_bytes`` or more is stored once in the run's blob store (`Job.data_ref`, expiring after ``seen_ttl_s``)
    rather than copied into each of a job's n entries.

    On a run of K partitions (``partitions``, or the run's count when 0), a job goes to `partition_of(job_id, K)`
    with its marker, and its results to the same-named reply stream of that partition (`reply_to` names partition
    0's). Bounds are per partition: ``max_inflight`` and a class's `max_inflight` are split evenly (ceil(M / K)
    each), and an `atomic` call must put all its jobs on one partition.
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
        reply_ttl_s: int = 0,
        max_job_bytes: int = MAX_JOB_BYTES,
        partitions: int = 0,
        blob_min_bytes: int = BLOB_MIN_BYTES,
        tracing: Tracing | None = None,
    ) -> None:
        self.redis = redis
        self.tracing = tracing or Tracing.disabled()
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
        self.reply_ttl_s = reply_ttl_s
        self.max_job_bytes = max_job_bytes
        self.blob_min_bytes = blob_min_bytes
        self._submit = redis.register_script(scripts.SUBMIT)
        self._store_blobs = redis.register_script(scripts.STORE_BLOBS)
        self._keep = redis.register_script(scripts.KEEP_REPLY_STREAM)
        self.wanted_partitions = partitions
        self._partitions = 0  # the run's count, read (or set) on first use
        self._groups_ready: set[str] = set()
        self._classes: dict[str, JobClass] = {}
        self._classes_at = -1e9

    @property
    def private(self) -> bool:
        """The reply stream is a private one (not the run's shared results stream)."""
        return self.reply_to != self.keys.results

    async def partitions(self) -> int:
        """The run's partition count (set to ``partitions`` when the run has none yet)."""
        if not self._partitions:
            self._partitions = await run_partitions(
                self.redis, self.keys.partitions, self.wanted_partitions, claim=True
            )
        return self._partitions

    async def remember_partitions(self) -> None:
        """Store the run's partition count again if Redis lost it (a restart that lost writes); processes that
        follow the run keep the count they saw meanwhile."""
        if self._partitions > 1:
            await self.redis.set(self.keys.partitions, self._partitions, nx=True)

    def reply_stream(self, partition: int) -> str:
        """Where the results of the jobs on `partition` go."""
        return self.keys.translate(self.reply_to, partition)

    async def reply_streams(self) -> list[str]:
        return [self.reply_stream(p) for p in range(await self.partitions())]

    async def vanished(self, job_ids: list[str]) -> list[str]:
        """The job ids whose idempotency marker is gone: never submitted, past `seen_ttl_s`, or lost by Redis."""
        count = await self.partitions()
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(self.keys.at(partition_of(job_id, count)).job_seen(job_id))
        found = await pipe.execute()
        return [job_id for job_id, exists in zip(job_ids, found, strict=True) if not exists]

    async def keep_reply_stream(self) -> None:
        """Create the private reply stream(s) when missing and renew their TTL (and their in-flight counters')."""
        if self.private:
            for stream in await self.reply_streams():
                await self._keep(keys=[stream, inflight_key(stream)], args=[self.reply_ttl_s])

    async def inflight(self) -> int:
        """Samples submitted for this reply stream and not consumed yet (all partitions)."""
        total = 0
        for stream in await self.reply_streams():
            total += int(await self.redis.get(inflight_key(stream)) or 0)
        return total

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

    async def classes(self, *, max_age_s: float = 1.0) -> dict[str, JobClass]:
        """The run's job classes (cached for `max_age_s`)."""
        if time.monotonic() - self._classes_at > max_age_s:
            stored = await self.redis.hgetall(self.keys.classes)  # type: ignore[misc]  # redis-py stub: sync|async
            self._classes = job_classes(stored)
            self._classes_at = time.monotonic()
        return self._classes

    async def submit_many(
        self, requests: Iterable[JobRequest], *, atomic: bool = False, wait: bool = True
    ) -> list[SubmitResult]:
        """Submit in chunks (one atomic SUBMIT call per partition each), in order within a partition; waits
        (backpressure) where an in-flight bound (this reply stream's, or a job class's) is reached. `atomic`: all the
        requests in one call, admitted all or nothing (a batch). `wait=False`: raise `QueueFull` instead of waiting
        for room. Returns one result per request, in order."""
        reqs = list(requests)
        for req in reqs:
            self._check(req)
        count = await self.partitions()
        ids = [req.job_id or uuid.uuid4().hex for req in reqs]
        if atomic and len({partition_of(job_id, count) for job_id in ids}) > 1:
            raise ValueError(
                f"an atomic batch must keep its jobs on one of the run's {count} partitions (partition_of(job_id)); "
                "give job ids of one partition or submit without atomic"
            )
        classes = await self._prepare(reqs, count)
        # One submit span per job, from this call until it is admitted or found a duplicate: a job that waits for
        # room (tried again below) stays one trace, its wait and tries on its span.
        spans = [self._submit_span(req, job_id) for req, job_id in zip(reqs, ids, strict=True)]
        if self.tracing.enabled:
            reqs = [
                msgspec.structs.replace(req, traceparent=traceparent(span))
                for req, span in zip(reqs, spans, strict=True)
            ]
        try:
            return await self._submit_all(reqs, ids, classes, count, spans, atomic=atomic, wait=wait)
        except BaseException as exc:
            for span in spans:  # those not admitted (the others were ended and replaced by INVALID_SPAN)
                self.tracing.error(span, type(exc).__name__, str(exc))
                span.end()
            raise

    async def _submit_all(
        self,
        reqs: list[JobRequest],
        ids: list[str],
        classes: dict[str, JobClass],
        count: int,
        spans: list[Span],
        *,
        atomic: bool,
        wait: bool,
    ) -> list[SubmitResult]:
        results: dict[int, SubmitResult] = {}
        tries = [0] * len(reqs)
        pending = list(range(len(reqs)))  # indices of the requests not admitted (nor found duplicate) yet
        while pending:
            chunk = pending if atomic else pending[: self.chunk_size]
            by_partition: dict[int, list[int]] = {}
            for k in chunk:
                by_partition.setdefault(partition_of(ids[k], count), []).append(k)
            full: list[tuple[int, int, str]] = []  # (request index, partition, bound) left out by a full bound
            for partition, indices in by_partition.items():
                replies = await self._submit_chunk(
                    partition, [(reqs[k], ids[k]) for k in indices], classes, count, atomic=atomic
                )
                statuses = [
                    (int(st), info.decode() if isinstance(info, bytes) else str(info))
                    for st, info in zip(replies[0::2], replies[1::2], strict=True)
                ]
                for k, (st, info) in zip(indices, statuses, strict=True):
                    tries[k] += 1
                    if st == -2:
                        raise ValueError(f"unknown job class {info!r} (define it with `rollq classes set {info}`)")
                    if st in (0, 1):
                        results[k] = SubmitResult(ids[k], st == 1, info if st == 0 else self.reply_stream(partition))
                        spans[k].set_attributes({"rollq.admitted": st == 1, "rollq.submit_tries": tries[k]})
                        spans[k].end()  # 0: a duplicate job id
                        spans[k] = INVALID_SPAN
                    elif st == -1 and info:
                        full.append((k, partition, info))
            pending = [k for k in pending if k not in results]
            if not full:
                continue
            k, partition, bound = min(full)
            if not wait:
                raise QueueFull(
                    f"no room for job {ids[k]!r}: the {bound} in-flight bound is reached",
                    bound=bound,
                    job_class=reqs[k].job_class,
                    admitted=[results[i] for i in sorted(results)],
                )
            classes = await self._wait_for_room(reqs[k], partition, count)
        return [results[k] for k in range(len(reqs))]

    def _check(self, req: JobRequest) -> None:
        if req.n < 1:
            raise ValueError(f"n must be >= 1, got {req.n}")
        if not req.workflow:
            raise ValueError("workflow import path is empty")
        if self.max_inflight and req.n > self.max_inflight:
            raise BackpressureError(f"a job of n={req.n} samples can never fit max_inflight={self.max_inflight}")
        if req.job_id is not None and (not req.job_id or len(req.job_id) > 512):
            raise ValueError("job_id must be a non-empty string of at most 512 characters")
        validate_class_name(req.job_class)
        blob = data_blob(self.codec, req.data, self.blob_min_bytes)
        job = self._job(req, req.job_id or uuid.uuid4().hex, req.n - 1, time.time(), blob=blob)
        size = max(len(self.codec.encode(job)), len(blob.payload) if blob else 0)
        if size > self.max_job_bytes:
            raise ValueError(
                f"job {req.job_id or '(no id)'} encodes to {describe_bytes(size)}, over max_job_bytes="
                f"{self.max_job_bytes} (a worker dead-letters larger jobs; pass large data by reference)"
            )

    def _job(
        self,
        req: JobRequest,
        job_id: str,
        sample_index: int,
        now: float,
        reply_to: str = "",
        blob: DataBlob | None = None,
    ) -> Job:
        return Job(
            job_id=job_id,
            workflow=req.workflow,
            data=None if blob else req.data,
            data_ref=blob.digest if blob else "",
            sample_index=sample_index,
            n=req.n,
            workflow_kwargs=req.workflow_kwargs,
            optional_kwargs=req.optional_kwargs,
            agent=req.agent,
            is_eval=req.is_eval,
            reply_to=reply_to or self.reply_to,
            submitted_at=now,
            job_class=req.job_class,
            priority=req.priority,
            lora=req.lora,
            traceparent=req.traceparent,
            text=req.text,
        )

    def _fits(self, req: JobRequest, classes: dict[str, JobClass], count: int) -> None:
        """Refuse a request that can never be admitted: more samples than a bound's share on one partition."""
        reply_bound = partition_share(self.max_inflight, count)
        if reply_bound and req.n > reply_bound:
            raise BackpressureError(
                f"a job of n={req.n} samples can never fit max_inflight={self.max_inflight}"
                + (f" ({reply_bound} per partition of {count})" if count > 1 else "")
            )
        bound = classes[req.job_class].max_inflight
        if bound and req.n > partition_share(bound, count):
            raise BackpressureError(
                f"a job of n={req.n} samples can never fit class {req.job_class!r} max_inflight={bound}"
                + (f" ({partition_share(bound, count)} per partition of {count})" if count > 1 else "")
            )

    async def _prepare(self, reqs: list[JobRequest], count: int) -> dict[str, JobClass]:
        """Refuse unknown classes and requests bigger than their bounds before anything is queued; create the
        workers' group on each class stream (every partition) the first time. Returns the run's classes."""
        names = {req.job_class for req in reqs}
        classes = await self.classes(max_age_s=0)
        unknown = sorted(names - classes.keys())
        if unknown:
            raise ValueError(
                f"unknown job class(es) {', '.join(unknown)} in run {self.keys.run!r} "
                f"(define them with `rollq classes set NAME`)"
            )
        for req in reqs:
            self._fits(req, classes, count)
        await self.keep_reply_stream()  # a private reply stream exists before any worker publishes to it
        for name in names:
            for partition in range(count):
                stream = self.keys.at(partition).job_stream(name)
                if stream not in self._groups_ready:
                    await ensure_group(self.redis, stream, WORKER_GROUP)
                    self._groups_ready.add(stream)
        return classes

    async def _submit_chunk(
        self,
        partition: int,
        chunk: list[tuple[JobRequest, str]],
        classes: dict[str, JobClass],
        count: int,
        *,
        atomic: bool = False,
    ) -> list[Any]:
        """One SUBMIT call for a chunk of jobs of one partition: idempotency marker, in-flight bounds and n XADDs
        each, atomically (every key in the partition's slot)."""
        now = time.time()
        keys = self.keys.at(partition)
        reply_to = self.reply_stream(partition)
        blobs: dict[str, bytes] = {}  # digest -> payload: one copy per distinct data in the call
        job_keys: list[str] = []
        job_args: list[Any] = []
        for req, job_id in chunk:
            blob = data_blob(self.codec, req.data, self.blob_min_bytes)
            if blob is not None:
                blobs.setdefault(blob.digest, blob.payload)
            job_keys.append(keys.job_seen(job_id))
            job_keys.append(keys.job_stream(req.job_class))
            job_args.append(req.job_class)
            job_args.append(class_bound(classes, req.job_class, count))
            job_args.append(req.n)
            job_args.extend(self.codec.encode(self._job(req, job_id, i, now, reply_to, blob)) for i in range(req.n))
        if blobs:  # stored first: an entry is never read before the data it references (SUBMIT keeps its layout)
            await self._store_blobs(
                keys=[*(keys.blob(d) for d in blobs), *(keys.blob_refs(d) for d in blobs)],
                args=[self.seen_ttl_s, *blobs.values()],
            )
        script_keys = [inflight_key(reply_to), *job_keys]
        args: list[Any] = [self.seen_ttl_s, partition_share(self.max_inflight, count), reply_to, 1 if atomic else 0]
        replies: list[Any] = await self._submit(keys=script_keys, args=[*args, *job_args])  # a pair per job
        return replies

    def _submit_span(self, req: JobRequest, job_id: str) -> Span:
        """The root of a job's trace (or a child of the caller's): its samples' attempts are its children."""
        return self.tracing.start(
            "submit",
            parent=req.traceparent or None,
            kind=SpanKind.PRODUCER,
            attributes={
                "rollq.run": self.keys.run,
                "rollq.job_id": job_id,
                "rollq.n": req.n,
                "rollq.workflow": self.tracing.workflow(req.workflow),
                "rollq.job_class": req.job_class,
                "rollq.is_eval": req.is_eval,
            },
        )

    async def _wait_for_room(self, req: JobRequest, partition: int, count: int) -> dict[str, JobClass]:
        """Poll until both bounds have room for `req` on its partition (the SUBMIT call that follows decides);
        returns the classes as last read."""
        delay = self.poll_interval_s
        reply_to = self.reply_stream(partition)
        while True:
            classes = await self.classes(max_age_s=0)
            if req.job_class not in classes:
                raise ValueError(f"unknown job class {req.job_class!r} (it was removed while jobs waited)")
            self._fits(req, classes, count)
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(inflight_key(reply_to))
            pipe.xlen(self.keys.at(partition).job_stream(req.job_class))
            inflight, queued = await pipe.execute()
            reply_bound = partition_share(self.max_inflight, count)
            bound = partition_share(classes[req.job_class].max_inflight, count)
            reply_ok = not reply_bound or int(inflight or 0) + req.n <= reply_bound
            if reply_ok and (not bound or int(queued) + req.n <= bound):
                return classes
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def consumer(
        self, *, group: str = "producer", name: str | None = None, **kwargs: Any
    ) -> ResultConsumer | PartitionedConsumer:
        """A consumer of this producer's reply stream(s) (one per partition: call after the first submission, or
        after `partitions()`, on a partitioned run)."""
        name = name or f"producer-{uuid.uuid4().hex[:8]}"
        count = self._partitions or 1
        if count == 1:
            return ResultConsumer(self.redis, self.reply_to, group=group, name=name, **kwargs)
        streams = [self.reply_stream(p) for p in range(count)]
        return PartitionedConsumer([ResultConsumer(self.redis, s, group=group, name=name, **kwargs) for s in streams])

    async def wait_for(
        self,
        expected: dict[str, int],
        *,
        timeout_s: float | None = None,
        consumer: ResultConsumer | PartitionedConsumer | None = None,
    ) -> AsyncIterator[Trajectory]:
        """Yield each expected trajectory once ({job_id: n} -> n samples per job) and commit it after the caller
        resumes the generator. Raises TimeoutError when they have not all arrived in time."""
        if consumer is None:
            await self.partitions()
            consumer = self.consumer()
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
