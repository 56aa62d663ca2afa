"""Bring your own trainer (rollq.trainer.seam): examples/plain_pytorch_trainer.py, a plain PyTorch loop, trains 3
steps against a real stack (Redis, a reference engine serving the tiny model, a rollq worker); each
publish returns with the engine serving exactly the loop's weights at the new version, nothing is trained twice,
and a second session on the same run resumes the loop's own model from rollq's checkpoint."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from collections.abc import Iterator
from types import ModuleType

import msgspec
import pytest
import torch

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.trainer import checkpoint, samples
from rollq.trainer.seam import RolloutSession
from tests.helpers import REPO_ROOT, running_worker, wait_until
from tests.trainer.helpers import WORKFLOW_KWARGS

STEPS, GROUP, GROUPS, ETA = 3, 2, 2, 1


def load_example() -> ModuleType:
    path = REPO_ROOT / "examples" / "plain_pytorch_trainer.py"
    spec = importlib.util.spec_from_file_location("plain_pytorch_trainer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run_steps(steps: Iterator, check, stop_after: int | None = None) -> list:
    """Drive the example's generator step by step (in a thread: its session blocks), `check` after each step, while
    the loop is paused between its publish and its next batch; closed after `stop_after` steps if given."""
    out = []
    try:
        while len(out) != stop_after and (step := await asyncio.to_thread(next, steps, None)) is not None:
            check(*step)
            out.append(step)
    finally:
        await asyncio.to_thread(steps.close)
    return out


@pytest.mark.slow
async def test_the_plain_pytorch_example_trains_through_the_seam(
    redis_url, run_name, tmp_path, make_train_config, auditor
):
    engine = await serve(
        ReferenceBackend(ReferenceConfig(model="tiny", max_running=8)),
        EngineServerConfig(port=0, weights_root=str(tmp_path)),
    )
    audit = await auditor(run_name)
    settings = dict(
        engine=[engine.url],
        group_size=GROUP,
        groups_per_step=GROUPS,
        max_staleness=ETA,
        workflow_kwargs=WORKFLOW_KWARGS,
    )
    example = load_example()

    def served_exactly(loss: float, record, model: torch.nn.Module) -> None:
        assert math.isfinite(loss)
        assert engine.server.weight_version == str(record.version)  # publish returned: the engine serves it
        served = dict(engine.server.backend.model.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(served[name], p.detach()), name

    async with (
        EnginePool(PoolConfig(urls=[engine.url])) as worker_pool,
        running_worker(redis_url, run_name, engine=worker_pool, concurrency=8),
    ):
        steps = await run_steps(example.train(make_train_config(steps=STEPS, **settings)), served_exactly)
        records = [record for _, record, _ in steps]
        assert [(r.step, r.version) for r in records] == [(1, 1), (2, 2), (3, 3)]
        assert all(r.samples == GROUP * GROUPS and r.staleness_max <= ETA for r in records)
        assert records[-1].train.loss == steps[-1][0]
        trained = [g for r in records for g in r.groups]
        await wait_until(lambda: audit.has(trained, GROUP), 20, what="the auditor to read every trained group")
        audit.check_trained(msgspec.to_builtins(records), group_size=GROUP, eta=ETA)  # each group once, in the bound
        saved = checkpoint.latest(tmp_path / "run")
        assert saved is not None and checkpoint.read_state(saved).step == STEPS
        assert (saved / "model" / "state.pt").is_file()  # the loop's own checkpoint, inside rollq's

        # A second session on the run resumes at step 3 with the loop's model restored from rollq's checkpoint; the
        # loop leaves after one step, its next batch handed out (or on the way) and never published.
        second = example.train(make_train_config(steps=STEPS + 3, **settings))
        resumed = await run_steps(second, served_exactly, stop_after=1)
        assert [(r.step, r.version) for _, r, _ in resumed] == [(4, 4)]
        records += [record for _, record, _ in resumed]
        trained = [g for r in records for g in r.groups]
        await wait_until(lambda: audit.has(trained, GROUP), 20, what="the auditor to read every trained group")
        audit.check_trained(msgspec.to_builtins(records), group_size=GROUP, eta=ETA)
        saved = checkpoint.latest(tmp_path / "run")
        assert saved is not None and checkpoint.read_state(saved).step == STEPS + 1  # the unpublished batch: not in it
        optimizer = torch.load(saved / "model" / "state.pt")["optimizer"]
        assert {int(s["step"]) for s in optimizer["state"].values()} == {STEPS + 1}  # AdamW went on from step 3
        # decoded samples with the served model's tokenizer (the seam's policy has none), each step's 4 once
        lines = samples.read(tmp_path / "run" / samples.SAMPLES_FILE)
        assert [r.step for r in lines] == [step for step in range(1, STEPS + 2) for _ in range(4)]
        assert all("Write a number using digits only." in r.prompt for r in lines)
    await engine.close()


def test_a_session_refuses_what_it_cannot_keep(make_train_config, tmp_path):
    with pytest.raises(ValueError, match="join_late"):
        RolloutSession(make_train_config(join_late=True), {})
    with pytest.raises(ValueError, match="go together"):
        RolloutSession(make_train_config(), {}, save_checkpoint=lambda d: None)
    with pytest.raises(ValueError, match="does not exist"):
        RolloutSession(make_train_config(), tmp_path / "nowhere")
