"""`rollq up`: the whole system on one machine — a redis-server (started when none answers), reference engines,
rollout workers and the trainer — training the built-in toy task with the tiny offline model."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from rollq.config import DEFAULT_REDIS_URL
from rollq.redis_client import TRANSIENT_ERRORS, redis_client, safe_url
from rollq.trainer.config import TrainConfig, UpConfig
from rollq.trainer.metrics import StepRecord

log = logging.getLogger("rollq.up")

QUIET_CHILD_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class EngineKeys(msgspec.Struct, frozen=True):
    """The keys of one `rollq up` run's engines: the trainer's own when it has them, else fresh random ones, so the
    engines' control routes are never open (they listen on loopback, but so does everything a local user runs)."""

    api_key: str
    admin_api_key: str

    @classmethod
    def for_run(cls, cfg: TrainConfig) -> EngineKeys:
        return cls(
            api_key=cfg.engine_api_key or secrets.token_urlsafe(32),
            admin_api_key=cfg.engine_admin_api_key or secrets.token_urlsafe(32),
        )

    def engine_env(self, weights_root: str) -> dict[str, str]:
        """What a spawned `rollq engine` gets: its keys and where it may load weights from. In the environment, not
        on the command line, which every local user can read (ps)."""
        return {
            "ROLLQ_ENGINE_API_KEY": self.api_key,
            "ROLLQ_ENGINE_ADMIN_API_KEY": self.admin_api_key,
            "ROLLQ_ENGINE_WEIGHTS_ROOT": weights_root,
        }

    def worker_env(self) -> dict[str, str]:
        """What a spawned `rollq worker` gets: both keys (workers abort requests, a control route)."""
        return {"ROLLQ_WORKER_ENGINE_API_KEY": self.api_key, "ROLLQ_WORKER_ENGINE_ADMIN_API_KEY": self.admin_api_key}


class StackError(RuntimeError):
    """A part of the local stack could not start or died; the message says which, with its log's tail."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGTERM if `rollq up` dies without cleaning up (SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalStack:
    """The child processes of `rollq up`, stopped (and a private Redis's directory deleted) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.tmp: Path | None = None

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` with this process's environment plus `env` (secrets go there, not in argv)."""
        with open(self.log_dir / f"{name}.log", "w") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **QUIET_CHILD_ENV, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"{name} exited with code {proc.returncode}; the end of its log:\n{tail}")

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


async def redis_answers(url: str) -> bool:
    client = redis_client(url, retries=0)
    try:
        await client.ping()
        return True
    except TRANSIENT_ERRORS:
        return False
    finally:
        await client.aclose()


async def engine_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the engine at `url` answers /health. Polled every 100 ms while engines start (and by the tests): aiohttp,
    whose session costs ~0.1 ms of CPU, where an httpx client loads the CA bundle each time (~85 ms)."""
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url + "/health") as response,
        ):
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def wait_for(ready: Callable[[], Awaitable[bool]], stack: LocalStack, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await ready():
        stack.check()
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not come up in {timeout_s:.0f} s (logs in {stack.log_dir})")
        await asyncio.sleep(0.1)


async def start_redis(stack: LocalStack, url: str | None) -> str:
    """`url` if given (it must answer); else the default Redis if one answers; else a private redis-server on a
    free port in a temporary directory, stopped on exit."""
    if url is not None:
        if not await redis_answers(url):
            raise StackError(f"no Redis answers at {url} (leave --redis/ROLLQ_REDIS_URL unset to start one)")
        return url
    if await redis_answers(DEFAULT_REDIS_URL):
        return DEFAULT_REDIS_URL
    binary = shutil.which("redis-server")
    if binary is None:
        raise StackError("no Redis answers and redis-server is not installed (run the README's set-up command)")
    stack.tmp = Path(tempfile.mkdtemp(prefix="rollq-up-redis-"))
    port = free_port()
    stack.spawn(
        "redis",
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(stack.tmp),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
    )
    local = f"redis://127.0.0.1:{port}/0"
    await wait_for(lambda: redis_answers(local), stack, "redis-server", 30)
    return local


def worker_allowlist(cfg: TrainConfig, stack: UpConfig) -> list[str]:
    """What the stack's workers may import: the operator's patterns and the trainer's own workflow (both named by
    whoever runs `rollq up`); rollq's built-ins are allowed anyway."""
    allow = list(stack.allow)
    if ":" in cfg.workflow or "." in cfg.workflow:  # an import path, not a built-in loop's short name
        allow.append(cfg.workflow)
    return allow


def engine_argv(cfg: TrainConfig, port: int) -> list[str]:
    """`rollq engine` as `rollq up` runs it (keys and weights root come through EngineKeys.engine_env)."""
    return [
        sys.executable,
        "-m",
        "rollq",
        "engine",
        "--backend",
        "reference",
        "--model",
        cfg.model,
        "--port",
        str(port),
        "--weight-version",
        "0",
        "--device",
        cfg.device,
        "--dtype",
        cfg.compute_dtype,  # engines serve in the dtype the trainer computes in
    ]


async def run_stack(cfg: TrainConfig, stack_cfg: UpConfig) -> list[StepRecord]:
    """Start the stack, train `cfg`, stop everything. Returns the metrics records."""
    from rollq.trainer.engines import engine_pool
    from rollq.trainer.loop import Trainer

    # SIGTERM (docker stop, kill) ends the run like Ctrl-C: cancelled, so every child is stopped below.
    this_task = asyncio.current_task()
    assert this_task is not None  # a coroutine run by the event loop always runs in a task
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this_task.cancel)
    run_dir = Path(cfg.directory)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    stack = LocalStack(run_dir / "logs")
    rollq = [sys.executable, "-m", "rollq"]
    try:
        if cfg.model == "smollm2":  # convert the GGUF once here, not in every engine and the trainer at once
            from rollq.engine.tiny_model import model_dir

            try:
                await asyncio.to_thread(model_dir, cfg.model)
            except ImportError as exc:  # the message names the install command
                raise StackError(str(exc)) from None
        url = await start_redis(stack, stack_cfg.redis_url)
        log.info("redis at %s, run %r; child logs in %s", safe_url(url), cfg.run, stack.log_dir)
        keys = EngineKeys.for_run(cfg)
        # The trainer writes each version under its weights directory; the engines load from there and nowhere else.
        weights_root = Path(cfg.weights_root).resolve()
        weights_root.mkdir(parents=True, exist_ok=True)
        urls = []
        for i in range(stack_cfg.engines):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            stack.spawn(f"engine-{i}", engine_argv(cfg, port), env=keys.engine_env(str(weights_root)))
        allow = [a for p in worker_allowlist(cfg, stack_cfg) for a in ("--allow", p)]
        for i in range(stack_cfg.workers):
            stack.spawn(
                f"worker-{i}",
                [
                    *rollq,
                    "worker",
                    "--redis",
                    url,
                    "--run",
                    cfg.run,
                    "--concurrency",
                    str(stack_cfg.concurrency),
                    "--wait-redis",
                    "30",
                    "--tokenizer",  # the agents' proxy renders and tokenizes as the served model does
                    cfg.model,
                    *allow,
                    *[a for u in urls for a in ("--engine", u)],
                ],
                env=keys.worker_env(),
            )
        for u in urls:
            await wait_for(functools.partial(engine_healthy, u), stack, f"engine {u}", 300)
        cfg = msgspec.structs.replace(
            cfg,
            redis_url=url,
            engine=urls,
            weights_dir=str(weights_root),
            engine_api_key=keys.api_key,
            engine_admin_api_key=keys.admin_api_key,
        )
        redis = redis_client(url)
        pool = engine_pool(cfg)
        try:
            training = asyncio.create_task(Trainer(cfg, redis, pool).run(), name="trainer")
            watch = asyncio.create_task(_watch(stack), name="watch")
            try:
                await asyncio.wait([training, watch], return_when=asyncio.FIRST_COMPLETED)
                if not training.done():
                    watch.result()  # a child died: raise with its log
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
        await asyncio.sleep(0.5)
        stack.check()


__all__ = ["EngineKeys", "LocalStack", "StackError", "engine_argv", "run_stack", "start_redis", "worker_allowlist"]
