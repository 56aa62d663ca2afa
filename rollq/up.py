"""`rollq up` (and plain `rollq`): the whole system on one machine — a redis-server (started when none answers),
reference engines, rollout workers and the trainer — training the built-in toy task with the tiny offline model.

It starts every service, so it sits beside the CLI rather than in any of them; the processes themselves (ports,
children, logs, bounded waits, the private redis-server) are rollq.local's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

import rollq.tracing as tracing
from rollq.child_errors import ChildErrors
from rollq.config import DEFAULT_REDIS_URL, ENV_PREFIX, RunSettings, Settings, fields_of, setting
from rollq.dead_letter_file import FILE as DEAD_LETTERS_FILE
from rollq.dead_letter_file import write_dead_letters
from rollq.handover import HandedConfig
from rollq.local import LocalError, Processes, RedisServer, free_port, wait_until
from rollq.protocol.keys import RunKeys
from rollq.redis_client import TRANSIENT_ERRORS, redis_client, safe_url
from rollq.shield import shield_secrets
from rollq.trainer.config import TrainConfig, is_generated_dataset
from rollq.up_record import UpRecord, describe_run_dir, read_record, write_record
from rollq.workers.environments.naming import is_environment, parse_environment
from rollq.workers.resolver import Allowlist, WorkflowLoadError

if TYPE_CHECKING:
    from rollq.trainer.metrics import StepRecord

log = logging.getLogger("rollq.up")

STOP_GRACE_S = 10.0  # on the way out, each tier (trainer and workers, then engines and Redis) gets this long
DEAD_LETTERS_TIMEOUT_S = 10.0  # reading the dead letters out of Redis on the way out

QUIET_CHILD_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class UpConfig(Settings, kw_only=True):
    """`rollq up`: the whole stack on this machine (the trainer's settings are the `trainer` section's)."""

    redis_url: Annotated[
        str | None,
        setting(
            "Redis URL; none given: the default one if it answers, else a private redis-server",
            flag="--redis",
            metavar="URL",
            shared=True,
        ),
    ] = None
    engines: Annotated[int, setting("reference engines to start", metavar="N", ge=1)] = 1
    gateway: Annotated[
        Literal["", "smg"],
        setting(
            "put a gateway in front of the engines: `smg` (SGLang's gateway, on loopback; the `smg` package): the "
            "engines join it, workers generate through it (a group's id as its routing key), the trainer's control "
            "calls go to each engine it lists; empty: none",
            metavar="NAME",
        ),
    ] = ""
    workers: Annotated[int, setting("rollout worker processes to start", metavar="N", ge=1)] = 1
    concurrency: Annotated[int, setting("jobs each worker runs at once", metavar="N", ge=1)] = 64
    allow: Annotated[
        list[str],
        setting(
            "import paths the workers may import besides rollq's built-ins, the trainer's workflow and the reward_fn "
            "of its workflow_kwargs (repeatable)",
            metavar="PATTERN",
        ),
    ] = []
    module_paths: Annotated[
        list[str],
        setting(
            "folders the workers import user modules from (the trainer's workflow, --allow paths), after the "
            "installed packages (repeatable); none given: the folder `rollq up` was started in",
            flag="--module-path",
            metavar="DIR",
        ),
    ] = []

    def worker_module_paths(self) -> list[str]:
        """What the workers get as module_paths: the given folders, else the one this was started in (absolute,
        so they need not share its working directory)."""
        return [os.path.abspath(p) for p in self.module_paths] or [os.getcwd()]


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

    def engine_config(self, weights_root: str, gateway: Gateway | None = None) -> dict[str, Any]:
        """What a spawned `rollq engine` is handed (HandedConfig: a pipe, never its command line or environment):
        its keys and where it may load weights from; with a gateway, the gateway it joins and its admin key."""
        engine = {"api_key": self.api_key, "admin_api_key": self.admin_api_key, "weights_root": weights_root}
        if gateway is not None:
            engine |= {"gateway_url": gateway.url, "gateway_admin_api_key": gateway.admin_api_key}
        return {"engine": engine}

    def worker_config(self, redis_url: str, gateway: Gateway | None = None) -> dict[str, Any]:
        """What a spawned `rollq worker` is handed: the Redis URL (its password in it) and both keys (workers abort
        requests, a control route); with a gateway, its admin key (the workers list the engines behind it)."""
        keys = {"engine_api_key": self.api_key, "engine_admin_api_key": self.admin_api_key}
        if gateway is not None:
            keys["gateway_admin_api_key"] = gateway.admin_api_key
        return {"redis_url": redis_url, "worker": keys}


@dataclass(frozen=True)
class Gateway:
    """The gateway `rollq up` put in front of its engines: where it listens and its admin key (fresh per run)."""

    url: str
    admin_api_key: str


def handed_names(document: dict[str, Any]) -> set[str]:
    """The ROLLQ_* variables that would override `document`'s settings in a child (the environment is read over the
    config file): never passed on to it, so what rollq up hands over is what the child uses."""
    names = set()
    for key, value in document.items():
        if isinstance(value, dict):
            names |= {f"{ENV_PREFIX}{key}_{name}".upper() for name in value}
        else:
            names.add(f"{ENV_PREFIX}{key}".upper())
    return names


def settings_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The ROLLQ_* variables `rollq up` was started with (taken before it sheds them): each engine and worker gets
    those of its own section and the shared ones (for_section), reads them as settings and sheds them in turn."""
    return {name: value for name, value in environ.items() if name.startswith(ENV_PREFIX)}


def for_section(inherited: Mapping[str, str], section: str, document: dict[str, Any]) -> dict[str, str]:
    """What of `inherited` a child of `section` is given: its section's variables, the shared settings' and
    ROLLQ_CACHE, but none that would override what is handed to it in `document` (the environment is read over the
    config file). Never the trainer's (its keys among them)."""
    shared = {f.env(section) for f in fields_of(RunSettings) if f.shared} | {f"{ENV_PREFIX}CACHE"}
    own = f"{ENV_PREFIX}{section.upper()}_"
    handed = handed_names(document)
    return {k: v for k, v in inherited.items() if (k.startswith(own) or k in shared) and k not in handed}


class StackError(LocalError):
    """A part of the local stack could not start or died; the message says which, with its log's tail."""


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


async def start_redis(procs: Processes, url: str | None, directory: Path) -> str:
    """`url` if given (it must answer); else the default Redis if one answers; else a private redis-server on a
    free port in `directory` (temporary, no persistence), a child of `procs`, with a fresh password (every local
    process can reach a loopback port: without the password, none can use it)."""
    if url is not None:
        if not await redis_answers(url):
            raise StackError(f"no Redis answers at {safe_url(url)} (leave --redis/ROLLQ_REDIS_URL unset to start one)")
        return url
    if await redis_answers(DEFAULT_REDIS_URL):
        log.warning(
            "using the Redis that answers at %s: whoever can reach it (every local process, when it has no "
            "password) can read and write this run; leave none there for a private one with a password",
            DEFAULT_REDIS_URL,
        )
        return DEFAULT_REDIS_URL
    server = RedisServer(directory=directory, processes=procs, password=secrets.token_urlsafe(32))
    # Started here, in the loop's thread (the main one), not in an executor's: it dies with the thread that forked it
    # (rollq.local._die_with_parent), and an executor's threads end at the loop's shutdown. Its start blocks the loop
    # for as long as it takes to answer (milliseconds), while nothing else runs yet.
    server.start(30)
    return server.url


DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # what an allowed object is named by


def worker_allowlist(cfg: TrainConfig, stack: UpConfig) -> list[str]:
    """What the stack's workers may import: the operator's patterns, the trainer's own workflow (or the environment
    it names, `verifiers:ENV_ID`) and the reward_fn of its own workflow_kwargs and eval_workflow_kwargs (all named by
    whoever runs `rollq up`); rollq's built-ins are allowed anyway. Each is that one object, not its whole module."""
    allow = list(stack.allow)
    named = [cfg.workflow, *(kwargs.get("reward_fn") for kwargs in (cfg.workflow_kwargs, cfg.eval_workflow_kwargs))]
    if is_environment(cfg.workflow):  # `verifiers:ENV_ID` / `openenv:NAME`: that environment, as written
        try:
            env = parse_environment(cfg.workflow)  # malformed: said now (no wildcards in a name)
        except WorkflowLoadError as exc:
            raise ValueError(str(exc)) from None
        try:
            Allowlist(tuple(allow)).check_environment(env.kind, env.name)  # a pattern of the operator's covers it
        except WorkflowLoadError:
            allow.append(cfg.workflow)
        named = named[1:]
    for path in named:
        if isinstance(path, str) and (":" in path or "." in path):  # an import path, not a built-in loop's name
            dotted = path.replace(":", ".")  # patterns are over dotted names (`mod:fn` is `mod.fn`)
            if not DOTTED_NAME.fullmatch(dotted):  # `mod:*` would allow a whole module (`*.*`: everything)
                raise ValueError(f"{path!r} is not an import path (module:name): `rollq up` allows only that object")
            if not Allowlist(tuple(allow)).allows(dotted):  # rollq's own (its toy tasks' rewards) need none
                allow.append(dotted)
    allow += [name for name in [*generator_modules(cfg), *reasoning_gym_tasks(cfg)] if name not in allow]
    allow += [name for name in variable_patterns(cfg) if name not in allow]
    return allow


ENV_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def variable_patterns(cfg: TrainConfig) -> list[str]:
    """`env:NAME` for each variable the trainer's own workflow_kwargs pass to its command agent or environment
    (`env: {NAME: value}`): named by whoever runs `rollq up`. Names only, never a wildcard; the workers still refuse
    ROLLQ_* and the proxy's variables whatever is allowed."""
    names: list[str] = []
    for kwargs in (cfg.workflow_kwargs, cfg.eval_workflow_kwargs):
        variables = kwargs.get("env")
        if isinstance(variables, dict):
            names += [f"env:{n}" for n in variables if isinstance(n, str) and ENV_VARIABLE.fullmatch(n)]
    return sorted(set(names))


def generator_modules(cfg: TrainConfig) -> list[str]:
    """The modules of the user's own task generators (dataset / eval_dataset MODULE:FACTORY): their scorers run on
    the workers (rollq.tasks.generated.task_reward), as named by whoever runs `rollq up`."""
    from rollq.tasks.generated import REASONING_GYM

    specs = {cfg.dataset, cfg.eval_dataset}
    return sorted(s.partition(":")[0] for s in specs if is_generated_dataset(s) and not s.startswith(REASONING_GYM))


def reasoning_gym_tasks(cfg: TrainConfig) -> list[str]:
    """`reasoning_gym.NAME` of the run's own reasoning-gym tasks: those whose scorers evaluate the answer are scored
    only where allowed (rollq.workers.builtin.task_reward), and whoever runs `rollq up` chose them."""
    from rollq.tasks.generated import REASONING_GYM

    specs = {cfg.dataset, cfg.eval_dataset}
    return sorted(f"reasoning_gym.{s[len(REASONING_GYM) :]}" for s in specs if s.startswith(REASONING_GYM))


def engine_argv(cfg: TrainConfig, port: int) -> list[str]:
    """`rollq engine` as `rollq up` runs it (keys and weights root are handed over: EngineKeys.engine_config)."""
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
        *(["--enable-lora"] if cfg.lora and cfg.lora_publish == "adapter" else []),  # each version an adapter
    ]


def worker_argv(cfg: TrainConfig, stack_cfg: UpConfig, engines: list[str]) -> list[str]:
    """`rollq worker` as `rollq up` runs it (the Redis URL and the engines' keys are handed over:
    EngineKeys.worker_config)."""
    allow = [a for p in worker_allowlist(cfg, stack_cfg) for a in ("--allow", p)]
    return [
        *[sys.executable, "-m", "rollq", "worker", "--run", cfg.run],
        *["--concurrency", str(stack_cfg.concurrency), "--wait-redis", "30"],
        *["--tokenizer", cfg.model],  # the agents' proxy renders and tokenizes as the served model does
        *allow,
        *[a for p in stack_cfg.worker_module_paths() for a in ("--module-path", p)],
        *[a for u in engines for a in ("--engine", u)],
    ]


@dataclass
class Stack:
    """What run_stack started, for its way out and for the messages after it: the children (their logs), the Redis
    and whether it is the private one `rollq up` started (fresh: nothing of an earlier run in it; gone at exit)."""

    procs: Processes
    run_dir: Path
    redis_url: str | None = None
    private_redis: bool = False
    plot: Path | None = None  # plot.png, drawn on the way out of a run that did not finish

    def worker_log(self, worker_id: str) -> Path | None:
        """The log of the worker that called itself `worker_id` (HOST-PID-HEX, workers/worker.py) if it is one of
        ours, else the only worker's log, if there is one."""
        pid = worker_id.split("-")[-2] if worker_id.count("-") >= 2 else ""
        named = [(name, proc) for name, proc in self.procs.started() if name.startswith("worker-")]
        for name, proc in named:
            if str(proc.pid) == pid:
                return self.procs.log_dir / f"{name}.log"
        return self.procs.log_dir / f"{named[0][0]}.log" if len(named) == 1 else None


async def run_stack(
    cfg: TrainConfig,
    stack_cfg: UpConfig,
    inherited: Mapping[str, str] | None = None,
    *,
    datasets: Datasets | None = None,
    stack: Stack | None = None,
) -> list[StepRecord]:
    """Start the stack, train `cfg`, stop everything. Returns the metrics records. `inherited`: the ROLLQ_*
    variables to pass on to the engines and workers (settings_environment; default: none). `datasets`: the prompts,
    loaded already (else the trainer loads them). `stack`: filled in as the stack starts (for the caller's messages)."""
    # SIGTERM (docker stop, kill) ends the run like Ctrl-C: cancelled, so every child is stopped below.
    this_task = asyncio.current_task()
    assert this_task is not None  # a coroutine run by the event loop always runs in a task
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this_task.cancel)
    run_dir = Path(cfg.directory)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs = Processes(run_dir / "logs", env=QUIET_CHILD_ENV, die_with_parent=True)
    if stack is None:
        stack = Stack(procs, run_dir)
    stack.procs, stack.run_dir = procs, run_dir
    errors = ChildErrors()
    echo = asyncio.create_task(_echo_errors(procs, errors), name="child-errors")
    try:
        with tempfile.TemporaryDirectory(prefix="rollq-up-redis-") as redis_dir:
            drawing: asyncio.Future[Path | None] | None = None
            try:
                return await _run(cfg, stack_cfg, stack, Path(redis_dir), dict(inherited or {}), datasets)
            except BaseException:  # interrupted or failed: the trainer did not draw its last plot; drawn meanwhile
                drawing = asyncio.ensure_future(asyncio.to_thread(redraw_plot, cfg))
                raise
            finally:
                await _to_the_end(asyncio.ensure_future(_stop_stack(stack, cfg.run)))
                if drawing is not None:
                    stack.plot = await drawing
    finally:
        echo.cancel()
        await asyncio.gather(echo, return_exceptions=True)
        procs.stop_all()  # (all stopped already, unless the wind-down itself was interrupted)
        for line in [*errors.poll(procs.logs()), *errors.poll(procs.logs()), *errors.summary()]:
            log.error("%s", line)  # what the children said last (the second poll ends their last records)


async def _stop_stack(stack: Stack, run: str) -> None:
    """Every child, in order: the wind-down, then Redis, last (its directory goes after it stopped)."""
    await _wind_down(stack, run)
    stack.procs.stop_all(STOP_GRACE_S)


async def _to_the_end(task: asyncio.Future[None]) -> None:
    """Await `task` to its end even when the caller is cancelled meanwhile (a SIGTERM after the Ctrl-C), then raise
    that cancellation. The way out is bounded on its own (STOP_GRACE_S a tier); cut short, the blanket stop_all()
    after it would stop Redis and the engines under workers still draining, each at once. A second Ctrl-C is no
    cancellation (asyncio raises KeyboardInterrupt): it still cuts the way out short."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


async def _wind_down(stack: Stack, run: str) -> None:
    """The way out, bounded (each part by STOP_GRACE_S, then SIGKILL): the trainer's ranks and the workers first
    (SIGTERM), while Redis and the engines still answer, so the workers drain and hand their unfinished jobs back
    rather than wait for a Redis that is gone (issue 44: they did, logging "engine registry unavailable" each second
    until killed 10 s later); the engines once every worker has drained (deregistered) or exited; the run's dead
    letters copied out of Redis into RUN_DIR/dead-letters.jsonl meanwhile, and the Redis URL taken out of
    RUN_DIR/up.json. Redis is the caller's to stop last."""
    procs = stack.procs
    first = [proc for name, proc in procs.started() if name == "trainer" or name.startswith("worker-")]
    engines = [proc for name, proc in procs.started() if name.startswith("engine-")]
    stopping = asyncio.ensure_future(asyncio.to_thread(procs.stop_all, STOP_GRACE_S, first))
    if stack.redis_url is not None:
        await _workers_gone(stack.redis_url, run, stopping)
    engines_stopping = asyncio.ensure_future(asyncio.to_thread(procs.stop_all, STOP_GRACE_S, engines))
    await stopping
    if stack.redis_url is not None:
        await _copy_dead_letters(stack, run)
        write_record(stack.run_dir, UpRecord(run=run, pid=os.getpid()))  # the URL goes: its Redis is about to
    await engines_stopping


async def _workers_gone(url: str, run: str, stopping: asyncio.Future[None]) -> None:
    """Returns once no worker of `run` is registered (each deregisters once it has drained) or they have all exited
    (`stopping` done), within STOP_GRACE_S."""
    redis = redis_client(url, retries=0)
    key = RunKeys(run).workers

    async def gone() -> bool:
        if stopping.done():
            return True
        try:
            return await redis.zcard(key) == 0
        except TRANSIENT_ERRORS:
            return False

    try:
        await wait_until(gone, STOP_GRACE_S, 0.05, "the workers to drain")
    except TimeoutError:
        pass  # the workers are killed by now: the engines go too
    finally:
        await redis.aclose()


async def _copy_dead_letters(stack: Stack, run: str) -> None:
    """RUN_DIR/dead-letters.jsonl from the run's dead letters in Redis (a fresh private Redis: after the earlier lives'
    letters, which only the file holds)."""
    assert stack.redis_url is not None
    path = stack.run_dir / DEAD_LETTERS_FILE
    redis = redis_client(stack.redis_url, retries=0)
    try:
        written = await asyncio.wait_for(
            write_dead_letters(redis, run, path, after=stack.private_redis), DEAD_LETTERS_TIMEOUT_S
        )
        if written:
            log.info("%d dead letters (failed jobs, with their tracebacks) written to %s", written, path)
    except (*TRANSIENT_ERRORS, TimeoutError, OSError) as exc:
        log.warning("could not copy the dead letters to %s: %s", path, exc)
    finally:
        await redis.aclose()


def start_child(
    procs: Processes,
    name: str,
    argv: list[str],
    document: dict[str, Any],
    inherited: Mapping[str, str],
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a rollq child (`argv` runs `rollq SECTION`) with `document` handed over in a pipe (`--config
    /dev/fd/N`: no key or password on its command line or in its environment) and its share of the inherited
    ROLLQ_* variables (for_section)."""
    section = argv[argv.index("rollq") + 1]
    child_env = {**for_section(inherited, section, document), **(env or {})}
    with HandedConfig(document) as config:
        return procs.start(name, [*argv, *config.argv()], env=child_env, pass_fds=[config.fd])


async def _run(
    cfg: TrainConfig,
    stack_cfg: UpConfig,
    stack: Stack,
    redis_dir: Path,
    inherited: dict[str, str],
    datasets: Datasets | None,
) -> list[StepRecord]:
    from rollq.trainer.engines import engine_pool
    from rollq.trainer.loop import Trainer
    from rollq.trainer.policy import Policy

    if cfg.model in ("smollm2", "tiny-vl"):  # build it once here, not in every engine and the trainer at once
        from rollq.engine.models import model_dir

        try:
            await asyncio.to_thread(model_dir, cfg.model)
        except ImportError as exc:  # the message names the install command
            raise StackError(str(exc)) from None
    procs = stack.procs
    url = await start_redis(procs, stack_cfg.redis_url, redis_dir)
    stack.redis_url, stack.private_redis = url, url not in (stack_cfg.redis_url, DEFAULT_REDIS_URL)
    log.info("redis at %s, run %r; child logs in %s", safe_url(url), cfg.run, procs.log_dir)
    write_record(stack.run_dir, UpRecord(run=cfg.run, redis_url=url, pid=os.getpid()))  # mode 0600: the password
    status_command = f"rollq status --run-dir {shlex.quote(str(stack.run_dir))}"
    print(f"rollq up: its queue, workers and ledger while it runs: {status_command}", file=sys.stderr)
    keys = EngineKeys.for_run(cfg)
    # The trainer writes each version under its weights directory; the engines load from there and nowhere else.
    weights_root = Path(cfg.weights_root).resolve()
    weights_root.mkdir(parents=True, exist_ok=True)
    gateway = await start_gateway(procs, keys) if stack_cfg.gateway else None
    urls = []
    for i in range(stack_cfg.engines):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        handed = keys.engine_config(str(weights_root), gateway)
        start_child(procs, f"engine-{i}", engine_argv(cfg, port), handed, inherited)
    # Behind a gateway, workers generate through it and the trainer follows its list of engines.
    served = [gateway.url] if gateway is not None else urls
    for i in range(stack_cfg.workers):
        env = tracing.child_env(cfg)  # its spans join the trainer's traces
        handed = keys.worker_config(url, gateway)
        start_child(procs, f"worker-{i}", worker_argv(cfg, stack_cfg, served), handed, inherited, env)
    # The trainer's model loads while the engines start (seconds each, on other cores): neither waits for the other.
    policy = asyncio.create_task(asyncio.to_thread(Policy, cfg)) if cfg.nproc == 1 else None
    try:
        for u in urls:
            await procs.wait_until(functools.partial(engine_healthy, u), 300, f"engine {u}", interval_s=0.1)
        if gateway is not None:
            routed = functools.partial(gateway_routes_to, gateway, urls)
            await procs.wait_until(routed, 60, f"the gateway to route to {len(urls)} engine(s)", interval_s=0.1)
        # No job, and so no agent, before every child has read what was handed to it: until then a child is not yet
        # non-dumpable, and a process of the same user could read its pipe (rollq/handover.py). An engine has read
        # its settings once it answers, a worker once it registers.
        await workers_registered(procs, url, cfg.run, stack_cfg.workers)
    except BaseException:
        if policy is not None:
            policy.cancel()
        raise
    cfg = msgspec.structs.replace(
        cfg,
        redis_url=url,
        engine=served,
        weights_dir=str(weights_root),
        engine_api_key=keys.api_key,
        engine_admin_api_key=keys.admin_api_key,
        gateway_admin_api_key=gateway.admin_api_key if gateway is not None else cfg.gateway_admin_api_key,
    )
    if cfg.nproc > 1:
        return await supervise_ranks(cfg, procs)
    redis = redis_client(url)
    pool = engine_pool(cfg)
    try:
        assert policy is not None
        trainer = Trainer(
            cfg,
            redis,
            pool,
            policy=await policy,
            fresh_redis=stack.private_redis,
            prompts=datasets.prompts if datasets else None,
            eval_prompts=datasets.eval_prompts if datasets else None,
        )
        training = asyncio.create_task(trainer.run(), name="trainer")
        watch = asyncio.create_task(_watch(procs), name="watch")
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


async def start_gateway(procs: Processes, keys: EngineKeys) -> Gateway:
    """smg on loopback (rollq/gateway_process.py), with a fresh admin key and the engines' api key handed in a pipe;
    returns once it answers. StackError saying how to install it when it is not installed."""
    from rollq.gateway_process import GatewayFlags, GatewayMissing, smg_python

    try:
        python = smg_python()
    except GatewayMissing as exc:
        raise StackError(str(exc)) from None
    flags = GatewayFlags(port=free_port(), prometheus_port=free_port())
    gateway = Gateway(url=flags.url, admin_api_key=secrets.token_urlsafe(32))
    with HandedConfig({"admin_api_key": gateway.admin_api_key, "api_key": keys.api_key}) as handed:
        proc = procs.start("gateway", flags.argv(python, handed.argv()[1]), pass_fds=[handed.fd])
    await procs.wait_until(
        functools.partial(gateway_answers, gateway.url), 60, f"the gateway at {gateway.url}", watch=proc
    )
    log.info("gateway (smg) at %s: the engines join it, the workers generate through it", gateway.url)
    return gateway


async def gateway_answers(url: str) -> bool:
    """Whether the gateway answers its liveness route."""
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session,
            session.get(url + "/liveness") as response,
        ):
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def gateway_routes_to(gateway: Gateway, urls: list[str]) -> bool:
    """Whether the gateway lists every one of `urls` as healthy (their registration is queued, then probed)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {gateway.admin_api_key}"}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session,
            session.get(gateway.url + "/workers", headers=headers) as response,
        ):
            body = await response.json() if response.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    healthy = {str(w.get("url", "")).rstrip("/") for w in body.get("workers", []) if w.get("is_healthy")}
    return set(urls) <= healthy


async def workers_registered(procs: Processes, url: str, run: str, workers: int) -> None:
    """Returns once `workers` workers of `run` have registered (ChildExited if a child dies first)."""
    redis = redis_client(url)
    key = RunKeys(run).workers

    async def registered() -> bool:
        return await redis.zcard(key) >= workers

    try:
        await procs.wait_until(registered, 300, f"{workers} worker(s) to register", interval_s=0.05)
    finally:
        await redis.aclose()


async def supervise_ranks(cfg: TrainConfig, procs: Processes) -> list[StepRecord]:
    """A trainer of `nproc` ranks as a child: torchrun (with no restarts of its own) of `rollq train`, started again
    whenever it dies, up to `max_restarts` times (each life resumes from the last checkpoint), its step lines
    echoed here. Any other child that dies ends the run, as with the embedded trainer."""
    from rollq.trainer.launch import CONFIG_FILE, torchrun_argv, write_config
    from rollq.trainer.metrics import MetricsLog, progress_line
    from rollq.trainer.samples import SAMPLES_FILE, notice

    ranks_cfg = msgspec.structs.replace(cfg, max_restarts=0)
    config = write_config(ranks_cfg, Path(cfg.directory) / CONFIG_FILE)
    metrics = MetricsLog(Path(cfg.directory))
    shown = len(metrics.read())
    samples, announced = Path(cfg.directory) / SAMPLES_FILE, False
    code: int | None = None
    for life in range(cfg.max_restarts + 1):
        trainer = procs.start("trainer", torchrun_argv(msgspec.structs.replace(ranks_cfg, nproc=cfg.nproc), config))
        code = None
        while code is None:
            await asyncio.sleep(0.5)
            code = procs.reap(trainer)  # first: the trainer's exit is this loop's to judge, not check()'s
            procs.check()  # an engine or a worker that died
            try:
                records = metrics.read()
            except msgspec.DecodeError:  # a line being written: read it next time
                continue
            for record in records[shown:]:
                print(progress_line(record, cfg.steps), file=sys.stderr)
            shown = max(shown, len(records))
            if not announced and samples.exists():  # rank 0 writes it (its own notice goes to the trainer's log)
                announced = True
                print(notice(samples, cfg.samples_every, cfg.samples_per_step), file=sys.stderr)
        if code == 0:
            return metrics.read()
        if life < cfg.max_restarts:
            log.warning(
                "the trainer (%d ranks) exited with code %d; starting it again (restart %d of %d): it resumes from "
                "its last checkpoint",
                cfg.nproc,
                code,
                life + 1,
                cfg.max_restarts,
            )
    raise StackError(
        f"the trainer ({cfg.nproc} ranks) exited with code {code} {cfg.max_restarts + 1} times; the end of its "
        f"log:\n{procs.tail(trainer, 2000)}"
    )


async def _echo_errors(procs: Processes, errors: ChildErrors, interval_s: float = 0.5) -> None:
    """The children's ERROR lines on this console while the run goes (rollq/child_errors.py): an engine whose steps
    fail is seen here, not only in its log."""
    while True:
        for line in errors.poll(procs.logs()):
            log.error("%s", line)
        await asyncio.sleep(interval_s)


async def _watch(procs: Processes) -> None:
    """A child that dies ends the run with its log, rather than a silent stall."""
    while True:
        await asyncio.sleep(0.5)
        procs.check()


@dataclass(frozen=True)
class Datasets:
    """The run's prompts, loaded (and so checked) before anything starts."""

    prompts: list[dict[str, Any]]
    eval_prompts: list[dict[str, Any]] | None


def load_datasets(cfg: TrainConfig, stack: UpConfig) -> Datasets:
    """`dataset` and `eval_dataset` read (mapped and key-checked: docs/rewards.md) as the trainer reads them: a bad
    line, an unknown task or a bad task_config is a DatasetError (a ValueError) said before Redis, an engine or a
    worker is started (issue 44, F12: it came after all of them). A user's own generator is imported from the
    folders the workers import from (module_paths)."""
    from rollq.module_paths import add_module_paths
    from rollq.trainer.data import run_prompts

    if generator_modules(cfg):
        add_module_paths(stack.worker_module_paths())
    train, held_out = run_prompts(cfg)
    return Datasets(train, held_out if cfg.eval_dataset else None)


def resumed_run(cfg: TrainConfig) -> tuple[TrainConfig, bool]:
    """The run `rollq up` left in the run directory named (`--run-dir DIR`, or runs/RUN for a `--run` given), its
    name read from DIR/up.json: resumed from its last checkpoint. (cfg, False) when the directory holds none.
    ValueError when another `rollq up` runs there now, or `--run` names another run than the directory's."""
    directory = cfg.run_dir or (cfg.directory if cfg.run != "default" else "")
    record = read_record(Path(directory)) if directory else None
    if record is None:
        return cfg, False
    if record.redis_url is not None and record.pid != os.getpid() and _alive(record.pid):
        raise ValueError(
            f"a rollq up (pid {record.pid}) is running run {record.run!r} in {directory} now: watch it with "
            f"`rollq status --run-dir {shlex.quote(directory)}`, or stop it first"
        )
    if cfg.run not in ("default", record.run):
        raise ValueError(
            f"{directory} holds run {record.run!r} ({Path(directory) / 'up.json'}), not {cfg.run!r}: leave --run out "
            "to resume it, or give another run_dir"
        )
    return msgspec.structs.replace(cfg, run=record.run), True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def redraw_plot(cfg: TrainConfig) -> Path | None:
    """plot.png from what metrics.jsonl holds (an interrupted or failed run: the trainer did not get to draw it);
    None when no step was recorded."""
    from rollq.trainer.metrics import plot_run

    try:
        return plot_run(Path(cfg.directory), f"rollq run {cfg.run}")
    except Exception as exc:  # the plot is a convenience: never what the run ends with
        log.warning("could not draw %s: %s", Path(cfg.directory) / "plot.png", exc)
        return None


def up(stack: UpConfig, cfg: TrainConfig) -> int:
    """`rollq up` (and plain `rollq`): the whole stack on this machine, training `cfg`."""
    import uvloop

    from rollq.trainer.commands import quiet_libraries, reward_change, run_summary
    from rollq.trainer.metrics import format_eval
    from rollq.trainer.nothing_trains import NothingTrains

    try:
        cfg, resuming = resumed_run(cfg)
    except ValueError as exc:
        print(f"rollq up: {exc}", file=sys.stderr)
        return 2
    if cfg.run == "default":  # a fresh run: repeated `up`s never share keys
        cfg = msgspec.structs.replace(cfg, run=f"up-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        datasets = load_datasets(cfg, stack)  # before anything starts: a bad line fails now, not after the stack is up
        worker_allowlist(cfg, stack)  # a workflow or reward_fn that is no import path: said now too
        if stack.gateway:
            from rollq.gateway_process import smg_python

            smg_python()  # not installed: said now, with how to install it
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"rollq up: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.directory)
    again = f"rollq up --run-dir {shlex.quote(cfg.directory)}"
    print(
        f"rollq up: {'resuming' if resuming else 'training'} {cfg.dataset} with the {cfg.model} model for "
        f"{cfg.steps} steps ({cfg.groups_per_step} groups x {cfg.group_size} samples, max staleness "
        f"{cfg.max_staleness}); run {cfg.run!r} in {cfg.directory} (stop with Ctrl-C; `{again}` resumes it)",
        file=sys.stderr,
    )
    started = time.monotonic()
    quiet_libraries()
    inherited = settings_environment(os.environ)  # for the children, which shed them too
    shield_secrets()  # it holds every key and the Redis password (rollq/shield.py)
    parts = Stack(Processes(run_dir / "logs"), run_dir)  # (run_stack starts the real ones)
    try:
        records = uvloop.run(run_stack(cfg, stack, inherited, datasets=datasets, stack=parts))
    except NothingTrains as exc:  # samples keep failing or coming back empty: the run would train nothing
        print(f"rollq up: {exc}. {_where_to_look(parts, exc.worker_id)}", file=sys.stderr)
        return NothingTrains.exit_code
    except (RuntimeError, ValueError) as exc:  # a part died or did not start (LocalError), ...
        print(f"rollq up: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C / SIGTERM: the stack was stopped on the way out
        drawn = parts.plot
        print(
            f"rollq up: stopped; {cfg.directory} keeps what was done: {describe_run_dir(run_dir)}. `{again}` resumes "
            f"the run from its last checkpoint"
            + (f"; `rollq plot {shlex.quote(cfg.directory)}` draws {drawn} again" if drawn else ""),
            file=sys.stderr,
        )
        return 130
    summary = run_summary(cfg, records)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["run_dir"] = cfg.directory
    goal = ("; goal " + ("met" if summary["goal_met"] else "NOT met")) if "goal_met" in summary else ""
    held_out = ""
    if summary.get("evals") and summary["evals"][0][0] == 0:  # evaluated before the first step (not resumed)
        held_out = f"; held-out {format_eval(summary['eval_before'])} -> {format_eval(summary['eval_after'])}"
        failed = sum(n for _, n in summary["eval_failed"])
        held_out += f" ({failed} evaluation samples failed: see eval.jsonl)" if failed else ""
    print(
        f"rollq up: {reward_change(summary)} in {summary['seconds']:.0f} s{goal}{held_out}. Wrote "
        f"{cfg.directory}/metrics.jsonl and {cfg.directory}/plot.png",
        file=sys.stderr,
    )
    print(msgspec.json.encode(summary).decode())
    return 0


def _where_to_look(stack: Stack, worker_id: str) -> str:
    """Where a run that trained nothing left the details: the failing worker's log, the dead letters' file."""
    worker_log = stack.worker_log(worker_id) if worker_id else None
    where = [f"its traceback: {worker_log}" if worker_log else f"the children's logs: {stack.procs.log_dir}"]
    dead = stack.run_dir / DEAD_LETTERS_FILE
    if dead.exists():
        where.append(f"every failed job with its traceback: {dead}")
    return "See " + "; ".join(where)


__all__ = [
    "Datasets",
    "EngineKeys",
    "StackError",
    "UpConfig",
    "engine_argv",
    "engine_healthy",
    "for_section",
    "generator_modules",
    "handed_names",
    "run_stack",
    "settings_environment",
    "Stack",
    "load_datasets",
    "redraw_plot",
    "resumed_run",
    "start_redis",
    "up",
    "worker_allowlist",
    "worker_argv",
]
