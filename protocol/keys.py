"""Redis key names. Every key of a run shares the hash tag ``{run}`` so one run lives in one Redis Cluster slot and
the Lua scripts may touch all of them; several runs (and tenants) share one Redis."""

from __future__ import annotations

import re

import msgspec

_RUN_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

WORKER_GROUP = "workers"
DEFAULT_CLASS = "train"  # the job class of jobs that name none; it always exists
DEFAULT_RESULTS_GROUP = "trainer"
PAYLOAD_FIELD = b"d"


def validate_run_name(run: str) -> str:
    if not _RUN_NAME.match(run):
        raise ValueError(f"run name {run!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return run


def validate_class_name(name: str) -> str:
    if not _RUN_NAME.match(name):
        raise ValueError(f"job class name {name!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return name


class RunKeys(msgspec.Struct, frozen=True):
    run: str

    def __post_init__(self) -> None:
        validate_run_name(self.run)

    @property
    def prefix(self) -> str:
        return f"rollq:{{{self.run}}}"

    @property
    def jobs(self) -> str:
        """The default class's stream on partition 0 (the key rollq always used)."""
        return f"{self.prefix}:jobs"

    def job_stream(self, job_class: str = DEFAULT_CLASS, partition: int = 0) -> str:
        """The stream of one job class on one partition. Named once for class x partition:

        - partition 0 keeps the run's hash tag: `rollq:{run}:jobs` (the default class) or `rollq:{run}:jobs:<class>`;
        - partition p > 0 gets a hash tag of its own, `rollq:{run/p<p>}:jobs[:<class>]` ('/' can't occur in a run
          name, so no other run's tag collides), so a run's partitions can spread over Redis Cluster shards.
        """
        validate_class_name(job_class)
        if partition < 0:
            raise ValueError(f"partition must be >= 0, got {partition}")
        prefix = self.prefix if partition == 0 else f"rollq:{{{self.run}/p{partition}}}"
        return f"{prefix}:jobs" if job_class == DEFAULT_CLASS else f"{prefix}:jobs:{job_class}"

    @property
    def classes(self) -> str:
        """Hash: job class name -> JSON `JobClass` (priority, weight, max_inflight). `train` exists when absent."""
        return f"{self.prefix}:classes"

    @property
    def results(self) -> str:
        """The run's shared results stream (the trainer consumes it)."""
        return f"{self.prefix}:results"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def dropped(self) -> str:
        """Hash: reason -> results a worker dropped instead of publishing (`reply_gone`: the job's private reply
        stream had expired or been deleted, its caller gone)."""
        return f"{self.prefix}:dropped"

    @property
    def workers(self) -> str:
        """Sorted set: worker name -> last heartbeat (unix seconds)."""
        return f"{self.prefix}:workers"

    @property
    def worker_info(self) -> str:
        """Hash: worker name -> JSON description."""
        return f"{self.prefix}:workers:info"

    @property
    def engines(self) -> str:
        """Sorted set: engine URL -> time its registration expires (engines renew it while alive)."""
        return f"{self.prefix}:engines"

    @property
    def ledger(self) -> str:
        """Hash: the trainer's policy version and sample admission counts (the staleness ledger)."""
        return f"{self.prefix}:ledger"

    @property
    def ledger_groups(self) -> str:
        """Hash: group (job) id -> samples it holds in the staleness ledger (0 once given back)."""
        return f"{self.prefix}:ledger:groups"

    @property
    def rewards(self) -> str:
        """The arq queue of remote reward calls (`rollq reward-worker` serves it)."""
        return f"{self.prefix}:rewards"

    def reply_stream(self, name: str) -> str:
        """A private results stream, e.g. for one `rollq enqueue --wait` or one external service."""
        validate_run_name(name)
        return f"{self.prefix}:results:{name}"

    def job_seen(self, job_id: str) -> str:
        """Idempotency marker for a submitted job id; holds the reply stream its results go to."""
        return f"{self.prefix}:job:{job_id}"

    def owns(self, key: str) -> bool:
        return key.startswith(self.prefix + ":")

    def job_control(self, job_id: str) -> str:
        """Hash: a cancellable job's record (`Job.cancellable`, e.g. the ingress's jobs): `n`, `cancelled` once
        cancelled, `s<i>` once sample i started, `c<i>` once its `cancelled` result was published. Expires with the
        job's retention; the ingress's idempotency marker."""
        return f"{self.prefix}:ctl:{job_id}"

    def job_results(self, job_id: str) -> str:
        """A job's own results stream (the ingress's jobs: their SSE event ids are its entry ids); expires with the
        job's retention. Outside `:results:*`, so `rollq status` does not list one per job."""
        return f"{self.prefix}:jobres:{job_id}"


def inflight_key(reply_stream: str) -> str:
    """Counter of samples submitted for this reply stream and not yet consumed (backpressure)."""
    return f"{reply_stream}:inflight"


def consumed_key(reply_stream: str, group: str, job_id: str) -> str:
    """Hash of sample indices of job_id that this consumer group already consumed (duplicate filter)."""
    return f"{reply_stream}:done:{group}:{job_id}"
