"""The ingress's HTTP messages (JSON), as msgspec Structs: they validate requests (errors name the field, e.g.
`$.jobs[2].n`) and generate `/openapi.json`. A trajectory's JSON view mirrors the wire `Trajectory`
(rollq.protocol.messages) with token arrays as lists and the caller's own job id."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from rollq.protocol.messages import AgentOptions, TrajectoryStatus

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


class JobBatch(msgspec.Struct, forbid_unknown_fields=True):
    """Several jobs, admitted all or nothing."""

    jobs: list[JobSpec]


class Admitted(msgspec.Struct):
    job_id: str
    admitted: bool  # False: this job id was submitted before (within the retention); nothing was queued
    n: int


class SubmitResponse(msgspec.Struct):
    jobs: list[Admitted]


class SequenceView(msgspec.Struct):
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0


class ErrorView(msgspec.Struct):
    type: str
    message: str
    traceback: str = ""
    worker_id: str = ""
    attempt: int = 0
    at: float = 0.0


class TrajectoryView(msgspec.Struct):
    """One finished sample (the SSE `sample` event's data): protocol.messages.Trajectory's JSON view, token arrays
    as lists (what the OpenAPI schema describes)."""

    job_id: str
    sample_index: int
    n: int
    status: TrajectoryStatus
    sequences: list[SequenceView] = []
    error: ErrorView | None = None
    worker_id: str = ""
    workflow: str = ""
    attempt: int = 0
    submitted_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0


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
    trajectories: list[TrajectoryView] | None = None  # in sample order; left out with ?trajectories=false


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


def _response(description: str, ref: str | None, content_type: str = "application/json") -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if ref is not None:
        out["content"] = {content_type: {"schema": {"$ref": f"#/components/schemas/{ref}"}}}
    return out


_ERRORS = {
    "401": _response("missing or unknown bearer token", "ErrorBody"),
}


def openapi(title: str = "rollq ingress", version: str = "1") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the ingress, its schemas generated from the Structs above."""
    _, components = msgspec.json.schema_components(
        [JobSpec, JobBatch, SubmitResponse, JobStatus, TrajectoryView, Done, CancelResponse, ErrorBody, Health],
        ref_template="#/components/schemas/{name}",
    )
    job_path_param = {
        "name": "job_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": JOB_ID_PATTERN},
    }
    err = _response("error", "ErrorBody")
    security: list[dict[str, list[str]]] = [{"bearer": []}]
    submit_body = {"oneOf": [{"$ref": "#/components/schemas/JobSpec"}, {"$ref": "#/components/schemas/JobBatch"}]}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": security,
        "paths": {
            "/v1/jobs": {
                "post": {
                    "summary": "submit one job or a batch (all or nothing)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": submit_body}}},
                    "responses": {
                        "202": _response("accepted (admitted, or duplicates of earlier submissions)", "SubmitResponse"),
                        "400": err,
                        **_ERRORS,
                        "403": err,
                        "413": err,
                        "415": err,
                        "429": err,
                    },
                }
            },
            "/v1/jobs/{job_id}": {
                "parameters": [job_path_param],
                "get": {
                    "summary": "status and trajectories",
                    "parameters": [{"name": "trajectories", "in": "query", "schema": {"type": "boolean"}}],
                    "responses": {"200": _response("the job", "JobStatus"), "400": err, **_ERRORS, "404": err},
                },
                "delete": {
                    "summary": "cancel: samples not yet started never run",
                    "responses": {"200": _response("cancelled", "CancelResponse"), "400": err, **_ERRORS, "404": err},
                },
            },
            "/v1/jobs/{job_id}/events": {
                "parameters": [job_path_param],
                "get": {
                    "summary": "Server-Sent Events: `sample` (id = results stream entry id, data = TrajectoryView) "
                    "as samples finish, then `done` (data = Done); resume with the Last-Event-ID header",
                    "parameters": [{"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}}],
                    "responses": {
                        "200": {"description": "event stream", "content": {"text/event-stream": {"schema": {}}}},
                        "400": err,
                        **_ERRORS,
                        "404": err,
                    },
                },
            },
            "/healthz": {
                "get": {
                    "summary": "whether Redis answers",
                    "security": [],
                    "responses": {"200": _response("healthy", "Health"), "503": _response("unhealthy", "Health")},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "security": [],
                    "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}},
                }
            },
        },
    }


__all__ = [
    "Admitted",
    "CancelResponse",
    "Counts",
    "Done",
    "ErrorBody",
    "ErrorView",
    "Health",
    "JobBatch",
    "JobSpec",
    "JobStatus",
    "SampleState",
    "SequenceView",
    "SubmitResponse",
    "TrajectoryView",
    "openapi",
]
