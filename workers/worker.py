"""The worker process: pulls jobs through the consumer group, runs workflows, publishes trajectories.

Crash safety comes from the stream protocol: a job stays in the group's pending list until it is acked in the same
atomic step (MULTI/EXEC, or the FINISH/REQUEUE scripts) that publishes its outcome. While a job runs, its lease is
refreshed (XCLAIM JUSTID resets the idle time without counting a delivery), so only jobs of dead workers go idle long
enough to be reclaimed.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import socket
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import StreamIdT

from rollq.engine.types import InferenceEngine
from rollq.protocol import scripts
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.image_limits import ImageLimits
from rollq.protocol.keys import DEFAULT_CLASS, PAYLOAD_FIELD, WORKER_GROUP, RunKeys
from rollq.protocol.limits import describe_bytes
from rollq.protocol.messages import (
    SCHEMA_VERSION,
    DeadLetter,
    ErrorRecord,
    Job,
    JobClass,
    Sequence,
    Trajectory,
    VisionRef,
    job_classes,
)
from rollq.redis_client import (
    TRANSIENT_ERRORS,
    OutageClock,
    ensure_group,
    is_cluster,
    is_nogroup,
    redis_client,
    run_partitions,
)
from rollq.tracing import INVALID_SPAN, Span, SpanKind, Tracing, traceparent
from rollq.workers.agents.agent_user import parse_agent_users
from rollq.workers.agents.command import is_command
from rollq.workers.batcher import WriteBatcher
from rollq.workers.blobs import BlobError, BlobReader
from rollq.workers.config import WorkerConfig
from rollq.workers.construct import KwargConverter
from rollq.workers.context import ContextConfig, EpisodeContext, RecordingEngine, WorkflowContext, episode_scope
from rollq.workers.fair_share import FairShare
from rollq.workers.loader import WorkflowCache, workflow_path
from rollq.workers.media import JobImages, MediaError
from rollq.workers.model_names import ModelNames, serving
from rollq.workers.outputs import to_sequences
from rollq.workers.proxy.server import ProxyConfig
from rollq.workers.resolver import Allowlist, WorkflowLoadError, enforcing
from rollq.workers.run_share import RunShare
from rollq.workers.sample_text import SampleText

log = logging.getLogger("rollq.worker")


class WorkerStats(msgspec.Struct):
    completed: int = 0
    rejected: int = 0
    requeued: int = 0
    dead_lettered: int = 0
    reclaimed: int = 0
    results_dropped: int = 0  # finished, but the job's private reply stream was gone (RunKeys.dropped)
    handed_back: int = 0  # given back to their streams unfinished by a drain (SIGTERM)


class _Running(msgspec.Struct):
    task: asyncio.Task
    payload: bytes | None
    # Its outcome is being written (published, retried or dead-lettered): a drain waits for that write and never
    # hands the job back, which would run a finished episode again (and publish it twice).
    finishing: bool = False


# After drain_grace: how long cancelled episodes get to unwind (command agents' process groups killed, remote reward
# runs aborted) and the hand-back writes get to reach Redis. A worker asked to stop exits within drain_grace +
# HAND_BACK_S + its own close (a few seconds), so terminationGracePeriodSeconds (compose: stop_grace_period) must be
# above drain_grace + 15 s; what a hung Redis leaves unwritten stays pending and is reclaimed after lease_ms.
HAND_BACK_S = 5.0
DEREGISTER_S = 2.0  # how long a stopping worker tries to remove its heartbeat


Entry = tuple[bytes, dict | None]  # a stream entry as XREADGROUP returns it


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
    except (msgspec.DecodeError, ValueError, RecursionError):
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


class _JobHeader(msgspec.Struct):
    """The identifying fields of a job; decoding into it skips the rest (the data) without building it."""

    job_id: str
    workflow: str = ""
    sample_index: int = 0
    n: int = 1
    reply_to: str = ""


def salvage_header(payload: bytes) -> Job | None:
    """The identifying fields of a job too large to decode (its data is skipped, never built)."""
    try:
        if payload[:1] == b"{":
            head = msgspec.json.decode(payload, type=_JobHeader)
        else:
            head = msgspec.msgpack.decode(payload, type=_JobHeader, ext_hook=lambda code, data: None)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError):
        return None
    return Job(
        job_id=head.job_id, workflow=head.workflow, sample_index=head.sample_index, n=head.n, reply_to=head.reply_to
    )


RAW_PREFIX_BYTES = 4096  # what a dead letter keeps of a payload too large to decode


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        engine: InferenceEngine | None = None,
        redis: aioredis.Redis | None = None,
        share: RunShare | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.cfg = config
        # Spans of each sample's attempts (rollq/tracing.py): the given one is its caller's to shut down.
        self.tracing = tracing if tracing is not None else Tracing.from_settings(config, "worker")
        self._owns_tracing = tracing is None
        self.keys = RunKeys(config.run)
        self.name = config.name or default_worker_name()
        self.redis = redis or redis_client(config.redis_url)
        self.engine = engine
        self._episode_engine = RecordingEngine.wrap(engine)  # keeps each episode's responses (outputs.py uses them)
        self.codec = Codec()
        self.blobs = BlobReader(self.redis, max_bytes=config.max_job_bytes)  # jobs' data stored by reference
        # Each job's images: bounded from their headers, decoded once and shared by its samples running here.
        self.images = JobImages(
            config.max_image_pixels,
            ImageLimits(
                max_images=config.max_job_images,
                max_bytes=config.max_job_image_bytes,
                max_pixels=config.max_job_image_pixels,
            ),
        )
        # The models jobs may name (tokenizers, processors): for the converter, and for the names built-in loops load.
        self.models = ModelNames(worker_tokenizer=config.tokenizer, models_root=config.models_root)
        self.workflows = WorkflowCache(KwargConverter(self.models))
        self.sample_text = SampleText(config.tokenizer)  # decodes a sample for a job that asks (Job.text)
        # Shared by this worker's workflows (HTTP clients, the agents' recording proxy); closed when it stops.
        self.context = WorkflowContext(
            ContextConfig(
                tokenizer=config.tokenizer,
                agent_processes=config.agent_processes,
                agent_hosts=config.agent_hosts,
                agent_user=str(parse_agent_users(config.agent_user) or ""),
                environments=config.environments(),
                proxy=ProxyConfig(
                    host=config.proxy_host,
                    port=config.proxy_port,
                    continuation=config.proxy_continuation,
                    max_body_bytes=config.proxy_max_body_bytes,
                    max_image_pixels=config.max_image_pixels,
                ),
                redis_url=config.rewards_url,
                run=config.run,
            )
        )
        # What jobs may import (workflows, reward functions, tools), checked before anything is imported.
        self.allowlist = Allowlist(
            patterns=tuple(config.allow), setting="--allow PATTERN (worker.allow, ROLLQ_WORKER_ALLOW)"
        )
        self.stats = WorkerStats()
        # Called with (job class, outcome, seconds, sequences) as each run of a job ends (workers/metrics.py).
        self.episode_observers: list[Callable[[str, str, float, list[Sequence] | None], None]] = []
        self._finish = self.redis.register_script(scripts.FINISH)
        self._requeue = self.redis.register_script(scripts.REQUEUE)
        self._start_sample = self.redis.register_script(scripts.START_SAMPLE)
        self._forget_workers = self.redis.register_script(scripts.FORGET_WORKERS)
        self._store_blobs = self.redis.register_script(scripts.STORE_BLOBS)
        self._running: dict[tuple[str, str], _Running] = {}  # (job stream, entry id) -> its task
        # Job classes (RunKeys.classes) and the run's partitions (RunKeys.partitions), refreshed every
        # classes_refresh_ms: class -> its streams (one per partition), and the DRR state.
        self._classes: dict[str, JobClass] = job_classes({})
        self._partitions = 1
        self._cluster = is_cluster(self.redis)  # no blocking read across slots there
        self._streams: dict[str, list[str]] = {DEFAULT_CLASS: [self.keys.jobs]}
        self._class_of: dict[str, JobClass] = {self.keys.jobs: self._classes[DEFAULT_CLASS]}  # stream -> class
        self._keys_of: dict[str, RunKeys] = {self.keys.jobs: self.keys}  # stream -> its partition's keys
        self._rotation = 0  # which partition a class's reads start at (turns, so no partition is favoured)
        self._fair = FairShare(self._classes.values())
        self._groups: set[str] = set()  # streams whose consumer group this worker has ensured
        self._own: dict[str, str] = {}  # stream -> cursor through this consumer's own pending entries (a restart)
        # A read failed (Redis away, a Cluster failover): a reply lost with the connection may have delivered entries
        # to this consumer. Once Redis answers again, its pending entries are walked (as at a restart) and those not
        # running are started, rather than left to wait out their lease as if this worker had died.
        self._rewalk = False
        self._held: list[tuple[str, Entry]] = []  # read by a blocking multi-stream read beyond the free slots
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()  # asked to stop twice: the drain's grace ends now
        self._handed_back: set[tuple[str, str]] = set()  # (job stream, entry id) the drain gave back: never published
        self._slot_free = asyncio.Event()
        self._batcher: WriteBatcher | None = None
        self.ready = asyncio.Event()  # set once the consumer group exists and reading began
        # Serving several runs in one process (workers/run_share.py): the slots this run may fill come from there.
        self.share = share
        if share is not None:
            share.join(config.run, lambda: len(self._running), self._slot_free)

    @property
    def _writes(self) -> WriteBatcher:
        """The write batcher of the current run(); every job, drain and dead letter happens inside run()."""
        assert self._batcher is not None, "the worker is not running"
        return self._batcher

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop reading new jobs; in-flight jobs get `drain_grace` to finish, the rest is handed back (SIGTERM does
        this). Asked again (a second SIGTERM, Ctrl-C twice), the grace ends at once."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()
        self._slot_free.set()

    async def run(self) -> WorkerStats:
        self._batcher = WriteBatcher(
            self.redis, self.cfg.publish_batch, outage_s=self.cfg.redis_outage_s, url=self.cfg.redis_url
        )
        background = [
            asyncio.create_task(self._batcher.run(), name="publisher"),
            asyncio.create_task(self._lease_loop(), name="lease"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        log.info("worker %s serving run %r (concurrency %d)", self.name, self.cfg.run, self.cfg.concurrency)
        try:
            # Job tasks started below inherit these: workflow_context() finds the context, resolve() the allowlist,
            # load_tokenizer() the models jobs may name.
            with enforcing(self.allowlist), serving(self.models), self.tracing.installed():
                async with self.context:
                    try:
                        await self._consume_until_stopped()
                        await self._drain()
                    finally:
                        await self.workflows.close()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._deregister()
            if self._owns_tracing:
                await asyncio.to_thread(self.tracing.shutdown)  # exports what is buffered
        log.info("worker %s stopped: %s", self.name, msgspec.json.encode(self.stats).decode())
        return self.stats

    async def _drain(self) -> None:
        """The shutdown contract (docs/deployment.md): entries read but not started go back to their streams at once;
        running jobs get drain_grace to finish (a second stop request ends it early); those still running then are
        cancelled and handed back (REQUEUE: acked, re-added at their stream's tail with the same attempt, so a worker
        reading the stream starts them at once, not after their lease). A job whose outcome is being written when
        the grace ends is not handed back: its write is waited for. Everything after the grace is bounded by
        HAND_BACK_S, so the worker exits before Kubernetes' SIGKILL even when Redis does not answer (then what was
        not written stays pending and is reclaimed after lease_ms: nothing is lost either way)."""
        held, self._held = self._held, []  # read but never started: back to their streams
        writes = [
            self._hand_back(stream, raw_id.decode(), (fields or {}).get(PAYLOAD_FIELD))
            for stream, (raw_id, fields) in held
        ]
        if self._running:
            log.info("draining %d in-flight jobs (grace %.1fs)", len(self._running), self.cfg.drain_grace)
            all_done = asyncio.ensure_future(asyncio.wait([r.task for r in self._running.values()]))
            hurry = asyncio.ensure_future(self._hurry.wait())
            await asyncio.wait([all_done, hurry], timeout=self.cfg.drain_grace, return_when=asyncio.FIRST_COMPLETED)
            all_done.cancel()  # (cancels the wait, not the jobs)
            hurry.cancel()
        left = {key: r for key, r in self._running.items() if not r.task.done()}
        finishing = [r.task for r in left.values() if r.finishing]
        cancelled = {key: r for key, r in left.items() if not r.finishing}
        if left:
            log.info(
                "drain grace over: %d jobs writing their outcome, %d cancelled and handed back",
                len(finishing),
                len(cancelled),
            )
        for r in cancelled.values():
            r.task.cancel()
        # Handed back at once (a cancelled run can no longer publish: _finishing), while the cancelled episodes
        # unwind (agents' process groups killed, reward runs aborted); both bounded.
        writes += [self._hand_back(stream, eid, r.payload) for (stream, eid), r in cancelled.items()]
        waits = [w for w in writes if w is not None] + finishing + [r.task for r in cancelled.values()]
        if waits:
            _, unanswered = await asyncio.wait(waits, timeout=HAND_BACK_S)
            if unanswered:
                log.warning(
                    "%d drain writes or cancelled episodes unfinished after %.0fs (Redis away?); what was not "
                    "written stays pending and is reclaimed after lease_ms",
                    len(unanswered),
                    HAND_BACK_S,
                )

    def _hand_back(self, stream: str, eid: str, payload: bytes | None) -> asyncio.Task | None:
        """Give an entry this worker holds back to its stream (REQUEUE; same attempt: a drain is not a failure), so
        another worker starts it at once. Once handed back, its own run (if any) never publishes."""
        self._handed_back.add((stream, eid))
        if payload is None:  # not a job (no payload): left pending, dead-lettered by whoever reclaims it
            return None
        write = self._writes.script(self._requeue, [stream], [WORKER_GROUP, eid, payload])
        job = salvage_header(payload)
        what = f"job {job.job_id}#{job.sample_index}" if job else "a job"

        async def logged() -> None:
            try:
                new_id = await write
            except Exception as exc:  # Redis refused it or stayed away: the entry stays pending (reclaimed later)
                log.warning("could not hand back %s (entry %s of %s): %s", what, eid, stream, exc)
                return
            if new_id:  # 0: it was acked meanwhile (its outcome was written)
                self.stats.handed_back += 1
                log.info("handed back %s: entry %s of %s, queued again as %s", what, eid, stream, new_id.decode())

        return asyncio.ensure_future(logged())

    async def _consume_until_stopped(self) -> None:
        """The read loop, until a stop request. A read in flight then returns within block_ms; one that Redis never
        answers (a hung connection: there is no socket timeout) is abandoned, so the drain still starts."""
        consume = asyncio.ensure_future(self._consume_loop())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([consume, stop], return_when=asyncio.FIRST_COMPLETED)
            if not consume.done():
                await asyncio.wait([consume], timeout=self.cfg.block_ms / 1000 + 1.0)
        finally:
            stop.cancel()
            if not consume.done():
                log.warning("the read in flight got no answer from Redis; stopping without it")
                consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
        if not consume.cancelled():
            consume.result()  # its error (RedisUnavailable past redis_outage_s) ends the worker as before

    async def _deregister(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self.keys.workers, self.name)
            pipe.hdel(self.keys.worker_info, self.name)
            # Bounded: a Redis that does not answer must not keep a stopping worker past its SIGKILL (its heartbeat
            # then ages out: forget_workers_after).
            await asyncio.wait_for(pipe.execute(), DEREGISTER_S)
        except (*TRANSIENT_ERRORS, TimeoutError):
            pass

    # -- reading -------------------------------------------------------------------------------------------------

    async def _consume_loop(self) -> None:
        next_reclaim = 0.0
        next_classes = 0.0
        delay = 0.05
        outage = OutageClock(self.cfg.redis_url, self.cfg.redis_outage_s, "reading jobs")
        while not self._stop.is_set():
            free = self._free()
            if free <= 0:
                if self.share is not None and not self._held and self.share.under_cap(self.cfg.run):
                    await self._claim_share()
                self._slot_free.clear()
                if self._free() <= 0 and not self._stop.is_set():
                    await self._slot_free.wait()
                continue
            try:
                now = time.monotonic()
                if now >= next_classes or len(self._groups) < len(self._class_of):
                    next_classes = now + self.cfg.classes_refresh_ms / 1000
                    await self._refresh_classes()
                    self.ready.set()
                if self._held:
                    take, self._held = self._held[:free], self._held[free:]
                    for stream, entry in take:
                        await self._start(stream, [entry], await self._deliveries(stream, [entry]))
                    continue
                if self._own:  # first re-read what an earlier life of this consumer name left pending
                    stream, cursor = next(iter(self._own.items()))
                    entries = await self._read(stream, cursor, free, block=None)
                    if entries:
                        self._own[stream] = entries[-1][0].decode()
                        held = {e[0] for s, e in self._held if s == stream}  # read already, started when slots free up
                        if fresh := [e for e in entries if e[0] not in held]:
                            await self._start(stream, fresh, await self._deliveries(stream, fresh))
                    else:
                        del self._own[stream]
                    continue
                if now >= next_reclaim:
                    next_reclaim = now + self.cfg.reclaim_interval_ms / 1000
                    claimed = await self._reclaim(free)
                    if claimed:
                        continue
                before = len(self._running)
                if len(self._class_of) == 1:  # one class, one partition (the usual case): one blocking read
                    stream = self._streams[DEFAULT_CLASS][0]
                    entries = await self._read(stream, ">", free, block=self.cfg.block_ms)
                    if entries:
                        await self._start(stream, entries, [1] * len(entries))
                else:
                    await self._read_classes(free)
                if self.share is not None:  # found work or none: the other runs' shares follow
                    self.share.wanting(self.cfg.run, len(self._running) > before or bool(self._held))
                delay = 0.05
                outage.ok()
                if self._rewalk:
                    self._rewalk = False
                    for stream in self._class_of:
                        self._own.setdefault(stream, "0")
            except TRANSIENT_ERRORS as exc:
                self._rewalk = True
                outage.failed(exc)  # past redis_outage_s: RedisUnavailable ends the worker
                log.warning("redis unavailable (%s); retrying in %.2fs", exc, delay)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
                delay = min(delay * 2, 2.0)
            except ResponseError as exc:
                if not is_nogroup(exc):
                    raise
                log.warning("consumer group is gone (Redis lost its data?); recreating it")
                self._groups.clear()

    async def _refresh_classes(self) -> None:
        """Follow the run's job classes (RunKeys.classes: their priorities and weights) and partitions."""
        classes = job_classes(await self.redis.hgetall(self.keys.classes))  # type: ignore[misc]  # sync|async stub
        # A count Redis lost (a restart that lost writes) never shrinks what this worker reads.
        partitions = max(self._partitions, await run_partitions(self.redis, self.keys.partitions, self.cfg.partitions))
        if classes != self._classes or partitions != self._partitions:
            names = ", ".join(f"{c.name} (priority {c.priority}, weight {c.weight:g})" for c in classes.values())
            log.info("job classes: %s; %d partition(s)", names, partitions)
            self._classes, self._partitions = classes, partitions
            self._fair.update(classes.values())
            parts = [self.keys.at(p) for p in range(partitions)]
            self._streams = {name: [k.job_stream(name) for k in parts] for name in self._fair.order()}
            self._keys_of = {k.job_stream(name): k for name in classes for k in parts}
            self._class_of = {stream: classes[name] for name, streams in self._streams.items() for stream in streams}
        for stream in self._class_of:
            if stream not in self._groups:
                await ensure_group(self.redis, stream, WORKER_GROUP)
                self._groups.add(stream)
                self._own.setdefault(stream, "0")

    def _split(self, name: str, count: int, empty: set[str]) -> list[tuple[str, int]]:
        """`count` reads of class `name` spread over its partitions' streams not found empty in this fill, starting
        at a partition that turns with each call."""
        streams = [s for s in self._streams[name] if s not in empty]
        if not streams:
            return []
        self._rotation += 1
        k = self._rotation % len(streams)
        streams = streams[k:] + streams[:k]
        base, extra = divmod(count, len(streams))
        return [(stream, base + (i < extra)) for i, stream in enumerate(streams) if base + (i < extra)]

    async def _read_classes(self, free: int) -> None:
        """Fill `free` slots across the class streams: strict priority between levels, DRR by weight within one;
        a class's share is read from its partitions in turn. One pipelined non-blocking read per round; a stream
        that comes back short is out for this fill, a class whose streams all are is exhausted and its slots go to
        the rest. When every stream is empty, one blocking read on all of them."""
        candidates = set(self._streams)
        empty: set[str] = set()
        started = 0
        while free > 0 and candidates:
            order = self._fair.allocate(free, candidates)
            plan = collections.Counter(order)
            reads = [(name, stream, n) for name, count in plan.items() for stream, n in self._split(name, count, empty)]
            replies = await self._read_new([(stream, n) for _, stream, n in reads])
            got: dict[str, collections.deque[tuple[str, Entry]]] = {name: collections.deque() for name in plan}
            for (name, stream, n), entries in zip(reads, replies, strict=True):
                got[name].extend((stream, e) for e in entries)
                if len(entries) < n:
                    empty.add(stream)
            for name in plan:
                if all(stream in empty for stream in self._streams[name]):
                    self._fair.exhausted(name)
                    candidates.discard(name)
            for name in order:  # start them in DRR order, so start order shows the shares slot by slot
                if got[name]:
                    stream, entry = got[name].popleft()
                    await self._start(stream, [entry], [1])
                    free -= 1
                    started += 1
        if started:
            return
        streams = list(self._class_of)  # highest priority first
        count = max(1, free // len(streams))
        woke = await self._block_read(streams, count)
        for stream, entries in woke:
            take = entries[:free]
            self._held.extend((stream, e) for e in entries[free:])  # started first when slots free up
            if take:
                await self._start(stream, take, [1] * len(take))
                free -= len(take)

    async def _block_read(self, streams: list[str], count: int) -> list[tuple[str, list[Entry]]]:
        """Wait (up to block_ms) for entries on any of `streams`; returns them per stream, in `streams` order. On
        Redis Cluster a read can't span slots: each stream is read on its own, all at once, waiting at most
        cluster_block_ms so no stream's entries wait for another's timeout."""
        if not self._cluster:
            reply = await self.redis.xreadgroup(
                WORKER_GROUP, self.name, dict.fromkeys(streams, ">"), count=count, block=self.cfg.block_ms
            )
            woke = [(key.decode() if isinstance(key, bytes) else key, entries) for key, entries in reply or []]
            return sorted(woke, key=lambda kv: streams.index(kv[0]))
        block = min(self.cfg.block_ms, self.cfg.cluster_block_ms)
        replies = await self._read_new([(stream, count) for stream in streams], block=block)
        return [(stream, entries) for stream, entries in zip(streams, replies, strict=True) if entries]

    async def _read_new(self, reads: list[tuple[str, int]], block: int | None = None) -> list[list[Entry]]:
        """New entries (`>`) of each (stream, count), in `reads` order: one pipeline on one Redis (`block` unused:
        callers block on one Redis with one multi-stream read). On Redis Cluster (a pipeline's reads span nodes)
        each stream is read on its own, all at once, blocking up to `block` ms; when a read fails (its node is away:
        a failover), what the others read is kept in `_held` (started first, leases refreshed) and the error raised.
        Entries Redis delivered are pending for this worker: dropping them would leave them to wait out a lease
        (`lease_ms`) before anyone runs them."""
        if not self._cluster:
            pipe = self.redis.pipeline(transaction=False)
            for stream, n in reads:
                pipe.xreadgroup(WORKER_GROUP, self.name, {stream: ">"}, count=n)
            return [reply[0][1] if reply else [] for reply in await pipe.execute()]
        replies = await asyncio.gather(
            *(self._read(stream, ">", n, block=block) for stream, n in reads), return_exceptions=True
        )
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is None:
            return [r for r in replies if not isinstance(r, BaseException)]
        for (stream, _), reply in zip(reads, replies, strict=True):
            if not isinstance(reply, BaseException):
                self._held.extend((stream, e) for e in reply)
        raise failed

    async def _read(self, stream: str, start: str, count: int, block: int | None) -> list[Entry]:
        reply = await self.redis.xreadgroup(WORKER_GROUP, self.name, {stream: start}, count=count, block=block)
        return reply[0][1] if reply else []

    async def _reclaim(self, count: int) -> bool:
        """Take over jobs whose worker stopped refreshing their lease (it died), stream by stream (highest
        priority first)."""
        claimed = 0
        for stream in self._class_of:
            if count - claimed <= 0:
                break
            reply = await self.redis.xautoclaim(
                stream, WORKER_GROUP, self.name, self.cfg.lease_ms, "0-0", count=count - claimed
            )
            entries = [e for e in reply[1] if (stream, e[0].decode()) not in self._running]
            if not entries:
                continue
            self.stats.reclaimed += len(entries)
            claimed += len(entries)
            log.info("reclaimed %d jobs of %s from dead workers", len(entries), stream)
            await self._start(stream, entries, await self._deliveries(stream, entries))
        return claimed > 0

    async def _deliveries(self, stream: str, entries: list[Entry]) -> list[int]:
        pipe = self.redis.pipeline(transaction=False)
        for eid, _ in entries:
            pipe.xpending_range(stream, WORKER_GROUP, min=eid, max=eid, count=1)
        replies = await pipe.execute()
        return [int(r[0]["times_delivered"]) if r else 1 for r in replies]

    async def _start(self, stream: str, entries: list[Entry], deliveries: list[int]) -> None:
        for (raw_id, fields), count in zip(entries, deliveries, strict=True):
            eid = raw_id.decode()
            if (stream, eid) in self._running:
                continue
            if self._stop.is_set():  # read by a read that was in flight as the stop came: handed back by the drain
                self._held.append((stream, (raw_id, fields)))
                continue
            payload = (fields or {}).get(PAYLOAD_FIELD)
            task = asyncio.create_task(self._handle(eid, payload, fields, count, stream), name=f"job-{eid}")
            self._running[(stream, eid)] = _Running(task, payload)
            task.add_done_callback(functools.partial(self._job_done, (stream, eid)))

    async def _claim_share(self) -> None:
        """Serving several runs, with the process full of the other runs' jobs (lent while this one had nothing)
        and this run under its part: read a little of what is queued for it, without blocking, and hold it. The
        share then counts it as wanting: the others start nothing beyond their parts, and as their jobs end the
        held entries start (at the top of the loop)."""
        assert self.share is not None
        streams = list(self._class_of)
        try:
            replies = await self._read_new([(stream, 1) for stream in streams])
        except (*TRANSIENT_ERRORS, ResponseError) as exc:  # the loop's next read reports and recovers
            log.debug("claiming a share of the slots: %s", exc)
            return
        held = [(stream, entry) for stream, entries in zip(streams, replies, strict=True) for entry in entries]
        self._held.extend(held)
        self.share.wanting(self.cfg.run, bool(held))

    def _free(self) -> int:
        """Slots to fill now: the concurrency left, or this run's part of the process's (serving several runs)."""
        if self.share is None:
            return self.cfg.concurrency - len(self._running)
        return self.share.free(self.cfg.run)

    def _job_done(self, key: tuple[str, str], task: asyncio.Task) -> None:
        self._running.pop(key, None)
        self._slot_free.set()
        if self.share is not None:
            self.share.released()
        if not task.cancelled() and task.exception() is not None:
            # Not the workflow's failure (that is handled in _handle): the job stays pending and is reclaimed.
            log.error("job entry %s of %s could not be finished: %r", key[1], key[0], task.exception())

    # -- leases and liveness ---------------------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_refresh_ms / 1000)
            by_stream: dict[str, list[StreamIdT]] = {}
            for stream, eid in [*self._running, *((s, e[0].decode()) for s, e in self._held)]:
                by_stream.setdefault(stream, []).append(eid)
            if not by_stream:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                for stream, ids in by_stream.items():
                    pipe.xclaim(stream, WORKER_GROUP, self.name, 0, ids, justid=True)
                await pipe.execute()
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
        sweep = True  # the first beat also forgets info entries that have no heartbeat at all
        refused = ""  # the last refusal logged (logged once, not every beat)
        while True:
            try:
                info["running"] = len(self._running)
                info.update(msgspec.structs.asdict(self.stats))
                pipe = self.redis.pipeline(transaction=False)
                pipe.zadd(self.keys.workers, {self.name: time.time()})
                pipe.hset(self.keys.worker_info, self.name, json.dumps(info))
                await pipe.execute()
                await self._forget_workers(  # crashed workers: their heartbeat and info (no script in a pipeline:
                    keys=[self.keys.workers, self.keys.worker_info],  # redis-py's cluster pipeline refuses them)
                    args=[time.time() - self.cfg.forget_workers_after, 1 if sweep else 0],
                )
                sweep = False
            except TRANSIENT_ERRORS:
                pass
            except ResponseError as exc:  # e.g. NOPERM from a Redis user without these rights: say so, keep beating
                if str(exc) != refused:
                    refused = str(exc)
                    log.error("heartbeat failed: %s (the worker keeps running; `rollq status` may show it dead)", exc)
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)

    # -- one job -------------------------------------------------------------------------------------------------

    def _error(self, exc_type: str, message: str, attempt: int, tb: str = "") -> ErrorRecord:
        return ErrorRecord(
            type=exc_type, message=message, traceback=tb, worker_id=self.name, attempt=attempt, at=time.time()
        )

    async def _handle(
        self, eid: str, payload: bytes | None, fields: dict | None, deliveries: int, stream: str = ""
    ) -> None:
        started = time.time()
        jobs = stream or self.keys.jobs  # the entry's own (class's) stream: acks, retries and dead letters go there
        keys = self._keys_of.get(jobs, self.keys)  # its partition's keys: everything one step writes is in its slot
        job: Job | None = None
        attempt: Span = INVALID_SPAN  # this run's span (tracing on): a child of the job's submit
        held: str | None = None  # the key of the job's decoded images this sample holds (self.images)
        try:
            job = self._decode(eid, payload, fields, keys)
            if self.tracing.enabled:
                attempt = self._attempt_span(job, eid, deliveries)
            reply_to = job.reply_to or keys.results
            if job.cancellable:  # mark the sample started, unless its job was cancelled (then it is acked, not run)
                skipped = Trajectory(
                    job_id=job.job_id,
                    sample_index=job.sample_index,
                    n=job.n,
                    status="cancelled",
                    worker_id=self.name,
                    workflow=job.workflow,
                    submitted_at=job.submitted_at,
                    started_at=started,
                    finished_at=started,
                )
                start_keys = [keys.job_control(job.job_id), jobs, reply_to]
                if job.tenant:  # the sample leaves its tenant's queued-sample count (quota) as it starts
                    start_keys += [keys.tenant_queued(job.tenant), *self._charge_keys(job, keys)]
                if not await self._writes.script(
                    self._start_sample,
                    start_keys,
                    [WORKER_GROUP, eid, job.sample_index, self.codec.encode(skipped)],
                ):
                    return
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
            if job.agent is not None and job.agent.timeout_seconds > self.cfg.max_agent_timeout:
                raise _Fatal(
                    self._error(
                        "AgentTimeoutTooLong",
                        f"job {job.job_id}#{job.sample_index}: agent.timeout_seconds={job.agent.timeout_seconds:g} "
                        f"is over the worker's max_agent_timeout={self.cfg.max_agent_timeout:g}",
                        runs,
                    )
                )
            data, held = await self._data(job, keys, runs)
            # A tenant's job may use only what its tenant's patterns allow too, for everything it imports.
            allowlist = self.allowlist.narrowed(job.allow)
            try:
                with enforcing(allowlist):
                    workflow = self.workflows.get(
                        workflow_path(job.workflow, data),
                        job.workflow_kwargs,
                        job.agent,
                        job.allow,
                        optional=job.optional_kwargs,
                    )
                text_tokenizer = self.sample_text.tokenizer_of(job) if job.text else None
            except WorkflowLoadError as exc:
                raise _Fatal(self._error(type(exc).__name__, str(exc), runs)) from None
            try:
                job_class = self._class_of.get(jobs) or self._classes.get(job.job_class) or self._classes[DEFAULT_CLASS]
                episode = EpisodeContext(
                    is_eval=job.is_eval,
                    task_id=job.job_id,
                    sample_index=job.sample_index,
                    group_size=job.n,
                    attempt=runs - 1,
                    job_class=job_class.name,
                    priority=job_class.priority if job.priority is None else job.priority,
                    lora=job.lora,
                )
                with (
                    enforcing(allowlist),
                    episode_scope(episode) as responses,  # workflow_context.get() in it
                    self.tracing.within(attempt),
                    self.tracing.span("episode", attributes={"rollq.workflow": self.tracing.workflow(job.workflow)}),
                ):
                    output = await workflow.arun_episode(self._episode_engine, data)
                sequences = to_sequences(output, responses)
                if text_tokenizer is not None and sequences:  # the job asked for its text (Job.text)
                    await self.sample_text.add(text_tokenizer, sequences)
            except asyncio.CancelledError:
                raise
            except WorkflowLoadError as exc:  # found only when it ran (an environment its driver cannot load)
                raise _Fatal(self._error(type(exc).__name__, str(exc), runs)) from None
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
                    self.tracing.error(attempt, error.type, error.message, retried=True)
                    if not self._finishing(jobs, eid):
                        return
                    await self._writes.script(self._requeue, [jobs], [WORKER_GROUP, eid, self.codec.encode(retry)])
                    self.stats.requeued += 1
                    self._observe(job, "failed", started)
                    return
                raise _Fatal(error) from None
            if sequences:
                await self._store_vision(sequences, keys)
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
                traceparent=traceparent(attempt) if self.tracing.enabled else "",  # sampled or not: followed
            )
            if attempt.is_recording():
                attempt.set_attribute("rollq.outcome", traj.status)
                attempt.set_attribute("rollq.reward", [s.reward for s in traj.sequences])
            encoded = self.codec.encode(traj)
            if len(encoded) > self.cfg.max_trajectory_bytes:
                raise _Fatal(
                    self._error(
                        "TrajectoryTooLarge",
                        f"the trajectory of job {job.job_id}#{job.sample_index} encodes to "
                        f"{describe_bytes(len(encoded))}, over the worker's "
                        f"max_trajectory_bytes={self.cfg.max_trajectory_bytes}",
                        runs,
                    )
                )
            if not self._finishing(jobs, eid):
                return
            if job.cancellable and job.tenant:  # an ingress job: the sample's end also ends its charge (FINISH)
                done = await self._writes.script(
                    self._finish,
                    [jobs, reply_to, keys.dead, keys.dropped, *self._charge_keys(job, keys, control=True)],
                    [WORKER_GROUP, eid, encoded, "", 1 if reply_to != keys.results else 0, job.sample_index],
                )
                published = None if done == 0 else 0 if done == 2 else 1  # 2: its stream is gone (counted there)
            else:
                published = await self._writes.publish(
                    jobs, WORKER_GROUP, eid, reply_to, encoded, private=reply_to != keys.results
                )
            if published == 0:  # its private reply stream is gone (its caller left): dropped, not recreated
                await self._result_dropped(job, eid, keys, counted=job.cancellable and bool(job.tenant))
            elif published:
                if sequences is None:
                    self.stats.rejected += 1
                else:
                    self.stats.completed += 1
                self._observe(job, "rejected" if sequences is None else "ok", started, sequences)
        except _Fatal as fatal:
            failed = job or fatal.job
            if failed is not None and self.tracing.enabled and not attempt.get_span_context().is_valid:
                attempt = self._attempt_span(failed, eid, deliveries)  # refused before its run began
            self.tracing.error(attempt, fatal.error.type, fatal.error.message)
            attempt.set_attribute("rollq.outcome", "dead_lettered")
            if not self._finishing(jobs, eid):
                return
            await self._dead_letter(
                eid, payload, job or fatal.job, fatal.error, deliveries, started, decoded=job is not None, stream=jobs
            )
            self._observe(job, "dead_lettered", started)
        finally:
            if held is not None:
                self.images.release(held)
            attempt.end()

    def _finishing(self, stream: str, eid: str) -> bool:
        """The job's outcome is about to be written: a drain now waits for that write instead of handing the job
        back. False when the drain has handed it back already (a workflow that ignored its cancellation): its
        outcome is dropped, as the job runs again elsewhere."""
        if (stream, eid) in self._handed_back:
            return False
        running = self._running.get((stream, eid))
        if running is not None:
            running.finishing = True
        return True

    def _attempt_span(self, job: Job, eid: str, deliveries: int) -> Span:
        """A run of one sample on this worker, in the trace of the job's submit (a new trace when it has none)."""
        return self.tracing.start(
            "attempt",
            parent=job.traceparent or None,
            kind=SpanKind.CONSUMER,
            attributes={
                "rollq.job_id": job.job_id,
                "rollq.sample_index": job.sample_index,
                "rollq.sample_id": f"{job.job_id}#{job.sample_index}",
                "rollq.attempt": job.attempt + deliveries,
                "rollq.worker": self.name,
                "rollq.workflow": self.tracing.workflow(job.workflow),
                "rollq.entry_id": eid,
            },
        )

    async def _store_vision(self, sequences: list[Sequence], keys: RunKeys) -> None:
        """Moves the sequences' large VisionInputs to the run's blob store (content-addressed: a rerun after a crash
        stores the same key), before the trajectory that references them is published."""
        large = [s for s in sequences if s.vision and s.vision.inline and s.vision.size >= self.cfg.vision_inline_bytes]
        if not large:
            return
        blobs = {s.vision.digest: s.vision.inline for s in large if s.vision}
        await self._writes.script(
            self._store_blobs,
            [*(keys.blob(d) for d in blobs), *(keys.blob_refs(d) for d in blobs)],
            [self.cfg.blob_ttl_s, *blobs.values()],
        )
        for s in large:
            assert s.vision is not None
            s.vision = VisionRef(digest=s.vision.digest, size=s.vision.size)

    def _observe(self, job: Job | None, outcome: str, started: float, sequences: list[Sequence] | None = None) -> None:
        for observe in self.episode_observers:
            observe(job.job_class if job else DEFAULT_CLASS, outcome, time.time() - started, sequences)

    async def _data(self, job: Job, keys: RunKeys, runs: int) -> tuple[object, str | None]:
        """The job's data: its own, or what its `data_ref` names in the blob store (a sample's own decoded copy),
        with its images made ready for the workflow (workers/media.py: checked against the job's image limits
        before any is decoded; a command agent gets them as data URIs); and the key of the job's decoded images
        this sample now holds (self.images.release once it is done), or None."""
        try:
            data = job.data if not job.data_ref else self.codec.decode_data(await self.blobs.get(keys, job.data_ref))
            raw = is_command(job.workflow) and not (isinstance(data, dict) and data.get("agent_name"))
            return await self.images.acquire(job.data_ref or None, data, raw=raw)
        except BlobError as exc:
            raise _Fatal(self._error(exc.kind, f"job {job.job_id}#{job.sample_index}: {exc}", runs)) from None
        except CodecError as exc:
            raise _Fatal(self._error("MalformedJob", f"job {job.job_id}#{job.sample_index}: {exc}", runs)) from None
        except MediaError as exc:
            raise _Fatal(self._error("BadImage", f"job {job.job_id}#{job.sample_index}: {exc}", runs)) from None

    def _decode(self, eid: str, payload: bytes | None, fields: dict | None, keys: RunKeys) -> Job:
        if payload is None:
            got = ", ".join(k.decode(errors="replace") for k in (fields or {})) or "no fields"
            raise _Fatal(self._error("MalformedJob", f"stream entry {eid} has no 'd' payload field (has {got})", 1))
        if len(payload) > self.cfg.max_job_bytes:  # refused before decoding: its waiter gets the error if readable
            raise _Fatal(
                self._error(
                    "JobTooLarge",
                    f"job payload of stream entry {eid} is {describe_bytes(len(payload))}, over the worker's "
                    f"max_job_bytes={self.cfg.max_job_bytes}",
                    1,
                ),
                salvage_header(payload),
            )
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
        if job.reply_to and not keys.owns(job.reply_to):
            where = f"partition {keys.partition} of run {self.cfg.run!r}" if keys.partition else f"run {self.cfg.run!r}"
            raise _Fatal(self._error("MalformedJob", f"reply_to {job.reply_to!r} is outside {where}", 1), job)
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
        stream: str = "",
    ) -> None:
        log.error("dead-lettering job entry %s: %s: %s", eid, error.type, error.message)
        stream = stream or self.keys.jobs
        keys = self._keys_of.get(stream, self.keys)
        raw = None if decoded else payload
        if raw is not None and error.type == "JobTooLarge":
            raw = raw[:RAW_PREFIX_BYTES]  # a prefix to tell what it was, not another copy of the whole payload
        letter = DeadLetter(
            entry_id=eid,
            error=error,
            job=job if decoded else None,
            raw=raw,
            deliveries=deliveries,
        )
        traj_payload = b""
        reply_to = keys.results
        if job is not None and (not job.reply_to or keys.owns(job.reply_to)):
            reply_to = job.reply_to or keys.results
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
        finish_keys = [stream, reply_to, keys.dead, keys.dropped]
        finish_args: list[Any] = [
            WORKER_GROUP, eid, traj_payload, self.codec.encode(letter), 1 if reply_to != keys.results else 0
        ]  # fmt: skip
        if decoded and job is not None and job.cancellable and job.tenant:
            finish_keys += self._charge_keys(job, keys, control=True)  # its sample is done: its charge may end
            finish_args.append(job.sample_index)
        done = await self._writes.script(self._finish, finish_keys, finish_args)
        if done:
            self.stats.dead_lettered += 1
        if done == 2:
            self.stats.results_dropped += 1

    def _charge_keys(self, job: Job, keys: RunKeys, *, control: bool = False) -> list[str]:
        """An ingress job's keys of its tenant's byte quota and of its data's blob (SAMPLE_DONE in
        protocol/scripts.py), after its control hash when `control`."""
        out = [keys.job_control(job.job_id)] if control else []
        out += [keys.tenant_charges(job.tenant), keys.tenant_bytes(job.tenant)]
        if job.data_ref:
            try:
                out += [keys.blob_refs(job.data_ref), keys.blob(job.data_ref)]
            except ValueError:  # not a digest: its data read refuses it (MalformedJob); its blob is not touched
                pass
        return out

    async def _result_dropped(self, job: Job, eid: str, keys: RunKeys, *, counted: bool = False) -> None:
        """`counted`: FINISH already counted it in the run's dropped hash."""
        self.stats.results_dropped += 1
        log.warning(
            "job %s sample %d (entry %s): reply stream %s is gone; result dropped",
            job.job_id,
            job.sample_index,
            eid,
            job.reply_to,
        )
        if counted:
            return
        try:
            await self.redis.hincrby(keys.dropped, "reply_gone", 1)  # type: ignore[misc]  # stub: sync|async
        except TRANSIENT_ERRORS:
            pass  # accounting only; the job itself is acked
