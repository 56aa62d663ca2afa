"""`rollq up`: the whole system on one machine — a redis-server (started if none answers), reference engines,
rollout workers and the trainer — training the built-in toy task with the tiny offline model."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from protocol.connection import TRANSIENT_ERRORS, redis_client
from trainer.config import TrainConfig

log = logging.getLogger("rollq.up")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStack:
    """Child processes of `rollq up`, stopped (and the temporary Redis deleted) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.tmp: Path | None = None

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text()[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


async def _answers(url: str) -> bool:
    client = redis_client(url, retries=0)
    try:
        await client.ping()
        return True
    except TRANSIENT_ERRORS:
        return False
    finally:
        await client.aclose()


async def _wait(predicate: Any, stack: LocalStack, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        stack.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def _healthy(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as c:
            return (await c.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def start_redis(stack: LocalStack, url: str | None) -> str:
    """The given Redis if it answers, else a private redis-server on a free port in a temporary directory."""
    if url and await _answers(url):
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no Redis answers and redis-server is not installed (run the README's set-up command)")
    stack.tmp = Path(tempfile.mkdtemp(prefix="rollq-up-redis-"))
    port = free_port()
    stack.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(stack.tmp),
                          "--save", "", "--appendonly", "no"])
    local = f"redis://127.0.0.1:{port}/0"
    await _wait(lambda: _answers(local), stack, "redis-server", 30)
    return local


async def up(cfg: TrainConfig, *, engines: int, workers: int, redis_url: str | None,
             concurrency: int = 64) -> list[dict[str, Any]]:
    from engine.pool import EnginePool, PoolConfig
    from trainer.loop import Trainer

    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    stack = LocalStack(run_dir / "logs")
    rollq = [sys.executable, "-m", "rollq"]
    try:
        url = await start_redis(stack, redis_url)
        urls = []
        for i in range(engines):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            stack.spawn(f"engine-{i}", [*rollq, "engine", "--backend", "reference", "--model", cfg.model,
                                        "--port", str(port), "--weight-version", "0"])
        for i in range(workers):
            stack.spawn(f"worker-{i}", [*rollq, "worker", "--redis", url, "--run", cfg.run, "--concurrency",
                                        str(concurrency), *[a for u in urls for a in ("--engine", u)]])
        for u in urls:
            await _wait(lambda u=u: _healthy(u), stack, f"engine {u}")
        cfg = msgspec.structs.replace(cfg, redis_url=url, engines=urls)
        redis = redis_client(url)
        pool = EnginePool(PoolConfig(urls=urls))
        try:
            trainer = Trainer(cfg, redis, pool)
            training = asyncio.create_task(trainer.run(), name="trainer")
            watch = asyncio.create_task(_watch(stack), name="watch")
            try:
                await asyncio.wait([training, watch], return_when=asyncio.FIRST_COMPLETED)
                if not training.done():
                    watch.result()  # a child died: raise its log
                return training.result()
            finally:
                for task in (training, watch):
                    task.cancel()
                await asyncio.gather(training, watch, return_exceptions=True)
        finally:
            await pool.close()
            await redis.aclose()
    finally:
        stack.stop()


async def _watch(stack: LocalStack) -> None:
    """A child that dies ends the run with its log, rather than a silent stall."""
    while True:
        await asyncio.sleep(1.0)
        stack.check()


__all__ = ["LocalStack", "start_redis", "up"]
