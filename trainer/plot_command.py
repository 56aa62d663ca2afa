"""`rollq plot RUN_DIR`: draw a run's plot.png again from its metrics.jsonl and eval.jsonl (after an interrupted run,
or while one goes: the trainer itself draws it every 20 steps and at the end)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import msgspec

from rollq.config import Settings, setting


class PlotConfig(Settings, kw_only=True):
    """Draw a run's plot.png (reward, generated tokens/s, staleness) from its metrics.jsonl."""

    run_dir: Annotated[str, setting("the run directory holding metrics.jsonl (the trainer's run_dir)", positional=True)]
    out: Annotated[str, setting("the PNG to write ('' = RUN_DIR/plot.png)", metavar="FILE")] = ""


def plot(cfg: PlotConfig) -> int:
    """The `rollq plot` entry: the PNG's path on stdout; one `rollq plot: ...` line and exit 2 when there is nothing
    to draw."""
    from rollq.trainer.metrics import PLOT_FILE, MetricsLog
    from rollq.trainer.metrics import plot as draw

    run_dir = Path(cfg.run_dir).expanduser()
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        print(f"rollq plot: no {metrics} (a run directory holds one once its first step is done)", file=sys.stderr)
        return 2
    log = MetricsLog(run_dir)
    try:
        records, evals = log.read(), log.read_evals()
    except msgspec.DecodeError as exc:
        print(f"rollq plot: {metrics} or its eval.jsonl is not a run's record: {exc}", file=sys.stderr)
        return 2
    if not records:
        print(f"rollq plot: {metrics} holds no step yet", file=sys.stderr)
        return 2
    out = Path(cfg.out).expanduser() if cfg.out else run_dir / PLOT_FILE
    draw(records, out, f"rollq run {run_dir.resolve().name}", evals)
    print(out)
    return 0


__all__ = ["PlotConfig", "plot"]
