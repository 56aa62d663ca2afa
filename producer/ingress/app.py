"""The HTTP ingress (aiohttp): other services, in any language, submit jobs, follow their results as Server-Sent
Events and cancel them. Nothing about a job lives in this process: its record (RunKeys.job_control), its queued
samples and its results stream (RunKeys.job_results) are in Redis, expiring `retention` seconds after submission,
so any number of ingress replicas serve the same jobs and SSE resumes from any of them.

- Tenants: a bearer token names a tenant; a job id is namespaced as `<tenant>:<client id>` inside, so a tenant sees
  (and deduplicates against) only its own jobs; another tenant's job is a 404.
- Submission: one job or a batch, validated first (errors name the field, `$.jobs[2].n`), then one INGRESS_SUBMIT
  script call: all or nothing, for duplicates and backpressure alike.
- Cancellation: CANCEL_JOB marks the job cancelled and publishes a `cancelled` result for every sample not started;
  a worker marks a sample started (START_SAMPLE) in the same record before running it, so each sample either runs
  or is cancelled, never both.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import json
import logging
import re
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from rollq.config import ConfigError
from rollq.producer.ingress.config import IngressConfig
from rollq.producer.ingress.models import (
    JOB_ID_PATTERN,
    NAME_PATTERN,
    Admitted,
    CancelResponse,
    Counts,
    Done,
    ErrorBody,
    Health,
    JobBatch,
    JobSpec,
    JobStatus,
    SampleState,
    SubmitResponse,
    openapi,
)
from rollq.protocol import scripts
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import DEFAULT_CLASS, PAYLOAD_FIELD, WORKER_GROUP, RunKeys, partition_of, partition_share
from rollq.protocol.messages import Job, JobClass, Trajectory, class_bound, job_classes
from rollq.redis_client import TRANSIENT_ERRORS, ensure_group, redis_client, run_partitions

log = logging.getLogger("rollq.ingress")

_JOB_ID = re.compile(JOB_ID_PATTERN)
_TENANT = re.compile(NAME_PATTERN)
_EVENT_ID = re.compile(r"^\d+-\d+$")
_AT = re.compile(r"^(.*) - at `(\$[^`]*)`$")


class IngressStats(msgspec.Struct):
    """Counters since start (the metrics collector reads them at scrape time)."""

    requests: int = 0
    jobs_admitted: int = 0
    samples_admitted: int = 0
    jobs_duplicate: int = 0
    refused_unauthorized: int = 0  # 401
    refused_invalid: int = 0  # 400 (bad JSON, a bad field, an unknown class)
    refused_forbidden: int = 0  # 403 (the tenant may not name that workflow)
    refused_too_large: int = 0  # 413 (body or batch)
    refused_busy: int = 0  # 429 (backpressure: the whole batch)
    cancels: int = 0
    events_sent: int = 0  # SSE sample events
    event_streams_open: int = 0  # SSE connections now
    redis_errors: int = 0  # 503


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.field = status, kind, message, field


_REFUSALS = {401: "refused_unauthorized", 400: "refused_invalid", 403: "refused_forbidden", 413: "refused_too_large"}
_REFUSALS.update({429: "refused_busy", 503: "redis_errors"})


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json", headers=headers)


def _token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def load_tenants(cfg: IngressConfig) -> dict[str, str]:
    """sha256(token) -> tenant, from `tokens` and `tokens_file` (tokens themselves are not kept)."""
    tokens: dict[str, Any] = {}
    if cfg.tokens_file:
        import yaml

        try:
            loaded = yaml.safe_load(Path(cfg.tokens_file).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"tokens_file: cannot read {cfg.tokens_file}: {str(exc).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"tokens_file: {cfg.tokens_file} must map token -> tenant")
        tokens.update(loaded)
    tokens.update(cfg.tokens)
    out: dict[str, str] = {}
    for token, tenant in tokens.items():
        if not isinstance(token, str) or not token or not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise ConfigError(
                f"tokens: each token must map to a tenant name of 1-64 letters, digits, '_', '.', '-' (got {tenant!r})"
            )
        out[_token_digest(token)] = tenant
    return out


def workflow_names(spec: JobSpec) -> list[str]:
    """The names a tenant's workflow patterns are checked against: the workflow as a dotted name (`pkg.mod:Cls` ->
    `pkg.mod.Cls`), `command:PROGRAM` for `exec:PROGRAM ...`, and a data `agent_name` (it picks a built-in loop)."""
    wf = spec.workflow
    if wf.startswith("exec:"):
        try:
            argv = shlex.split(wf[5:])
        except ValueError:
            argv = wf[5:].split()
        names = [f"command:{argv[0] if argv else ''}"]
    else:
        names = [wf.replace(":", ".")]
    if isinstance(spec.data, dict) and spec.data.get("agent_name"):
        names.append(str(spec.data["agent_name"]))
    return names


def pattern_allows(patterns: list[str], name: str) -> bool:
    """Shell-style, a pattern covering everything below it (as the workers' allowlist)."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


class Ingress:
    """The ingress service: `app()` is the aiohttp application; `stats` its counters."""

    def __init__(self, cfg: IngressConfig, *, redis: aioredis.Redis | None = None) -> None:
        self.cfg = cfg
        self.keys = RunKeys(cfg.run)
        self.tenants = load_tenants(cfg)
        self.open = not self.tenants  # no tokens configured: refuse everything but /healthz and /openapi.json
        self._own_redis = redis is None
        self.redis = redis or redis_client(cfg.redis_url)
        self.stats = IngressStats()
        self.codec = Codec()
        self._submit = self.redis.register_script(scripts.INGRESS_SUBMIT)
        self._cancel = self.redis.register_script(scripts.CANCEL_JOB)
        self._groups: set[str] = set()
        self._partitions = 0  # the run's partition count, read on first use
        self._openapi = msgspec.json.encode(openapi())
        if self.open:
            log.warning("rollq ingress: no tokens configured (tokens / tokens_file): every job request gets 401")

    # -- the application -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._middleware])
        app[INGRESS] = self
        app.router.add_post("/v1/jobs", self.submit)
        app.router.add_get("/v1/jobs/{job_id}", self.get_job)
        app.router.add_delete("/v1/jobs/{job_id}", self.cancel)
        app.router.add_get("/v1/jobs/{job_id}/events", self.events)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/openapi.json", self.openapi)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        if self._own_redis:
            await self.redis.aclose()

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self.stats.requests += 1
        try:
            return await handler(request)
        except HttpError as exc:
            err = exc
        except web.HTTPRequestEntityTooLarge:
            err = HttpError(413, "too_large", f"request body exceeds max_body_bytes={self.cfg.max_body_bytes}")
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method
            if exc.status < 400:
                raise
            err = HttpError(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
        except TRANSIENT_ERRORS as exc:
            err = HttpError(503, "unavailable", f"Redis is not answering ({type(exc).__name__}); try again")
        counter = _REFUSALS.get(err.status)
        if counter:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        if err.status == 401:
            headers = {"WWW-Authenticate": 'Bearer realm="rollq"'}
        return _json(ErrorBody(err.kind, err.message, err.field), err.status, headers)

    # -- helpers ----------------------------------------------------------------------------------------------

    def tenant(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise HttpError(401, "unauthorized", "send 'Authorization: Bearer <token>'")
        tenant = self.tenants.get(_token_digest(token.strip()))
        if tenant is None:
            raise HttpError(401, "unauthorized", "unknown token")
        return tenant

    def internal_id(self, tenant: str, client_id: str) -> str:
        return f"{tenant}:{client_id}"

    async def partitions(self) -> int:
        if not self._partitions:
            self._partitions = await run_partitions(self.redis, self.keys.partitions, self.cfg.partitions, claim=True)
        return self._partitions

    async def keys_of(self, job_id: str) -> RunKeys:
        """The keys of the partition an (internal) job id lives on."""
        return self.keys.at(partition_of(job_id, await self.partitions()))

    def _job_ref(self, request: web.Request) -> tuple[str, str]:
        """(client id, internal id) of the path's job; a job id that can't exist is a 404 like an unknown one."""
        tenant = self.tenant(request)
        client_id = request.match_info["job_id"]
        if not _JOB_ID.match(client_id):
            raise HttpError(404, "not_found", f"no job {client_id!r}")
        return client_id, self.internal_id(tenant, client_id)

    async def _body(self, request: web.Request) -> bytes:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise HttpError(413, "too_large", f"request body of {request.content_length} bytes exceeds {limit}")
        return await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size (chunked bodies)

    def _view(self, traj: Trajectory, client_id: str) -> dict[str, Any]:
        view: dict[str, Any] = self.codec.to_builtins(traj)
        view["job_id"] = client_id
        view.pop("schema", None)
        return view

    # -- POST /v1/jobs ---------------------------------------------------------------------------------------

    def _parse(self, body: bytes) -> tuple[list[JobSpec], str]:
        """The jobs of a request and the path prefix of each (`$.jobs[i]` in a batch, `$` for one job)."""
        try:
            obj = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise HttpError(400, "invalid", f"the body is not valid JSON: {exc}") from None
        batch = isinstance(obj, dict) and "jobs" in obj
        try:
            if batch:
                specs = msgspec.convert(obj, JobBatch).jobs
            else:
                specs = [msgspec.convert(obj, JobSpec)]
        except msgspec.ValidationError as exc:
            match = _AT.match(str(exc))
            message, field = (match.group(1), match.group(2)) if match else (str(exc), None)
            raise HttpError(400, "invalid", f"{field}: {message}" if field else message, field) from None
        return specs, "$.jobs[{}]" if batch else "$"

    async def submit(self, request: web.Request) -> web.Response:
        tenant = self.tenant(request)
        specs, where = self._parse(await self._body(request))
        cfg = self.cfg
        if not specs:
            raise HttpError(400, "invalid", "$.jobs: a batch needs at least one job", "$.jobs")
        if len(specs) > cfg.max_batch:
            raise HttpError(413, "too_large", f"$.jobs: {len(specs)} jobs exceed max_batch={cfg.max_batch}", "$.jobs")
        patterns = cfg.tenant_workflows.get(tenant)
        classes: dict[str, Any] | None = None
        seen_ids: set[str] = set()
        for i, spec in enumerate(specs):
            at = where.format(i)
            if spec.n > cfg.max_n:
                raise HttpError(400, "invalid", f"{at}.n: {spec.n} samples exceed max_n={cfg.max_n}", f"{at}.n")
            if spec.job_id is not None:
                if spec.job_id in seen_ids:
                    raise HttpError(
                        400, "invalid", f"{at}.job_id: {spec.job_id!r} appears twice in the batch", f"{at}.job_id"
                    )
                seen_ids.add(spec.job_id)
            if patterns is not None:
                for name in workflow_names(spec):
                    if not pattern_allows(patterns, name):
                        raise HttpError(
                            403,
                            "forbidden",
                            f"{at}.workflow: tenant {tenant!r} may not run {name!r} (allowed: {', '.join(patterns)})",
                            f"{at}.workflow",
                        )
            if spec.job_class not in (None, DEFAULT_CLASS):
                if classes is None:
                    classes = await self._classes()
                if spec.job_class not in classes:
                    raise HttpError(
                        400,
                        "invalid",
                        f"{at}.job_class: run {cfg.run!r} has no job class {spec.job_class!r} "
                        f"(it has {', '.join(sorted(classes))})",
                        f"{at}.job_class",
                    )
        admitted = await self._admit(tenant, specs)
        return _json(SubmitResponse(admitted), 202)

    async def _classes(self) -> dict[str, JobClass]:
        return job_classes(await self.redis.hgetall(self.keys.classes))  # type: ignore[misc]  # stub: sync|async

    async def _admit(self, tenant: str, specs: list[JobSpec]) -> list[Admitted]:
        """One INGRESS_SUBMIT per partition the batch's jobs live on (one, unless the run is partitioned), all or
        nothing on each. Should a later partition refuse after an earlier one admitted (its bound filled meanwhile),
        the 429 names the jobs admitted: resubmitting the batch with the same job ids is safe (duplicates)."""
        count = await self.partitions()
        classes = await self._classes()
        client_ids = [spec.job_id or uuid.uuid4().hex for spec in specs]
        by_partition: dict[int, list[int]] = {}
        for k, client_id in enumerate(client_ids):
            by_partition.setdefault(partition_of(self.internal_id(tenant, client_id), count), []).append(k)
        fresh: dict[int, bool] = {}
        for partition, indices in sorted(by_partition.items()):
            try:
                jobs = [(specs[k], client_ids[k]) for k in indices]
                flags = await self._admit_on(partition, count, classes, tenant, jobs)
            except HttpError as exc:
                admitted = [client_ids[k] for k, new in fresh.items() if new]
                if admitted and exc.status == 429:
                    exc.message += f"; on other partitions these jobs were queued: {', '.join(admitted)}"
                raise
            fresh.update(zip(indices, flags, strict=True))
        out = []
        for k, (spec, client_id) in enumerate(zip(specs, client_ids, strict=True)):
            out.append(Admitted(client_id, fresh[k], spec.n))
            if fresh[k]:
                self.stats.jobs_admitted += 1
                self.stats.samples_admitted += spec.n
            else:
                self.stats.jobs_duplicate += 1
        return out

    async def _admit_on(
        self,
        partition: int,
        count: int,
        classes: dict[str, JobClass],
        tenant: str,
        jobs: list[tuple[JobSpec, str]],
    ) -> list[bool]:
        """Admit `jobs` (all on `partition`) all or nothing; per job, True if new (False: a duplicate)."""
        now = time.time()
        keys = self.keys.at(partition)
        streams: dict[str, int] = {}
        stream_args: list[Any] = []
        stream_classes: list[str] = []
        job_keys: list[str] = []
        args: list[Any] = []
        for spec, client_id in jobs:
            job_id = self.internal_id(tenant, client_id)
            job_class = spec.job_class or DEFAULT_CLASS
            stream = keys.job_stream(job_class)
            index = streams.get(stream, 0)
            if not index:
                index = streams[stream] = len(streams) + 1
                stream_classes.append(job_class)
                stream_args += (job_class, class_bound(classes, job_class, count))
            job_keys += (keys.job_control(job_id), keys.job_results(job_id))
            args += (index, spec.n)
            job = Job(
                job_id=job_id,
                workflow=spec.workflow,
                data=spec.data,
                n=spec.n,
                workflow_kwargs=spec.workflow_kwargs,
                agent=spec.agent,
                reply_to=keys.job_results(job_id),
                submitted_at=now,
                is_eval=spec.is_eval,
                cancellable=True,
                job_class=job_class,
            )
            encode = self.codec.encode
            args += [encode(msgspec.structs.replace(job, sample_index=i)) if i else encode(job) for i in range(spec.n)]
        for stream in streams:
            if stream not in self._groups:
                await ensure_group(self.redis, stream, WORKER_GROUP)
                self._groups.add(stream)
        reply = await self._submit(
            keys=[*streams, *job_keys],
            args=[len(streams), partition_share(self.cfg.max_queued, count), int(self.cfg.retention)]
            + [*stream_args, *args],
        )
        if int(reply[0]) < 0:
            job_class = stream_classes[int(reply[1]) - 1]
            if int(reply[0]) == -2:
                raise HttpError(400, "invalid", f"run {self.cfg.run!r} has no job class {job_class!r}", "job_class")
            where = f" on partition {partition}" if count > 1 else ""
            raise HttpError(
                429,
                "busy",
                f"job class {job_class!r} has {int(reply[2])} samples queued or running{where}; this batch's new "
                f"samples would pass its bound of {int(reply[3])}: nothing was queued, retry later",
            )
        return [int(flag) == 1 for flag in reply[1:]]

    # -- GET /v1/jobs/{id} -----------------------------------------------------------------------------------

    async def _record(self, client_id: str, job_id: str) -> dict[bytes, bytes]:
        keys = await self.keys_of(job_id)
        record: dict[bytes, bytes] = await self.redis.hgetall(keys.job_control(job_id))  # type: ignore[misc]
        if not record:
            raise HttpError(404, "not_found", f"no job {client_id!r} (never submitted, or past its retention)")
        return record

    def _decode(self, fields: dict[bytes, bytes] | None) -> Trajectory | None:
        try:
            return self.codec.decode_trajectory((fields or {}).get(PAYLOAD_FIELD, b""))
        except CodecError:
            return None

    async def get_job(self, request: web.Request) -> web.Response:
        client_id, job_id = self._job_ref(request)
        want = request.query.get("trajectories", "true").lower() not in ("false", "0", "no")
        record = await self._record(client_id, job_id)
        n = int(record.get(b"n", 0))
        firsts: dict[int, Trajectory] = {}
        for _, fields in await self.redis.xrange((await self.keys_of(job_id)).job_results(job_id)):
            traj = self._decode(fields)
            if traj is not None and 0 <= traj.sample_index < n:
                firsts.setdefault(traj.sample_index, traj)
        states: list[SampleState] = []
        counts = Counts()
        for i in range(n):
            traj = firsts.get(i)
            state: SampleState = traj.status if traj else "running" if f"s{i}".encode() in record else "queued"
            states.append(state)
            setattr(counts, state, getattr(counts, state) + 1)
        trajectories = [self._view(firsts[i], client_id) for i in sorted(firsts)] if want else None
        status = JobStatus(
            job_id=client_id,
            n=n,
            cancelled=b"cancelled" in record,
            done=len(firsts) == n,
            counts=counts,
            samples=states,
            trajectories=trajectories,  # type: ignore[arg-type]  # plain dicts shaped as TrajectoryView
        )
        return _json(status)

    # -- DELETE /v1/jobs/{id} --------------------------------------------------------------------------------

    async def cancel(self, request: web.Request) -> web.Response:
        client_id, job_id = self._job_ref(request)
        record = await self._record(client_id, job_id)
        n = int(record.get(b"n", 0))
        now = time.time()
        payloads = [
            self.codec.encode(
                Trajectory(
                    job_id=job_id,
                    sample_index=i,
                    n=n,
                    status="cancelled",
                    worker_id="ingress",
                    started_at=now,
                    finished_at=now,
                )
            )
            for i in range(n)
        ]
        keys = await self.keys_of(job_id)
        reply = await self._cancel(keys=[keys.job_control(job_id), keys.job_results(job_id)], args=payloads)
        if int(reply[0]) == -1:
            raise HttpError(404, "not_found", f"no job {client_id!r} (never submitted, or past its retention)")
        started = sorted(int(i) for i in reply[1:])
        self.stats.cancels += 1
        left = set(started)
        return _json(CancelResponse(client_id, n, int(reply[0]) == 1, started, [i for i in range(n) if i not in left]))

    # -- GET /v1/jobs/{id}/events ----------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        client_id, job_id = self._job_ref(request)
        last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0-0"
        if not _EVENT_ID.match(last):
            raise HttpError(400, "invalid", f"Last-Event-ID {last!r} is not an event id (like 1700000000000-0)")
        record = await self._record(client_id, job_id)
        n = int(record.get(b"n", 0))
        keys = await self.keys_of(job_id)
        stream = keys.job_results(job_id)
        seen: set[int] = set()
        counts = Counts()
        if last != "0-0":  # what the client already has: its samples are not sent again
            for _, fields in await self.redis.xrange(stream, "-", last):
                traj = self._decode(fields)
                if traj is not None and 0 <= traj.sample_index < n and traj.sample_index not in seen:
                    seen.add(traj.sample_index)
                    setattr(counts, traj.status, getattr(counts, traj.status) + 1)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        self.stats.event_streams_open += 1
        block_ms = max(1, int(self.cfg.keepalive * 1000))
        try:
            while len(seen) < n:
                reply = await self.redis.xread({stream: last}, count=256, block=block_ms)
                entries = reply[0][1] if reply else []
                if not entries:
                    if not await self.redis.exists(keys.job_control(job_id)):
                        await resp.write(b'event: expired\ndata: {"message": "the job passed its retention"}\n\n')
                        return resp
                    await resp.write(b": keepalive\n\n")
                    continue
                chunks = []
                for eid, fields in entries:
                    last = eid.decode()
                    traj = self._decode(fields)
                    if traj is None or not 0 <= traj.sample_index < n or traj.sample_index in seen:
                        continue
                    seen.add(traj.sample_index)
                    setattr(counts, traj.status, getattr(counts, traj.status) + 1)
                    data = json.dumps(self._view(traj, client_id), separators=(",", ":"))
                    chunks.append(f"id: {last}\nevent: sample\ndata: {data}\n\n".encode())
                if chunks:
                    await resp.write(b"".join(chunks))
                    self.stats.events_sent += len(chunks)
            done = msgspec.json.encode(Done(client_id, n, counts))
            await resp.write(b"event: done\ndata: " + done + b"\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away (with handler cancellation, the handler is cancelled instead)
        finally:
            self.stats.event_streams_open -= 1
        return resp

    # -- the rest ---------------------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        try:
            ok = bool(await asyncio.wait_for(self.redis.ping(), 2.0))
        except (TimeoutError, *TRANSIENT_ERRORS):
            ok = False
        return _json(Health(ok=ok, redis=ok), 200 if ok else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")


INGRESS = web.AppKey("ingress", Ingress)

__all__ = ["INGRESS", "HttpError", "Ingress", "IngressStats", "load_tenants", "pattern_allows", "workflow_names"]
