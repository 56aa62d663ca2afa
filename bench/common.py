"""Harness code the benchmarks share: a private redis-server and `rollq worker` subprocesses (as children of
rollq.local.Processes, the one supervisor of local processes), the environment and argv for children, CPU time of a
process, clean-up of a run's keys, the common main (`run_bench`) and the JSON summary printed as the last line.

Every benchmark runs both as `python -m bench.NAME` and as `python bench/NAME.py` from the repository root; as a
script it first takes bench/ off sys.path and puts the repository root on it (bench/script_path.py), so that
`from bench.common import ...` works.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from rollq.local import LocalError, Processes, RedisServer
from rollq.protocol.keys import RunKeys

REPO = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A step of the benchmark failed or timed out."""


# -- processes ---------------------------------------------------------------------------------------------------


def start_redis(procs: Processes, data_dir: Path, timeout_s: float = 15.0) -> str:
    """A private redis-server (no persistence) in `data_dir`, stopped with the benchmark's other children."""
    return RedisServer(directory=data_dir, processes=procs).start(timeout_s).url


def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def rollq_argv() -> list[str]:
    exe = Path(sys.executable).parent / "rollq"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rollq"]


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), or None where that is not readable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def delete_matching(redis: Any, pattern: str) -> None:
    """Remove the keys a measurement left behind (not timed)."""
    batch: list[bytes] = []
    async for key in redis.scan_iter(match=pattern, count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            await redis.unlink(*batch)
            batch.clear()
    if batch:
        await redis.unlink(*batch)


# -- rollq workers ---------------------------------------------------------------------------------------------


async def start_worker(procs: Processes, redis: Any, url: str, run: str, *args: str) -> subprocess.Popen[bytes]:
    """A `rollq worker` subprocess for `run`, returned once it registered (ChildExited with its log if it dies)."""
    # bench's workflows come from the repository (--module-path: a worker never imports from its working directory)
    argv = [*rollq_argv(), "worker", "--redis", url, "--run", run, "--allow", "bench", "--module-path", str(REPO)]
    worker = procs.start("rollq-worker", [*argv, "--log-level", "WARNING", *args], env=bench_env())
    await procs.wait_until(lambda: redis.zcard(RunKeys(run).workers), 30, "rollq worker to register", watch=worker)
    return worker


# -- main ----------------------------------------------------------------------------------------------------------


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_bench(run: Callable[[Processes, Path], Awaitable[Any]], prefix: str) -> int:
    """A benchmark's main: temp directory and child processes cleaned up on any exit (SIGTERM included), the
    coroutine run on uvloop (as the worker runs), and a failure reported in one line with exit code 1."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    procs = Processes(tmp, cwd=REPO)
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(run(procs, tmp))
        else:
            uvloop.run(run(procs, tmp))
        return 0
    except (TimeoutError, BenchError, LocalError, RedisError) as exc:
        kind = "" if isinstance(exc, BenchError | LocalError) else f"{type(exc).__name__}: "
        print(f"bench failed: {kind}{exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def print_summary(summary: Any) -> None:
    """The benchmark's JSON summary: always the last line it prints."""
    print(json.dumps(summary), flush=True)
