"""The benchmarks start their redis-server and other children through rollq.local (bench/common.py's start_redis,
start_worker and run_bench), never by hand: one supervisor, whose waits are bounded and whose children are stopped
on any exit. A static check of bench/*.py: none but common.py calls subprocess.Popen or names redis-server."""

from __future__ import annotations

import ast

from tests.helpers import REPO_ROOT


def own_process_starts(source: str) -> list[str]:
    """What in `source` starts a process or a redis-server by hand."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "Popen":
            found.append(f"line {node.lineno}: subprocess.Popen")
        elif isinstance(node, ast.Constant) and node.value == "redis-server":
            found.append(f"line {node.lineno}: 'redis-server'")
    return found


def test_no_benchmark_starts_its_own_processes():
    starts = {
        path.name: own_process_starts(path.read_text())
        for path in sorted((REPO_ROOT / "bench").glob("*.py"))
        if path.name != "common.py"
    }
    assert {name: found for name, found in starts.items() if found} == {}


def test_the_check_sees_a_hand_started_redis_server():
    source = 'import subprocess\nsubprocess.Popen(["redis-server", "--port", "1"])\n'
    assert own_process_starts(source) == ["line 2: subprocess.Popen", "line 2: 'redis-server'"]
