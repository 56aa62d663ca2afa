"""Harness code the benchmarks share: child processes (Procs), free ports, a private redis-server, `rollq worker`
subprocesses, the environment and argv for children, CPU time of a process, clean-up of a run's keys, the common
main (`run_bench`) and the JSON summary printed as the last line.

Every benchmark runs both as `python -m bench.NAME` and as `python bench/NAME.py` from the repository root; as a
script it first takes bench/ off sys.path (bench/queue.py would shadow the stdlib `queue`) and puts the repository
root on it, so that `from bench.common import ...` works.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from rollq.protocol.keys import RunKeys

REPO = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A step of the benchmark failed or timed out."""


# -- processes ---------------------------------------------------------------------------------------------------


class Procs:
    """Subprocesses started by the benchmark; all are stopped at the end (terminate, then kill)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[tuple[str, subprocess.Popen, Any]] = []

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO
    ) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}-{len(self._procs)}.log", "wb")
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append((name, proc, log))
        return proc

    def log_tail(self, proc: subprocess.Popen, chars: int = 3000) -> str:
        for _, p, log in self._procs:
            if p is proc:
                log.flush()
                return Path(log.name).read_bytes()[-chars:].decode(errors="replace")
        return ""

    def stop(self, proc: subprocess.Popen, grace_s: float = 5.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop_all(self) -> None:
        for _, proc, log in reversed(self._procs):
            try:
                self.stop(proc)
            finally:
                log.close()
        self._procs.clear()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(procs: Procs, data_dir: Path, timeout_s: float = 15.0) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise BenchError("redis-server is not on PATH (or pass --redis URL)")
    for _ in range(5):
        port = free_port()
        proc = procs.start(
            "redis",
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(data_dir),
                "--protected-mode",
                "no",
            ],
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            procs.stop(proc)
            raise BenchError(f"redis-server on port {port} did not answer PING in {timeout_s}s")
        # exited: most likely the port was taken in the meantime; try another one
    raise BenchError(f"redis-server would not start: {procs.log_tail(proc)}")


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


async def start_worker(procs: Procs, redis: Any, url: str, run: str, *args: str) -> subprocess.Popen:
    """A `rollq worker` subprocess for `run`, returned once it registered (or BenchError with its log)."""
    worker = procs.start(
        "rollq-worker",
        [*rollq_argv(), "worker", "--redis", url, "--run", run, "--allow", "bench", "--log-level", "WARNING", *args],
        env=bench_env(),
    )
    deadline = time.monotonic() + 30
    while not await redis.zcard(RunKeys(run).workers):
        if worker.poll() is not None:
            raise BenchError(f"rollq worker exited with {worker.returncode}:\n{procs.log_tail(worker)}")
        if time.monotonic() > deadline:
            raise BenchError(f"rollq worker did not register in 30 s:\n{procs.log_tail(worker)}")
        await asyncio.sleep(0.05)
    return worker


# -- main ----------------------------------------------------------------------------------------------------------


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_bench(run: Callable[[Procs, Path], Awaitable[Any]], prefix: str) -> int:
    """A benchmark's main: temp directory and child processes cleaned up on any exit (SIGTERM included), the
    coroutine run on uvloop (as the worker runs), and a failure reported in one line with exit code 1."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    procs = Procs(tmp)
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(run(procs, tmp))
        else:
            uvloop.run(run(procs, tmp))
        return 0
    except (TimeoutError, BenchError, RedisError) as exc:
        print(
            f"bench failed: {type(exc).__name__}: {exc}" if not isinstance(exc, BenchError) else f"bench failed: {exc}",
            file=sys.stderr,
        )
        return 1
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def print_summary(summary: Any) -> None:
    """The benchmark's JSON summary: always the last line it prints."""
    print(json.dumps(summary), flush=True)
