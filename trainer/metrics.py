"""A run's record: one JSON line per step in `metrics.jsonl`, a live progress line, and a PNG plot of reward,
throughput and staleness."""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import msgspec


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
    pause_s: float  # generation paused for the weight update
    weight_load_s: float  # the slowest engine's load, within pause_s
    ledger_version: int
    ledger_admitted: int
    ledger_limit: int  # (eta + ledger_version + 1) * B
    elapsed_s: float
    time: float
    train: TrainStats


class MetricsLog:
    def __init__(self, run_dir: Path, out: TextIO | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.out = out if out is not None else sys.stderr
        self.observers: list[Callable[[StepRecord], None]] = []  # e.g. the Prometheus exporter (trainer/exporter.py)

    def write(self, record: StepRecord, total_steps: int | None = None) -> None:
        with self.path.open("ab") as f:
            f.write(msgspec.json.encode(record) + b"\n")
        self.out.write(progress_line(record, total_steps) + "\n")
        self.out.flush()
        for observe in self.observers:
            observe(record)

    def read(self) -> list[StepRecord]:
        if not self.path.exists():
            return []
        decoder = msgspec.json.Decoder(StepRecord)
        return [decoder.decode(line) for line in self.path.read_bytes().splitlines() if line.strip()]

    def truncate(self, last_step: int) -> None:
        """Keep the steps up to `last_step` (a restarted trainer redoes the steps its checkpoint doesn't hold)."""
        kept = [r for r in self.read() if r.step <= last_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in kept))
        os.replace(tmp, self.path)


class RateWindow:
    """Rates of growing counters over at least `seconds` (reads come in bursts: one step's rate says little)."""

    def __init__(self, seconds: float, start: float) -> None:
        self.seconds = seconds
        self._marks: deque[tuple[float, tuple[int, ...]]] = deque([(start, ())])

    def rates(self, now: float, *counters: int) -> tuple[float, ...]:
        self._marks.append((now, counters))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.seconds:
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


def plot(records: list[StepRecord], path: Path, title: str = "rollq run") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: servers have no display
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r.reward_mean for r in records], marker=".")
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


__all__ = ["MetricsLog", "RateWindow", "StepRecord", "TrainStats", "plot", "progress_line"]
