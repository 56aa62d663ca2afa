"""The worker process: pulls jobs through the consumer group, runs workflows, publishes trajectories.

Crash safety comes from the stream protocol: a job stays in the group's pending list until it is acked in the same
atomic step (MULTI/EXEC, or the FINISH/REQUEUE scripts) that publishes its outcome. While a job runs, its lease is
refreshed (XCLAIM JUSTID resets the idle time without counting a delivery), so only jobs of dead workers go idle long
enough to be reclaimed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import time
import traceback
import uuid

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import StreamIdT

from rollq.engine.types import InferenceEngine
from rollq.protocol import scripts
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP, RunKeys
from rollq.protocol.messages import SCHEMA_VERSION, DeadLetter, ErrorRecord, Job, Trajectory
from rollq.redis_client import TRANSIENT_ERRORS, ensure_group, is_nogroup, redis_client
from rollq.workers.batcher import WriteBatcher
from rollq.workers.config import WorkerConfig
from rollq.workers.context import ContextConfig, EpisodeContext, RecordingEngine, WorkflowContext, episode_scope
from rollq.workers.loader import WorkflowCache, workflow_path
from rollq.workers.outputs import to_sequences
from rollq.workers.proxy.server import ProxyConfig
from rollq.workers.resolver import Allowlist, WorkflowLoadError, enforcing

log = logging.getLogger("rollq.worker")

FORGET_GONE_WORKERS_S = 3600.0  # `rollq status` lists a crashed worker as gone for this long


class WorkerStats(msgspec.Struct):
    completed: int = 0
    rejected: int = 0
    requeued: int = 0
    dead_lettered: int = 0
    reclaimed: int = 0


class _Running(msgspec.Struct):
    task: asyncio.Task
    payload: bytes | None


class _Fatal(Exception):
    """This job can't succeed here; dead-letter it with the message."""

    def __init__(self, error: ErrorRecord, job: Job | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.job = job  # what could be read of an undecodable job, so its waiter still gets an error trajectory


def salvage_job(payload: bytes) -> Job | None:
    """The identifying fields of a job that failed validation, if they are readable."""
    try:
        raw = msgspec.json.decode(payload) if payload[:1] == b"{" else msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("job_id"), str):
        return None
    n, idx, reply = raw.get("n", 1), raw.get("sample_index", 0), raw.get("reply_to", "")
    if not (isinstance(n, int) and isinstance(idx, int) and isinstance(reply, str)):
        return None
    workflow = raw.get("workflow")
    if not isinstance(workflow, str):
        workflow = ""
    return Job(job_id=raw["job_id"], workflow=workflow, sample_index=idx, n=n, reply_to=reply)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self, config: WorkerConfig, *, engine: InferenceEngine | None = None, redis: aioredis.Redis | None = None
    ) -> None:
        self.cfg = config
        self.keys = RunKeys(config.run)
        self.name = config.name or default_worker_name()
        self.redis = redis or redis_client(config.redis_url)
        self.engine = engine
        self._episode_engine = RecordingEngine.wrap(engine)  # keeps each episode's responses (outputs.py uses them)
        self.codec = Codec()
        self.workflows = WorkflowCache()
        # Shared by this worker's workflows (HTTP clients, the agents' recording proxy); closed when it stops.
        self.context = WorkflowContext(
            ContextConfig(
                tokenizer=config.tokenizer,
                agent_processes=config.agent_processes,
                agent_hosts=config.agent_hosts,
                proxy=ProxyConfig(
                    host=config.proxy_host, port=config.proxy_port, continuation=config.proxy_continuation
                ),
                redis_url=config.redis_url,
                run=config.run,
            )
        )
        # What jobs may import (workflows, reward functions, tools), checked before anything is imported.
        self.allowlist = Allowlist(
            patterns=tuple(config.allow), setting="--allow PATTERN (worker.allow, ROLLQ_WORKER_ALLOW)"
        )
        self.stats = WorkerStats()
        self._finish = self.redis.register_script(scripts.FINISH)
        self._requeue = self.redis.register_script(scripts.REQUEUE)
        self._running: dict[str, _Running] = {}
        self._stop = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._batcher: WriteBatcher | None = None
        self.ready = asyncio.Event()  # set once the consumer group exists and reading began

    @property
    def _writes(self) -> WriteBatcher:
        """The write batcher of the current run(); every job, drain and dead letter happens inside run()."""
        assert self._batcher is not None, "the worker is not running"
        return self._batcher

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop reading new jobs; in-flight jobs get `drain_grace` to finish (SIGTERM does this)."""
        self._stop.set()
        self._slot_free.set()

    async def run(self) -> WorkerStats:
        self._batcher = WriteBatcher(self.redis, self.cfg.publish_batch)
        background = [
            asyncio.create_task(self._batcher.run(), name="publisher"),
            asyncio.create_task(self._lease_loop(), name="lease"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        log.info("worker %s serving run %r (concurrency %d)", self.name, self.cfg.run, self.cfg.concurrency)
        try:
            # Job tasks started below inherit both: workflow_context() finds the context, resolve() the allowlist.
            with enforcing(self.allowlist):
                async with self.context:
                    try:
                        await self._consume_loop()
                        await self._drain()
                    finally:
                        await self.workflows.close()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._deregister()
        log.info("worker %s stopped: %s", self.name, msgspec.json.encode(self.stats).decode())
        return self.stats

    async def _drain(self) -> None:
        if not self._running:
            return
        log.info("draining %d in-flight jobs (grace %.1fs)", len(self._running), self.cfg.drain_grace)
        tasks = [r.task for r in self._running.values()]
        _, unfinished = await asyncio.wait(tasks, timeout=self.cfg.drain_grace)
        if not unfinished:
            return
        left = {eid: r.payload for eid, r in self._running.items() if r.task in unfinished}
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        # Hand the unfinished jobs back to the queue (same attempt: a drain is not a failure).
        waits = [
            self._writes.script(self._requeue, [self.keys.jobs], [WORKER_GROUP, eid, payload])
            for eid, payload in left.items()
            if payload is not None
        ]
        await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), timeout=10)
        log.info("requeued %d unfinished jobs for other workers", len(waits))

    async def _deregister(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self.keys.workers, self.name)
            pipe.hdel(self.keys.worker_info, self.name)
            await pipe.execute()
        except TRANSIENT_ERRORS:
            pass

    # -- reading -------------------------------------------------------------------------------------------------

    async def _consume_loop(self) -> None:
        own_cursor: str | None = "0"  # first re-read what an earlier life of this consumer name left pending
        next_reclaim = 0.0
        delay = 0.05
        group_ready = False
        while not self._stop.is_set():
            free = self.cfg.concurrency - len(self._running)
            if free <= 0:
                self._slot_free.clear()
                if self.cfg.concurrency - len(self._running) <= 0 and not self._stop.is_set():
                    await self._slot_free.wait()
                continue
            try:
                if not group_ready:
                    await ensure_group(self.redis, self.keys.jobs, WORKER_GROUP)
                    group_ready = True
                    self.ready.set()
                if own_cursor is not None:
                    entries = await self._read(own_cursor, free, block=None)
                    if entries:
                        own_cursor = entries[-1][0].decode()
                        await self._start(entries, await self._deliveries(entries))
                    else:
                        own_cursor = None
                    continue
                now = time.monotonic()
                if now >= next_reclaim:
                    next_reclaim = now + self.cfg.reclaim_interval_ms / 1000
                    claimed = await self._reclaim(free)
                    if claimed:
                        continue
                entries = await self._read(">", free, block=self.cfg.block_ms)
                if entries:
                    await self._start(entries, [1] * len(entries))
                delay = 0.05
            except ResponseError as exc:
                if not is_nogroup(exc):
                    raise
                log.warning("consumer group is gone (Redis lost its data?); recreating it")
                group_ready = False
            except TRANSIENT_ERRORS as exc:
                log.warning("redis unavailable (%s); retrying in %.2fs", exc, delay)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
                delay = min(delay * 2, 2.0)

    async def _read(self, start: str, count: int, block: int | None) -> list[tuple[bytes, dict | None]]:
        reply = await self.redis.xreadgroup(WORKER_GROUP, self.name, {self.keys.jobs: start}, count=count, block=block)
        return reply[0][1] if reply else []

    async def _reclaim(self, count: int) -> bool:
        """Take over jobs whose worker stopped refreshing their lease (it died)."""
        reply = await self.redis.xautoclaim(
            self.keys.jobs, WORKER_GROUP, self.name, self.cfg.lease_ms, "0-0", count=count
        )
        entries = [e for e in reply[1] if e[0].decode() not in self._running]
        if not entries:
            return False
        self.stats.reclaimed += len(entries)
        log.info("reclaimed %d jobs from dead workers", len(entries))
        await self._start(entries, await self._deliveries(entries))
        return True

    async def _deliveries(self, entries: list[tuple[bytes, dict | None]]) -> list[int]:
        pipe = self.redis.pipeline(transaction=False)
        for eid, _ in entries:
            pipe.xpending_range(self.keys.jobs, WORKER_GROUP, min=eid, max=eid, count=1)
        replies = await pipe.execute()
        return [int(r[0]["times_delivered"]) if r else 1 for r in replies]

    async def _start(self, entries: list[tuple[bytes, dict | None]], deliveries: list[int]) -> None:
        for (raw_id, fields), count in zip(entries, deliveries, strict=True):
            eid = raw_id.decode()
            if eid in self._running:
                continue
            payload = (fields or {}).get(PAYLOAD_FIELD)
            task = asyncio.create_task(self._handle(eid, payload, fields, count), name=f"job-{eid}")
            self._running[eid] = _Running(task, payload)
            task.add_done_callback(functools.partial(self._job_done, eid))

    def _job_done(self, eid: str, task: asyncio.Task) -> None:
        self._running.pop(eid, None)
        self._slot_free.set()
        if not task.cancelled() and task.exception() is not None:
            # Not the workflow's failure (that is handled in _handle): the job stays pending and is reclaimed.
            log.error("job entry %s could not be finished: %r", eid, task.exception())

    # -- leases and liveness ---------------------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_refresh_ms / 1000)
            ids: list[StreamIdT] = list(self._running)
            if not ids:
                continue
            try:
                await self.redis.xclaim(self.keys.jobs, WORKER_GROUP, self.name, 0, ids, justid=True)
            except TRANSIENT_ERRORS:
                pass  # Redis is away; the next tick tries again
            except ResponseError as exc:
                log.warning("lease refresh failed: %s", exc)

    async def _heartbeat_loop(self) -> None:
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "concurrency": self.cfg.concurrency,
            "engines": self.cfg.engine,
            "started_at": time.time(),
        }
        while True:
            try:
                info["running"] = len(self._running)
                info.update(msgspec.structs.asdict(self.stats))
                pipe = self.redis.pipeline(transaction=False)
                pipe.zadd(self.keys.workers, {self.name: time.time()})
                pipe.zremrangebyscore(self.keys.workers, "-inf", time.time() - FORGET_GONE_WORKERS_S)
                pipe.hset(self.keys.worker_info, self.name, json.dumps(info))
                await pipe.execute()
            except TRANSIENT_ERRORS:
                pass
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)

    # -- one job -------------------------------------------------------------------------------------------------

    def _error(self, exc_type: str, message: str, attempt: int, tb: str = "") -> ErrorRecord:
        return ErrorRecord(
            type=exc_type, message=message, traceback=tb, worker_id=self.name, attempt=attempt, at=time.time()
        )

    async def _handle(self, eid: str, payload: bytes | None, fields: dict | None, deliveries: int) -> None:
        started = time.time()
        job: Job | None = None
        try:
            job = self._decode(eid, payload, fields)
            reply_to = job.reply_to or self.keys.results
            runs = job.attempt + deliveries
            if runs > self.cfg.max_attempts:
                raise _Fatal(
                    self._error(
                        "TooManyAttempts",
                        f"job {job.job_id}#{job.sample_index} was started {runs - 1} times without finishing "
                        f"(max_attempts={self.cfg.max_attempts}); its workers died or were killed each time",
                        runs - 1,
                    )
                )
            try:
                workflow = self.workflows.get(workflow_path(job.workflow, job.data), job.workflow_kwargs, job.agent)
            except WorkflowLoadError as exc:
                raise _Fatal(self._error(type(exc).__name__, str(exc), runs)) from None
            try:
                episode = EpisodeContext(
                    is_eval=job.is_eval,
                    task_id=job.job_id,
                    sample_index=job.sample_index,
                    group_size=job.n,
                    attempt=runs - 1,
                )
                with episode_scope(episode) as responses:  # what workflow_context.get() returns in the episode
                    output = await workflow.arun_episode(self._episode_engine, job.data)
                sequences = to_sequences(output, responses)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the workflow's own failure: retry, then dead-letter
                error = self._error(type(exc).__name__, str(exc) or repr(exc), runs, traceback.format_exc(limit=20))
                if runs < self.cfg.max_attempts:
                    log.warning(
                        "job %s#%d failed (attempt %d/%d): %s: %s",
                        job.job_id,
                        job.sample_index,
                        runs,
                        self.cfg.max_attempts,
                        error.type,
                        error.message,
                    )
                    retry = msgspec.structs.replace(job, attempt=runs)
                    await self._writes.script(
                        self._requeue, [self.keys.jobs], [WORKER_GROUP, eid, self.codec.encode(retry)]
                    )
                    self.stats.requeued += 1
                    return
                raise _Fatal(error) from None
            traj = Trajectory(
                job_id=job.job_id,
                sample_index=job.sample_index,
                n=job.n,
                status="rejected" if sequences is None else "ok",
                sequences=sequences or [],
                worker_id=self.name,
                workflow=job.workflow,
                attempt=runs,
                submitted_at=job.submitted_at,
                started_at=started,
                finished_at=time.time(),
            )
            published = await self._writes.publish(self.keys.jobs, WORKER_GROUP, eid, reply_to, self.codec.encode(traj))
            if published:
                if sequences is None:
                    self.stats.rejected += 1
                else:
                    self.stats.completed += 1
        except _Fatal as fatal:
            await self._dead_letter(
                eid, payload, job or fatal.job, fatal.error, deliveries, started, decoded=job is not None
            )

    def _decode(self, eid: str, payload: bytes | None, fields: dict | None) -> Job:
        if payload is None:
            got = ", ".join(k.decode(errors="replace") for k in (fields or {})) or "no fields"
            raise _Fatal(self._error("MalformedJob", f"stream entry {eid} has no 'd' payload field (has {got})", 1))
        try:
            job = self.codec.decode_job(payload)
        except CodecError as exc:
            raise _Fatal(self._error("MalformedJob", str(exc), 1), salvage_job(payload)) from None
        if job.schema > SCHEMA_VERSION:
            raise _Fatal(
                self._error(
                    "SchemaTooNew",
                    f"job schema {job.schema} is newer than this worker's ({SCHEMA_VERSION}); upgrade the worker",
                    1,
                ),
                job,
            )
        if job.reply_to and not self.keys.owns(job.reply_to):
            raise _Fatal(
                self._error("MalformedJob", f"reply_to {job.reply_to!r} is outside run {self.cfg.run!r}", 1), job
            )
        if job.n < 1 or not 0 <= job.sample_index < job.n:
            raise _Fatal(
                self._error("MalformedJob", f"sample_index {job.sample_index} is not in [0, n={job.n})", 1), job
            )
        return job

    async def _dead_letter(
        self,
        eid: str,
        payload: bytes | None,
        job: Job | None,
        error: ErrorRecord,
        deliveries: int,
        started: float,
        *,
        decoded: bool,
    ) -> None:
        log.error("dead-lettering job entry %s: %s: %s", eid, error.type, error.message)
        letter = DeadLetter(
            entry_id=eid,
            error=error,
            job=job if decoded else None,
            raw=None if decoded else payload,
            deliveries=deliveries,
        )
        traj_payload = b""
        reply_to = self.keys.results
        if job is not None and (not job.reply_to or self.keys.owns(job.reply_to)):
            reply_to = job.reply_to or self.keys.results
            traj_payload = self.codec.encode(
                Trajectory(
                    job_id=job.job_id,
                    sample_index=job.sample_index,
                    n=job.n,
                    status="error",
                    error=error,
                    worker_id=self.name,
                    workflow=job.workflow,
                    attempt=error.attempt,
                    submitted_at=job.submitted_at,
                    started_at=started,
                    finished_at=time.time(),
                )
            )
        done = await self._writes.script(
            self._finish,
            [self.keys.jobs, reply_to, self.keys.dead],
            [WORKER_GROUP, eid, traj_payload, self.codec.encode(letter)],
        )
        if done:
            self.stats.dead_lettered += 1
