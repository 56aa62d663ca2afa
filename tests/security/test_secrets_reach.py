"""Secrets out of reach of the machine's other processes (issue 43: N4, N5, F2 and F4 residuals).

- Every rollq process that holds a secret sheds it and turns non-dumpable (rollq/shield.py): a process of the same
  user (uid 65534 here, as the target: CI runs as root, which ignores non-dumpability) can't read its
  /proc/<pid>/environ.
- `rollq up` hands keys and the Redis URL to its children in a pipe, and its private Redis has a password.
- An engine started without keys refuses its control routes.
- Engines' registrations are signed: a URL planted in the registry gets no request from a worker or the trainer.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from rollq.engine.fleet import FleetController
from rollq.engine.registry import EngineRegistry, control_key
from rollq.local import Processes, free_port
from rollq.producer import JobRequest, Producer
from rollq.protocol.keys import RunKeys
from rollq.trainer.config import TrainConfig
from rollq.trainer.engines import engine_pool as trainer_pool
from tests.helpers import REPO_ROOT, descendants, engine_healthy, wait_registered, wait_until

NOBODY = 65534


def as_nobody() -> dict:
    """subprocess arguments that run a process as uid/gid 65534 with no supplementary groups."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def _reachable(path: Path) -> bool:
    """Whether uid 65534 can execute `path` (every folder on the way searchable, the file executable by others)."""
    path = path.resolve()
    folders_ok = all(p.stat().st_mode & 0o001 for p in path.parents)
    return folders_ok and bool(path.stat().st_mode & 0o001)


def nobody_python() -> list[str]:
    """A command that runs this interpreter's version with this environment's packages (rollq's editable install
    included) as uid 65534 can: the venv's python may link to an interpreter under root's home, which it can't
    reach. `[*nobody_python(), "-m", "rollq", ...]`."""
    exe = Path(sys.executable)
    if not _reachable(exe):
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        found = [Path(p) for p in (f"/usr/bin/{version}", f"/usr/local/bin/{version}") if Path(p).exists()]
        found = [p for p in found if _reachable(p)]
        if not found:
            pytest.skip(f"no {version} that uid 65534 can run")
        exe = found[0]
    site = sysconfig.get_paths()["purelib"]
    boot = (
        f"import runpy, site, sys; site.addsitedir({site!r}); sys.path.append({str(_fallbacks())!r}); "
        "module = sys.argv.pop(1); runpy.run_module(module, run_name='__main__', alter_sys=True)"
    )
    return [str(exe), "-c", boot]


def _fallbacks() -> Path:
    """Modules a system Python older than this one may lack, last on its path: redis-py imports `async_timeout` on
    Python before 3.11.3 (asyncio.timeout after), a package this environment, on a newer 3.11, doesn't install."""
    folder = Path(tempfile.gettempdir()) / "rollq-nobody-fallbacks"
    folder.mkdir(mode=0o755, exist_ok=True)
    shim, text = folder / "async_timeout.py", "from asyncio import timeout\n\n__all__ = ['timeout']\n"
    if not shim.exists() or shim.read_text() != text:  # written whole, then renamed: test processes run in parallel
        part = folder / f".async_timeout.{os.getpid()}"
        part.write_text(text)
        part.chmod(0o644)
        os.replace(part, shim)
    folder.chmod(0o755)
    return folder


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A folder uid 65534 may use as its HOME and working directory, in one it can reach (pytest's tmp_path is
    under root's private folder)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the target and the attacker as uid 65534")
    top = Path(tempfile.mkdtemp(prefix="rollq-nobody-"))
    top.chmod(0o755)
    home = top / "nobody"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    yield home
    shutil.rmtree(top, ignore_errors=True)


def read_as_nobody(path: str) -> bytes | None:
    """`path` read by a process of uid 65534 (the attacker, an agent's user); None when it is refused."""
    script = (
        "import sys\n"
        "try:\n"
        "    sys.stdout.buffer.write(b'READ:' + open(sys.argv[1], 'rb').read())\n"
        "except PermissionError:\n"
        "    sys.stdout.buffer.write(b'DENIED')\n"
    )
    out = subprocess.run([*nobody_python()[:1], "-c", script, path], capture_output=True, timeout=60, **as_nobody())
    assert out.returncode == 0, out.stderr
    return None if out.stdout == b"DENIED" else out.stdout.removeprefix(b"READ:")


def uid_of(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
    return int(line.split()[1])


async def http_answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            return (await http.get(url)).status_code < 500
    except httpx.HTTPError:
        return False


# -- every process that holds a secret is closed to its own user --------------------------------------------------


def _targets(redis_url: str, port: int, secret: str, model: Path) -> dict[str, tuple[list[str], dict, str]]:
    """Each rollq command holding a secret: (argv, its secrets as a deployment gives them, the URL that answers
    once it runs)."""
    rollq = [*nobody_python(), "rollq"]
    url = f"http://127.0.0.1:{port}"
    return {
        "engine": (
            [*rollq, "engine", "--backend", "synthetic", "--port", str(port)],
            {"ROLLQ_ENGINE_API_KEY": f"api-{secret}", "ROLLQ_ENGINE_ADMIN_API_KEY": f"admin-{secret}"},
            url + "/health",
        ),
        "ingress": (
            [*rollq, "ingress", "--port", str(port), "--redis", redis_url],
            {"ROLLQ_INGRESS_TOKENS": f'{{"tok-{secret}": "acme"}}', "REDISCLI_AUTH": secret},
            url + "/healthz",
        ),
        "reward-worker": (
            [*rollq, "reward-worker", "--redis", redis_url, "--metrics-port", str(port)],
            {"REDISCLI_AUTH": secret, "ROLLQ_REWARD_WORKER_ALLOW": f'["pkg-{secret}"]'},
            url + "/metrics",
        ),
        "trainer": (
            [*rollq, "train", "--redis", redis_url, "--model", str(model), "--metrics-port", str(port)]
            + ["--engine", f"http://127.0.0.1:{free_port()}", "--steps", "1000", "--device", "cpu"],
            {"ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY": f"admin-{secret}", "REDISCLI_AUTH": secret},
            url + "/metrics",
        ),
    }


@pytest.fixture
def nobody_model(nobody_dir: Path, tiny_dir: Path) -> Path:
    """The tiny model where uid 65534 can read it (the trainer loads it)."""
    target = nobody_dir.parent / "model"
    shutil.copytree(tiny_dir, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


@pytest.mark.parametrize("command", ["engine", "ingress", "reward-worker", "trainer"])
async def test_a_same_user_process_cannot_read_the_secrets_of_a_rollq_process(
    command, nobody_dir, nobody_model, redis_url, run_name
):
    """N4: a rollq process started with its secrets in its environment (as compose and hand-started stacks give
    them), as uid 65534; another process of uid 65534 reads its /proc/<pid>/environ: refused (non-dumpable), and
    its command line holds no secret."""
    secret = secrets.token_hex(16)
    port = free_port()
    argv, secret_env, ready = _targets(redis_url, port, secret, nobody_model)[command]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLQ_", "REDIS"))}
    env.update(HOME=str(nobody_dir), ROLLQ_RUN=run_name, **secret_env)
    log = nobody_dir.parent / f"{command}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=nobody_dir, env=env, stdout=out, stderr=subprocess.STDOUT, **as_nobody())
    try:
        await wait_until(lambda: proc.poll() is not None or http_answers(ready), 120, what=f"{command} up")
        assert proc.poll() is None, log.read_text()[-3000:]
        assert uid_of(proc.pid) == NOBODY
        environ = read_as_nobody(f"/proc/{proc.pid}/environ")
        assert environ is None or secret.encode() not in environ, f"{command}'s environment is readable: {environ!r}"
        assert secret.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert read_as_nobody(f"/proc/{proc.pid}/mem") is None  # nor its memory
    finally:
        proc.kill()
        proc.wait(30)


# -- rollq up: a pipe for the keys, a password for its Redis ------------------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


@pytest.mark.slow
async def test_rollq_up_hands_keys_over_in_a_pipe_and_its_redis_needs_a_password(tmp_path):
    """F4 (b)(c), N4 under `rollq up`: its private Redis refuses unauthenticated commands (NOAUTH); no child's
    command line or environment holds a key or the Redis password; the engine's and the worker's config is an
    inherited descriptor, nothing on disk; and the stack still trains with what was handed over."""
    api, admin = f"api-{secrets.token_hex(12)}", f"admin-{secrets.token_hex(12)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLQ_") or k == "ROLLQ_CACHE"}
    env.update(ROLLQ_TRAINER_ENGINE_API_KEY=api, ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY=admin)
    run_dir = tmp_path / "run"
    log = open(tmp_path / "up.log", "wb")
    argv = [sys.executable, "-m", "rollq", "up", "steps=200", f"run_dir={run_dir}"]
    up = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def trained() -> bool:  # a step trained: the workers reached Redis and the engines with what they were given
            metrics = run_dir / "metrics.jsonl"
            return up.poll() is not None or (metrics.exists() and metrics.read_text().count("\n") >= 1)

        await wait_until(trained, 240, what="rollq up's first step")
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        children = {pid: _cmdline(pid) for pid in descendants(up.pid)}
        # redis-server sets its title: "redis-server 127.0.0.1:PORT"; it runs in its --dir, with its config file
        [redis_pid] = [pid for pid, cmd in children.items() if cmd and "redis-server" in cmd[0]]
        port = int(children[redis_pid][0].rsplit(":", 1)[1])
        # Its password's config file (mode 0600) is gone once it has read it: nothing left for a process of the same
        # user to read there (nor anywhere in its directory).
        redis_dir = Path(f"/proc/{redis_pid}/cwd")
        assert not (redis_dir / "redis-auth.conf").exists()
        assert not [f for f in redis_dir.iterdir() if f.is_file() and b"requirepass" in f.read_bytes()]

        # Its Redis refuses whoever has no password.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"KEYS *\r\n")
        reply = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert reply.startswith(b"-NOAUTH"), reply

        engines = [pid for pid, cmd in children.items() if "engine" in cmd and "rollq" in cmd]
        workers = [pid for pid, cmd in children.items() if "worker" in cmd and "rollq" in cmd]
        assert engines and workers, children
        redis_url_with_password = re.compile(rb"rediss?://[^@\s\0]*:[^@\s\0]+@")
        for pid, cmd in children.items():
            text = "\0".join(cmd).encode()
            for secret in (api, admin):
                assert secret.encode() not in text, (pid, cmd)
            assert not redis_url_with_password.search(text), (pid, cmd)
            try:  # root reads any environment: what the child was started with, secrets never among it
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            for secret in (api, admin):
                assert secret.encode() not in environ, (pid, cmd)
            assert not redis_url_with_password.search(environ), (pid, cmd)
        for pid in engines + workers:
            cmd = children[pid]
            config = cmd[cmd.index("--config") + 1]
            assert re.fullmatch(r"/dev/fd/\d+", config), cmd  # a pipe it inherited: no file to find or delete
            assert "--redis" not in cmd and "--api-key" not in cmd and "--admin-api-key" not in cmd
    finally:
        with_timeout_kill(up)
        log.close()


def with_timeout_kill(proc: subprocess.Popen) -> None:
    """SIGTERM (rollq up stops what it started), SIGKILL of its group past 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# -- an engine without keys serves no control route ---------------------------------------------------------------


async def test_an_engine_started_without_keys_refuses_its_control_routes(tmp_path):
    """F2 (a): `rollq engine` on loopback without keys: any local process calling /pause_generation, a LoRA load or
    a weight version gets 403 naming the settings; generation stays open. insecure_no_auth opens them (the
    explicit opt-out)."""
    procs = Processes(tmp_path, cwd=REPO_ROOT)
    try:
        urls = {}
        for name, extra in (("closed", []), ("open", ["--insecure-no-auth"])):
            port = free_port()
            argv = [sys.executable, "-m", "rollq", "engine", "--backend", "synthetic", "--port", str(port)]
            proc = procs.start(name, [*argv, "--enable-lora", *extra])
            urls[name] = f"http://127.0.0.1:{port}"
            await procs.wait_until(lambda u=urls[name]: engine_healthy(u), 90, f"{name} engine", watch=proc)
        async with httpx.AsyncClient(timeout=10) as http:
            for route, body in (
                ("/pause_generation", {}),
                ("/update_weight_version", {"new_version": "stolen"}),
                ("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
                ("/flush_cache", {}),
                ("/abort_request", {"rid": "x"}),
            ):
                resp = await http.post(urls["closed"] + route, json=body)
                assert resp.status_code == 403 and "admin_api_key" in resp.text, (route, resp.text)
            info = await http.get(urls["closed"] + "/model_info")
            assert info.json()["weight_version"] == "default"  # nothing changed it
            generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            assert (await http.post(urls["closed"] + "/generate", json=generate)).status_code == 200
            assert (await http.post(urls["open"] + "/pause_generation", json={})).status_code == 200
    finally:
        procs.stop_all(grace_s=0)


# -- the registry: engine keys go to registered engines only -------------------------------------------------------


class HeaderLog:
    """An HTTP server on loopback that answers everything and records every request (method, path, headers)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path, dict(request.headers)))
        return web.json_response({})


@pytest.fixture
async def planted() -> AsyncIterator[tuple[HeaderLog, str]]:
    sink = HeaderLog()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", sink.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield sink, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_a_url_planted_in_the_registry_gets_nothing_from_workers_or_the_trainer(
    redis, redis_url, run_name, planted, engine_process, spawn_worker
):
    """N5: a Redis writer adds its own URL to the run's engine registry (unsigned, with a made-up signature, and
    with a registered engine's signature copied onto it). A keyed engine registers itself (`rollq engine
    --register`); a `rollq worker` holding the same keys finds it only through the registry and runs jobs until it
    has served N of them; the trainer's pool pauses and resumes the fleet. The planted server records no request."""
    sink, planted_url = planted
    api, admin = secrets.token_hex(16), secrets.token_hex(16)
    key = RunKeys(run_name).engines
    far = time.time() + 3600
    await redis.zadd(key, {planted_url: far, f"{planted_url} {far:.3f} {'0' * 64}": far})
    registry = EngineRegistry(redis, run_name)  # keyless: sees every entry
    engine_args = ["--register", "--redis", redis_url, "--run", run_name, "--api-key", api, "--admin-api-key", admin]
    _, engine_url = await engine_process(*engine_args)
    await wait_until(lambda: _lists(registry, engine_url), 30, what="the engine registered")
    # A registered engine's signature on the planted URL (a copy of its entry with the URL changed)
    entry = next(e.decode() for e in await redis.zrange(key, 0, -1) if e.decode().startswith(engine_url + " "))
    _, stamp, signature = entry.split(" ")
    await redis.zadd(key, {f"{planted_url} {stamp} {signature}": far})

    worker = spawn_worker(
        redis_url,
        run_name,
        "--concurrency",
        "4",
        env={"ROLLQ_WORKER_ENGINE_API_KEY": api, "ROLLQ_WORKER_ENGINE_ADMIN_API_KEY": admin},
    )
    await wait_registered(redis, run_name, worker.name)
    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    n = 16
    await producer.submit_many(
        [
            JobRequest(workflow="tests.workflows:Generate", job_id=f"g{i}", data={"prompt_ids": [5, 6, 7]})
            for i in range(n)
        ]
    )
    trajectories = [t async for t in producer.wait_for({f"g{i}": 1 for i in range(n)}, timeout_s=90, consumer=consumer)]
    assert len(trajectories) == n and all(t.status == "ok" for t in trajectories), [t.error for t in trajectories]
    assert sink.requests == [], sink.requests  # the worker's health checks, generations and aborts: none there
    assert "engine registry entry" in worker.output()  # it saw the planted entries and said why it ignored them

    # The trainer: its pool follows the registry as `rollq train` builds it, then pauses and resumes the fleet.
    cfg = TrainConfig(redis_url=redis_url, run=run_name, engine_api_key=api, engine_admin_api_key=admin)
    pool = trainer_pool(cfg)
    try:
        await pool.sync_registry(EngineRegistry(redis, run_name, key=control_key(api, admin)))
        assert sorted(pool.members) == [engine_url]
        fleet = FleetController(pool)
        await fleet.pause()
        await fleet.resume()
    finally:
        await pool.close()
    assert sink.requests == [], sink.requests


async def _lists(registry: EngineRegistry, url: str) -> bool:
    return url in await registry.live()


async def test_registry_entries_are_checked_against_the_pools_keys(redis, run_name):
    """Which entries a pool with keys accepts: one signed with its control key and not expired; never an unsigned
    one, one signed with another key, one whose signed expiry passed (its score raised by a Redis writer), nor a
    signature moved onto another URL. A pool without keys accepts them all (it has no key to give away)."""
    key = control_key("api", "admin")
    engine = EngineRegistry(redis, run_name, key=key)
    await engine.register("http://good:1")
    other = EngineRegistry(redis, run_name, key="another-key")
    await other.register("http://other-key:1")
    now = time.time()
    stale = engine.entry("http://stale:1", now - 1)
    good_entry = engine.entry("http://good:1", now + 60)
    moved = "http://moved:1 " + " ".join(good_entry.split(" ")[1:])
    far = now + 3600
    odd = "http://odd:1 1.0 sig\u00e9\u2603".encode() + b"\xff"  # not ASCII, not UTF-8: ignored, never an error
    await redis.zadd(RunKeys(run_name).engines, {stale: far, moved: far, "http://unsigned:1": far, odd: far})
    assert await EngineRegistry(redis, run_name, key=key).live() == ["http://good:1"]
    keyless = await EngineRegistry(redis, run_name).live()
    assert sorted(keyless) == sorted(
        ["http://good:1", "http://other-key:1", "http://stale:1", "http://moved:1", "http://unsigned:1", "http://odd:1"]
    )
    await engine.deregister("http://good:1")
    assert await EngineRegistry(redis, run_name, key=key).live() == []


async def test_an_engine_renewing_its_entry_stays_listed_and_leaves_one_entry(redis, run_name):
    """Each renewal writes a new signed entry and then removes the previous one: the URL is never missing and the
    registry holds one entry per engine."""
    key = control_key("api", None)
    engine = EngineRegistry(redis, run_name, key=key, ttl_s=30)
    pool = EngineRegistry(redis, run_name, key=key)
    for _ in range(3):
        await engine.register("http://e:1/")
        assert await pool.live() == ["http://e:1"]
    assert await redis.zcard(RunKeys(run_name).engines) == 1
