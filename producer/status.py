"""`rollq status`: what is queued, running, pending, dead-lettered, and which workers are alive."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys, inflight_key
from rollq.protocol.messages import job_classes
from rollq.redis_client import run_partitions

if TYPE_CHECKING:
    from rich.console import RenderableType

WORKER_TTL_S = 15.0  # a worker that has not sent a heartbeat for this long is reported dead


class ConsumerStatus(msgspec.Struct):
    name: str
    pending: int
    idle_ms: int


class GroupStatus(msgspec.Struct):
    name: str
    pending: int
    lag: int | None
    consumers: list[ConsumerStatus]


class StreamStatus(msgspec.Struct):
    key: str
    length: int
    groups: list[GroupStatus]
    inflight: int | None = None  # results streams: samples submitted for it and not yet consumed


class WorkerStatus(msgspec.Struct):
    name: str
    alive: bool
    last_seen_s: float
    info: dict[str, Any]


class DeadLetterSummary(msgspec.Struct):
    entry_id: str
    job_id: str | None
    error_type: str
    message: str


class TrainerStatus(msgspec.Struct):
    """The staleness ledger a trainer keeps for the run."""

    version: int  # the policy version new admissions are counted against
    admitted: int  # samples admitted and not given back
    released: int  # samples given back by dropped groups
    bound: int | None  # (eta + version + 1) * B, when the trainer recorded eta and B
    released_by_reason: dict[str, int] = {}  # the given-back samples per drop reason (stale, failed, ...)


class RunStatus(msgspec.Struct):
    run: str
    jobs: StreamStatus  # the default class's stream on partition 0 (also the first of job_streams)
    results: list[StreamStatus]  # every partition's shared results stream and private reply streams
    dead_letters: int  # all partitions
    recent_dead_letters: list[DeadLetterSummary]
    workers: list[WorkerStatus]
    trainer: TrainerStatus | None = None
    partitions: int = 1
    job_streams: list[StreamStatus] = []  # every job class's stream on every partition
    dropped: dict[str, int] = {}  # results workers dropped instead of publishing, per reason (all partitions)


async def _stream_status(redis: aioredis.Redis, key: str) -> StreamStatus:
    length = await redis.xlen(key)
    groups: list[GroupStatus] = []
    try:
        infos = await redis.xinfo_groups(key)
    except ResponseError:  # no such stream
        infos = []
    for g in infos:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        consumers = [
            ConsumerStatus(
                name=c["name"].decode() if isinstance(c["name"], bytes) else c["name"],
                pending=int(c["pending"]),
                idle_ms=int(c["idle"]),
            )
            for c in await redis.xinfo_consumers(key, name)
        ]
        lag = g.get("lag")
        groups.append(GroupStatus(name, int(g["pending"]), None if lag is None else int(lag), consumers))
    return StreamStatus(key, length, groups)


async def gather_status(redis: aioredis.Redis, run: str, *, recent: int = 5) -> RunStatus:
    keys = RunKeys(run)
    codec = Codec()
    count = await run_partitions(redis, keys.partitions)
    parts = [keys.at(p) for p in range(count)]
    classes = job_classes(await redis.hgetall(keys.classes))  # type: ignore[misc]  # redis-py stub: sync|async
    job_streams = [await _stream_status(redis, k.job_stream(name)) for name in classes for k in parts]
    jobs = next(st for st in job_streams if st.key == keys.jobs)
    result_keys = []
    for k in parts:
        result_keys.append(k.results)
        async for key in redis.scan_iter(match=f"{k.prefix}:results:*", _type="stream"):
            result_keys.append(key.decode())
    results = []
    for key in result_keys:
        st = await _stream_status(redis, key)
        st.inflight = int(await redis.get(inflight_key(key)) or 0)
        results.append(st)
    dead_count = 0
    recent_dead: list[DeadLetterSummary] = []
    dropped: dict[str, int] = {}
    for k in parts:
        dead_count += await redis.xlen(k.dead)
        for reason, n in (await redis.hgetall(k.dropped)).items():  # type: ignore[misc]  # stub: sync|async
            dropped[reason.decode()] = dropped.get(reason.decode(), 0) + int(n)
        for eid, fields in await redis.xrevrange(k.dead, count=recent):
            try:
                letter = codec.decode_dead_letter(fields.get(PAYLOAD_FIELD, b""))
                recent_dead.append(
                    DeadLetterSummary(
                        eid.decode(), letter.job.job_id if letter.job else None, letter.error.type, letter.error.message
                    )
                )
            except CodecError as exc:
                recent_dead.append(DeadLetterSummary(eid.decode(), None, "Undecodable", str(exc)))
    recent_dead = sorted(recent_dead, key=lambda d: tuple(map(int, d.entry_id.split("-"))), reverse=True)[:recent]
    now = time.time()
    workers = []
    seen = await redis.zrange(keys.workers, 0, -1, withscores=True)
    infos = await redis.hgetall(keys.worker_info)  # type: ignore[misc]  # redis-py stub: sync|async union
    for name, last in seen:
        info = json.loads(infos.get(name, b"{}"))
        workers.append(WorkerStatus(name.decode(), now - last < WORKER_TTL_S, round(now - last, 1), info))
    trainer = await _trainer_status(redis, keys)
    return RunStatus(run, jobs, results, dead_count, recent_dead, workers, trainer, count, job_streams, dropped)


async def _trainer_status(redis: aioredis.Redis, keys: RunKeys) -> TrainerStatus | None:
    ledger = await redis.hgetall(keys.ledger)  # type: ignore[misc]  # redis-py stub: sync|async union
    raw = {k.decode(): int(v) for k, v in ledger.items()}
    if not raw:
        return None
    bound = None
    if "eta" in raw and "batch" in raw:
        bound = (raw["eta"] + raw.get("version", 0) + 1) * raw["batch"]
    reasons = {k.removeprefix("released:"): v for k, v in raw.items() if k.startswith("released:")}
    return TrainerStatus(raw.get("version", 0), raw.get("admitted", 0), raw.get("released", 0), bound, reasons)


def _reasons(t: TrainerStatus) -> str:
    """ " (stale 12, failed 4)" after the given-back count, when the ledger counted reasons."""
    parts = [f"{reason} {n}" for reason, n in sorted(t.released_by_reason.items())]
    return f" ({', '.join(parts)})" if parts else ""


def render_status(st: RunStatus) -> RenderableType:
    """`rollq status --watch`: the same facts as format_status, as rich tables."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    queues = Table(
        title=f"run {st.run}: streams" + (f" ({st.partitions} partitions)" if st.partitions > 1 else ""),
        title_justify="left",
        expand=False,
    )
    for col in ("stream", "entries", "in flight", "group", "pending", "unread", "consumers"):
        if col == "stream":
            queues.add_column(col, overflow="fold")
        else:
            queues.add_column(col, justify="left" if col == "group" else "right")
    for s in [*(st.job_streams or [st.jobs]), *st.results]:
        inflight = "" if s.inflight is None else str(s.inflight)
        if not s.groups:
            queues.add_row(s.key, str(s.length), inflight, "", "", "", "")
        for i, g in enumerate(s.groups):
            lag = "?" if g.lag is None else str(g.lag)
            first = i == 0
            queues.add_row(
                s.key if first else "",
                str(s.length) if first else "",
                inflight if first else "",
                g.name,
                str(g.pending),
                lag,
                str(len(g.consumers)),
            )
    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "state", "running", "completed", "dead-lettered", "last seen"):
        workers.add_column(col, justify="left" if col in ("worker", "state") else "right")
    for w in st.workers:
        workers.add_row(
            w.name,
            Text("alive", style="green") if w.alive else Text("gone", style="red"),
            str(w.info.get("running", "?")),
            str(w.info.get("completed", "?")),
            str(w.info.get("dead_lettered", "?")),
            f"{w.last_seen_s:.1f}s",
        )
    parts: list[RenderableType] = [queues, workers]
    dropped = "".join(f", {n} dropped ({reason})" for reason, n in sorted(st.dropped.items()))
    dead = Table(title=f"dead letters: {st.dead_letters}{dropped}", title_justify="left")
    for col in ("entry", "job", "error", "message"):
        dead.add_column(col, overflow="fold")
    for d in st.recent_dead_letters:
        dead.add_row(d.entry_id, d.job_id or "?", d.error_type, d.message[:200])
    parts.append(dead)
    if st.trainer is not None:
        t = st.trainer
        bound = f" of at most {t.bound}" if t.bound is not None else ""
        parts.append(
            Text(
                f"trainer: policy version {t.version}; {t.admitted} samples admitted{bound}, "
                f"{t.released} given back by dropped groups{_reasons(t)}"
            )
        )
    parts.append(Text(time.strftime("updated %H:%M:%S"), style="dim"))
    return Group(*parts)


def _stream_lines(st: StreamStatus) -> list[str]:
    extra = f", {st.inflight} in flight" if st.inflight is not None else ""
    lines = [f"  {st.key}: {st.length} entries{extra}"]
    for g in st.groups:
        lag = "?" if g.lag is None else g.lag
        lines.append(f"    group {g.name}: {g.pending} pending, {lag} unread")
        for c in g.consumers:
            lines.append(f"      {c.name}: {c.pending} pending, idle {c.idle_ms / 1000:.1f}s")
    return lines


def format_status(st: RunStatus) -> str:
    lines = [f"run {st.run}" + (f" ({st.partitions} partitions)" if st.partitions > 1 else ""), "jobs:"]
    for s in st.job_streams or [st.jobs]:
        if s.length or s.groups or s.key == st.jobs.key:
            lines += _stream_lines(s)
    lines.append("results:")
    for r in st.results:
        lines += _stream_lines(r)
    lines.append(f"dead letters: {st.dead_letters}")
    for reason, n in sorted(st.dropped.items()):
        lines.append(f"dropped results ({reason}): {n}")
    for d in st.recent_dead_letters:
        lines.append(f"  {d.entry_id} job {d.job_id or '?'}: {d.error_type}: {d.message}")
    alive = sum(w.alive for w in st.workers)
    lines.append(f"workers: {alive} alive, {len(st.workers) - alive} gone")
    for w in st.workers:
        state = "alive" if w.alive else "gone "
        running = w.info.get("running", "?")
        done = w.info.get("completed", "?")
        lines.append(f"  {state} {w.name}: running {running}, completed {done}, last seen {w.last_seen_s:.1f}s ago")
    if st.trainer is not None:
        t = st.trainer
        bound = f" of at most {t.bound}" if t.bound is not None else ""
        lines.append(
            f"trainer: policy version {t.version}; {t.admitted} samples admitted{bound}, "
            f"{t.released} given back by dropped groups{_reasons(t)}"
        )
    return "\n".join(lines)
