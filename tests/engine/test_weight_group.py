"""New weights over SGLang's distributed update path (gloo on CPU), against real reference engines: in-process ones
(their parameters can be read back) and a `rollq engine --backend reference` subprocess (SIGKILLed mid-update)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from rollq.engine.client import SGLangClient  # noqa: E402
from rollq.engine.pool import EnginePool, PoolConfig  # noqa: E402
from rollq.engine.server.app import ServerHandle  # noqa: E402
from rollq.engine.server.distributed_routes import ROUTES_KEY  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.engine.weight_group import DistributedSyncConfig, DistributedWeightSync  # noqa: E402
from rollq.local import free_port  # noqa: E402
from tests.helpers import REPO_ROOT, engine_healthy, wait_until  # noqa: E402

TIMEOUT_S = 8.0  # the sync's bound on joins, broadcast ops and control calls in these tests
PROMPT = [1, 5, 9, 13, 17, 21]


@pytest.fixture
def cache_dir(tiny_dir: Path) -> Path:
    return tiny_dir.parent  # where ROLLQ_CACHE=<it> puts `--model tiny` (the subprocess engine's)


@pytest.fixture
def start_ref(cache_dir: Path, start_engine):
    """`await start_ref()` -> an in-process reference engine on the tiny model; closed at teardown."""

    async def start() -> ServerHandle:
        return await start_engine(
            backend=ReferenceBackend(ReferenceConfig(model=str(cache_dir / "tiny-model"), max_running=4))
        )

    return start


@pytest.fixture
async def pool():
    p = EnginePool(PoolConfig(health_timeout_s=2.0))
    yield p
    await p.close()


def new_weights(handle: ServerHandle, seed: int) -> dict[str, torch.Tensor]:
    """The engine's parameters, perturbed: what a training step would publish."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: p.detach().clone() + 0.05 * torch.randn(p.shape, generator=gen)
        for n, p in handle.server.backend.model.named_parameters()
    }


def holds(handle: ServerHandle, tensors: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, tensors[n]) for n, p in handle.server.backend.model.named_parameters())


async def greedy(client: SGLangClient) -> tuple[list[int], str]:
    from rollq.engine.types import SamplingParams

    result = await client.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    return result.output_ids, result.weight_version


async def test_broadcast_weights_are_what_engines_serve(start_ref, pool, tmp_path):
    a, b, disk = await start_ref(), await start_ref(), await start_ref()
    for h in (a, b):
        pool.add(h.url)
    sync = DistributedWeightSync(pool, DistributedSyncConfig(timeout_s=TIMEOUT_S))
    weights = new_weights(a, seed=1)

    result = await sync.update(weights, 7)
    assert sorted(result.ok) == sorted([a.url, b.url]) and not result.failed
    assert result.bytes_sent == sum(t.numel() * t.element_size() for t in weights.values())
    assert holds(a, weights) and holds(b, weights)

    # The same tensors through the disk path: the same greedy tokens, and every engine reports its version.
    save_file({n: t.contiguous() for n, t in weights.items()}, str(tmp_path / "model.safetensors"))
    await pool.add(disk.url).client.update_weights_from_disk(str(tmp_path), weight_version="7")
    outs = [await greedy(pool.members[h.url].client) for h in (a, b, disk)]
    assert outs[0] == outs[1] == outs[2] and outs[0][1] == "7"
    assert pool.members[a.url].weight_version == "7" and not pool.members[a.url].stale

    # The next update reuses the group: same members (the disk engine left the pool again).
    pool.remove(disk.url)
    second = new_weights(a, seed=2)
    assert (await sync.update(second, 8, flush_cache=False)).rebuilt == 0 and holds(b, second)
    assert sync.builds == 1

    # A restarted trainer (a new instance: new group names) takes over; the old group stays harmless on the engines.
    restarted = DistributedWeightSync(pool, DistributedSyncConfig(timeout_s=TIMEOUT_S))
    third = new_weights(a, seed=3)
    result = await restarted.update(third, 9)
    assert not result.failed and holds(a, third) and holds(b, third) and a.server.weight_version == "9"
    await restarted.close()
    await sync.close()


async def test_session_rules_and_sglang_answers(start_ref):
    engine = await start_ref()
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "g"}
    async with httpx.AsyncClient(base_url=engine.url, timeout=10) as http:
        r = await http.post("/update_weights_from_distributed", json=update)
        assert r.status_code == 400 and r.json() == {
            "success": False,
            "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        }
        assert (await http.post("/end_weight_update", json={})).status_code == 400
        assert (await http.post("/begin_weight_update", json={})).json() == {"success": True, "message": "Success"}
        r = await http.post("/begin_weight_update", json={})
        assert r.status_code == 400 and "already open" in r.json()["message"]
        r = await http.post("/update_weights_from_distributed", json=update)  # in a session, but no such group
        assert r.status_code == 400 and r.json()["message"].startswith("Failed to receive weights: Group g not in")
        assert engine.server.weight_version == "default"
        assert (await http.post("/end_weight_update", json={})).status_code == 200
        r = await http.post("/destroy_weights_update_group", json={"group_name": "g"})
        assert r.status_code == 400 and r.json()["message"] == "The group to be destroyed does not exist."
        bad = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "mpi"}
        r = await http.post("/init_weights_update_group", json=bad)
        assert r.status_code == 400 and r.json()["success"] is False
        r = await http.post("/init_weights_update_group", json={"master_port": 1})
        assert r.status_code == 400  # validation: the required fields


class KillingClient(SGLangClient):
    """The subprocess engine's client, SIGKILLing it right as the update starts (its group joined, session open)."""

    proc: subprocess.Popen

    async def update_weights_from_distributed(self, payload, *, timeout=None):
        self.proc.kill()
        return await super().update_weights_from_distributed(payload, timeout=timeout)


@pytest.mark.slow
async def test_a_killed_engine_fails_alone_and_a_late_one_catches_up(start_ref, pool, cache_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "engine.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollq", "engine", "--backend", "reference", "--port", str(port), "--insecure-no-auth"],
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ROLLQ_CACHE": str(cache_dir)},
    )
    try:
        victim_url = f"http://127.0.0.1:{port}"
        survivor = await start_ref()
        await wait_until(lambda: proc.poll() is not None or engine_healthy(victim_url), 120, what="engine up")
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()
        pool.add(survivor.url)
        victim = pool.add(victim_url)
        sync = DistributedWeightSync(pool, DistributedSyncConfig(timeout_s=TIMEOUT_S))
        first = new_weights(survivor, seed=1)
        assert not (await sync.update(first, 1)).failed  # the subprocess engine takes part normally first
        assert await victim.client.weight_version() == "1"

        killer = KillingClient(victim_url, victim.client.http)
        killer.proc = proc
        victim.client = killer
        second = new_weights(survivor, seed=2)
        started = time.monotonic()
        result = await sync.update(second, 2)
        assert time.monotonic() - started < 2 * TIMEOUT_S  # bounded: the broken group is dropped, the rest retried
        assert result.ok == [survivor.url] and list(result.failed) == [victim_url]
        assert victim.stale and not pool.members[survivor.url].stale
        assert holds(survivor, second) and survivor.server.weight_version == "2"

        # A late engine: stale (out of routing) until an update over a rebuilt group brings it to the fleet's weights.
        late = await start_ref()
        pool.add(late.url)
        await pool.check_health()  # it reports "default", the fleet is at "2"
        assert pool.members[late.url].stale and pool.route("") is pool.members[survivor.url]
        third = new_weights(survivor, seed=3)
        builds = sync.builds
        result = await sync.update(third, 3)
        assert sorted(result.ok) == sorted([survivor.url, late.url]) and list(result.failed) == [victim_url]
        assert sync.builds == builds + 1 and holds(late, third) and holds(survivor, third)
        # Groups the trainer dropped (the broken one, the retry's) were destroyed on the engines: one each is left.
        assert survivor.runner.app[ROUTES_KEY].groups.names() == [sync.group_name]
        assert late.runner.app[ROUTES_KEY].groups.names() == [sync.group_name]
        assert not pool.members[late.url].stale and late.server.weight_version == "3"
        assert (await greedy(pool.members[late.url].client)) == (await greedy(pool.members[survivor.url].client))
        await sync.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
