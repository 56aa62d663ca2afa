"""Every benchmark starts both ways it is documented to run from the repository root: `python -m bench.NAME` and
`python bench/NAME.py` (as a script, bench/ is sys.path[0]: its bootstrap must put the repository root there instead,
or `from bench.common import ...` fails). `--help` only: no Redis, no engines, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

BENCHMARKS = [
    "queue_throughput",
    "engine",
    "engine_batching",
    "engine_control",
    "engine_prefix",
    "engine_weights",
    "agents",
    "async_rl",
    "ingress",
    "fair_share",
    "partitions",
    "redis_wait",
    "gpu_check",
    "staleness_model",
    "trainer",
    "lora",
    "images",
    "tracing",
    "weight_sync",
    "report",
]


def test_every_benchmark_is_listed():
    found = {
        p.stem
        for p in (REPO_ROOT / "bench").glob("*.py")
        if p.stem not in {"__init__", "common"} and "def main(" in p.read_text()
    }
    assert found == set(BENCHMARKS)


def test_no_benchmark_shadows_a_standard_library_module():
    """Run as a script, bench/ is first on sys.path: a bench/queue.py would be what `import queue` finds."""
    modules = {p.stem for p in (REPO_ROOT / "bench").glob("*.py")}
    assert not modules & sys.stdlib_module_names


@pytest.mark.parametrize("how", ["module", "script"])
@pytest.mark.parametrize("name", BENCHMARKS)
def test_help(name, how):
    target = ["-m", f"bench.{name}"] if how == "module" else [f"bench/{name}.py"]
    res = subprocess.run([sys.executable, *target, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("usage:"), res.stdout[:500]
    assert "Traceback" not in res.stderr
