"""`rollq worker`'s settings: the `worker` section, ROLLQ_WORKER_<KEY>, and the command's flags."""

from __future__ import annotations

from typing import Annotated, Literal

from rollq.config import RunSettings, setting
from rollq.module_paths import SETTING_DOC as MODULE_PATHS_DOC
from rollq.protocol.blobs import DEFAULT_BLOB_TTL_S, VISION_INLINE_BYTES
from rollq.protocol.image_limits import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES, DEFAULT_MAX_TOTAL_PIXELS
from rollq.protocol.keys import validate_run_name
from rollq.protocol.limits import MAX_JOB_BYTES, MAX_TRAJECTORY_BYTES
from rollq.workers.environments.settings import EnvironmentSettings, OpenenvPython, OpenenvServers, VerifiersPython
from rollq.workers.media import DEFAULT_MAX_PIXELS

AGENTS = "agent workflows"


class WorkerConfig(RunSettings, kw_only=True):
    """A rollout worker: pulls jobs, runs their workflows against the engines, publishes trajectories."""

    concurrency: Annotated[int, setting("jobs run at once", metavar="N", ge=1)] = 64
    also_serve: Annotated[
        list[str],
        setting(
            "more runs this worker serves besides `run` (repeatable): the concurrency shared between them by "
            "run_weight, each run's jobs, results and leases its own, one engine pool (a fleet's) for all",
            metavar="RUN",
        ),
    ] = []
    run_weight: Annotated[
        list[str],
        setting("a served run's share weight, RUN=W (repeatable; default 1 each)", metavar="RUN=W"),
    ] = []
    fleet: Annotated[
        str,
        setting(
            "use the engines registered in fleet NAME (shared by several runs) instead of the run's own registry",
            metavar="NAME",
        ),
    ] = ""
    name: Annotated[str, setting("consumer name (default host-pid-random); reuse it to resume its pending jobs")] = ""
    engine: Annotated[
        list[str],
        setting("inference engine URL (repeatable); engines registered for the run are used too", metavar="URL"),
    ] = []
    engine_api_key: Annotated[
        str | None, setting("the engines' api_key: sent as Bearer on every engine call", metavar="KEY")
    ] = None
    engine_admin_api_key: Annotated[
        str | None,
        setting(
            "the engines' admin_api_key: sent on control routes (pause, weights, abort, flush); default "
            "engine_api_key. Workers abort requests (cancelled episodes, stop strings): without it an engine with an "
            "admin key refuses those aborts and runs the requests to max_new_tokens",
            metavar="KEY",
        ),
    ] = None
    gateway_admin_api_key: Annotated[
        str | None,
        setting(
            "the admin key of a gateway among `engine` (smg --control-plane-api-keys ID:NAME:admin:KEY): lists the "
            "engines behind it (GET /workers), whose facts requests need and which take the workers' aborts",
            metavar="KEY",
        ),
    ] = None
    allow: Annotated[
        list[str],
        setting(
            "import paths jobs may name besides rollq's built-ins (repeatable): shell "
            "patterns over dotted names, `my_pkg` covers everything in it; `command:PROG` for exec: agents, "
            "`env:NAME` for their variables, `verifiers:ENV_ID` / `openenv:NAME` for environments",
            metavar="PATTERN",
        ),
    ] = []
    module_paths: Annotated[list[str], setting(MODULE_PATHS_DOC, flag="--module-path", metavar="DIR")] = []
    max_attempts: Annotated[
        int, setting("runs of a job (crashes included) before it is dead-lettered", metavar="N", ge=1)
    ] = 3
    lease_ms: Annotated[
        int, setting("a pending job idle this long belongs to a dead worker and may be reclaimed", metavar="MS", ge=100)
    ] = 60_000
    lease_refresh_ms: Annotated[
        int, setting("how often live jobs' leases are refreshed; 0 = lease_ms / 6", metavar="MS", ge=0)
    ] = 0
    reclaim_interval_ms: Annotated[
        int, setting("how often dead workers' jobs are looked for; 0 = lease_ms / 4", metavar="MS", ge=0)
    ] = 0
    classes_refresh_ms: Annotated[
        int,
        setting("how often the run's job classes (`rollq classes`) and partitions are re-read", metavar="MS", ge=10),
    ] = 1_000
    heartbeat_ms: Annotated[int, setting("how often the worker reports itself alive", metavar="MS", ge=1)] = 2_000
    forget_workers_after: Annotated[
        float,
        setting(
            "live workers forget a worker (heartbeat and info) silent for S seconds (a crashed one)", metavar="S", gt=0
        ),
    ] = 3600.0
    block_ms: Annotated[
        int, setting("longest blocking read; bounds how fast a stop is noticed", metavar="MS", ge=1)
    ] = 500
    cluster_block_ms: Annotated[
        int,
        setting(
            "on Redis Cluster with several streams (partitions, classes): how long an idle read waits on each "
            "(a blocking read can't span slots there, so each stream is read on its own, all at once)",
            metavar="MS",
            ge=1,
        ),
    ] = 100
    drain_grace: Annotated[
        float,
        setting(
            "seconds in-flight jobs get to finish on SIGTERM before the rest is handed back (keep the kill timer, "
            "terminationGracePeriodSeconds or stop_grace_period, at least 15 s above it)",
            metavar="S",
            ge=0,
        ),
    ] = 30.0
    wait_redis: Annotated[float, setting("wait up to S seconds for Redis at start", metavar="S", ge=0)] = 0.0
    metrics_port: Annotated[
        int, setting("serve Prometheus /metrics on this port (0 = off)", metavar="PORT", ge=0, le=65535)
    ] = 0
    metrics_host: Annotated[
        str, setting("address the /metrics server binds (0.0.0.0 in a container so Prometheus can scrape it)")
    ] = "127.0.0.1"
    max_job_bytes: Annotated[
        int,
        setting(
            "a job payload larger than this is dead-lettered (JobTooLarge) without decoding its data", metavar="N", ge=1
        ),
    ] = MAX_JOB_BYTES
    max_image_pixels: Annotated[
        int,
        setting(
            "an image in a job's data with more pixels than this (read from its header, before decoding) "
            "dead-letters the job (BadImage)",
            metavar="N",
            ge=1,
        ),
    ] = DEFAULT_MAX_PIXELS
    max_job_images: Annotated[
        int,
        setting(
            "a job whose data holds more images than this is dead-lettered (BadImage) before any is decoded",
            metavar="N",
            ge=1,
        ),
    ] = DEFAULT_MAX_IMAGES
    max_job_image_bytes: Annotated[
        int,
        setting(
            "a job whose images take more encoded bytes than this together is dead-lettered (BadImage)",
            metavar="N",
            ge=1,
        ),
    ] = DEFAULT_MAX_IMAGE_BYTES
    max_job_image_pixels: Annotated[
        int,
        setting(
            "a job whose images have more pixels than this together (read from their headers, before decoding; "
            "decoded once per job, shared by its samples) is dead-lettered (BadImage)",
            metavar="N",
            ge=1,
        ),
    ] = DEFAULT_MAX_TOTAL_PIXELS
    max_agent_timeout: Annotated[
        float,
        setting(
            "a job whose agent.timeout_seconds is longer than this is dead-lettered (AgentTimeoutTooLong) before it "
            "runs: what one episode may hold a slot for",
            metavar="S",
            gt=0,
            group=AGENTS,
        ),
    ] = 3600.0
    vision_inline_bytes: Annotated[
        int,
        setting(
            "a sequence's images (the processor's pixel values) at least this large go to the run's blob store, "
            "referenced from the trajectory; smaller ones ride in it",
            metavar="N",
            ge=0,
        ),
    ] = VISION_INLINE_BYTES
    blob_ttl_s: Annotated[
        int,
        setting("seconds the images of a published trajectory stay in the blob store", metavar="S", ge=60),
    ] = DEFAULT_BLOB_TTL_S
    max_trajectory_bytes: Annotated[
        int,
        setting(
            "a trajectory whose encoding is larger is published as an `error` result (TrajectoryTooLarge) instead",
            metavar="N",
            ge=1,
        ),
    ] = MAX_TRAJECTORY_BYTES
    publish_batch: Annotated[int, setting("trajectories published per Redis round trip at most", metavar="N", ge=1)] = (
        256
    )
    tokenizer: Annotated[
        str,
        setting(
            "tokenizer + chat template of the agents' proxy: `tiny`, `smollm2` or the served model's directory",
            group=AGENTS,
        ),
    ] = "tiny"
    models_root: Annotated[
        str,
        setting(
            "a directory whose model folders jobs' workflow kwargs may name as a tokenizer or processor (relative to "
            "it), besides `tiny`, `smollm2` and --tokenizer; empty: none (a job never names other paths)",
            metavar="DIR",
        ),
    ] = ""
    agent_user: Annotated[
        str,
        setting(
            "run agents (command agents, subproc-mode agents, agent hosts) as this user: UID:GID or a user name, "
            "which all agents share (they can read each other's environment, proxy keys included); or a uid range "
            "FIRST-LAST:GID (e.g. 20000-20255:20000): Python agents run as FIRST, each running command agent as a "
            "uid of the others of its own, all of whose processes are killed when its episode ends (at least the "
            "worker's concurrency of them, or episodes wait for a free one; one worker per range and machine). The "
            "worker needs CAP_SETUID, CAP_SETGID and CAP_KILL, as root has, and refuses to start when the agents "
            "can write an allowed command folder or a sys.path entry. Empty: agents run as the worker's own user, "
            "which is no boundary",
            metavar="USER",
            group=AGENTS,
        ),
    ] = ""
    agent_processes: Annotated[int, setting("subproc-mode agents running at once", metavar="N", ge=1, group=AGENTS)] = 4
    agent_hosts: Annotated[
        int,
        setting(
            "processes that run inline agents' episodes (each many at once, its own event loop and HTTP client); "
            "0 = the worker's own event loop",
            metavar="N",
            ge=0,
            group=AGENTS,
        ),
    ] = 0
    proxy_host: Annotated[str, setting("where the agents' OpenAI-compatible proxy listens", group=AGENTS)] = "127.0.0.1"
    proxy_port: Annotated[int, setting("its port (0: a free one)", ge=0, le=65535, group=AGENTS)] = 0
    proxy_continuation: Annotated[
        Literal["exact", "template"],
        setting(
            "a turn that continues a recorded conversation: `exact` = the engine's ids + only the new turns' tokens "
            "(one growing sequence); `template` = the chat template renders the whole conversation (a new sequence)",
            group=AGENTS,
        ),
    ] = "exact"
    proxy_max_body_bytes: Annotated[
        int,
        setting(
            "the proxy answers 413 to a request body over this (and records nothing)",
            metavar="BYTES",
            ge=1024,
            group=AGENTS,
        ),
    ] = 64 << 20
    # Environments (rollq.workers.environments): declared in its settings module, shared with EnvironmentSettings.
    verifiers_python: VerifiersPython = ""
    openenv_python: OpenenvPython = ""
    openenv_servers: OpenenvServers = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        self.environments()  # a malformed openenv_servers is an error now
        if not self.lease_refresh_ms:
            self.lease_refresh_ms = max(50, self.lease_ms // 6)
        if not self.reclaim_interval_ms:
            self.reclaim_interval_ms = max(50, self.lease_ms // 4)
        if self.lease_refresh_ms * 2 > self.lease_ms:
            raise ValueError("lease_refresh_ms must be well below lease_ms (at most half)")
        for run in self.also_serve:
            validate_run_name(run)
        self.weights()  # a malformed run_weight is an error now

    def environments(self) -> EnvironmentSettings:
        """The environment settings, as the worker hands them to its workflows."""
        return EnvironmentSettings(
            verifiers_python=self.verifiers_python,
            openenv_python=self.openenv_python,
            openenv_servers=dict(self.openenv_servers),
        )

    @property
    def runs(self) -> list[str]:
        """Every run this worker serves: `run`, then also_serve (each once)."""
        return list(dict.fromkeys([self.run, *self.also_serve]))

    def weights(self) -> dict[str, float]:
        """run_weight as run -> weight."""
        out: dict[str, float] = {}
        for item in self.run_weight:
            run, sep, raw = item.partition("=")
            try:
                weight = float(raw)
            except ValueError:
                weight = -1.0
            if not sep or run not in self.runs or not weight > 0:
                raise ValueError(f"run_weight {item!r} must be RUN=W with RUN a served run ({self.runs}) and W > 0")
            out[run] = weight
        return out


__all__ = ["WorkerConfig"]
