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
- What one request may cost: its body (max_body_bytes), what its jobs take in Redis (max_request_bytes: a job's data
  is stored once, in the blob store, however many samples it asks for), the tenant's samples waiting
  (max_tenant_queued) and the bytes its unfinished jobs hold (max_tenant_queued_bytes: a job's blob is freed with it,
  protocol/scripts.py SAMPLE_DONE), its images (max_job_images, max_job_image_bytes, max_job_image_pixels: from their
  headers, nothing decoded here), its agent's timeout (max_agent_timeout), and its SSE streams (max_event_streams, per
  tenant too), which share one Redis reader per partition (producer/ingress/events.py) instead of a connection each.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import re
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import ResponseError

from rollq.config import ConfigError
from rollq.http_server import BAD_JSON, read_body
from rollq.producer.ingress.config import IngressConfig
from rollq.producer.ingress.events import StreamReader, entry_id
from rollq.producer.ingress.models import (
    JOB_ID_PATTERN,
    NAME_PATTERN,
    ROUTES,
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
from rollq.protocol.blobs import BLOB_MIN_BYTES, DataBlob
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.environments import environment_name_problem, is_environment
from rollq.protocol.image_limits import ImageLimitError, ImageLimits, check_images, images_in
from rollq.protocol.keys import DEFAULT_CLASS, PAYLOAD_FIELD, WORKER_GROUP, RunKeys, partition_of, partition_share
from rollq.protocol.media import ImageError
from rollq.protocol.messages import Job, JobClass, Trajectory, class_bound, job_classes
from rollq.redis_client import TRANSIENT_ERRORS, ensure_group, redis_client, run_partitions
from rollq.tracing import INVALID_SPAN, TRACEPARENT, Span, SpanKind, Tracing, traceparent

log = logging.getLogger("rollq.ingress")

_JOB_ID = re.compile(JOB_ID_PATTERN)
_TENANT = re.compile(NAME_PATTERN)
_EVENT_ID = re.compile(r"^\d+-\d+$")
_AT = re.compile(r"^(.*) - at `(\$[^`]*)`$")
# A string of a job's workflow_kwargs that names an import path (`pkg.mod:attr`): checked against the tenant's
# patterns up front (the workers enforce them on everything the episode imports, dotted names too: Job.allow).
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_T = TypeVar("_T")
QUOTA_RETRY_AFTER_S = 5  # a tenant over its quota waits for workers to start its samples: longer than a busy retry


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
    refused_quota: int = 0  # 429 (the tenant's queued samples, or its open SSE streams)
    cancels: int = 0
    events_sent: int = 0  # SSE sample events
    event_streams_open: int = 0  # SSE connections now
    redis_errors: int = 0  # 503


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, field: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.field = status, kind, message, field
        self.retry_after = retry_after  # seconds, sent with 429 and 503


_REFUSALS = {401: "refused_unauthorized", 400: "refused_invalid", 403: "refused_forbidden", 413: "refused_too_large"}
_REFUSALS.update({429: "refused_busy", 503: "redis_errors"})


_CODEC = Codec()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """`body` as JSON (token arrays as lists)."""
    return web.Response(body=_CODEC.encode_json(body), status=status, content_type="application/json", headers=headers)


def _overflows(value: Any) -> bool:
    """Whether msgpack cannot hold `value` (an integer below -2**63 or above 2**64-1 somewhere in it)."""
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        return True
    return False


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
    `pkg.mod.Cls`), `command:PROGRAM` for `exec:PROGRAM ...`, an environment as written (`verifiers:ENV_ID`,
    `openenv:NAME`), and a data `agent_name` (it picks a built-in loop)."""
    wf = spec.workflow
    if is_environment(wf):
        names = [wf]
    elif wf.startswith("exec:"):
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


def kwargs_import_paths(value: Any, at: str) -> list[tuple[str, str]]:
    """(path in the request, import path) of every string in a job's workflow_kwargs shaped as `pkg.mod:attr`
    (reward_fn, tools, ...: workflows resolve such strings through the workers' allowlist)."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(value, at)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _IMPORT_PATH.match(item):
                found.append((where, item.replace(":", ".")))
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return found


def variable_names(spec: JobSpec, at: str) -> list[tuple[str, str]]:
    """(path in the request, `env:NAME`) of each variable a command agent's or an environment's job passes
    (`workflow_kwargs.env`): the workers allow each by an `env:NAME` pattern, the job's tenant's included."""
    variables = (spec.workflow_kwargs or {}).get("env")
    if not isinstance(variables, dict) or not (spec.workflow.startswith("exec:") or is_environment(spec.workflow)):
        return []
    return [(f"{at}.{name}", f"env:{name}") for name in variables if isinstance(name, str)]


def pattern_allows(patterns: list[str], name: str) -> bool:
    """Shell-style, a pattern covering everything below it (as the workers' allowlist); an environment name only
    as a whole (as Allowlist.check_environment)."""
    if is_environment(name):
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


class _Prepared(msgspec.Struct):
    """A job of a request, ready to queue: its spec, the caller's id, its partition, its sample-0 Job and entry, and
    its data's blob."""

    spec: JobSpec
    client_id: str
    partition: int
    job: Job
    first: bytes  # the sample-0 entry's payload
    blob: DataBlob | None
    span: Span = INVALID_SPAN  # its submit span (tracing on), ended once it is admitted or refused


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
        # Each job's submit span: a trace of its own linked to the request's `traceparent` header, or its child with
        # trace_client_parent (rollq/tracing.py).
        self.tracing = Tracing.from_settings(cfg, "ingress")
        self._image_limits = ImageLimits(
            max_images=cfg.max_job_images, max_bytes=cfg.max_job_image_bytes, max_pixels=cfg.max_job_image_pixels
        )
        self._submit = self.redis.register_script(scripts.INGRESS_SUBMIT)
        self._cancel = self.redis.register_script(scripts.CANCEL_JOB)
        self._groups: set[str] = set()
        self._partitions = 0  # the run's partition count, read on first use
        self._readers: dict[int, StreamReader] = {}  # partition -> the reader of its jobs' results streams
        self._streams_of: dict[str, int] = {}  # tenant -> its open SSE streams
        self._openapi = msgspec.json.encode(openapi())
        if self.open:
            log.warning("rollq ingress: no tokens configured (tokens / tokens_file): every job request gets 401")

    # -- the application -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._middleware])
        app[INGRESS] = self
        for route in ROUTES:  # what /openapi.json describes
            if route.method == "GET":  # add_get: HEAD too, as before (health checkers and proxies send it)
                app.router.add_get(route.path, getattr(self, route.handler))
            else:
                app.router.add_route(route.method, route.path, getattr(self, route.handler))
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            await reader.close()
        if self._own_redis:
            await self.redis.aclose()
        await asyncio.to_thread(self.tracing.shutdown)  # exports the submits still buffered

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
        except ResponseError as exc:  # a key of another type than rollq writes (planted or damaged), out of memory...
            log.error("%s %s: Redis refused a command: %s", request.method, request.path, exc)
            err = HttpError(503, "unavailable", f"Redis refused a command ({str(exc)[:200]})")
        counter = "refused_quota" if err.kind == "quota" else _REFUSALS.get(err.status)
        if counter:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        headers = {"Retry-After": str(err.retry_after)} if err.status in (429, 503) else None
        if err.status == 401:
            headers = {"WWW-Authenticate": 'Bearer realm="rollq"'}
        response = _json(ErrorBody(err.kind, err.message, err.field), err.status, headers)
        if err.status == 408:
            response.force_close()  # the rest of a trickled body is not waited for on this connection
        return response

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
        return await read_body(request)  # 413 past client_max_size (chunked bodies), 408 past body_timeout

    def _view(self, traj: Trajectory, client_id: str) -> Trajectory:
        """The sample as its caller sees it: under the job id the caller gave."""
        return msgspec.structs.replace(traj, job_id=client_id)

    # -- POST /v1/jobs ---------------------------------------------------------------------------------------

    def _parse(self, body: bytes) -> tuple[list[JobSpec], str]:
        """The jobs of a request and the path prefix of each (`$.jobs[i]` in a batch, `$` for one job)."""
        try:
            obj = msgspec.json.decode(body)
        except BAD_JSON as exc:
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
        body = await self._body(request)
        specs, where = self._parse(body)
        cfg = self.cfg
        # Images are looked for only in a body that can hold one: a data URI written out, or any escape (a JSON
        # string whose decoded text is a data URI shows `\` in the body); the common text-only job pays nothing.
        maybe_images = b"data:image/" in body or b"\\" in body
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
            if spec.agent is not None and spec.agent.timeout_seconds > cfg.max_agent_timeout:
                raise HttpError(
                    400,
                    "invalid",
                    f"{at}.agent.timeout_seconds: {spec.agent.timeout_seconds:g} is over max_agent_timeout="
                    f"{cfg.max_agent_timeout:g}",
                    f"{at}.agent.timeout_seconds",
                )
            if is_environment(spec.workflow) and (problem := environment_name_problem(spec.workflow)) is not None:
                raise HttpError(400, "invalid", f"{at}.workflow: {problem}", f"{at}.workflow")
            if maybe_images and spec.data is not None:
                self._check_images(spec.data, f"{at}.data")
            if spec.job_id is not None:
                if spec.job_id in seen_ids:
                    raise HttpError(
                        400, "invalid", f"{at}.job_id: {spec.job_id!r} appears twice in the batch", f"{at}.job_id"
                    )
                seen_ids.add(spec.job_id)
            if patterns is not None:
                named = [(f"{at}.workflow", name) for name in workflow_names(spec)]
                named += kwargs_import_paths(spec.workflow_kwargs, f"{at}.workflow_kwargs")
                named += variable_names(spec, f"{at}.workflow_kwargs.env")
                for field, name in named:
                    if not pattern_allows(patterns, name):
                        raise HttpError(
                            403,
                            "forbidden",
                            f"{field}: tenant {tenant!r} may not use {name!r} (allowed: {', '.join(patterns)})",
                            field,
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
        admitted = await self._admit(tenant, specs, patterns, where, request.headers.get(TRACEPARENT, ""))
        return _json(SubmitResponse(admitted), 202)

    def _check_images(self, data: Any, field: str) -> None:
        """Refuses a job whose images pass the job limits (413) or do not read as images (400), from their headers:
        nothing is decoded here (the workers check again, and decode)."""
        images = list(images_in(data))
        if not images:
            return
        try:
            check_images(images, self._image_limits, field)
        except ImageLimitError as exc:
            raise HttpError(413, "too_large", str(exc), field) from None
        except ImageError as exc:
            raise HttpError(400, "invalid", f"{field}: {exc}", field) from None

    async def _classes(self) -> dict[str, JobClass]:
        return job_classes(await self.redis.hgetall(self.keys.classes))  # type: ignore[misc]  # stub: sync|async

    def _prepare(
        self,
        tenant: str,
        specs: list[JobSpec],
        where: str,
        patterns: list[str] | None,
        partitions: int,
        parent: str,
        spans: list[Span],
    ) -> list[_Prepared]:
        """Each job's sample-0 entry and its data's blob, refusing (413) a request whose jobs would take more than
        max_request_bytes in Redis before anything more is encoded: n entries per job, each distinct data once.
        Each job's submit span (tracing on) is appended to `spans` as it is begun: the caller ends them all."""
        now = time.time()
        total = 0
        blobs: set[str] = set()
        out = []
        for i, spec in enumerate(specs):
            client_id = spec.job_id or uuid.uuid4().hex
            job_id = self.internal_id(tenant, client_id)
            partition = partition_of(job_id, partitions)
            span: Span = INVALID_SPAN
            if self.tracing.enabled:
                # A caller's traceparent is its parent only where the operator trusts callers with it (its sampled
                # flag would override trace_sample_rate, its trace id join any trace); else a link to it.
                joined = self.cfg.trace_client_parent
                span = self.tracing.start(
                    "submit",
                    parent=parent if joined and parent else None,
                    links=() if joined else (parent,),
                    kind=SpanKind.SERVER,
                    attributes={
                        "rollq.run": self.cfg.run,
                        "rollq.job_id": job_id,
                        "rollq.client_job_id": client_id,
                        "rollq.tenant": tenant,
                        "rollq.n": spec.n,
                        "rollq.workflow": self.tracing.workflow(spec.workflow),
                    },
                )
                spans.append(span)
            job = Job(
                job_id=job_id,
                workflow=spec.workflow,
                data=spec.data,
                n=spec.n,
                workflow_kwargs=spec.workflow_kwargs,
                agent=spec.agent,
                reply_to=self.keys.at(partition).job_results(job_id),
                submitted_at=now,
                is_eval=spec.is_eval,
                text=spec.text,
                cancellable=True,
                job_class=spec.job_class or DEFAULT_CLASS,
                tenant=tenant,
                allow=patterns,
                traceparent=traceparent(span) if self.tracing.enabled else "",  # sampled or not: followed
            )
            try:
                first = self.codec.encode(job)
            except OverflowError as exc:  # JSON allows any integer; msgpack, the wire format, holds 64 bits
                fields = [f"{where.format(i)}.{f}" for f in ("data", "workflow_kwargs") if _overflows(getattr(spec, f))]
                field = fields[0] if fields else where.format(i)
                raise HttpError(400, "invalid", f"{field}: {exc} (the wire format is msgpack)", field) from None
            blob = None
            if len(first) >= BLOB_MIN_BYTES and spec.data is not None:  # else its data is smaller still: inline
                encoded = self.codec.encode(spec.data)
                if len(encoded) >= BLOB_MIN_BYTES:
                    blob = DataBlob(encoded)
                    job = msgspec.structs.replace(job, data=None, data_ref=blob.digest)
                    first = self.codec.encode(job)
            total += spec.n * (len(first) + 4)  # + a longer sample index, at most
            if blob is not None and blob.digest not in blobs:
                blobs.add(blob.digest)
                total += len(blob.payload)
            if total > self.cfg.max_request_bytes:
                raise HttpError(
                    413,
                    "too_large",
                    f"{where.format(i)}: the request's jobs would take over {total:,} bytes in Redis by this job "
                    f"(n x each sample's entry, plus each distinct data once), over max_request_bytes="
                    f"{self.cfg.max_request_bytes:,}: fewer samples or jobs per request",
                    where.format(i),
                )
            out.append(_Prepared(spec, client_id, partition, job, first, blob, span))
        return out

    async def _admit(
        self, tenant: str, specs: list[JobSpec], patterns: list[str] | None, where: str, parent: str = ""
    ) -> list[Admitted]:
        """One INGRESS_SUBMIT per partition the batch's jobs live on (one, unless the run is partitioned), all or
        nothing on each. Should a later partition refuse after an earlier one admitted (its bound filled meanwhile),
        the 429 names the jobs admitted: resubmitting the batch with the same job ids is safe (duplicates)."""
        count = await self.partitions()
        spans: list[Span] = []  # every job's begun so far: a request refused halfway (400, 413) ends them too
        try:
            prepared = self._prepare(tenant, specs, where, patterns, count, parent, spans)
            return await self._admit_prepared(prepared, count, tenant)
        except BaseException as exc:
            for span in spans:
                self.tracing.error(span, type(exc).__name__, str(exc))
            raise
        finally:
            for span in spans:
                span.end()

    async def _admit_prepared(self, prepared: list[_Prepared], count: int, tenant: str) -> list[Admitted]:
        classes = await self._classes()
        by_partition: dict[int, list[int]] = {}
        for k, job in enumerate(prepared):
            by_partition.setdefault(job.partition, []).append(k)
        fresh: dict[int, bool] = {}
        for partition, indices in sorted(by_partition.items()):
            try:
                flags = await self._admit_on(partition, count, classes, tenant, [prepared[k] for k in indices])
            except HttpError as exc:
                admitted = [prepared[k].client_id for k, new in fresh.items() if new]
                if admitted and exc.status == 429:
                    exc.message += f"; on other partitions these jobs were queued: {', '.join(admitted)}"
                raise
            fresh.update(zip(indices, flags, strict=True))
        out = []
        for k, job in enumerate(prepared):
            job.span.set_attribute("rollq.admitted", fresh[k])
            out.append(Admitted(job.client_id, fresh[k], job.spec.n))
            if fresh[k]:
                self.stats.jobs_admitted += 1
                self.stats.samples_admitted += job.spec.n
            else:
                self.stats.jobs_duplicate += 1
        return out

    async def _admit_on(
        self,
        partition: int,
        count: int,
        classes: dict[str, JobClass],
        tenant: str,
        jobs: list[_Prepared],
    ) -> list[bool]:
        """Admit `jobs` (all on `partition`) all or nothing; per job, True if new (False: a duplicate)."""
        keys = self.keys.at(partition)
        streams: dict[str, int] = {}
        stream_args: list[Any] = []
        stream_classes: list[str] = []
        blobs: dict[str, bytes] = {}
        blob_indices: dict[str, int] = {}  # digest -> its 1-based place in blobs
        job_keys: list[str] = []
        args: list[Any] = []
        encode = self.codec.encode
        for prepared in jobs:
            job = prepared.job
            stream = keys.job_stream(job.job_class)
            index = streams.get(stream, 0)
            if not index:
                index = streams[stream] = len(streams) + 1
                stream_classes.append(job.job_class)
                stream_args += (job.job_class, class_bound(classes, job.job_class, count))
            blob_index = 0
            if prepared.blob is not None:
                blobs.setdefault(prepared.blob.digest, prepared.blob.payload)
                blob_index = blob_indices.setdefault(prepared.blob.digest, len(blob_indices) + 1)
            job_keys += (keys.job_control(job.job_id), keys.job_results(job.job_id))
            args += (index + 65536 * blob_index, job.n)
            args.append(prepared.first)
            args += [encode(msgspec.structs.replace(job, sample_index=i)) for i in range(1, job.n)]
        for stream in streams:
            if stream not in self._groups:
                await ensure_group(self.redis, stream, WORKER_GROUP)
                self._groups.add(stream)
        quota = partition_share(self.cfg.max_tenant_queued, count)
        byte_quota = partition_share(self.cfg.max_tenant_queued_bytes, count)
        tenant_keys = [keys.tenant_queued(tenant), keys.tenant_charges(tenant), keys.tenant_bytes(tenant)]
        reply = await self._submit(
            keys=[*streams, *map(keys.blob, blobs), *map(keys.blob_refs, blobs), *tenant_keys, *job_keys],
            args=[len(streams), len(blobs), partition_share(self.cfg.max_queued, count), int(self.cfg.retention)]
            + [quota, byte_quota, int(time.time()), uuid.uuid4().hex, *stream_args, *blobs.values(), *args],
        )
        where = f" on partition {partition}" if count > 1 else ""
        if int(reply[0]) == -4:
            raise HttpError(
                429,
                "quota",
                f"tenant {tenant!r} has jobs holding {int(reply[2]):,} bytes in Redis{where}; this request's would "
                f"pass its quota of {int(reply[3]):,} (max_tenant_queued_bytes): nothing was queued, retry when "
                "some of its jobs are done (or cancel some)",
                retry_after=QUOTA_RETRY_AFTER_S,
            )
        if int(reply[0]) == -3:
            raise HttpError(
                429,
                "quota",
                f"tenant {tenant!r} has {int(reply[2])} samples queued and not started{where}; this request's new "
                f"samples would pass its quota of {int(reply[3])} (max_tenant_queued): nothing was queued, retry "
                "when workers have started some",
                retry_after=QUOTA_RETRY_AFTER_S,
            )
        if int(reply[0]) < 0:
            job_class = stream_classes[int(reply[1]) - 1]
            if int(reply[0]) == -2:
                raise HttpError(400, "invalid", f"run {self.cfg.run!r} has no job class {job_class!r}", "job_class")
            raise HttpError(
                429,
                "busy",
                f"job class {job_class!r} has {int(reply[2])} samples queued or running{where}; this batch's new "
                f"samples would pass its bound of {int(reply[3])}: nothing was queued, retry later",
            )
        return [int(flag) == 1 for flag in reply[1:]]

    # -- GET /v1/jobs/{id} -----------------------------------------------------------------------------------

    async def _record(self, client_id: str, job_id: str) -> tuple[dict[bytes, bytes], int]:
        """The job's control record and its n. A record that does not read as one the ingress wrote (n not an
        integer in [1, max_n]: written by someone else, or damaged) is a 404 like a missing one, never a 500."""
        keys = await self.keys_of(job_id)
        record: dict[bytes, bytes] = await self._job_read(
            job_id,
            client_id,
            self.redis.hgetall(keys.job_control(job_id)),  # type: ignore[arg-type]
        )
        if not record:
            raise HttpError(404, "not_found", f"no job {client_id!r} (never submitted, or past its retention)")
        raw = record.get(b"n", b"")
        n = int(raw) if raw.isdigit() and len(raw) <= 9 else 0
        if not 1 <= n <= self.cfg.max_n:
            log.error("job %r: its control record is unreadable (n=%r); answered as not found", job_id, raw[:32])
            raise HttpError(404, "not_found", f"no job {client_id!r} (its record in Redis is unreadable)")
        return record, n

    async def _job_read(self, job_id: str, client_id: str, read: Awaitable[_T]) -> _T:
        """`read` of one job's keys. A key of another type than the ingress writes (WRONGTYPE: planted by a Redis
        writer, or damaged) is a 404 like a missing job, never a 500."""
        try:
            return await read
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            log.error("job %r: one of its keys holds another type than rollq writes (%s): not found", job_id, exc)
            raise HttpError(404, "not_found", f"no job {client_id!r} (its record in Redis is unreadable)") from None

    def _decode(self, fields: dict[bytes, bytes] | None) -> Trajectory | None:
        try:
            return self.codec.decode_trajectory((fields or {}).get(PAYLOAD_FIELD, b""))
        except CodecError:
            return None

    async def get_job(self, request: web.Request) -> web.Response:
        client_id, job_id = self._job_ref(request)
        want = request.query.get("trajectories", "true").lower() not in ("false", "0", "no")
        record, n = await self._record(client_id, job_id)
        firsts: dict[int, Trajectory] = {}
        results = self.redis.xrange((await self.keys_of(job_id)).job_results(job_id))
        for _, fields in await self._job_read(job_id, client_id, results):
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
            trajectories=trajectories,
        )
        return _json(status)

    # -- DELETE /v1/jobs/{id} --------------------------------------------------------------------------------

    async def cancel(self, request: web.Request) -> web.Response:
        client_id, job_id = self._job_ref(request)
        tenant = job_id.partition(":")[0]
        record, n = await self._record(client_id, job_id)
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
        cancel_keys = [keys.job_control(job_id), keys.job_results(job_id), keys.tenant_queued(tenant)]
        cancel_keys += [keys.tenant_charges(tenant), keys.tenant_bytes(tenant)]  # its samples cancelled: its bytes
        ref = record.get(b"ref", b"").decode(errors="replace")
        if ref:
            try:
                cancel_keys += [keys.blob_refs(ref), keys.blob(ref)]
            except ValueError:  # not a digest the ingress wrote: the blob is left to its TTL
                pass
        reply = await self._job_read(job_id, client_id, self._cancel(keys=cancel_keys, args=payloads))
        if int(reply[0]) == -1:
            raise HttpError(404, "not_found", f"no job {client_id!r} (never submitted, or past its retention)")
        started = sorted(int(i) for i in reply[1:])
        self.stats.cancels += 1
        left = set(started)
        return _json(CancelResponse(client_id, n, int(reply[0]) == 1, started, [i for i in range(n) if i not in left]))

    # -- GET /v1/jobs/{id}/events ----------------------------------------------------------------------------

    def _open_stream(self, tenant: str) -> None:
        """Count an SSE stream of `tenant` in, or refuse it (429) past max_event_streams or the tenant's share."""
        cfg = self.cfg
        if self.stats.event_streams_open >= cfg.max_event_streams:
            raise HttpError(
                429, "busy", f"this ingress serves max_event_streams={cfg.max_event_streams} SSE streams already"
            )
        mine = self._streams_of.get(tenant, 0)
        if mine >= cfg.max_event_streams_per_tenant:
            raise HttpError(
                429,
                "quota",
                f"tenant {tenant!r} holds {mine} SSE streams on this ingress, its limit "
                f"(max_event_streams_per_tenant={cfg.max_event_streams_per_tenant}): close one first",
                retry_after=QUOTA_RETRY_AFTER_S,
            )
        self._streams_of[tenant] = mine + 1
        self.stats.event_streams_open += 1

    def _close_stream(self, tenant: str) -> None:
        self.stats.event_streams_open -= 1
        left = self._streams_of.get(tenant, 1) - 1
        if left:
            self._streams_of[tenant] = left
        else:
            self._streams_of.pop(tenant, None)

    def _reader(self, partition: int) -> StreamReader:
        reader = self._readers.get(partition)
        if reader is None:
            block_ms = max(1, int(self.cfg.keepalive * 1000))
            reader = self._readers[partition] = StreamReader(self.redis, self.keys.at(partition), block_ms=block_ms)
        return reader

    async def events(self, request: web.Request) -> web.StreamResponse:
        client_id, job_id = self._job_ref(request)
        tenant = job_id.partition(":")[0]
        last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0-0"
        if not _EVENT_ID.match(last) or len(last) > 41:
            raise HttpError(400, "invalid", f"Last-Event-ID {last[:48]!r} is not an event id (like 1700000000000-0)")
        _, n = await self._record(client_id, job_id)
        keys = await self.keys_of(job_id)
        stream = keys.job_results(job_id)
        seen: set[int] = set()
        counts = Counts()

        def count(traj: Trajectory | None) -> bool:
            """Count a sample's first result; False for anything else (a repeat, a foreign or unreadable entry)."""
            if traj is None or not 0 <= traj.sample_index < n or traj.sample_index in seen:
                return False
            seen.add(traj.sample_index)
            setattr(counts, traj.status, getattr(counts, traj.status) + 1)
            return True

        # What the client already has (none for 0-0): its samples are not sent again. Read before the response
        # begins, so a results key of another type is a 404 here, not a broken stream.
        for _, fields in await self._job_read(job_id, client_id, self.redis.xrange(stream, "-", last)):
            count(self._decode(fields))
        self._open_stream(tenant)
        reader = self._reader(keys.partition)
        sub = await reader.subscribe(stream, last)
        try:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
            await resp.prepare(request)
            # What arrived before the reader took the stream up, when it already followed it for another client.
            backlog = await self.redis.xrange(stream, f"({last}", "+") if len(seen) < n and not sub.from_since else []
            at = entry_id(last)
            while len(seen) < n:
                batch = backlog or await sub.get(self.cfg.keepalive)
                backlog = []
                if batch is None:
                    if not await self.redis.exists(keys.job_control(job_id)):
                        await resp.write(b'event: expired\ndata: {"message": "the job passed its retention"}\n\n')
                        return resp
                    await resp.write(b": keepalive\n\n")
                    continue
                if isinstance(batch, str):
                    await resp.write(b"event: error\ndata: " + msgspec.json.encode({"message": batch}) + b"\n\n")
                    return resp
                chunks = []
                for eid, fields in batch:
                    if entry_id(eid) <= at:
                        continue  # delivered again (the reader and the backlog overlap)
                    at, last = entry_id(eid), eid.decode()
                    traj = self._decode(fields)
                    if not count(traj):
                        continue
                    assert traj is not None
                    data = self.codec.encode_json(self._view(traj, client_id))
                    chunks.append(f"id: {last}\nevent: sample\ndata: ".encode() + data + b"\n\n")
                if chunks:
                    await resp.write(b"".join(chunks))
                    self.stats.events_sent += len(chunks)
            done = msgspec.json.encode(Done(client_id, n, counts))
            await resp.write(b"event: done\ndata: " + done + b"\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away (with handler cancellation, the handler is cancelled instead)
        finally:
            reader.unsubscribe(sub)
            self._close_stream(tenant)
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
