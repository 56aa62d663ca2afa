"""`rollq weight-agent` (engine/server/weight_agent/): the host agent that rebuilds full weights from the trainer's
deltas for an engine that loads only full weights from disk. A real agent subprocess on loopback (SIGKILLed, then
restarted on its local root), and end to end with rollq's reference engine standing in for SGLang: it loads what
the agent built through /update_weights_from_disk, and serves the trainer's tensors bit for bit."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollq.config import ConfigError
from rollq.engine import weight_delta as wd
from rollq.engine.server.weight_agent.config import WeightAgentConfig
from rollq.engine.server.weight_agent.server import build_app
from rollq.engine.server.weight_agent.versions import STATE_FILE, LocalVersions, Refused
from rollq.http_server import start_site
from rollq.local import Processes, free_port
from tests.helpers import REPO_ROOT, answers

KEY = "agent-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREPARE = "/rollq/prepare_weights"


# --- the trainer's side: full versions in v{N}/, deltas in d{N}/ under its weights directory ----------------------


def initial(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(dtype),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(dtype),
        "model.norm.weight": torch.ones(16, dtype=dtype),
    }


def stepped(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An Adam-sized step on every weight but the norm (which keeps every bit: an "unchanged" tensor)."""
    g = torch.Generator().manual_seed(seed)
    step = {n: 1e-3 * torch.sign(torch.randn(t.shape, generator=g)) for n, t in weights.items()}
    return {n: t if n == "model.norm.weight" else (t.float() - step[n]).to(t.dtype) for n, t in weights.items()}


def write_full(directory: Path, weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": 16}))
    return directory


def checksums(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: wd.checksum(t) for n, t in weights.items()}


def file_checksums(directory: str | Path) -> dict[str, str]:
    """The checksums of the tensors in a directory's safetensors files, as read from disk."""
    out: dict[str, str] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                out[name] = wd.checksum(f.get_tensor(name))
    return out


# --- the agent as a subprocess ------------------------------------------------------------------------------------


class Agent:
    def __init__(self, tmp_path: Path, shared: Path, local: Path) -> None:
        self.procs = Processes(tmp_path, cwd=REPO_ROOT)
        self.shared, self.local = shared, local
        self.proc = None
        self.url = ""

    async def start(self) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "rollq", "weight-agent", "--port", str(port)]
        argv += ["--weights-root", str(self.shared), "--local-root", str(self.local)]
        self.proc = self.procs.start("agent", argv, env={"ROLLQ_WEIGHT_AGENT_ADMIN_API_KEY": KEY})
        self.url = f"http://127.0.0.1:{port}"
        # a hang guard, not a speed check: the agent imports torch (seconds on a shared 2-core machine)
        await self.procs.wait_until(
            lambda: answers(f"{self.url}/health"), 90, "the weight agent to answer /health", watch=self.proc
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.procs.kill(self.proc)


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    shared, local = tmp_path / "shared", tmp_path / "local"
    shared.mkdir()
    a = Agent(tmp_path, shared, local)
    await a.start()
    yield a
    a.procs.stop_all(grace_s=0)


async def prepare(http: httpx.AsyncClient, url: str, path: Path | str, version: str, **headers: str) -> httpx.Response:
    body = {"model_path": str(path), "weight_version": version}
    return await http.post(f"{url}{PREPARE}", json=body, headers=headers or AUTH)


async def test_the_agent_rebuilds_each_version_bit_for_bit_and_refuses_what_does_not_apply(agent: Agent):
    shared, versions = agent.shared, [initial()]
    write_full(shared / "v0", versions[0])
    async with httpx.AsyncClient(timeout=60) as http:
        url = agent.url
        # closed: no key, or another, is 401; a path outside its weights_root (or missing) is 400, said alike
        assert (await prepare(http, url, shared / "v0", "0", Authorization="Bearer nope")).status_code == 401
        assert (await http.post(f"{url}{PREPARE}", json={"model_path": str(shared / "v0")})).status_code == 401
        outside = await prepare(http, url, agent.local.parent / "elsewhere", "0")
        missing = await prepare(http, url, shared / "v9", "0")
        assert outside.status_code == missing.status_code == 400
        assert outside.json()["message"] == missing.json()["message"]
        assert (await prepare(http, url, shared / "..", "0")).status_code == 400
        assert (await prepare(http, url, shared / "v0", "../x")).status_code == 400
        # no version held yet: a delta is refused with 409 (the trainer sends a full version)
        wd.write(shared / "d1", wd.encode(versions[0], stepped(versions[0], 1), base_version="0", version="1"))
        first = await prepare(http, url, shared / "d1", "1")
        assert first.status_code == 409 and first.json()["weight_version"] == "", first.json()

        full = await prepare(http, url, shared / "v0", "0")
        assert full.status_code == 200, full.text
        assert full.json()["bytes_read"] > 0 and Path(full.json()["load_path"]).parent == agent.local.resolve()
        assert file_checksums(full.json()["load_path"]) == checksums(versions[0])

        for v in range(1, 5):
            versions.append(stepped(versions[-1], v))
            delta = wd.encode(versions[-2], versions[-1], base_version=str(v - 1), version=str(v))
            wd.write(shared / f"d{v}", delta)
            reply = await prepare(http, url, shared / f"d{v}", str(v))
            assert reply.status_code == 200, reply.text
            body = reply.json()
            load_path = Path(body["load_path"])
            assert file_checksums(load_path) == checksums(versions[-1]), v  # bit for bit, as the trainer has them
            assert (load_path / "config.json").read_text() == (shared / "v0" / "config.json").read_text()
            assert body["bytes_read"] == len(delta.blob) + (shared / f"d{v}" / wd.MANIFEST_FILE).stat().st_size
            assert sorted(p.name for p in agent.local.iterdir() if p.is_dir()) == [f"v{v - 1}", f"v{v}"]  # keeps 2
        again = await prepare(http, url, shared / "d4", "4")  # a retry: prepared already
        assert again.status_code == 200 and again.json()["load_path"] == body["load_path"]

        # a delta whose base is another version: 409 with what the agent holds
        other = wd.encode(versions[2], versions[3], base_version="2", version="3")
        wd.write(shared / "d3-again", other)
        refused = await prepare(http, url, shared / "d3-again", "3")
        assert refused.status_code == 409 and refused.json()["weight_version"] == "4", refused.json()
        # a corrupt delta (the right base named, one byte of its blob changed): 409, the base unchanged
        versions.append(stepped(versions[-1], 5))
        good = wd.encode(versions[-2], versions[-1], base_version="4", version="5")
        wd.write(shared / "d5", good)
        wd.write(shared / "d5-corrupt", good)
        blob = bytearray((shared / "d5-corrupt" / wd.BLOB_FILE).read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        (shared / "d5-corrupt" / wd.BLOB_FILE).write_bytes(bytes(blob))
        corrupt = await prepare(http, url, shared / "d5-corrupt", "5")
        assert corrupt.status_code == 409 and corrupt.json()["weight_version"] == "4", corrupt.json()
        assert (await http.get(f"{url}/health")).json()["weight_version"] == "4"
        assert not any(p.name.endswith(".tmp") for p in agent.local.iterdir())
        assert file_checksums(agent.local / "v4") == checksums(versions[4])

        # SIGKILLed, with what a kill mid-prepare leaves (a half-written directory), then restarted on the same
        # local root: it continues from the version it recorded, and the leftover is gone. (Restarted in this
        # process: a second agent process would cost CI another torch import, and the restart reads only files.)
        agent.kill()
        (agent.local / ".v5.dead.tmp").mkdir()
        runner, port = await start_site(build_app(LocalVersions(shared, agent.local), KEY), "127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{port}"
            assert (await http.get(f"{url}/health")).json()["weight_version"] == "4"
            assert not (agent.local / ".v5.dead.tmp").exists()
            reply = await prepare(http, url, shared / "d5", "5")
            assert reply.status_code == 200, reply.text
            assert file_checksums(reply.json()["load_path"]) == checksums(versions[5])
        finally:
            await runner.cleanup()


def test_an_agent_without_its_versions_asks_for_a_full_one(tmp_path: Path):
    """A restart that lost the local directory (a new pod, another host), or whose recorded version's files are
    gone: nothing to build on, so a delta is refused (409) until a full version comes; a version whose files were
    changed under it is refused by the delta's checksums."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    v0 = initial()
    write_full(shared / "v0", v0)
    v1 = stepped(v0, 1)
    wd.write(shared / "d1", wd.encode(v0, v1, base_version="0", version="1"))
    agent = LocalVersions(shared, local)
    with pytest.raises(Refused) as refused:
        agent.prepare(str(shared / "d1"), "1")
    assert refused.value.status == 409
    agent.prepare(str(shared / "v0"), "0")
    assert LocalVersions(shared, local).version == "0"  # what a restart reads back
    shutil.rmtree(local / "v0")
    restarted = LocalVersions(shared, local)
    assert restarted.version == ""
    with pytest.raises(Refused) as refused:
        restarted.prepare(str(shared / "d1"), "1")
    assert refused.value.status == 409
    restarted.prepare(str(shared / "v0"), "0")
    tampered = dict(v0, **{"model.norm.weight": v0["model.norm.weight"] * 2})
    save_file(tampered, str(local / "v0" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Refused, match="model.norm.weight") as refused:
        restarted.prepare(str(shared / "d1"), "1")
    assert refused.value.status == 409 and restarted.version == "0"
    assert json.loads((local / STATE_FILE).read_text())["versions"][-1]["version"] == "0"


def test_a_version_built_from_another_delta_is_never_answered_as_prepared(tmp_path: Path):
    """A trainer that published v2 and died before its checkpoint sends, once restarted, another delta to v2: the
    agent must not answer with the v2 it built from the first one (the engine would serve weights the trainer never
    had). Orphaned version directories (killed between the rename and the state write) go at start, and the agent
    never holds more than `keep` versions, even while it builds one."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    v1 = initial()
    write_full(shared / "v1", v1)
    first_v2, second_v2 = stepped(v1, 1), stepped(v1, 2)
    agent = LocalVersions(shared, local, keep=2)
    agent.prepare(str(shared / "v1"), "1")
    wd.write(shared / "d2", wd.encode(v1, first_v2, base_version="1", version="2"))
    built = agent.prepare(str(shared / "d2"), "2")
    assert agent.prepare(str(shared / "d2"), "2").load_path == built.load_path  # the same delta again: a retry
    wd.write(shared / "d2", wd.encode(v1, second_v2, base_version="1", version="2"))  # the restarted trainer's
    with pytest.raises(Refused) as refused:
        agent.prepare(str(shared / "d2"), "2")
    assert refused.value.status == 409
    assert file_checksums(built.load_path) == checksums(first_v2)  # what it holds is still whole

    empty = tmp_path / "empty"
    (empty / "v0").mkdir(parents=True)  # killed before its very first state write: no state file at all
    assert LocalVersions(shared, empty).version == "" and not (empty / "v0").exists()
    (local / "v9").mkdir()  # renamed into place, never recorded
    restarted = LocalVersions(shared, local, keep=2)
    assert not (local / "v9").exists() and restarted.version == "2"
    v3 = stepped(first_v2, 3)
    wd.write(shared / "d3", wd.encode(first_v2, v3, base_version="2", version="3"))
    restarted.prepare(str(shared / "d3"), "3")
    assert sorted(p.name for p in local.iterdir() if p.name.startswith("v")) == ["v2", "v3"]


def test_the_agent_starts_only_closed_and_apart_from_the_trainers_files(tmp_path: Path):
    from rollq.cli import parse

    env = {"ROLLQ_WEIGHT_AGENT_WEIGHTS_ROOT": str(tmp_path / "s"), "ROLLQ_WEIGHT_AGENT_LOCAL_ROOT": str(tmp_path / "l")}
    (cfg,) = parse(["weight-agent"], env=env).settings
    assert "admin_api_key" in (cfg.refusal() or "")
    (cfg,) = parse(["weight-agent"], env={**env, "ROLLQ_WEIGHT_AGENT_ADMIN_API_KEY": KEY}).settings
    assert cfg.refusal() is None and cfg.admin_api_key == KEY and cfg.keep_versions == 2
    assert WeightAgentConfig(admin_api_key=KEY).refusal() is not None  # no roots: nothing to do
    with pytest.raises(ValueError, match="overlap"):
        LocalVersions(tmp_path, tmp_path / "local")  # pruning could reach the trainer's versions
    with pytest.raises((ConfigError, SystemExit)):
        parse(["weight-agent", "--keep-versions", "0"], env=env)


# --- end to end: rollq's reference engine standing in for SGLang -------------------------------------------------


async def test_an_engine_loads_what_the_agent_built_and_serves_the_trainers_weights(tmp_path: Path, tiny_dir: Path):
    """The agent beside a reference engine (which, like SGLang, loads full directories through
    /update_weights_from_disk, from under a weights_root that covers the agent's local root): each version the
    agent prepares, the engine loads from load_path, and then serves the trainer's tensors bit for bit."""
    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
    from rollq.engine.server.weights import served_parameters

    shared, local = tmp_path / "shared", tmp_path / "local"
    shutil.copytree(tiny_dir, shared / "v0")  # the trainer's first full version: the model the engine started with
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        trainer = [{name: f.get_tensor(name) for name in f.keys()}]
    runner, port = await start_site(build_app(LocalVersions(shared, local), KEY), "127.0.0.1", 0)
    agent = f"http://127.0.0.1:{port}"
    backend = ReferenceBackend(ReferenceConfig(model="tiny", max_running=2))
    engine = await serve(backend, EngineServerConfig(port=0, weight_version="0", weights_root=str(tmp_path)))

    def served() -> dict[str, str]:
        return {n: wd.checksum(p.detach().cpu()) for n, p in served_parameters(backend.model).items()}

    try:
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await prepare(http, agent, shared / "v0", "0")).status_code == 200
            for v in (1, 2):
                trainer.append(stepped(trainer[-1], v))
                wd.write(shared / f"d{v}", wd.encode(trainer[-2], trainer[-1], base_version=str(v - 1), version=str(v)))
                prepared = await prepare(http, agent, shared / f"d{v}", str(v))  # before the pause
                assert prepared.status_code == 200, prepared.text
                swap = {"model_path": prepared.json()["load_path"], "weight_version": str(v)}
                loaded = await http.post(f"{engine.url}/update_weights_from_disk", json=swap)
                assert loaded.status_code == 200, loaded.text
                assert served() == checksums(trainer[-1]), v
                reported = await http.get(f"{engine.url}/rollq/weights_checksum")  # the engine's own report, if served
                if reported.status_code != 404:
                    assert reported.json()["checksums"] == checksums(trainer[-1]), v
            assert served() != checksums(trainer[0])  # the weights did change
    finally:
        await engine.close()
        await runner.cleanup()


# --- how the trainer learns an engine's agent ----------------------------------------------------------------------


async def test_agent_urls_reach_the_trainers_pool_from_its_settings_and_the_registry(redis_url: str, run_name: str):
    """`rollq engine --register --agent-url URL` (the sglang backend's launcher) names the agent in its signed entry;
    the trainer's engine_agents names those of static engines; both end up in the trainer's pool members."""
    import asyncio

    from rollq.cli import parse
    from rollq.engine.registry import EngineRegistry, control_key
    from rollq.engine.server.commands import _register, _unregister
    from rollq.redis_client import redis_client
    from rollq.trainer.engines import engine_pool

    env = {"ROLLQ_ENGINE_ADMIN_API_KEY": KEY, "ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY": KEY}
    flags = ["--redis", redis_url, "--run", run_name, "--register", "--agent-url", "http://sglang-0:30010"]
    (engine_cfg,) = parse(["engine", *flags], env=env).settings
    with pytest.raises(SystemExit):
        parse(["engine", "--agent-url", "sglang-0:30010"], env=env)  # not a URL: exit 2 naming the setting
    agents = "{http://static:30000: http://static:30010}"
    (train_cfg,) = parse(["train", "--engine", "http://static:30000", "--engine-agents", agents], env=env).settings
    with pytest.raises(SystemExit):
        parse(["train", "--engine-agents", "{http://static:30000: static:30010}"], env=env)

    task = await _register(engine_cfg, "http://sglang-0:30000")
    redis = redis_client(redis_url)
    pool = engine_pool(train_cfg)
    try:
        registry = EngineRegistry(redis, run_name, key=control_key(None, KEY))
        await asyncio.wait_for(_wait_listed(registry, "http://sglang-0:30000"), 10)
        await pool.sync_registry(registry)
        agents_of = {url: m.agent_url for url, m in pool.members.items()}
        assert agents_of == {
            "http://static:30000": "http://static:30010",
            "http://sglang-0:30000": "http://sglang-0:30010",
        }
    finally:
        await pool.close()
        await _unregister(task)
        await redis.aclose()


async def _wait_listed(registry, url: str) -> None:
    import asyncio

    while url not in await registry.live():  # bounded by the caller's wait_for
        await asyncio.sleep(0.02)
