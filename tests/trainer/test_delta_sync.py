"""Delta weight sync (trainer/delta_sync.py): what the trainer sends each engine at each update, checked by reading
the engines' weights back (/rollq/weights_checksum) against the trainer's snapshot, bit for bit.

Real reference engines in-process (the tiny model), a real Redis under the Trainer, no workers: each "step" moves
every weight of the policy by an Adam-sized amount (a sign step of `LR`), then publishes it as the training loop
does (Trainer._publish_weights), so a handful of updates costs well under a second each."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollq.engine.pool import EnginePool, PoolConfig  # noqa: E402
from rollq.engine.server.app import EngineServerConfig, ServerHandle, serve  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.trainer.loop import Trainer  # noqa: E402
from rollq.trainer.policy import Policy  # noqa: E402

LR = 2e-4  # per step, on every weight: most bf16 weights of the tiny model keep every bit (a delta of a few %)


StartEngine = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
async def start_engine(tmp_path: Path) -> AsyncIterator[StartEngine]:
    """`await start_engine(dtype=..., port=...)`: an in-process reference engine on the tiny model that loads
    weights from under tmp_path; closed at teardown."""
    handles: list[ServerHandle] = []

    async def start(dtype: str = "bfloat16", port: int = 0) -> ServerHandle:
        backend = ReferenceBackend(ReferenceConfig(model="tiny", dtype=dtype, max_running=4))
        handles.append(await serve(backend, EngineServerConfig(port=port, weights_root=str(tmp_path))))
        return handles[-1]

    yield start
    for h in handles:
        await h.close()


@pytest.fixture
async def make_trainer(redis, make_train_config, tmp_path: Path) -> AsyncIterator[Callable[..., Trainer]]:
    pools: list[EnginePool] = []

    def make(urls: list[str], **settings: Any) -> Trainer:
        weights = tmp_path / settings.pop("weights", "weights")
        cfg = make_train_config(engine=urls, weights_dir=str(weights), **settings)
        pool = EnginePool(PoolConfig(urls=urls, agent_urls=cfg.engine_agents))
        pools.append(pool)
        return Trainer(cfg, redis, pool, progress=io.StringIO(), policy=Policy(cfg))

    yield make
    for pool in pools:
        await pool.close()


def step(trainer: Trainer, seed: int) -> None:
    """An Adam-like step on every weight of the trained model: each moves by LR, up or down."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.policy.model.parameters():  # type: ignore[attr-defined]
            p.add_(LR * torch.randn(p.shape, generator=generator).sign())


async def served_checksums(engine: ServerHandle, trainer: Trainer) -> dict[str, Any]:
    member = trainer.pool.members[engine.url]
    return await member.client.weights_checksum()


async def assert_bit_exact(trainer: Trainer, engines: list[ServerHandle], version: int) -> None:
    assert trainer.delta is not None
    expected = trainer.delta.checksums()
    assert expected and trainer.delta.snapshot_version == str(version)
    for engine in engines:
        served = await served_checksums(engine, trainer)
        assert served["weight_version"] == str(version), engine.url
        differ = sorted(n for n in expected if served["checksums"].get(n) != expected[n])
        assert not differ and set(served["checksums"]) == set(expected), (engine.url, differ[:5])


async def test_deltas_keep_engines_bit_exact_and_a_restarted_engine_gets_the_full_weights(
    start_engine, make_trainer, tmp_path: Path
) -> None:
    a, b = await start_engine(), await start_engine()
    trainer = make_trainer([a.url, b.url], delta_full_every=0)
    first = await trainer._publish_weights(0)  # the trainer's first update: nothing to take a delta from
    assert first["delta"] == 0 and first["full_engines"] == 2 and first["bytes_per_engine"] > 0
    full_bytes = first["bytes_per_engine"]
    await assert_bit_exact(trainer, [a, b], 0)

    phases = []
    for version in (1, 2):
        step(trainer, version)
        phases.append(await trainer._publish_weights(version))
        await assert_bit_exact(trainer, [a, b], version)
    for p in phases:
        assert p["delta"] == 1 and p["full_engines"] == 0, p
        assert 0 < p["delta_share"] < 0.5 and 0 < p["bytes_per_engine"] < full_bytes / 2, p
        assert p["bytes_sent"] == 2 * p["bytes_per_engine"] and p["prepare_s"] > 0
    assert a.server.control_calls["/rollq/prepare_weights"] == 2
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["d1", "d2"]  # v0 pruned; no v1, v2 needed

    # b restarts (its port kept): it serves the model's own weights again, under the version it starts with
    port = int(b.url.rsplit(":", 1)[1])
    await b.close()
    b = await start_engine(port=port)
    step(trainer, 3)
    restarted = await trainer._publish_weights(3)
    assert restarted["delta"] == 1 and restarted["full_engines"] == 1, restarted
    assert full_bytes < restarted["bytes_sent"] < 1.5 * full_bytes  # b read the full weights, a a delta
    await assert_bit_exact(trainer, [a, b], 3)
    step(trainer, 4)
    again = await trainer._publish_weights(4)  # back on the base: deltas again
    assert again["delta"] == 1 and again["full_engines"] == 0, again
    await assert_bit_exact(trainer, [a, b], 4)


async def test_an_engine_with_a_host_agent_loads_what_its_agent_built(
    start_engine, make_trainer, tmp_path: Path
) -> None:
    """The engine (a reference engine standing in for SGLang, which loads full directories only) never prepares:
    its agent (`rollq weight-agent`) takes the full version, then each delta, and answers the directory it built."""
    from rollq.engine.server.weight_agent.server import build_app
    from rollq.engine.server.weight_agent.versions import LocalVersions
    from rollq.http_server import start_site

    engine = await start_engine()  # its weights_root (tmp_path) holds the trainer's weights and the agent's copies
    (tmp_path / "weights").mkdir()
    runner, port = await start_site(
        build_app(LocalVersions(tmp_path / "weights", tmp_path / "agent"), None), "127.0.0.1", 0
    )
    try:
        trainer = make_trainer([engine.url], engine_agents={engine.url: f"http://127.0.0.1:{port}"})
        sent = []
        for version in range(3):
            step(trainer, version)
            phases = await trainer._publish_weights(version)
            sent.append((phases["delta"], phases["full_engines"]))
            await assert_bit_exact(trainer, [engine], version)
        assert sent == [(0, 1), (1, 0), (1, 0)]
        assert engine.server.control_calls["/rollq/prepare_weights"] == 0  # the agent prepared every version
        assert sorted(p.name for p in (tmp_path / "agent").iterdir() if p.name.startswith("v")) == ["v1", "v2"]
    finally:
        await runner.cleanup()


async def test_a_joining_engine_and_mismatched_engines_get_the_full_weights(
    start_engine, make_trainer, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    a, b, d = await start_engine(), await start_engine(), await start_engine()
    trainer = make_trainer([a.url, b.url, d.url], delta_full_every=0)
    await trainer._publish_weights(0)
    step(trainer, 1)
    assert (await trainer._publish_weights(1))["full_engines"] == 0
    assert trainer.delta is not None and trainer.delta.snapshot is not None

    c = await start_engine()  # joins after the fleet moved to version 1: it catches up with the full version 1
    trainer.pool.add(c.url)
    # b's version changed behind the trainer's back
    await trainer.pool.members[b.url].client._json("POST", "/update_weight_version", json={"new_version": "7"})
    # a still says version 1, but holds other weights (one tensor off): its checksums refuse the delta
    tampered = {name: t.clone() for name, t in trainer.delta.snapshot.items()}
    name = next(iter(tampered))
    tampered[name].view(-1)[0] += 1
    (tmp_path / "tampered").mkdir()
    save_file(tampered, str(tmp_path / "tampered" / "model.safetensors"))
    await trainer.pool.members[a.url].client.update_weights_from_disk(str(tmp_path / "tampered"), weight_version="1")

    step(trainer, 2)
    phases = await trainer._publish_weights(2)
    # full weights: a (409) and b (version 7) in the cycle, c before it (then its delta); d: the delta alone
    assert phases["delta"] == 1 and phases["full_engines"] == 3, phases
    assert a.server.control_calls["/rollq/prepare_weights"] == 2  # asked, refused
    assert b.server.control_calls["/rollq/prepare_weights"] == 1  # not asked: not on the base
    assert c.server.control_calls["/update_weights_from_disk"] == 2  # the full version 1, then the delta's swap
    assert (tmp_path / "weights" / "v2").is_dir() and (tmp_path / "weights" / "d2").is_dir()
    await assert_bit_exact(trainer, [a, b, c, d], 2)


async def test_a_delta_not_smaller_than_delta_max_share_goes_full(start_engine, make_trainer, tmp_path: Path) -> None:
    engine = await start_engine(dtype="float32")  # sync_dtype auto: float32, where every weight changes each step
    trainer = make_trainer([engine.url], delta_full_every=0)
    await trainer._publish_weights(0)
    step(trainer, 1)
    phases = await trainer._publish_weights(1)
    assert phases["delta"] == 0 and phases["full_engines"] == 1 and phases["delta_share"] > 0.5, phases
    assert engine.server.control_calls["/rollq/prepare_weights"] == 0
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v0", "v1"]
    await assert_bit_exact(trainer, [engine], 1)
    # while deltas stay too large they are taken less and less often (1 update skipped, then 3, ...): encoding one
    # costs seconds on a large fp32 model, for nothing
    assert trainer.delta is not None and trainer.delta.deltas_taken == 1
    taken = []
    for version in range(2, 7):
        step(trainer, version)
        phases = await trainer._publish_weights(version)
        assert phases["delta"] == 0 and phases["delta_share"] > 0.5, phases
        taken.append(trainer.delta.deltas_taken)
    assert taken == [1, 2, 2, 2, 2]  # v2 skipped, v3 taken (too large again), v4-v6 skipped
    await assert_bit_exact(trainer, [engine], 6)


async def test_delta_full_every_and_delta_sync_off_send_the_full_weights(
    start_engine, make_trainer, tmp_path: Path
) -> None:
    from rollq.engine.weight_delta import checksum

    engine = await start_engine()
    trainer = make_trainer([engine.url], delta_full_every=2)
    sent = []
    for version in range(4):
        step(trainer, version)
        sent.append((await trainer._publish_weights(version))["delta"])
    assert sent == [0, 1, 0, 1]  # full at 0 (the first), at 2 (every 2), deltas between
    await assert_bit_exact(trainer, [engine], 3)

    off = await start_engine()
    trainer = make_trainer([off.url], delta_sync=False, weights="off")
    assert trainer.delta is None
    for version in range(2):
        step(trainer, version)
        phases = await trainer._publish_weights(version)
        assert phases["delta"] == 0 and phases["full_engines"] == 1 and phases["bytes_sent"] > 0, phases
    assert off.server.control_calls["/rollq/prepare_weights"] == 0
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == ["v0", "v1"]
    served = (await served_checksums(off, trainer))["checksums"]
    model = trainer.policy.model  # type: ignore[attr-defined]
    assert served == {n: checksum(p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()}


async def test_distributed_deltas_keep_engines_bit_exact(start_engine, make_trainer) -> None:
    a, b = await start_engine(), await start_engine()
    trainer = make_trainer([a.url, b.url], weight_sync="distributed", weight_sync_timeout_s=5.0, delta_full_every=0)
    assert (await trainer._publish_weights(0))["delta"] == 0
    await assert_bit_exact(trainer, [a, b], 0)
    for version in (1, 2):
        step(trainer, version)
        phases = await trainer._publish_weights(version)
        assert phases["delta"] == 1 and phases["full_engines"] == 0 and 0 < phases["delta_share"] < 0.5, phases
        await assert_bit_exact(trainer, [a, b], version)
    assert [e.server.control_calls["/rollq/swap_prepared_weights"] for e in (a, b)] == [2, 2]
    # an engine off the base: the whole group gets the full weights
    await trainer.pool.members[b.url].client._json("POST", "/update_weight_version", json={"new_version": "7"})
    step(trainer, 3)
    phases = await trainer._publish_weights(3)
    assert phases["delta"] == 0 and phases["full_engines"] == 2, phases
    await assert_bit_exact(trainer, [a, b], 3)
    await trainer.weight_sync.close()  # type: ignore[union-attr]


async def test_a_distributed_group_with_an_engine_that_cannot_prepare_gets_full_broadcasts(
    start_engine, make_trainer
) -> None:
    from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig

    engine = await start_engine()
    holds_none = await serve(SyntheticBackend(SyntheticConfig()), EngineServerConfig(port=0))  # as SGLang: 404
    try:
        trainer = make_trainer([engine.url, holds_none.url], weight_sync="distributed", weight_sync_timeout_s=20.0)
        sent = []
        for version in range(4):
            step(trainer, version)
            sent.append((await trainer._publish_weights(version))["delta"])
        assert sent == [0, 0, 0, 0]
        # asked once (it answered 404 after receiving the blob), never again: no delta is taken for such a group
        assert holds_none.server.control_calls["/rollq/prepare_weights"] == 1
        await assert_bit_exact(trainer, [engine], 3)
        await trainer.weight_sync.close()  # type: ignore[union-attr]
    finally:
        await holds_none.close()


@pytest.mark.slow
@pytest.mark.scenario
async def test_many_updates_stay_bit_exact_with_an_engine_sigkilled_mid_swap_and_restarted(
    make_trainer, tmp_path: Path, tiny_dir
) -> None:
    """Two `rollq engine` processes serving bfloat16; one stops halfway through each weight load while
    `hold/release` is missing (its fault hook): at update 4 it is SIGKILLed there, half of its tensors new, then
    restarted on its port. It gets the full weights once, then deltas again; both engines match the trainer's
    snapshot bit for bit after every one of 12 updates."""
    import sys

    from rollq.local import Processes, free_port
    from tests.helpers import REPO_ROOT, engine_healthy, wait_until

    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "release").touch()
    procs = Processes(tmp_path, cwd=REPO_ROOT)
    ports = [free_port(), free_port()]

    async def start(i: int) -> Any:
        argv = [sys.executable, "-m", "rollq.engine", "--backend", "reference", "--model", "tiny", "--dtype"]
        argv += ["bfloat16", "--port", str(ports[i]), "--insecure-no-auth", "--weights-root", str(tmp_path)]
        argv += ["--fault", f"hold_load:{hold}"] if i == 1 else []
        proc = procs.start(f"engine-{i}", argv)
        url = f"http://127.0.0.1:{ports[i]}"
        await procs.wait_until(lambda: engine_healthy(url), 90, f"{url} healthy", watch=proc, interval_s=0.05)
        return proc

    class Remote:  # what assert_bit_exact reads of an engine: its URL
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    try:
        held = [await start(0), await start(1)]
        engines = [Remote(p) for p in ports]
        trainer = make_trainer([e.url for e in engines], delta_full_every=0)
        kinds = []
        for version in range(12):
            step(trainer, version)
            if version != 4:
                phases = await trainer._publish_weights(version)
            else:  # B's swap holds halfway: SIGKILL it there
                (hold / "release").unlink()
                (hold / "holding").unlink(missing_ok=True)
                publishing = asyncio.create_task(trainer._publish_weights(version))
                await wait_until(lambda: (hold / "holding").exists(), 60, what="engine B to hold its load")
                procs.kill(held[1])
                phases = await asyncio.wait_for(publishing, 120)
                assert phases["full_engines"] == 0  # A swapped its delta in; B is dead
                (hold / "release").touch()
                held[1] = await start(1)
                kinds.append("killed")
                continue
            kinds.append("delta" if phases["delta"] else "full")
            if version == 5:
                assert phases["full_engines"] == 1, phases  # the restarted B: the full weights; A: the delta
            await assert_bit_exact(trainer, engines, version)  # type: ignore[arg-type]
        assert kinds == ["full", "delta", "delta", "delta", "killed", "delta", *["delta"] * 6], kinds
    finally:
        procs.stop_all(grace_s=0)


async def test_engines_that_cannot_prepare_over_disk_cost_no_delta(start_engine, make_trainer, tmp_path: Path) -> None:
    """An engine whose prepare answers 404 (here one holding no weights; plain SGLang without an agent alike) gets
    full updates; once no engine can prepare, no delta is taken or written, and no prepare is sent, until the engines
    are asked again (every DISK_REPROBE_EVERY updates)."""
    from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
    from rollq.trainer.delta_sync import DISK_REPROBE_EVERY

    backend = SyntheticBackend(SyntheticConfig())
    synthetic = await serve(backend, EngineServerConfig(port=0, weights_root=str(tmp_path)))
    try:
        trainer = make_trainer([synthetic.url], delta_full_every=0, delta_max_share=1.0)
        assert trainer.delta is not None
        for version in range(4):
            step(trainer, version)
            phases = await trainer._publish_weights(version)
            assert phases["delta"] == 0 and phases["full_engines"] == 1, phases
        assert trainer.delta.deltas_taken == 1  # at version 1, prepared and refused with 404: never again
        assert trainer.delta.no_disk_prepare == {synthetic.url}
        assert not list((tmp_path / "weights").glob("d*"))
        assert sorted(p.name for p in (tmp_path / "weights").glob("v*")) == ["v2", "v3"]
        step(trainer, DISK_REPROBE_EVERY)
        await trainer._publish_weights(DISK_REPROBE_EVERY)  # asked again: a delta taken and refused
        assert trainer.delta.deltas_taken == 2 and trainer.delta.no_disk_prepare == {synthetic.url}
    finally:
        await synthetic.close()


async def test_an_agent_that_cannot_prepare_is_not_asked_each_update(
    start_engine, make_trainer, tmp_path: Path, caplog
) -> None:
    """An engine whose agent URL answers 404 (a wrong or old agent) loads the trainer's full versions itself, and its
    agent is not asked again (neither for deltas nor for the full version) until the next re-probe."""
    import logging

    from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig

    engine = await start_engine()
    backend = SyntheticBackend(SyntheticConfig())
    not_an_agent = await serve(backend, EngineServerConfig(port=0, weights_root=str(tmp_path)))
    try:
        trainer = make_trainer([engine.url], delta_full_every=0, engine_agents={engine.url: not_an_agent.url})
        with caplog.at_level(logging.INFO, logger="rollq.trainer"):
            for version in range(5):
                step(trainer, version)
                phases = await trainer._publish_weights(version)
                assert phases["delta"] == 0 and phases["full_engines"] == 1, phases
        asked = [r for r in caplog.records if "did not take" in r.getMessage() or "cannot prepare" in r.getMessage()]
        assert len(asked) == 1, [r.getMessage() for r in asked]
        await assert_bit_exact(trainer, [engine], 4)
    finally:
        await not_an_agent.close()
