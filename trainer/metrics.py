"""A run's record: one JSON line per step in `metrics.jsonl`, a live progress line, and a PNG plot of reward,
throughput and staleness."""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

import msgspec

T = TypeVar("T")

PLOT_FILE = "plot.png"


class TrainStats(msgspec.Struct, kw_only=True):
    """What one optimizer step of decoupled PPO reports."""

    loss: float
    clip_fraction: float  # trained tokens whose ratio pi / pi_prox was clipped
    capped_fraction: float  # trained tokens left out: pi_prox / pi_behav above the cap
    importance_mean: float  # mean pi_prox / pi_behav over the tokens kept
    grad_norm: float  # before clipping
    behav_prox_gap: float  # mean |log pi_prox - log pi_behav| over trained tokens


class StepRecord(msgspec.Struct, kw_only=True):
    """One line of metrics.jsonl."""

    step: int
    version: int  # policy version after the step
    reward_mean: float
    reward_max: float
    reward_min: float
    samples: int  # trained this step
    trained_samples: int  # whole run
    groups: list[str]  # the group ids trained this step
    dropped: dict[str, int]  # samples dropped per reason, whole run
    dropped_this_step: dict[str, int]
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[str, int]  # trained samples per staleness, this step
    trained_tokens: int  # tokens the loss trained on this step (after masking)
    masked_tokens: int = 0  # generated tokens of this step's groups masked as older than v - eta (stale_policy mask)
    dropped_tokens: int = 0  # generated tokens of the samples dropped while collecting this step (any reason)
    trained_sample_tokens: int = 0  # generated tokens of the samples trained this step, masked ones included
    generated_tokens: int = 0  # generated tokens of every sample read so far (whole run)
    partial_groups: int = 0  # groups trained this step on their survivors only (partial_groups)
    split_parts: int = 0  # groups of which this step trained the finished samples ahead of stragglers (split_groups)
    late_samples: int = 0  # samples that joined the step while it trained (join_late), in `samples` too
    paced_s: float = 0.0  # waited before the weight update to keep the step at least min_step_s long
    # Beside the bound, not part of it: versions from a trained group's admission to the step training it (groups
    # admitted by this trainer life), and seconds its samples waited in the queue (submitted -> started).
    admission_lag_mean: float = 0.0
    queue_s_mean: float = 0.0
    gen_tokens_per_s: float  # generated tokens of every sample read, over the last RATE_WINDOW_S
    samples_per_s: float  # samples read (trained or dropped), same window
    collect_s: float  # waiting for fit groups
    train_s: float
    step_s: float
    # Seconds the engines did not generate for this step's weight update: from the pause until the resume answered
    # (0 when none paused: a LoRA run's adapters load beside generation). Before issue 46 this was the whole publish
    # cycle, also for adapter loads (publish_s now).
    pause_s: float
    weight_load_s: float  # the slowest engine's load (within publish_s; within pause_s when the engines paused)
    ledger_version: int
    ledger_admitted: int
    ledger_limit: int  # (eta + ledger_version + 1) * B
    elapsed_s: float
    time: float
    train: TrainStats
    # dynamic_sampling: groups (and their samples) dropped this step as `filtered`, their rewards all equal (in
    # dropped_this_step too); their rewards count in reward_mean/max/min, which describe the policy's samples
    filtered_groups: int = 0
    filtered_samples: int = 0
    # The whole weight publish of this step: saving or broadcasting the new version, and the engines' pause, load and
    # resume (an adapter's load in a LoRA run). Absent from records written before issue 46 (read as 0).
    publish_s: float = 0.0
    # What the step's weight update shipped and cost (issue 46; records written before read as a full update with
    # nothing counted): `sync` the kind of update, "delta" when at least one engine got a delta; the weight bytes
    # the engines read or received, summed and per engine updated; seconds preparing the version before the pause
    # (the engines rebuild it from the delta while generating); the delta's size over the full weights' (also when
    # a full update was sent instead: it says why); engines given full weights.
    sync: Literal["full", "delta", "adapter"] = "full"
    bytes_sent: int = 0
    bytes_per_engine: int = 0
    prepare_s: float = 0.0
    delta_share: float = 0.0
    full_engines: int = 0
    # Requests in flight that the update aborted (their clients saw finish_reason abort and resubmit) and retracted
    # (a retract pause: moved back to the engine's queue, recomputed after the resume, never seen by the client),
    # summed over the engines (engine/update_counts.py says how each engine kind counts them).
    aborted_requests: int = 0
    retracted_requests: int = 0


def update_fields(phases: dict[str, float], *, adapter: bool) -> dict[str, Any]:
    """The StepRecord fields of a weight update from its phases (engine/fleet.py run_cycle's, with the trainer's
    prepare and bytes keys: a key absent reads 0). `adapter`: a LoRA run's adapter load."""
    sync = "adapter" if adapter else "delta" if phases.get("delta", 0.0) >= 1.0 else "full"
    return {
        "sync": sync,
        "bytes_sent": round(phases.get("bytes_sent", 0.0)),
        "bytes_per_engine": round(phases.get("bytes_per_engine", 0.0)),
        "prepare_s": phases.get("prepare_s", 0.0),
        "delta_share": phases.get("delta_share", 0.0),
        "full_engines": round(phases.get("full_engines", 0.0)),
        "aborted_requests": round(phases.get("aborted", 0.0)),
        "retracted_requests": round(phases.get("retracted", 0.0)),
    }


class EvalRecord(msgspec.Struct, kw_only=True):
    """One line of eval.jsonl: the held-out mean reward of the policy after `step` steps."""

    step: int  # training steps done when evaluated (0: before the first)
    version: int  # the policy version every evaluated token was generated by
    reward_mean: float | None  # over the prompts whose sample came back ok; None (n/a) when none did
    samples: int  # prompts evaluated
    failed: int  # of them: error, rejected or timed out
    first_error: str = ""  # the first failure's type and message (one line), when any failed
    token_versions: list[int] = []  # the policy versions that generated the evaluated tokens (expected: [version])
    seconds: float  # wall time of the evaluation


class MetricsLog:
    def __init__(self, run_dir: Path, out: TextIO | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.eval_path = Path(run_dir) / "eval.jsonl"  # held-out evaluations (trainer/evaluate.py)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.out = out if out is not None else sys.stderr
        self.observers: list[Callable[[StepRecord], None]] = []  # e.g. trainer/prometheus_metrics.py

    def write(self, record: StepRecord, total_steps: int | None = None) -> None:
        with self.path.open("ab") as f:
            f.write(msgspec.json.encode(record) + b"\n")
        self.out.write(progress_line(record, total_steps) + "\n")
        self.out.flush()
        for observe in self.observers:
            observe(record)

    def write_eval(self, record: EvalRecord) -> None:
        with self.eval_path.open("ab") as f:
            f.write(msgspec.json.encode(record) + b"\n")
        self.out.write(eval_line(record) + "\n")
        self.out.flush()

    def read(self) -> list[StepRecord]:
        return read_records(self.path, StepRecord)

    def read_evals(self) -> list[EvalRecord]:
        return read_records(self.eval_path, EvalRecord)

    def truncate(self, last_step: int) -> None:
        """Keep the steps (and evaluations) up to `last_step`: a restarted trainer redoes the steps its checkpoint
        doesn't hold."""
        for path, kept in (
            (self.path, [r for r in self.read() if r.step <= last_step]),
            (self.eval_path, [e for e in self.read_evals() if e.step <= last_step]),
        ):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in kept))
            os.replace(tmp, path)


def read_records(path: Path, kind: type[T]) -> list[T]:
    """The records of a JSONL file of ours (metrics, evaluations, samples); none when it does not exist."""
    if not path.exists():
        return []
    decoder = msgspec.json.Decoder(kind)
    return [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


class RateWindow:
    """Rates of growing counters over at least `seconds` (reads come in bursts: one step's rate says little), and
    back to the last change: a step can train groups an earlier step read (one read takes what has finished), so it
    reads nothing itself, and a window of only such steps would say 0 tok/s while the engines generate."""

    MAX_MARKS = 10_000

    def __init__(self, seconds: float, start: float) -> None:
        self.seconds = seconds
        self._marks: deque[tuple[float, tuple[int, ...]]] = deque([(start, ())], maxlen=self.MAX_MARKS)

    def rates(self, now: float, *counters: int) -> tuple[float, ...]:
        self._marks.append((now, counters))
        # (the counters only grow: a mark equal to now's is followed by marks equal to it)
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.seconds and self._marks[1][1] != counters:
            self._marks.popleft()
        t0, first = self._marks[0]
        first = first or (0,) * len(counters)  # the start mark: every counter at 0
        span = max(now - t0, 1e-9)
        return tuple((c - f) / span for c, f in zip(counters, first, strict=True))


def progress_line(r: StepRecord, total_steps: int | None = None) -> str:
    of = f"/{total_steps}" if total_steps else ""
    return (
        f"step {r.step:>4}{of}  reward {r.reward_mean:.3f}  accepted {r.trained_samples:>6}"
        f"  dropped {sum(r.dropped.values()):>4}  staleness {r.staleness_mean:.2f} (max {r.staleness_max})"
        f"  {r.gen_tokens_per_s:>7.0f} tok/s  {r.samples_per_s:>6.1f} samples/s"
        f"  pause {r.pause_s * 1000:.0f} ms  {r.elapsed_s:.0f}s"
    )


def eval_line(record: EvalRecord) -> str:
    """The progress line of one evaluation: its mean, or n/a with why when every sample failed."""
    where = f"(policy version {record.version}, {record.seconds:.1f}s)"
    if record.reward_mean is None:
        return (
            f"eval after step {record.step}: held-out reward n/a: {record.failed} of {record.samples} prompts "
            f"failed, the first with {record.first_error or 'no reason given'} {where}"
        )
    line = (
        f"eval after step {record.step}: held-out reward {record.reward_mean:.3f} over "
        f"{record.samples - record.failed} of {record.samples} prompts {where}"
    )
    return line + (f"; {record.failed} failed, the first with {record.first_error}" if record.failed else "")


def format_eval(value: float | None) -> str:
    """A held-out mean as the summary prints it (n/a: every sample of that evaluation failed)."""
    return "n/a" if value is None else f"{value:.3f}"


def plot(
    records: list[StepRecord], path: Path, title: str = "rollq run", evals: list[EvalRecord] | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: servers have no display
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r.reward_mean for r in records], marker=".", label="training samples")
    scored = [e for e in evals or [] if e.reward_mean is not None]  # an evaluation that all failed has no point
    if scored:
        axes[0].plot(
            [e.step for e in scored], [e.reward_mean for e in scored], marker="o", color="tab:orange", label="held-out"
        )
        axes[0].legend()
    axes[0].set_ylabel("mean reward")
    axes[0].grid(alpha=0.3)
    axes[1].plot(steps, [r.gen_tokens_per_s for r in records], marker=".", color="tab:green")
    axes[1].set_ylabel("generated tokens/s")
    axes[1].grid(alpha=0.3)
    axes[2].plot(steps, [r.staleness_mean for r in records], marker=".", color="tab:red", label="mean")
    axes[2].plot(steps, [r.staleness_max for r in records], linestyle="--", color="tab:red", label="max")
    axes[2].set_ylabel("staleness (versions)")
    axes[2].set_xlabel("step")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_run(run_dir: Path, title: str = "") -> Path | None:
    """RUN_DIR/plot.png drawn from RUN_DIR/metrics.jsonl and eval.jsonl (what the trainer draws as it goes and at the
    end; `rollq plot RUN_DIR` and an interrupted `rollq up` draw it from the files). None when no step is recorded."""
    log = MetricsLog(Path(run_dir))
    records = log.read()
    if not records:
        return None
    return plot(records, Path(run_dir) / PLOT_FILE, title or f"rollq run {Path(run_dir).name}", log.read_evals())


__all__ = [
    "PLOT_FILE",
    "EvalRecord",
    "MetricsLog",
    "RateWindow",
    "StepRecord",
    "TrainStats",
    "eval_line",
    "format_eval",
    "plot",
    "plot_run",
    "read_records",
    "progress_line",
    "update_fields",
]
