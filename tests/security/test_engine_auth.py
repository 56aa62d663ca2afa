"""Engines reachable only with their keys, and weights read only from under their weights_root (issue 24, F2 and F10).

Real engine servers on loopback (in-process, or `python -m rollq.engine` where the command line and environment are
what is tested), a real redis-server for the worker; no mocks."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollq.cli import main as cli_main
from rollq.config import load
from rollq.engine.client import EngineError
from rollq.engine.fleet import FleetController
from rollq.engine.server.app import EngineServerConfig, ServerHandle, build_app, serve
from rollq.engine.server.config import EngineConfig, is_loopback
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.engine.server.sglang_launcher import SGLangLaunch
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.server.weights_root import NO_ROOT, OUTSIDE
from rollq.engine.types import ADMIN_ROUTES, ModelRequest, SamplingParams
from rollq.handover import HandedConfig
from rollq.local import Processes, free_port
from rollq.producer import JobRequest, Producer
from rollq.trainer.config import TrainConfig
from rollq.trainer.engines import engine_pool as trainer_pool
from rollq.up import EngineKeys, engine_argv, start_child
from rollq.workers import commands as worker_commands
from rollq.workers.config import WorkerConfig
from rollq.workers.worker import Worker
from tests.helpers import REPO_ROOT, engine_healthy, wait_until

USR, ADM = "usr-key", "adm-key"
AS_USER, AS_ADMIN = {"Authorization": f"Bearer {USR}"}, {"Authorization": f"Bearer {ADM}"}


@pytest.fixture
async def keyed_engine(tmp_path: Path):
    """A synthetic engine with both keys, loading weights from under tmp_path/weights."""
    root = tmp_path / "weights"
    (root / "v1").mkdir(parents=True)
    config = EngineServerConfig(host="127.0.0.1", port=0, api_key=USR, admin_api_key=ADM, weights_root=str(root))
    handle = await serve(SyntheticBackend(SyntheticConfig()), config)
    yield handle
    await handle.close()


def request(i: int) -> ModelRequest:
    return ModelRequest(input_ids=[3, 4, 5, i], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))


# --- (a) a keyed stack works end to end; without the admin key the trainer's update is refused, clearly --------------


async def test_a_worker_with_the_engine_keys_generates_jobs_through_a_keyed_engine(
    keyed_engine: ServerHandle, redis, redis_url: str, run_name: str
):
    cfg = WorkerConfig(
        redis_url=redis_url,
        run=run_name,
        engine=[keyed_engine.url],
        engine_api_key=USR,
        engine_admin_api_key=ADM,
        allow=["tests"],
    )
    async with worker_commands.engine_pool(cfg) as pool:
        worker = Worker(cfg, engine=pool)
        task = asyncio.create_task(worker.run())
        try:
            producer = Producer(redis, run_name)
            consumer = producer.consumer()
            await consumer.setup()
            data = {"prompt_ids": [30, 31, 32], "max_new_tokens": 5}
            await producer.submit_many([JobRequest(workflow="tests.workflows:Generate", job_id="k", n=2, data=data)])
            trajs = [t async for t in producer.wait_for({"k": 2}, timeout_s=30, consumer=consumer)]
            assert [t.status for t in trajs] == ["ok", "ok"], [t.error for t in trajs]
            assert all(sum(t.sequences[0].loss_mask) == 5 for t in trajs)
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, 30)
            await worker.redis.aclose()

    keyless = WorkerConfig(redis_url=redis_url, run=run_name, engine=[keyed_engine.url])
    async with worker_commands.engine_pool(keyless) as pool:
        with pytest.raises(EngineError) as refused:
            await pool.agenerate(request(1))
    text = str(refused.value)  # names the engine, the route, the status and the setting to set
    assert f"{keyed_engine.url}/generate: HTTP 401: Unauthorized" in text and "engine_api_key" in text


async def test_the_trainer_updates_weights_with_the_admin_key_and_is_refused_without_it(
    keyed_engine: ServerHandle, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    weights = str(tmp_path / "weights" / "v1")
    keyed = TrainConfig(engine=[keyed_engine.url], engine_api_key=USR, engine_admin_api_key=ADM)
    async with trainer_pool(keyed) as pool:
        fleet = FleetController(pool, retries=0)
        phases = await fleet.cycle(weights, 1, mode="retract")  # pause -> update_weights_from_disk -> continue
        assert phases["total_s"] >= 0 and keyed_engine.server.weight_version == "1"
        assert not keyed_engine.server.paused and not pool.members[keyed_engine.url].stale
        assert len((await pool.agenerate(request(2))).output_tokens) == 4

    # Only the api key: generation works, every control call is refused (the engine has an admin key).
    user_only = TrainConfig(engine=[keyed_engine.url], engine_api_key=USR)
    caplog.set_level(logging.WARNING, logger="rollq.engine")
    async with trainer_pool(user_only) as pool:
        fleet = FleetController(pool, retries=0)
        assert len((await pool.agenerate(request(3))).output_tokens) == 4
        paused = await fleet.pause("retract")
        loaded = await fleet.update_weights(weights, 2)
        resumed = await fleet.resume()
    assert not keyed_engine.server.paused and keyed_engine.server.weight_version == "1"
    for result, route in (
        (paused, "/pause_generation"),
        (loaded, "/update_weights_from_disk"),
        (resumed, "/continue_generation"),
    ):
        error = result.failed[keyed_engine.url]
        assert f"{keyed_engine.url}{route}: HTTP 401: Unauthorized" in error, error
        assert "engine_admin_api_key" in error and "ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY" in error, error
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{keyed_engine.url}/update_weights_from_disk: HTTP 401: Unauthorized" in logged


async def test_a_refused_disk_update_names_the_engine_route_status_and_message(keyed_engine: ServerHandle):
    cfg = TrainConfig(engine=[keyed_engine.url], engine_api_key=USR, engine_admin_api_key=ADM)
    async with trainer_pool(cfg) as pool:
        result = await FleetController(pool, retries=0).update_weights("/etc", 5)
    error = result.failed[keyed_engine.url]
    assert error == f"{keyed_engine.url}/update_weights_from_disk: HTTP 400: {OUTSIDE}"


async def test_a_worker_without_the_admin_key_says_once_that_its_aborts_are_refused(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
):
    config = EngineServerConfig(host="127.0.0.1", port=0, api_key=USR, admin_api_key=ADM)
    handle = await serve(SyntheticBackend(SyntheticConfig(per_token_latency_s=0.01)), config)
    caplog.set_level(logging.WARNING, logger="rollq.engine")
    long = ModelRequest(input_ids=[3, 4], sampling=SamplingParams(max_new_tokens=30_000, ignore_eos=True))
    try:
        for admin, aborted in ((None, False), (ADM, True)):
            cfg = WorkerConfig(redis_url=redis_url, engine=[handle.url], engine_api_key=USR, engine_admin_api_key=admin)
            async with worker_commands.engine_pool(cfg) as pool:
                for _ in range(2):
                    task = asyncio.create_task(pool.agenerate(long))
                    await wait_until(lambda: handle.server.running > 0, 10, what="the request running")
                    task.cancel()  # an episode given up: the pool aborts its request on the engine
                    await asyncio.gather(task, return_exceptions=True)
                    if aborted:
                        await wait_until(lambda: not handle.server.states, 10, what="the request aborted")
                    else:
                        await wait_until(lambda: "aborts are refused" in caplog.text, 10, what="the warning")
                        assert handle.server.running > 0  # the engine still runs it
                        handle.server.abort_all_dispatched("test cleanup")
                        await wait_until(lambda: not handle.server.states, 10, what="the cleanup")
        warnings = [r.getMessage() for r in caplog.records if "aborts are refused" in r.getMessage()]
        assert (
            len(warnings) == 1 and "/abort_request: HTTP 401" in warnings[0] and "engine_admin_api_key" in warnings[0]
        )
    finally:
        await handle.close()


def test_the_settings_take_the_keys_from_the_environment():
    env = {
        "ROLLQ_WORKER_ENGINE_API_KEY": "w1",
        "ROLLQ_WORKER_ENGINE_ADMIN_API_KEY": "w2",
        "ROLLQ_TRAINER_ENGINE_API_KEY": "123",  # a text setting: not read as a number
        "ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY": "true",
        "ROLLQ_ENGINE_API_KEY": "e1",
        "ROLLQ_ENGINE_ADMIN_API_KEY": "e2",
        "ROLLQ_ENGINE_WEIGHTS_ROOT": "/srv/weights",
    }
    worker = load(WorkerConfig, "worker", env=env)
    trainer = load(TrainConfig, "trainer", env=env)
    engine = load(EngineConfig, "engine", env=env)
    assert (worker.engine_api_key, worker.engine_admin_api_key) == ("w1", "w2")
    assert (trainer.engine_api_key, trainer.engine_admin_api_key) == ("123", "true")
    assert (engine.api_key, engine.admin_api_key, engine.weights_root) == ("e1", "e2", "/srv/weights")
    assert WorkerConfig().engine_api_key is None and TrainConfig().engine_admin_api_key is None


def test_every_control_route_the_engine_serves_is_an_admin_route():
    # What SGLang 0.5.23 marks ADMIN_OPTIONAL (engine/types.py cites http_server.py); everything else the engine
    # serves is either open (health, ready, metrics) or takes the api key.
    app = build_app(SyntheticBackend(SyntheticConfig()), EngineServerConfig(compat="0.5.23"))
    served = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    normal = {"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/models"}
    open_ = {"/health", "/health_generate", "/ready", "/metrics"}
    assert served - normal - open_ == ADMIN_ROUTES - {"/update_weights_from_tensor"}  # rollq serves no CUDA IPC


# --- (b) `rollq up`'s engines and workers get keys, handed over in a pipe -------------------------------------------


def test_up_makes_fresh_keys_per_run_and_hands_them_over_in_a_pipe(tmp_path: Path):
    cfg = TrainConfig()
    first, second = EngineKeys.for_run(cfg), EngineKeys.for_run(cfg)
    assert len({first.api_key, first.admin_api_key, second.api_key, second.admin_api_key}) == 4
    assert len(first.api_key) >= 32 and len(first.admin_api_key) >= 32
    given = EngineKeys.for_run(TrainConfig(engine_api_key="mine", engine_admin_api_key="ours"))
    assert (given.api_key, given.admin_api_key) == ("mine", "ours")

    argv = engine_argv(cfg, 12345)
    assert first.api_key not in " ".join(argv) and "--api-key" not in argv and "--admin-api-key" not in argv
    with HandedConfig(first.engine_config(str(tmp_path))) as handed:
        engine = load(EngineConfig, "engine", handed.argv()[1], env={})
    assert (engine.api_key, engine.admin_api_key, engine.weights_root) == (
        first.api_key,
        first.admin_api_key,
        str(tmp_path),
    )
    with HandedConfig(first.worker_config("redis://:pw@127.0.0.1:1/0")) as handed:
        worker = load(WorkerConfig, "worker", handed.argv()[1], env={})
    assert (worker.engine_api_key, worker.engine_admin_api_key) == (first.api_key, first.admin_api_key)
    assert worker.redis_url == "redis://:pw@127.0.0.1:1/0"


async def test_an_engine_started_as_up_starts_it_refuses_keyless_calls(tmp_path: Path):
    keys = EngineKeys.for_run(TrainConfig())
    root = tmp_path / "weights"
    (root / "v1").mkdir(parents=True)
    port = free_port()
    # up's own argv and hand-over; only the backend is the synthetic one (no model to load: a fast start)
    argv = [*engine_argv(TrainConfig(), port), "--backend", "synthetic"]
    procs = Processes(tmp_path, cwd=REPO_ROOT)
    proc = start_child(procs, "engine", argv, keys.engine_config(str(root)), {})
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until(lambda: proc.poll() is not None or engine_healthy(url), 90, what="the engine up")
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()
        assert keys.api_key.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # not in `ps`
        admin = {"Authorization": f"Bearer {keys.admin_api_key}"}
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.post(url + "/pause_generation", json={})).status_code == 401
            user = {"Authorization": f"Bearer {keys.api_key}"}
            assert (await http.post(url + "/pause_generation", json={}, headers=user)).status_code == 401
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            assert (await http.post(url + "/generate", json=body)).status_code == 401
            update = {"model_path": str(root / "v1"), "weight_version": "1"}
            assert (await http.post(url + "/update_weights_from_disk", json=update)).status_code == 401
            resp = await http.post(url + "/update_weights_from_disk", json=update, headers=admin)
            assert resp.status_code == 200 and resp.json()["success"] is True
            resp = await http.post(url + "/update_weights_from_disk", json={"model_path": "/etc"}, headers=admin)
            assert resp.status_code == 400 and resp.json()["message"] == OUTSIDE
    finally:
        procs.stop_all(grace_s=0)


def test_the_sglang_launcher_passes_the_keys_in_a_private_file_not_on_the_command_line(tmp_path: Path):
    launch = SGLangLaunch(model_path="/models/qwen", api_key="k-user", admin_api_key="k-admin")
    with pytest.raises(ValueError, match="file"):
        launch.command()  # keys never go on the command line
    secrets = launch.write_secrets(tmp_path)
    assert secrets is not None and secrets.stat().st_mode & 0o777 == 0o600
    cmd = launch.command(secrets)
    assert "k-user" not in " ".join(cmd) and cmd[cmd.index("--config") + 1] == str(secrets)
    # SGLang's config parser turns each key into `--<key> VALUE` (server_args_config_parser.py): the flag names
    # --api-key / --admin-api-key (server args fields api_key / admin_api_key).
    import yaml

    assert yaml.safe_load(secrets.read_text()) == {"api-key": "k-user", "admin-api-key": "k-admin"}
    assert SGLangLaunch(model_path="/m").write_secrets(tmp_path / "none") is None


# --- (c) an engine reachable from the network does not start without keys --------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
     ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("engine.example", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool):
    assert is_loopback(host) is loopback
    refusal = EngineConfig(host=host).open_exposure()
    assert (refusal is None) is loopback
    assert EngineConfig(host=host, api_key="k").open_exposure() is None
    assert EngineConfig(host=host, admin_api_key="k").open_exposure() is None
    assert EngineConfig(host=host, insecure_no_auth=True).open_exposure() is None


async def test_an_engine_on_all_interfaces_without_keys_refuses_to_start_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    port = free_port()
    args = ["engine", "--host", "0.0.0.0", "--port", str(port)]
    assert cli_main(args) == 2  # the command itself, in-process: it refuses before it binds anything
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollq engine: host '0.0.0.0' is not a loopback address"), lines
    for name in ("api_key", "admin_api_key", "insecure_no_auth", "ROLLQ_ENGINE_API_KEY"):
        assert name in lines[0]

    log = open(tmp_path / "engine.log", "w")
    cmd = [sys.executable, "-m", "rollq", *args, "--insecure-no-auth"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until(lambda: proc.poll() is not None or engine_healthy(url), 90, what="the engine up")
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


# --- (d) weights load only from under weights_root, with one generic error ------------------------------------------


@pytest.fixture
def layout(tmp_path: Path, tiny_dir: Path) -> dict[str, Path]:
    """root/good: a valid copy of the tiny model's weights; other/: another valid copy outside the root;
    root/link -> other; root/link-file -> other/model.safetensors."""
    root, other = tmp_path / "root", tmp_path / "other"
    for d in (root / "good", other):
        d.mkdir(parents=True)
        shutil.copy(tiny_dir / "model.safetensors", d / "model.safetensors")
    (root / "link").symlink_to(other)
    (root / "link-file.safetensors").symlink_to(other / "model.safetensors")
    return {"root": root, "other": other}


def outside_paths(root: Path, other: Path) -> list[str]:
    return [
        "/etc",
        "/etc/passwd",
        "/etc/shadow",
        "/proc/self/environ",
        "/nonexistent",
        str(root / ".." / "other"),  # exists and holds valid weights
        str(other),
        str(other / "model.safetensors"),
        str(root / "link"),  # a symlink inside the root to a directory outside
        str(root / "link-file.safetensors"),
        str(root / "missing"),  # under the root, but not there: the same answer
        "~",
        "~root",
        "relative/path",
        "a\x00b",
    ]


def backend(kind: str, tiny_dir: Path) -> SyntheticBackend | ReferenceBackend:
    if kind == "synthetic":
        return SyntheticBackend(SyntheticConfig())
    return ReferenceBackend(ReferenceConfig(model=str(tiny_dir), max_running=4))


@pytest.mark.parametrize("kind", ["synthetic", "reference"])
async def test_every_path_outside_the_root_gets_the_same_answer(kind: str, layout, tiny_dir: Path):
    root, other = layout["root"], layout["other"]
    handle = await serve(backend(kind, tiny_dir), EngineServerConfig(host="127.0.0.1", port=0, weights_root=str(root)))
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for path in outside_paths(root, other):
                resp = await http.post(
                    handle.url + "/update_weights_from_disk", json={"model_path": path, "weight_version": "pwn"}
                )
                assert resp.status_code == 400, path
                assert resp.json() == {"success": False, "message": OUTSIDE, "num_paused_requests": 0}, path
            assert handle.server.weight_version == "default" and not handle.server._updating
            resp = await http.post(
                handle.url + "/update_weights_from_disk",
                json={"model_path": str(root / "good"), "weight_version": "v1"},
            )
            assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
            assert handle.server.weight_version == "v1"
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
            assert (await http.post(handle.url + "/generate", json=body)).status_code == 200
    finally:
        await handle.close()


@pytest.mark.parametrize("kind", ["synthetic", "reference"])
async def test_an_engine_without_a_weights_root_loads_nothing_from_disk(kind: str, layout, tiny_dir: Path):
    handle = await serve(backend(kind, tiny_dir), EngineServerConfig(host="127.0.0.1", port=0))
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for path in (str(layout["root"] / "good"), "/etc/shadow", "/nonexistent"):
                resp = await http.post(handle.url + "/update_weights_from_disk", json={"model_path": path})
                assert resp.status_code == 400 and resp.json()["message"] == NO_ROOT, path
                assert "--weights-root" in resp.json()["message"]
        assert handle.server.weight_version == "default"
    finally:
        await handle.close()


@pytest.mark.parametrize(
    "shard",
    [
        "../../other/model.safetensors",  # each names (or leads to) a real file outside the directory
        "{other}/model.safetensors",
        "sub/../../../other/model.safetensors",
        "link/model.safetensors",
        "",
    ],
)
async def test_an_index_naming_shards_outside_its_directory_is_refused(shard: str, layout, tiny_dir: Path):
    root = layout["root"]
    model = root / "indexed"
    model.mkdir()
    (model / "link").symlink_to(layout["other"])
    shutil.copy(tiny_dir / "model.safetensors", model / "model-00001-of-00001.safetensors")
    shard = shard.format(other=layout["other"])
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    handle = await serve(
        backend("reference", tiny_dir), EngineServerConfig(host="127.0.0.1", port=0, weights_root=str(root))
    )
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.post(
                handle.url + "/update_weights_from_disk", json={"model_path": str(model), "weight_version": "x"}
            )
            assert resp.status_code == 400 and resp.json()["success"] is False
            assert "its weights directory" in resp.json()["message"] and shard in resp.json()["message"]
            assert handle.server.weight_version == "default"
            # The same directory with an index of plain shard names loads.
            index = {"weight_map": dict.fromkeys(["w"], "model-00001-of-00001.safetensors")}
            (model / "model.safetensors.index.json").write_text(json.dumps(index))
            resp = await http.post(
                handle.url + "/update_weights_from_disk", json={"model_path": str(model), "weight_version": "x"}
            )
            assert resp.status_code == 200 and handle.server.weight_version == "x", resp.text
    finally:
        await handle.close()
