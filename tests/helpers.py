"""Helpers shared by the test modules and the conftest fixtures (import them from here, not from a conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from rollq.local import Processes, wait_until
from rollq.shield import NOT_SECRET
from rollq.workers.config import WorkerConfig
from rollq.workers.worker import Worker

REPO_ROOT = Path(__file__).resolve().parent.parent


def env_without_settings() -> dict[str, str]:
    """This environment without its ROLLQ_* settings, but what is no secret (the model cache, the local port range):
    a `rollq` started with it runs on its defaults (unless a Redis answers on the default port, it starts its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLQ_") or k in NOT_SECRET}


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@asynccontextmanager
async def running_worker(redis_url: str, run: str, engine=None, tracing=None, **config) -> AsyncIterator[Worker]:
    config.setdefault("allow", ["tests"])  # the test suite's workflows, rewards, agents and tools
    worker = Worker(WorkerConfig(redis_url=redis_url, run=run, **config), engine=engine, tracing=tracing)
    task = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    done, _ = await asyncio.wait([task, ready], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()  # raises the worker's start-up error
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
        await worker.redis.aclose()


class WorkerProcess:
    """`rollq worker` as a real subprocess (for SIGKILL/SIGTERM tests), started by rollq.local.Processes: its output
    in `log`."""

    def __init__(self, redis_url: str, run: str, *args: str, name: str, env: dict | None = None, log: Path) -> None:
        self.name = name
        self.log = log
        cmd = [sys.executable, "-m", "rollq", "worker", "--redis", redis_url, "--run", run, "--name", name]
        self._procs = Processes(log.parent, cwd=REPO_ROOT)
        # the test suite's modules: imported from the repository's root (a worker never searches its working directory)
        cmd += ["--allow", "tests", "--module-path", str(REPO_ROOT)]
        self.proc = self._procs.start(log.stem, [*cmd, *args], env=env)

    def kill(self) -> None:
        self._procs.kill(self.proc)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """Kill the worker and what it forked: it leads its own process group, and a pool it forked (AReaL's
        AsyncRewardWrapper: children with the worker's command line) would outlive a kill of the worker alone."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._procs.kill(self.proc)

    def output(self) -> str:
        return self.log.read_text()


async def answers(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether `url` answers a GET with 200 now (for bounded waits on a server's start: a health route)."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            return (await client.get(url, headers=dict(headers or {}))).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def shared_folder(prefix: str, mode: int) -> Iterator[Path]:
    """A fresh folder other uids can reach (`mode`: 0o755 to read, 0o1777 to write too), removed after: pytest's own
    tmp folders are root's and 0700, so an agent run as another user could not use them."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def engine_healthy(url: str) -> bool:
    """Whether an engine at `url` answers /health (for bounded waits on engine start-up): `rollq up`'s own check."""
    from rollq.up import engine_healthy as answers

    return await answers(url, timeout_s=1.0)


async def wait_registered(redis, run: str, name: str, timeout_s: float = 15.0) -> None:
    from rollq.protocol.keys import RunKeys

    key = RunKeys(run).workers
    await wait_until(lambda: redis.zscore(key, name), timeout_s, what=f"worker {name} to register")


def rss_kib(pid: int) -> tuple[int, int]:
    """(peak RSS, current RSS) of a live process in KiB, from /proc/<pid>/status (VmHWM, VmRSS; Linux). For the
    memory-flatness checks of soak runs: sample it over the run and compare quarters."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0])  # "  123456 kB"
    if len(fields) != 2:
        raise ProcessLookupError(f"process {pid} has no memory figures (a zombie or a kernel thread)")
    return fields["VmHWM"], fields["VmRSS"]


def descendants(root: int) -> list[int]:
    """Every process below `root` (from /proc: its children, theirs, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found
