"""A run's record: one JSON line per step in `metrics.jsonl`, a live progress line, and a PNG plot of reward,
throughput and staleness."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    def __init__(self, run_dir: Path, out: TextIO | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.out = out if out is not None else sys.stderr

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.out.write(
            f"step {record['step']:>4}  reward {record['reward_mean']:.3f}  accepted {record['accepted_samples']:>5}"
            f"  dropped {record['dropped_samples']:>4}  staleness {record['staleness_mean']:.2f}"
            f" (max {record['staleness_max']})  {record['tokens_per_s']:>7.0f} tok/s  pause {record['pause_s']*1000:.0f} ms\n")
        self.out.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(records: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r["reward_mean"] for r in records], marker=".")
    axes[0].set_ylabel("mean reward")
    axes[1].plot(steps, [r["tokens_per_s"] for r in records], marker=".", color="tab:green")
    axes[1].set_ylabel("generated tokens/s")
    axes[2].plot(steps, [r["staleness_mean"] for r in records], marker=".", color="tab:red", label="mean")
    axes[2].plot(steps, [r["staleness_max"] for r in records], linestyle="--", color="tab:red", label="max")
    axes[2].set_ylabel("staleness (versions)")
    axes[2].set_xlabel("step")
    axes[2].legend()
    fig.suptitle("rollq run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["MetricsLog", "plot"]
