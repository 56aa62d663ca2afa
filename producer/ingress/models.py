"""The ingress's HTTP messages (JSON), as msgspec Structs, and its routes (`ROUTES`): they validate requests (errors
name the field, e.g. `$.jobs[2].n`), and `/openapi.json` is generated from them (`openapi()`), the app serves the
same routes. A finished sample is the wire `Trajectory` (rollq.protocol.messages) as JSON: token arrays as lists
(rollq.protocol.codec) and the caller's own job id."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from rollq.protocol.codec import json_schema_hook
from rollq.protocol.messages import AgentOptions, Trajectory

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@~+=-]{0,199}$"
NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"

JobId = Annotated[
    str,
    msgspec.Meta(
        pattern=JOB_ID_PATTERN,
        description="client-given id (1-200 of letters, digits, _.:@~+=-; starting with a letter or digit): "
        "submitting it again within the retention queues nothing; scoped per tenant",
    ),
]
SampleState = Literal["queued", "running", "ok", "rejected", "error", "cancelled"]


class JobSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One prompt, run n times (n samples)."""

    workflow: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=1024,
            description="a built-in loop's name, an import path (pkg.mod:Class) or `exec:PROGRAM ARGS...`; "
            "the workers' allowlist and the tenant's workflow patterns decide whether it may run",
        ),
    ]
    data: Any = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1_000_000, description="samples of this prompt")] = 1
    job_id: JobId | None = None
    workflow_kwargs: dict[str, Any] | None = None
    agent: AgentOptions | None = None
    job_class: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, description="a job class of the run")] | None = None
    is_eval: bool = False
    text: Annotated[
        bool,
        msgspec.Meta(
            description="each finished sample's sequences carry their decoded `text` (`prompt`, `completion`), "
            "decoded by the worker with the workflow's tokenizer (else the worker's); off by default: text costs bytes"
        ),
    ] = False


class JobBatch(msgspec.Struct, forbid_unknown_fields=True):
    """Several jobs, admitted all or nothing."""

    jobs: list[JobSpec]


class Admitted(msgspec.Struct):
    job_id: str
    admitted: bool  # False: this job id was submitted before (within the retention); nothing was queued
    n: int


class SubmitResponse(msgspec.Struct):
    jobs: list[Admitted]


class Counts(msgspec.Struct):
    queued: int = 0
    running: int = 0
    ok: int = 0
    rejected: int = 0
    error: int = 0
    cancelled: int = 0


class JobStatus(msgspec.Struct):
    job_id: str
    n: int
    cancelled: bool  # DELETE was called
    done: bool  # every sample has a result
    counts: Counts
    samples: list[SampleState]  # per sample index
    # The finished samples in sample order (job_id: the caller's); left out with ?trajectories=false.
    trajectories: list[Trajectory] | None = None


class Done(msgspec.Struct):
    """The SSE `done` event's data: every sample is accounted for."""

    job_id: str
    n: int
    counts: Counts


class CancelResponse(msgspec.Struct):
    job_id: str
    n: int
    already_cancelled: bool
    started: list[int]  # samples that had started: they run to the end and report their own result
    cancelled: list[int]  # samples that will never run (their result is "cancelled")


class ErrorBody(msgspec.Struct):
    error: str  # a short kind: unauthorized, not_found, invalid, forbidden, too_large, busy, unavailable
    message: str
    field: str | None = None  # where in the request, e.g. $.jobs[2].n


class Health(msgspec.Struct):
    ok: bool
    redis: bool


class JobPath(msgspec.Struct):
    """The path parameters of a job's routes."""

    job_id: JobId


class JobQuery(msgspec.Struct):
    """GET /v1/jobs/{job_id}'s query parameters."""

    trajectories: bool = True  # false: the status without the finished samples


class EventsHeaders(msgspec.Struct):
    """The request headers the event stream reads."""

    last_event_id: str = msgspec.field(default="", name="Last-Event-ID")  # resume after this event


class Answer(NamedTuple):
    """One documented answer of a route: what it means and the type of its body (None: not described)."""

    description: str
    body: Any = None
    content_type: str = "application/json"


class Route(NamedTuple):
    """One operation of the ingress: the app serves it with the Ingress method `handler`; `openapi()` describes it."""

    method: Literal["GET", "POST", "DELETE"]
    path: str
    handler: str
    summary: str
    answers: dict[int, Answer]
    body: tuple[type, ...] = ()  # the request body: one of these
    parameters: dict[Literal["path", "query", "header"], type[msgspec.Struct]] = {}  # a parameter per field
    events: tuple[type, ...] = ()  # the data of its Server-Sent Events
    public: bool = False  # served without a bearer token


def _errors(*statuses: int) -> dict[int, Answer]:
    unauthorized = Answer("missing or unknown bearer token", ErrorBody)
    return {401: unauthorized} | {status: Answer("error", ErrorBody) for status in statuses}


ROUTES = (
    Route(
        "POST",
        "/v1/jobs",
        "submit",
        "submit one job or a batch (all or nothing)",
        body=(JobSpec, JobBatch),
        answers={
            202: Answer("accepted (admitted, or duplicates of earlier submissions)", SubmitResponse),
            **_errors(400, 403, 413, 415, 429),
        },
    ),
    Route(
        "GET",
        "/v1/jobs/{job_id}",
        "get_job",
        "status and trajectories",
        parameters={"path": JobPath, "query": JobQuery},
        answers={200: Answer("the job", JobStatus), **_errors(400, 404)},
    ),
    Route(
        "DELETE",
        "/v1/jobs/{job_id}",
        "cancel",
        "cancel: samples not yet started never run",
        parameters={"path": JobPath},
        answers={200: Answer("cancelled", CancelResponse), **_errors(400, 404)},
    ),
    Route(
        "GET",
        "/v1/jobs/{job_id}/events",
        "events",
        "Server-Sent Events: `sample` (id = results stream entry id, data = Trajectory) as samples finish, then `done` "
        "(data = Done); resume with the Last-Event-ID header",
        parameters={"path": JobPath, "header": EventsHeaders},
        answers={200: Answer("event stream", content_type="text/event-stream"), **_errors(400, 404)},
        events=(Trajectory, Done),
    ),
    Route(
        "GET",
        "/healthz",
        "healthz",
        "whether Redis answers",
        answers={200: Answer("healthy", Health), 503: Answer("unhealthy", Health)},
        public=True,
    ),
    Route("GET", "/openapi.json", "openapi", "this document", answers={200: Answer("OpenAPI 3.1")}, public=True),
)


def openapi(title: str = "rollq ingress", version: str = "1") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the ingress: its paths from `ROUTES`, every schema generated from the types they
    name (msgspec.json.schema_components)."""
    types = list(
        dict.fromkeys(
            t
            for route in ROUTES
            for t in (*route.body, *(a.body for a in route.answers.values() if a.body is not None), *route.events)
        )
    )
    refs, components = msgspec.json.schema_components(
        types, schema_hook=json_schema_hook, ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip(types, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        parameters = [
            {"name": f.encode_name, "in": where, "required": f.required, "schema": msgspec.json.schema(f.type)}
            for where, struct in route.parameters.items()
            for f in msgspec.structs.fields(struct)
        ]
        operation: dict[str, Any] = {
            "summary": route.summary,
            **({"parameters": parameters} if parameters else {}),
            "responses": {
                str(status): {
                    "description": answer.description,
                    "content": {answer.content_type: {"schema": schema_of.get(answer.body, {})}},
                }
                for status, answer in sorted(route.answers.items())
            },
        }
        if route.body:
            schema = {"oneOf": [schema_of[t] for t in route.body]} if len(route.body) > 1 else schema_of[route.body[0]]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        if route.public:
            operation["security"] = []
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }


__all__ = [
    "ROUTES",
    "Admitted",
    "Answer",
    "CancelResponse",
    "Counts",
    "Done",
    "ErrorBody",
    "EventsHeaders",
    "Health",
    "JobBatch",
    "JobPath",
    "JobQuery",
    "JobSpec",
    "JobStatus",
    "Route",
    "SampleState",
    "SubmitResponse",
    "openapi",
]
