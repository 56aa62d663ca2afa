"""The real AReaL package (the `areal` wheel from PyPI, pinned) for the tests of rollq's promise to AReaL users:
bring AReaL's own workflow and agent files and change only their import lines.

- `areal_file(rel)`: the text of a file as the wheel ships it (e.g. "areal/workflow/rlvr.py"), never copied here.
- `convert_imports(text)`: what a user does, mode (b): every `from areal... import names` line becomes
  `from rollq.workers.api import names`; an import of another AReaL file the user brought too (vision_rlvr.py
  imports rlvr.py) becomes an import of the user's copy. Nothing else in the file changes.
- `user_package(dir, name, files)`: a package of converted copies, importable once `dir` is on the path.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from tests.third_party import unpacked

AREAL = "areal==1.0.4"
API = "rollq.workers.api"


def areal_root() -> Path:
    """The unpacked wheel: `areal/` lies in it."""
    return unpacked(AREAL)


def areal_file(rel: str) -> str:
    return (areal_root() / rel).read_text()


def _is_areal(module: str | None) -> bool:
    return module is not None and (module == "areal" or module.startswith("areal."))


def convert_imports(text: str, user_modules: dict[str, str] | None = None) -> str:
    """`text` with each `from areal... import ...` statement (any indentation, parenthesised or not) rewritten to
    import the same names from rollq.workers.api, or from `user_modules[areal_module]` for AReaL modules the user
    converted too. A plain `import areal...` has no such rewrite: ValueError (none of the files tested has one)."""
    user_modules = user_modules or {}
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(_is_areal(a.name) for a in node.names):
            raise ValueError(f"line {node.lineno}: `import areal...` has no rollq equivalent; use `from ... import`")
        if not isinstance(node, ast.ImportFrom) or not _is_areal(node.module) or node.level:
            continue
        target = user_modules.get(node.module or "", API)
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        indent = " " * node.col_offset
        assert node.end_lineno is not None
        edits.append((node.lineno - 1, node.end_lineno, f"{indent}from {target} import {names}\n"))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start:end] = [replacement]
    return "".join(lines)


def user_package(root: Path, package: str, files: dict[str, str], user_modules: dict[str, str] | None = None) -> str:
    """Write `files` ({module name in the package: AReaL file path}) converted into `root/package/` and return the
    package name (import it with `root` on sys.path)."""
    folder = root / package
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    for module, rel in files.items():
        (folder / f"{module}.py").write_text(convert_imports(areal_file(rel), user_modules))
    return package


QUESTION = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
# AReaL's VisionRLVRWorkflow's arguments in a job: the tiny vision-language model's tokenizer and processor by name
VISION_KWARGS = {
    "reward_fn": "tests.reward_fns:answer_in_completion",
    "gconfig": {"max_new_tokens": 16},
    "tokenizer": "tiny-vl",
    "processor": "tiny-vl",
    "enable_thinking": False,
}


def colour_question(colour: tuple[int, int, int], size: int = 56) -> dict[str, Any]:
    """A row of AReaL's vision datasets' shape: the templated prompt with one image placeholder, the PIL image, the
    answer."""
    from PIL import Image

    from rollq.engine.models import model_dir
    from rollq.engine.tiny_vlm import load_processor

    processor = load_processor(model_dir("tiny-vl"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {"messages": prompt, "images": [Image.new("RGB", (size, size), colour)], "answer": "red"}


async def submit_and_wait(redis: Any, run_name: str, workflow: str, n: int = 1, **job: Any) -> list[Any]:
    """Submit one job of `workflow` on QUESTION (job fields: kwargs, agent, data...) and return its n
    trajectories, ok or not (bounded: 90 s)."""
    from rollq.producer.producer import JobRequest, Producer

    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    job.setdefault("data", QUESTION)
    await producer.submit_many([JobRequest(workflow=workflow, job_id="j", n=n, **job)])
    got = [t async for t in producer.wait_for({"j": n}, timeout_s=90, consumer=consumer)]
    return sorted(got, key=lambda t: t.sample_index)


async def submit_all(redis: Any, run_name: str, requests: list[Any], timeout_s: float = 120) -> dict[str, list[Any]]:
    """Submit JobRequests and return each job's trajectories by job id, ok or not (bounded)."""
    from rollq.producer.producer import Producer

    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    await producer.submit_many(requests)
    got: dict[str, list[Any]] = {r.job_id: [] for r in requests}
    async for t in producer.wait_for({r.job_id: r.n for r in requests}, timeout_s=timeout_s, consumer=consumer):
        got[t.job_id].append(t)
    return {job_id: sorted(ts, key=lambda t: t.sample_index) for job_id, ts in got.items()}


async def run_converted(
    redis: Any, redis_url: str, run_name: str, replies: list[str], workflow: str, n: int = 1, **job: Any
) -> list[Any]:
    """Mode (b): the user's converted copy (its package already on sys.path) in a rollq worker in this process,
    against a real EnginePool on a scripted engine server."""
    from rollq.engine.pool import EnginePool, PoolConfig
    from tests.helpers import running_worker
    from tests.scripted import scripted_engine

    package = workflow.split(".")[0].split(":")[0]
    async with scripted_engine(replies) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, allow=["tests", package]):
            return await submit_and_wait(redis, run_name, workflow, n, **job)


# --- mode (a): the real package's own environment, and one worker subprocess for a module's tests ---

# What areal 1.0.4's import chain needs that the project's environment lacks (`import areal.workflow.rlvr`,
# multi_turn, openai/langchain math_agent, experimental multi_turn_v2): areal/__init__.py imports areal.infra, so
# even `from areal.api import AsyncRewardWrapper` pulls ray, hydra/omegaconf, flask, numba... Each one is imported
# by that chain, unguarded (without it the import fails); each pinned; none is a dependency of the project's: they
# live in the site folder only. areal's own pins that the project's venv contradicts (torch<2.11,
# transformers<=5.3, math-verify==0.8.0) are left to the venv's versions (--no-deps). math_verify works with the
# site's antlr 4.9.3 (latex2sympy2_extended ships parsers for both runtimes).
AREAL_SITE_REQUIREMENTS = [
    "colorlog==6.12.0",
    "flask==3.1.3",
    "blinker==1.9.0",
    "itsdangerous==2.2.0",
    "torchdata==0.11.0",
    "lark==1.3.1",
    "hydra-core==1.4.0.dev1",  # areal's pins; their generated grammar needs the antlr runtime 4.9.3
    "omegaconf==2.4.0.dev2",
    "antlr4-python3-runtime==4.9.3",  # shadows the venv's 4.13.2 in mode (a) processes only
    "ray==2.60.0",
    "msgpack==1.2.4",
    "protobuf==7.36.2",
    "numba==0.68.1",
    "llvmlite==0.50.0",
    "einops==0.8.2",
    "aiofiles==25.1.0",
]
SDIST_ONLY = ("antlr4-python3-runtime==4.9.3",)  # PyPI has no wheel of it


def _wheel_from_sdist(requirement: str) -> Path:
    """fetch_wheel for a pure-Python release PyPI ships only as an sdist: built once (`pip wheel`) into the wheel
    cache, where fetch_wheel and site() find it."""
    import tempfile

    from tests import third_party

    name, _, version = requirement.partition("==")
    prefix = f"{name.replace('-', '_').lower()}-{version}-"
    target = third_party.wheels_dir()
    with third_party._locked("wheels"):
        if not any(p.name.lower().startswith(prefix) for p in target.glob("*.whl")):
            target.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target) as tmp:
                third_party._pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, requirement)
                for wheel in Path(tmp).glob("*.whl"):
                    wheel.rename(target / wheel.name)
    return third_party.fetch_wheel(requirement)  # after the lock: flock is per open file, not per process


def areal_site() -> Path:
    """A cached folder with the real areal and exactly what its import chain lacks in the project's environment
    (AREAL_SITE_REQUIREMENTS): first on a mode (a) process's path, so `import areal...` works there."""
    from tests.third_party import site

    for requirement in SDIST_ONLY:
        _wheel_from_sdist(requirement)
    return site("areal", [AREAL, *AREAL_SITE_REQUIREMENTS])


class ScriptedEngineThread:
    """A scripted engine (tests.scripted's: SyntheticBackend with the tiny tokenizer) served from a thread of its
    own for a whole test module, whose replies each test sets (`script`, between jobs): a worker subprocess started
    once per module keeps its one engine URL while the tests' scripts differ."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted-engine", daemon=True)
        self._thread.start()
        try:
            self._handle = self._call(self._serve())
        except BaseException:
            self._stop()
            raise
        self.url: str = self._handle.url

    @staticmethod
    def _backend(replies: list[str]) -> Any:
        from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig

        return SyntheticBackend(SyntheticConfig(tokenizer="tiny", replies=replies))

    async def _serve(self) -> Any:
        from rollq.engine.server.app import EngineServerConfig, serve

        return await serve(self._backend([]), EngineServerConfig(host="127.0.0.1", port=0))

    def _call(self, coro: Any) -> Any:
        """Run `coro` in the engine's loop and return its result (bounded)."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    def script(self, replies: list[str]) -> None:
        """From now on, the n-th assistant turn of a conversation gets replies[n - 1] (the last one beyond)."""

        async def swap() -> None:  # the server reads its backend per request
            self._handle.server.backend = self._backend(replies)

        self._call(swap())

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def close(self) -> None:
        try:
            self._call(self._handle.close())
        finally:
            self._stop()


async def _scripted_job(
    redis: Any, run: str, engine: ScriptedEngineThread, replies: list[str], workflow: str, n: int, log: Any, **job: Any
) -> list[Any]:
    """Script `engine` with `replies`, submit one job of `workflow` (on QUESTION unless `data` is given) to `run` and
    return its n trajectories, ok or not (bounded: 90 s; on a timeout, `log()` says what the worker said)."""
    import uuid

    from rollq.producer.producer import JobRequest

    engine.script(replies)
    job_id = f"j{uuid.uuid4().hex[:8]}"
    job.setdefault("data", QUESTION)
    request = JobRequest(workflow=workflow, job_id=job_id, n=n, **job)
    try:
        got = await submit_all(redis, run, [request], timeout_s=90)
    except TimeoutError:
        raise AssertionError(f"no result from the worker; {log()}") from None
    return got[job_id]


class UnchangedWorker:
    """Mode (a) for a module's tests: one `rollq worker` subprocess with areal's site first on its path, on a run
    of its own, against a ScriptedEngineThread. areal is imported once, by the first job that names it (seconds:
    the first test pays it, within its bounded wait)."""

    def __init__(self, redis_url: str, log_dir: Path, *args: str, extra_path: tuple[Path, ...] = ()) -> None:
        import os
        import uuid

        from tests.helpers import WorkerProcess

        self.run = f"t{uuid.uuid4().hex[:10]}"
        self.engine = ScriptedEngineThread()
        path = os.pathsep.join(str(p) for p in (areal_site(), *extra_path))
        try:
            self.process = WorkerProcess(
                redis_url,
                self.run,
                *("--engine", self.engine.url, "--allow", "areal", "--tokenizer", "tiny", "--max-attempts", "1"),
                *args,
                name=f"areal-{uuid.uuid4().hex[:6]}",
                env={"PYTHONPATH": path},
                log=log_dir / "areal-worker.log",
            )
        except BaseException:
            self.engine.close()
            raise

    async def run_job(self, redis: Any, replies: list[str], workflow: str, n: int = 1, **job: Any) -> list[Any]:
        """See _scripted_job."""

        def log() -> str:
            return f"its log:\n{self.process.output()[-4000:]}"

        if self.process.proc.poll() is not None:  # not 90 s per test for a worker that is gone
            raise AssertionError(f"the worker exited ({self.process.proc.returncode}); {log()}")
        return await _scripted_job(redis, self.run, self.engine, replies, workflow, n, log, **job)

    def close(self) -> None:
        try:
            self.process.close()
        finally:
            self.engine.close()


class ConvertedWorker:
    """Mode (b) for a module's tests: one rollq worker in this process (the user's converted packages on sys.path,
    allowlisted), on a run of its own, against a real EnginePool on a ScriptedEngineThread; one set of reward
    processes, which import the user's file once, for all the tests. `async with` it in the loop its tests run in
    (a module-scoped loop); `redis` is a client of that loop."""

    def __init__(self, redis_url: str, packages: list[str]) -> None:
        import contextlib
        import uuid

        self.redis_url = redis_url
        self.packages = packages
        self.run = f"t{uuid.uuid4().hex[:10]}"
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> ConvertedWorker:
        from rollq.engine.pool import EnginePool, PoolConfig
        from rollq.redis_client import redis_client
        from tests.helpers import running_worker

        async with self._stack as stack:
            self.engine = ScriptedEngineThread()
            stack.callback(self.engine.close)
            pool = await stack.enter_async_context(EnginePool(PoolConfig(urls=[self.engine.url])))
            allow = ["tests", *self.packages]
            await stack.enter_async_context(
                running_worker(self.redis_url, self.run, engine=pool, max_attempts=1, allow=allow)
            )
            self.redis = redis_client(self.redis_url)
            stack.push_async_callback(self.redis.aclose)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def run_job(self, replies: list[str], workflow: str, n: int = 1, **job: Any) -> list[Any]:
        """See _scripted_job."""
        return await _scripted_job(self.redis, self.run, self.engine, replies, workflow, n, lambda: "", **job)
