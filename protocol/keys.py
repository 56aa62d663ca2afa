"""Redis key names. A run's keys carry hash tags, so each atomic step (a Lua script, a MULTI) touches one Redis
Cluster slot; several runs (and tenants) share one Redis.

A run has K partitions (`RunKeys.partitions`, default 1), each with its own hash tag so they can land on different
Cluster shards: partition 0 uses the run's tag `{run}`, partition p > 0 `{run/p<p>}` ('/' can't occur in a run name).
Where each key lives:

- per partition (the partition's tag): the job streams (one per class), the results stream and private reply
  streams with their in-flight counters and consumed-sets, idempotency markers, dead letters, dropped counts, the
  ingress's per-job control hash and results stream. A job id's partition is `partition_of(job_id, K)`, so the
  job, its marker, its results and its control records share a slot;
- run-wide (the run's tag `{run}`, also partition 0's): the partition count, job classes, workers and their info,
  engines, the trainer's staleness ledger and its groups, the arq reward queue.

With K = 1 every key is under `{run}`, as before partitions existed."""

from __future__ import annotations

import re
import zlib

import msgspec

_RUN_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")

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


def partition_of(job_id: str, partitions: int) -> int:
    """The partition of a job id among `partitions`: stable across processes and languages (CRC-32 of its UTF-8
    bytes, modulo the count), so a resubmission, a lookup or a cancel finds the job's keys from its id alone."""
    return zlib.crc32(job_id.encode()) % partitions if partitions > 1 else 0


def partition_share(bound: int, partitions: int) -> int:
    """A run-wide bound's share on one of `partitions` (ceil(bound / partitions)); 0 stays "no bound"."""
    return -(-bound // partitions) if bound > 0 else bound


class RunKeys(msgspec.Struct, frozen=True):
    run: str
    partition: int = 0  # which partition's keys the per-partition names below are (the run-wide ones ignore it)

    def __post_init__(self) -> None:
        validate_run_name(self.run)
        if self.partition < 0:
            raise ValueError(f"partition must be >= 0, got {self.partition}")

    def at(self, partition: int) -> RunKeys:
        """The same run's keys on `partition`."""
        return self if partition == self.partition else RunKeys(self.run, partition)

    @property
    def run_prefix(self) -> str:
        """The run-wide keys' prefix (the run's hash tag; partition 0's too)."""
        return f"rollq:{{{self.run}}}"

    @property
    def prefix(self) -> str:
        """This partition's prefix: `rollq:{run}` for partition 0, `rollq:{run/p<p>}` for p > 0."""
        return self.run_prefix if self.partition == 0 else f"rollq:{{{self.run}/p{self.partition}}}"

    @property
    def partitions(self) -> str:
        """String: the run's partition count K (absent = 1). Set once, by the first process that names one."""
        return f"{self.run_prefix}:partitions"

    @property
    def jobs(self) -> str:
        """The default class's stream on this partition."""
        return f"{self.prefix}:jobs"

    def job_stream(self, job_class: str = DEFAULT_CLASS) -> str:
        """The stream of one job class on this partition: `<prefix>:jobs` (the default class) or
        `<prefix>:jobs:<class>`."""
        validate_class_name(job_class)
        return self.jobs if job_class == DEFAULT_CLASS else f"{self.prefix}:jobs:{job_class}"

    @property
    def classes(self) -> str:
        """Hash: job class name -> JSON `JobClass` (priority, weight, max_inflight). `train` exists when absent."""
        return f"{self.run_prefix}:classes"

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
        return f"{self.run_prefix}:workers"

    @property
    def worker_info(self) -> str:
        """Hash: worker name -> JSON description."""
        return f"{self.run_prefix}:workers:info"

    @property
    def engines(self) -> str:
        """Sorted set: engine URL -> time its registration expires (engines renew it while alive)."""
        return f"{self.run_prefix}:engines"

    @property
    def ledger(self) -> str:
        """Hash: the trainer's policy version and sample admission counts (the staleness ledger)."""
        return f"{self.run_prefix}:ledger"

    @property
    def ledger_groups(self) -> str:
        """Hash: group (job) id -> samples it holds in the staleness ledger (0 once given back)."""
        return f"{self.run_prefix}:ledger:groups"

    @property
    def ledger_partial(self) -> str:
        """Hash: group (job) id -> samples a partial group gave back (its failed ones), written once; `<id>|rest` ->
        what a split group had not trained when it was dropped."""
        return f"{self.run_prefix}:ledger:partial"

    @property
    def rewards(self) -> str:
        """The arq queue of remote reward calls (`rollq reward-worker` serves it)."""
        return f"{self.run_prefix}:rewards"

    def reply_stream(self, name: str) -> str:
        """A private results stream, e.g. for one `rollq enqueue --wait` or one external service."""
        validate_run_name(name)
        return f"{self.prefix}:results:{name}"

    def job_seen(self, job_id: str) -> str:
        """Idempotency marker for a submitted job id; holds the reply stream its results go to."""
        return f"{self.prefix}:job:{job_id}"

    def owns(self, key: str) -> bool:
        """`key` is one of this partition's keys."""
        return key.startswith(self.prefix + ":")

    def translate(self, key: str, partition: int) -> str:
        """This partition's key `key` named on `partition` (e.g. a reply stream on the partition of a job)."""
        if not self.owns(key):
            raise ValueError(f"{key!r} is not a key of {self.prefix}")
        return self.at(partition).prefix + key[len(self.prefix) :]

    def job_control(self, job_id: str) -> str:
        """Hash: a cancellable job's record (`Job.cancellable`, e.g. the ingress's jobs): `n`, `cancelled` once
        cancelled, `s<i>` once sample i started, `c<i>` once its `cancelled` result was published; for the byte
        quota, `charge` ("<bytes>:<call>": what it holds, and the admitting call), `f<i>` once sample i is done for
        good (published, dead-lettered, or cancelled unstarted), `d` (how many are) and `ref` (its data's blob
        digest). Expires with the job's retention; the ingress's idempotency marker."""
        return f"{self.prefix}:ctl:{job_id}"

    def blob(self, digest: str) -> str:
        """String: a content-addressed payload on this partition (a job's data, msgpack), named by the SHA-256 hex
        digest of its bytes (`Job.data_ref`). Written with the jobs that reference it, in the same atomic step, and
        expiring with the retention of the longest-lived submission that referenced it; an ingress job's is deleted
        sooner, once no job that references it has a sample left (blob_refs)."""
        if not _DIGEST.match(digest):
            raise ValueError(f"blob digest {digest!r} is not a SHA-256 hex digest")
        return f"{self.prefix}:blob:{digest}"

    def blob_refs(self, digest: str) -> str:
        """Set: who still needs the blob `digest` (RunKeys.blob): the ingress's jobs that reference it and have a
        sample not finished, by job id, and "*" once a producer or a worker stored it (STORE_BLOBS: their jobs are
        not tracked, so the blob lives its TTL). The last job to finish (or be cancelled) deletes the blob with it;
        expires with the blob."""
        return self.blob(digest).replace(":blob:", ":blobrefs:", 1)

    def tenant_charges(self, tenant: str) -> str:
        """Sorted set: the ingress calls (one admission each, by a unique id) whose jobs on this partition still hold
        bytes in Redis for an ingress tenant (its byte quota, `max_tenant_queued_bytes`), scored by when their
        retention ends. A call leaves it when its last job is done (its last sample finished, or it was cancelled)
        or, at the latest, once its retention is over."""
        validate_run_name(tenant)
        return f"{self.prefix}:tenant:{tenant}:charges"

    def tenant_bytes(self, tenant: str) -> str:
        """Hash: the bytes an ingress tenant's unfinished jobs on this partition hold in Redis: `total`, and per call
        in `tenant_charges` what its jobs still hold."""
        validate_run_name(tenant)
        return f"{self.prefix}:tenant:{tenant}:bytes"

    def tenant_queued(self, tenant: str) -> str:
        """Counter: an ingress tenant's samples queued on this partition and not started yet (its quota,
        `max_tenant_queued`). The ingress adds on admission; a worker takes one off as it starts (or skips) a
        sample, a cancel as it cancels samples that never started."""
        validate_run_name(tenant)
        return f"{self.prefix}:tenant:{tenant}:queued"

    def ingress_wake(self, reader: str) -> str:
        """Stream: wake-ups of one ingress reader on this partition (`reader`, a process-unique name). The reader's
        blocking XREAD over many jobs' results streams includes it, so a new subscriber's stream joins the read at
        once; it holds no data and expires when its reader is gone."""
        validate_run_name(reader)
        return f"{self.prefix}:ingress:wake:{reader}"

    def job_results(self, job_id: str) -> str:
        """A job's own results stream (the ingress's jobs: their SSE event ids are its entry ids); expires with the
        job's retention. Outside `:results:*`, so `rollq status` does not list one per job."""
        return f"{self.prefix}:jobres:{job_id}"


def fleet_engines_key(fleet: str) -> str:
    """Sorted set of a fleet's engines (as RunKeys.engines): the engines several runs share (their LoRA adapters
    side by side), registered with `rollq engine --fleet NAME --register`."""
    validate_run_name(fleet)
    return f"rollq:fleet:{{{fleet}}}:engines"


def inflight_key(reply_stream: str) -> str:
    """Counter of samples submitted for this reply stream and not yet consumed (backpressure)."""
    return f"{reply_stream}:inflight"


def consumed_key(reply_stream: str, group: str, job_id: str) -> str:
    """Hash of sample indices of job_id that this consumer group already consumed (duplicate filter)."""
    return f"{reply_stream}:done:{group}:{job_id}"
