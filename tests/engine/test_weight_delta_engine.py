"""Weight deltas on the reference engine (engine/server/delta_routes.py): prepared while generation goes on, swapped
in under the pause, bit-exact against the trainer's tensors (the engine's own checksums), refused with 409 when
they do not apply. In-process engines on the tiny model in bfloat16 (small deltas), a real gloo group for the
distributed form, and a `rollq engine` subprocess SIGKILLed halfway through a swap."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from rollq.engine import weight_delta  # noqa: E402
from rollq.engine.server.app import ServerHandle  # noqa: E402
from rollq.engine.server.delta_routes import DELTA_MANIFEST  # noqa: E402
from rollq.engine.server.delta_routes import ROUTES_KEY as DELTA_ROUTES_KEY  # noqa: E402
from rollq.engine.server.faults import FaultyBackend, LoadHold  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.engine.server.weights_root import OUTSIDE  # noqa: E402
from rollq.engine.weight_group import TrainerGroup  # noqa: E402
from rollq.local import Processes, free_port, wait_until  # noqa: E402
from tests.helpers import REPO_ROOT, engine_healthy  # noqa: E402

Weights = dict[str, torch.Tensor]
TIMEOUT_S = 20.0  # bounds the group's join and broadcast (a hang guard: CI shares two cores)


@pytest.fixture
def start_ref(tiny_dir: Path, start_engine):
    """`await start_ref()` -> an in-process reference engine on the tiny model in bfloat16; weights_root = tmp_path."""

    async def start() -> ServerHandle:
        config = ReferenceConfig(model=str(tiny_dir), dtype="bfloat16", max_running=4)
        return await start_engine(backend=ReferenceBackend(config))

    return start


def served(handle: ServerHandle) -> Weights:
    return {n: t.detach().clone() for n, t in handle.server.backend.served_weights().items()}


def step(weights: Weights, seed: int) -> Weights:
    """What a training step at a small learning rate publishes: a few weights of each tensor nudged (in bfloat16,
    most keep every bit)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        nudge = 1e-2 * torch.randn(t.shape, generator=gen) * (torch.rand(t.shape, generator=gen) < 0.05)
        out[name] = (t.float() + nudge).to(t.dtype)
    return out


def checksums(weights: Weights) -> dict[str, str]:
    return {n: weight_delta.checksum(t) for n, t in weights.items()}


def write_delta(root: Path, base: Weights, new: Weights, base_version: str, version: str) -> Path:
    return weight_delta.write(
        root / f"d{version}", weight_delta.encode(base, new, base_version=base_version, version=version)
    )


async def engine_checksums(http: httpx.AsyncClient, url: str) -> dict:
    r = await http.get(f"{url}/rollq/weights_checksum")
    assert r.status_code == 200, r.text
    return r.json()


async def prepare(http: httpx.AsyncClient, url: str, path: Path | str, version: str) -> httpx.Response:
    return await http.post(f"{url}/rollq/prepare_weights", json={"model_path": str(path), "weight_version": version})


async def swap(http: httpx.AsyncClient, url: str, path: Path | str, version: str) -> httpx.Response:
    body = {"model_path": str(path), "weight_version": version}
    return await http.post(f"{url}/update_weights_from_disk", json=body)


async def test_deltas_over_disk_rebuild_the_trainers_weights_bit_exact(start_ref, http, tmp_path):
    engine = await start_ref()
    url, routes = engine.url, engine.runner.app[DELTA_ROUTES_KEY]
    assert DELTA_MANIFEST == weight_delta.MANIFEST_FILE
    assert (await http.get(f"{url}/server_info")).json()["dtype"] == "bfloat16"
    trainer, held = served(engine), "default"
    first = await engine_checksums(http, url)
    assert first == {"weight_version": "default", "dtype": "bfloat16", "checksums": checksums(trainer)}
    for version in ("1", "2", "3", "4"):
        new = step(trainer, seed=int(version))
        delta_dir = write_delta(tmp_path, trainer, new, held, version)
        if version != "3":  # version 3 is swapped in without a prepare: applied under the pause, checked as well
            r = await prepare(http, url, delta_dir, version)
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["success"] and reply["load_path"] == str(delta_dir.resolve())
            blob = (delta_dir / weight_delta.BLOB_FILE).stat().st_size
            assert reply["bytes_read"] == blob + (delta_dir / DELTA_MANIFEST).stat().st_size
            assert routes.staged is not None and routes.staged.version == version
            assert (await engine_checksums(http, url))["checksums"] == checksums(trainer)  # staged, not swapped
        r = await swap(http, url, reply["load_path"] if version != "3" else delta_dir, version)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert routes.staged is None  # swapped in and let go
        assert await engine_checksums(http, url) == {
            "weight_version": version,
            "dtype": "bfloat16",
            "checksums": checksums(new),
        }
        trainer, held = new, version
    assert checksums(trainer) != first["checksums"]


async def test_a_delta_that_does_not_apply_is_refused_and_changes_nothing(start_ref, start_engine, http, tmp_path):
    engine = await start_ref()
    url, routes = engine.url, engine.runner.app[DELTA_ROUTES_KEY]
    base = served(engine)
    before = await engine_checksums(http, url)
    new = step(base, seed=1)

    # Another base version: 409 naming what the engine holds (the trainer then sends it full weights).
    wrong_base = write_delta(tmp_path, base, new, "7", "8")
    r = await prepare(http, url, wrong_base, "8")
    assert r.status_code == 409 and r.json()["weight_version"] == "default"
    assert "not the delta's base '7'" in r.json()["message"]
    # The right version name on other bits: the checksums refuse it.
    other = write_delta(tmp_path, step(base, seed=2), new, "default", "9")
    r = await prepare(http, url, other, "9")
    assert r.status_code == 409 and "not the delta's base" in r.json()["message"]
    # Another dtype than the one served: 409 naming both.
    as_float = {n: t.float() for n, t in base.items()}
    fp32 = write_delta(tmp_path, as_float, {n: t.float() for n, t in new.items()}, "default", "10")
    r = await prepare(http, url, fp32, "10")
    assert r.status_code == 409 and "in float32, this engine serves bfloat16" in r.json()["message"]
    # A corrupt delta (one flipped byte): refused by prepare, and by the swap without a prepare (400, unchanged).
    corrupt = write_delta(tmp_path, base, new, "default", "11")
    blob = bytearray((corrupt / weight_delta.BLOB_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0x40
    (corrupt / weight_delta.BLOB_FILE).write_bytes(bytes(blob))
    r = await prepare(http, url, corrupt, "11")
    assert r.status_code == 409 and r.json()["weight_version"] == "default"
    r = await swap(http, url, corrupt, "11")
    assert r.status_code == 400 and not r.json()["success"]
    # A path outside weights_root, for both calls: refused as /update_weights_from_disk refuses it.
    outside = tmp_path.parent / "elsewhere"
    weight_delta.write(outside, weight_delta.encode(base, new, base_version="default", version="12"))
    for r in (await prepare(http, url, outside, "12"), await swap(http, url, outside, "12")):
        assert r.status_code == 400 and r.json()["message"] == OUTSIDE
    # Malformed requests, a version that is not the delta's, a swap of nothing staged.
    good = write_delta(tmp_path, base, new, "default", "13")
    assert (await prepare(http, url, good, "14")).status_code == 400
    assert (await swap(http, url, good, "14")).status_code == 400
    assert (await http.post(f"{url}/rollq/prepare_weights", json={"weight_version": "1"})).status_code == 400
    assert (await http.post(f"{url}/rollq/prepare_weights", content=b"{")).status_code == 400
    bad_manifest = {"group_name": "g", "manifest": {"format": "x"}, "weight_version": "1"}
    r = await http.post(f"{url}/rollq/prepare_weights", json=bad_manifest)
    assert r.status_code == 400 and "manifest" in r.json()["message"]
    r = await http.post(f"{url}/rollq/swap_prepared_weights", json={"weight_version": "13"})
    assert r.status_code == 409 and r.json()["weight_version"] == "default"
    assert await engine_checksums(http, url) == before and routes.staged is None

    # A staged version another load overtook is never swapped in: the delta is then applied to what is served, and
    # refused (it was built on the old base).
    full = tmp_path / "v20"
    full.mkdir()
    other_weights = step(base, seed=20)
    save_file({n: t.contiguous() for n, t in other_weights.items()}, str(full / "model.safetensors"))
    r = await prepare(http, url, full, "20")  # a full version: staged nothing, the swap reads the directory
    assert r.status_code == 200 and r.json()["load_path"] == str(full.resolve()) and r.json()["bytes_read"] == 0
    assert (await prepare(http, url, good, "13")).status_code == 200
    assert (await swap(http, url, full, "default")).status_code == 200  # same version name, other bits
    r = await swap(http, url, good, "13")
    assert r.status_code == 400 and "not the delta's base" in r.json()["message"]
    assert (await engine_checksums(http, url))["checksums"] == checksums(other_weights)

    # An engine that holds no weights (the synthetic backend) answers 404, as plain SGLang: full updates only.
    synthetic = await start_engine()
    assert (await prepare(http, synthetic.url, good, "13")).status_code == 404
    assert (await http.get(f"{synthetic.url}/rollq/weights_checksum")).status_code == 404


async def test_a_delta_over_a_group_is_prepared_while_generating_and_a_mismatched_engine_completes_it(
    start_ref, http, tmp_path
):
    a, b = await start_ref(), await start_ref()
    assert (await http.post(f"{b.url}/update_weight_version", json={"new_version": "elsewhere"})).status_code == 200
    base = served(a)
    new = step(base, seed=5)
    delta = weight_delta.encode(base, new, base_version="default", version="1")

    group = await asyncio.to_thread(TrainerGroup, "127.0.0.1", 0, 3, "delta-test", TIMEOUT_S)
    try:
        join = asyncio.create_task(asyncio.to_thread(group.join))
        init = {"master_address": "127.0.0.1", "master_port": group.port, "world_size": 3, "group_name": "delta-test"}
        init["backend"] = "gloo"
        inits = [
            http.post(f"{h.url}/init_weights_update_group", json={**init, "rank_offset": i + 1, "timeout_s": TIMEOUT_S})
            for i, h in enumerate((a, b))
        ]
        assert [r.status_code for r in await asyncio.gather(*inits)] == [200, 200]
        await join

        # A request in flight on `a` before the prepare.
        params = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}
        gen = asyncio.create_task(
            http.post(f"{a.url}/generate", json={"input_ids": [1, 5, 9], "sampling_params": params, "rid": "long"})
        )
        state = (await wait_until(lambda: a.server.states.get("long"), TIMEOUT_S, what="the request")).state
        await wait_until(lambda: state.output_ids, TIMEOUT_S, what="its first token")

        body = {"group_name": "delta-test", "manifest": msgspec.to_builtins(delta.manifest)}
        prepares = [
            asyncio.create_task(http.post(f"{h.url}/rollq/prepare_weights", json={**body, "weight_version": "1"}))
            for h in (a, b)
        ]
        await wait_until(lambda: a.server.control_calls["/rollq/prepare_weights"] == 1, TIMEOUT_S, what="prepare")
        # The prepare waits for the broadcast: generation goes on meanwhile.
        tokens = len(state.output_ids)
        await wait_until(lambda: len(state.output_ids) >= tokens + 2, TIMEOUT_S, what="tokens during the prepare")
        assert not any(p.done() for p in prepares)
        blob = torch.frombuffer(bytearray(delta.blob), dtype=torch.uint8)
        assert await asyncio.to_thread(group.broadcast, [blob]) == len(delta.blob)
        ready, refused = await asyncio.gather(*prepares)
        assert ready.status_code == 200 and ready.json()["bytes_read"] == len(delta.blob), ready.text
        # The mismatched engine received its part of the collective, then said what it holds.
        assert refused.status_code == 409 and refused.json()["weight_version"] == "elsewhere"
        assert state.finish is None  # the request outlived the prepare

        swapped = await http.post(f"{a.url}/rollq/swap_prepared_weights", json={"weight_version": "1"})
        assert swapped.status_code == 200 and swapped.json()["success"], swapped.text
        answer = (await gen).json()
        assert answer["meta_info"]["finish_reason"]["type"] == "length" and len(answer["output_ids"]) == 200
        assert a.server.counters["num_aborted_requests"] == 0 and a.server.counters["num_retracted_requests"] == 0
        assert await engine_checksums(http, a.url) == {
            "weight_version": "1",
            "dtype": "bfloat16",
            "checksums": checksums(new),
        }
        r = await http.post(f"{b.url}/rollq/swap_prepared_weights", json={"weight_version": "1"})
        assert r.status_code == 409 and (await engine_checksums(http, b.url))["checksums"] == checksums(base)
    finally:
        group.close()


@pytest.mark.scenario  # two reference engine starts in subprocesses: ~20 s, more than CI affords
async def test_an_engine_killed_halfway_through_a_swap_comes_back_on_its_own_weights(tiny_dir, http, tmp_path):
    """A `rollq engine` subprocess SIGKILLed while its swap has copied half the tensors (fault hold_load) restarts
    on the weights it starts with, refuses the next delta, and a full update brings it to the trainer's weights."""
    root, hold = tmp_path / "weights", tmp_path / "hold"
    root.mkdir()
    hold.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "rollq", "engine", "--backend", "reference", "--dtype", "bfloat16"]
    argv += ["--port", str(port), "--insecure-no-auth", "--weights-root", str(root)]
    initial = {n: t.to(torch.bfloat16) for n, t in load_file(str(tiny_dir / "model.safetensors")).items()}
    with Processes(tmp_path, cwd=REPO_ROOT, env={"ROLLQ_CACHE": str(tiny_dir.parent)}) as procs:
        proc = procs.start("engine", [*argv, "--fault", f"hold_load:{hold}"])
        await procs.wait_until(lambda: engine_healthy(url), 120, f"{url} healthy", watch=proc)
        assert (await engine_checksums(http, url))["checksums"] == checksums(initial)

        v1 = step(initial, seed=1)
        d1 = write_delta(root, initial, v1, "default", "1")
        assert (await prepare(http, url, d1, "1")).status_code == 200
        swapping = asyncio.create_task(swap(http, url, d1, "1"))
        await procs.wait_until(lambda: (hold / "holding").exists(), 30, "the swap halfway", watch=proc)
        procs.kill(proc)
        with pytest.raises(httpx.TransportError):
            await swapping

        proc = procs.start("engine", argv)  # the same engine, restarted (without the fault)
        await procs.wait_until(lambda: engine_healthy(url), 120, f"{url} healthy again", watch=proc)
        assert await engine_checksums(http, url) == {
            "weight_version": "default",
            "dtype": "bfloat16",
            "checksums": checksums(initial),
        }
        v2 = step(v1, seed=2)
        r = await prepare(http, url, write_delta(root, v1, v2, "1", "2"), "2")
        assert r.status_code == 409 and r.json()["weight_version"] == "default"
        full = root / "v2"
        full.mkdir()
        save_file({n: t.contiguous() for n, t in v2.items()}, str(full / "model.safetensors"))
        assert (await swap(http, url, full, "2")).status_code == 200
        assert await engine_checksums(http, url) == {
            "weight_version": "2",
            "dtype": "bfloat16",
            "checksums": checksums(v2),
        }


async def test_a_delta_under_loaded_lora_adapters_changes_the_base_weights_only(tiny_dir, start_engine, http, tmp_path):
    from tests.engine.test_lora_serving import make_adapter

    backend = ReferenceBackend(ReferenceConfig(model=str(tiny_dir), dtype="bfloat16", max_running=4))
    engine = await start_engine(server={"enable_lora": True}, backend=backend)
    base = served(engine)
    adapter = make_adapter(tmp_path / "adapter", seed=1)
    r = await http.post(f"{engine.url}/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    lora = {n: p.detach().clone() for n, p in backend.model.named_parameters() if ".lora_" in n}
    assert lora and set(served(engine)) == set(base)  # the served names hide peft's wrapping

    new = step(base, seed=3)
    delta_dir = write_delta(tmp_path, base, new, "default", "1")
    assert (await prepare(http, engine.url, delta_dir, "1")).status_code == 200
    assert (await swap(http, engine.url, delta_dir, "1")).status_code == 200
    assert (await engine_checksums(http, engine.url))["checksums"] == checksums(new)
    after = {n: p for n, p in backend.model.named_parameters() if ".lora_" in n}
    assert all(torch.equal(after[n], t) for n, t in lora.items())


async def test_a_prepare_never_reads_weights_a_load_is_halfway_through(tiny_dir, start_engine, http, tmp_path):
    """A swap held halfway (fault hold_load: half the tensors are new) while a prepare comes: the prepare reads the
    weights only once the load is done, and builds on the whole new version."""
    hold = tmp_path / "hold"
    hold.mkdir()
    inner = ReferenceBackend(ReferenceConfig(model=str(tiny_dir), dtype="bfloat16", max_running=4))
    engine = await start_engine(backend=FaultyBackend(inner, LoadHold(directory=str(hold))))
    w0 = served(engine)
    w1 = step(w0, seed=1)
    w2 = step(w1, seed=2)
    d1 = write_delta(tmp_path, w0, w1, "default", "1")
    d2 = write_delta(tmp_path, w1, w2, "1", "2")

    swapping = asyncio.create_task(swap(http, engine.url, d1, "1"))  # nothing staged: applied, then held halfway
    await wait_until(lambda: (hold / "holding").exists(), TIMEOUT_S, what="the swap halfway")
    preparing = asyncio.create_task(prepare(http, engine.url, d2, "2"))
    await wait_until(lambda: engine.server.control_calls["/rollq/prepare_weights"] == 1, TIMEOUT_S, what="prepare")
    (hold / "release").touch()
    assert (await swapping).status_code == 200
    r = await preparing
    assert r.status_code == 200, r.text
    (hold / "holding").unlink()
    assert (await swap(http, engine.url, d2, "2")).status_code == 200
    assert (await engine_checksums(http, engine.url))["checksums"] == checksums(w2)
