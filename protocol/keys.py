"""Redis key names. Every key of a run shares the hash tag ``{run}`` so one run lives in one Redis Cluster slot and
the Lua scripts may touch all of them; several runs (and tenants) share one Redis."""

from __future__ import annotations

import re

import msgspec

_RUN_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

WORKER_GROUP = "workers"
DEFAULT_RESULTS_GROUP = "trainer"
PAYLOAD_FIELD = b"d"


def validate_run_name(run: str) -> str:
    if not _RUN_NAME.match(run):
        raise ValueError(f"run name {run!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return run


class RunKeys(msgspec.Struct, frozen=True):
    run: str

    def __post_init__(self) -> None:
        validate_run_name(self.run)

    @property
    def prefix(self) -> str:
        return f"rollq:{{{self.run}}}"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def results(self) -> str:
        """The run's shared results stream (the trainer consumes it)."""
        return f"{self.prefix}:results"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

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


def inflight_key(reply_stream: str) -> str:
    """Counter of samples submitted for this reply stream and not yet consumed (backpressure)."""
    return f"{reply_stream}:inflight"


def consumed_key(reply_stream: str, group: str, job_id: str) -> str:
    """Hash of sample indices of job_id that this consumer group already consumed (duplicate filter)."""
    return f"{reply_stream}:done:{group}:{job_id}"
