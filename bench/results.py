"""Each benchmark's results file: its JSON summary with the provenance that makes a figure mean something (the
command, the date, the commit and the machine it ran on), written to `bench/results/<bench>.json` by default.

A benchmark's parser gets `--results DIR` from `add_results_arg` (which also starts the clock and notes the load
average), and its main calls `write_results` with the summary it prints. `python -m bench.report` renders
docs/benchmarks.md and the README's headline from those files; a test fails when the committed page or headline
differs from what they render.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"

_started: tuple[float, list[float]] | None = None  # (monotonic clock, load average) when the arguments were parsed


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def add_results_arg(p: argparse.ArgumentParser) -> None:
    """`--results DIR` (default bench/results; '' writes nothing); the run's clock starts here."""
    global _started
    _started = (time.monotonic(), _loadavg())
    p.add_argument(
        "--results",
        metavar="DIR",
        default=str(RESULTS_DIR),
        help="write the JSON summary with its provenance to DIR/<bench>.json (default bench/results; '' writes none)",
    )


def _run(argv: list[str]) -> str | None:
    try:
        res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def commit() -> dict[str, Any]:
    """The checked-out commit, and whether tracked files differed from it. ROLLQ_BENCH_COMMIT (and ROLLQ_BENCH_DIRTY
    0 or 1) say it instead, for a working tree copied to another machine, whose git metadata may be another's."""
    if os.environ.get("ROLLQ_BENCH_COMMIT"):
        dirty = os.environ.get("ROLLQ_BENCH_DIRTY")
        return {"commit": os.environ["ROLLQ_BENCH_COMMIT"], "dirty": None if dirty is None else dirty == "1"}
    rev = _run(["git", "rev-parse", "HEAD"])
    if rev is None:
        return {"commit": None, "dirty": None}
    return {"commit": rev, "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()] if out else []


def _version(dist: str) -> str | None:
    module = sys.modules.get(dist)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return str(module.__version__)  # torch's own says the build too: 2.13.0+cpu
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What the figures depend on: CPU model and count, memory, GPUs, OS, Python and torch."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": _version("torch"),
    }


def _program(bench: str) -> list[str]:
    """How this process was started: `python -m bench.NAME` or `python bench/NAME.py`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return ["python", "-m", spec.name]
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0].endswith(".py") else None
    if script is not None and script.is_relative_to(REPO):
        return ["python", str(script.relative_to(REPO))]
    return ["python", "-m", f"bench.{bench}"]


def results_record(bench: str, summary: Any, argv: list[str] | None = None) -> dict[str, Any]:
    """The results file's content: provenance first, then the summary as the benchmark printed it."""
    args = sys.argv[1:] if argv is None else argv
    started, load_start = _started if _started is not None else (None, [])
    return {
        "bench": bench,
        "command": shlex.join([*_program(bench), *args]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "duration_s": None if started is None else round(time.monotonic() - started, 1),
        **commit(),
        "machine": machine(),
        "load_avg": {"start": load_start, "end": _loadavg()},
        "summary": summary,
    }


def write_results(bench: str, summary: Any, results: str | None, argv: list[str] | None = None) -> Path | None:
    """Write DIR/<bench>.json; `results` '' or None writes nothing."""
    if not results:
        return None
    folder = Path(results)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{bench}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results_record(bench, summary, argv), indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
    print(f"results: {path}", file=sys.stderr, flush=True)
    return path
