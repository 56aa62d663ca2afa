"""`rollq ingress` settings: the `ingress` section, ROLLQ_INGRESS_<KEY>, and the command's flags."""

from __future__ import annotations

from typing import Annotated

from rollq.config import RunSettings, setting
from rollq.protocol.image_limits import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES, DEFAULT_MAX_TOTAL_PIXELS

AUTH = "authentication and tenants"
LIMITS = "limits"


class IngressConfig(RunSettings, kw_only=True):
    """HTTP ingress: other services submit jobs, follow their results (SSE) and cancel them."""

    host: Annotated[str, setting("address to listen on (0.0.0.0 in a container)", metavar="HOST")] = "127.0.0.1"
    port: Annotated[int, setting("port to listen on", metavar="PORT", ge=0, le=65535)] = 8300
    tokens: Annotated[
        dict[str, str],
        setting("bearer token -> tenant, e.g. '{s3cret: acme}' (a tenant sees only its own jobs)", group=AUTH),
    ] = {}
    tokens_file: Annotated[
        str | None,
        setting("a YAML/JSON file mapping token -> tenant, read at start (merged with tokens)", group=AUTH),
    ] = None
    tenant_workflows: Annotated[
        dict[str, list[str]],
        setting(
            "tenant -> workflow patterns it may submit (shell-style over dotted names, as the workers' --allow; "
            "`command:PROG` for exec: agents, `env:NAME` for their variables, `verifiers:ENV_ID` / `openenv:NAME` for "
            "environments); a tenant not listed may submit anything the workers allow",
            group=AUTH,
        ),
    ] = {}
    retention: Annotated[
        float,
        setting(
            "how long a job's record and results stay in Redis after submission (SSE resume works within it)", ge=1
        ),
    ] = 86400.0
    max_body_bytes: Annotated[
        int, setting("largest request body (413 beyond)", metavar="BYTES", ge=1024, group=LIMITS)
    ] = 8 * 1024 * 1024
    max_batch: Annotated[int, setting("most jobs in one POST (413 beyond)", metavar="N", ge=1, group=LIMITS)] = 1000
    max_n: Annotated[int, setting("most samples per job (400 beyond)", metavar="N", ge=1, group=LIMITS)] = 1024
    max_request_bytes: Annotated[
        int,
        setting(
            "most bytes one request's jobs take in Redis, every sample's entry and the data stored once (413 beyond): "
            "what bounds a small body asking for many samples",
            metavar="BYTES",
            ge=1024,
            group=LIMITS,
        ),
    ] = 16 * 1024 * 1024
    max_queued: Annotated[
        int,
        setting(
            "backpressure: refuse a whole batch (429) that would push a job stream past N entries, queued + running "
            "(0 = no bound)",
            metavar="N",
            ge=0,
            group=LIMITS,
        ),
    ] = 1_000_000
    max_tenant_queued: Annotated[
        int,
        setting(
            "quota: a tenant's samples queued and not yet started, at most (429 with Retry-After beyond; 0 = none)",
            metavar="N",
            ge=0,
            group=LIMITS,
        ),
    ] = 100_000
    max_tenant_queued_bytes: Annotated[
        int,
        setting(
            "byte quota: what a tenant's unfinished jobs take in Redis (every sample's entry and their data, as "
            "max_request_bytes counts them), at most; a job's bytes are freed with it once its last sample is done "
            "or it is cancelled (429 with Retry-After beyond; 0 = none)",
            metavar="BYTES",
            ge=0,
            group=LIMITS,
        ),
    ] = 1 << 30
    max_job_images: Annotated[
        int,
        setting(
            "most images in one job's data (413 beyond; counted before any is read)", metavar="N", ge=1, group=LIMITS
        ),
    ] = DEFAULT_MAX_IMAGES
    max_job_image_bytes: Annotated[
        int,
        setting("most bytes of one job's images together, encoded (413 beyond)", metavar="BYTES", ge=1, group=LIMITS),
    ] = DEFAULT_MAX_IMAGE_BYTES
    max_job_image_pixels: Annotated[
        int,
        setting(
            "most pixels of one job's images together, read from their headers; nothing is decoded here (413 beyond)",
            metavar="N",
            ge=1,
            group=LIMITS,
        ),
    ] = DEFAULT_MAX_TOTAL_PIXELS
    max_agent_timeout: Annotated[
        float,
        setting(
            "longest agent.timeout_seconds a job may ask for (400 beyond): how long one episode may hold a worker's "
            "slot (the workers refuse past their own max_agent_timeout too)",
            metavar="S",
            gt=0,
            group=LIMITS,
        ),
    ] = 3600.0
    max_event_streams: Annotated[
        int,
        setting(
            "open SSE streams (GET .../events) this ingress serves at once (429 beyond)",
            metavar="N",
            ge=1,
            group=LIMITS,
        ),
    ] = 10_000
    max_event_streams_per_tenant: Annotated[
        int,
        setting("open SSE streams one tenant may hold on this ingress (429 beyond)", metavar="N", ge=1, group=LIMITS),
    ] = 1_000
    header_timeout: Annotated[
        float,
        setting(
            "seconds a connection may go without a complete request head, after it opens or its last answer (also "
            "how long an idle keep-alive connection stays open: keep it above your clients' keep-alive)",
            metavar="S",
            gt=0,
            group=LIMITS,
        ),
    ] = 30.0
    body_timeout: Annotated[
        float, setting("seconds a request body may take to arrive (408 beyond)", metavar="S", gt=0, group=LIMITS)
    ] = 60.0
    keepalive: Annotated[
        float, setting("SSE comment line every S seconds while nothing happens", metavar="S", gt=0)
    ] = 15.0
    metrics_port: Annotated[
        int, setting("serve Prometheus /metrics on this port (0 = off)", metavar="PORT", ge=0, le=65535)
    ] = 0
    trace_client_parent: Annotated[
        bool,
        setting(
            "make each job's submit span a child of the request's traceparent header, following its sampled flag; "
            "off: a trace of its own (sampled by trace_sample_rate) linked to the caller's span, as tenants are not "
            "trusted with the operator's sampling or with joining other traces"
        ),
    ] = False


__all__ = ["IngressConfig"]
