"""A run's record: one JSON line per step in `metrics.jsonl`, a live progress line, and a PNG plot of reward,
throughput and staleness."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    def __init__(self, run_dir: Path, out: TextIO | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.out = out if out is not None else sys.stderr

    def write(self, record: dict[str, Any], total_steps: int | None = None) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.out.write(progress_line(record, total_steps) + "\n")
        self.out.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate(self, last_step: int) -> None:
        """Keep the steps up to `last_step` (a restarted trainer redoes the steps its checkpoint doesn't hold)."""
        kept = [r for r in self.read() if r["step"] <= last_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)


def progress_line(r: dict[str, Any], total_steps: int | None = None) -> str:
    of = f"/{total_steps}" if total_steps else ""
    dropped = sum(r["dropped"].values())
    return (f"step {r['step']:>4}{of}  reward {r['reward_mean']:.3f}  accepted {r['trained_samples']:>6}"
            f"  dropped {dropped:>4}  staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})"
            f"  {r['gen_tokens_per_s']:>7.0f} tok/s  {r['samples_per_s']:>6.1f} samples/s"
            f"  pause {r['pause_s'] * 1000:.0f} ms  {r['elapsed_s']:.0f}s")


def plot(records: list[dict[str, Any]], path: Path, title: str = "rollq run") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: servers have no display
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r["reward_mean"] for r in records], marker=".")
    axes[0].set_ylabel("mean reward")
    axes[0].grid(alpha=0.3)
    axes[1].plot(steps, [r["gen_tokens_per_s"] for r in records], marker=".", color="tab:green")
    axes[1].set_ylabel("generated tokens/s")
    axes[1].grid(alpha=0.3)
    axes[2].plot(steps, [r["staleness_mean"] for r in records], marker=".", color="tab:red", label="mean")
    axes[2].plot(steps, [r["staleness_max"] for r in records], linestyle="--", color="tab:red", label="max")
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


__all__ = ["MetricsLog", "plot", "progress_line"]
