"""A LoRA run serving versioned adapters (`lora_publish: adapter`): each version's adapter is loaded on the engine
beside the previous ones and groups name the version they were admitted under. No pause, flush or full-weight call
ever reaches the engine (its own count of control calls), the engine serves exactly the trainer's adapter, and every
trained token's version is the adapter that generated it, within the staleness bound (the auditor)."""

from __future__ import annotations

import io

import msgspec
import pytest
import torch

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.protocol.messages import Trajectory
from rollq.trainer import samples
from rollq.trainer.batch import trained_versions
from rollq.trainer.feeder import adapter_name
from rollq.trainer.loop import Trainer
from rollq.trainer.policy import Policy
from tests.trainer.helpers import WORKFLOW_KWARGS

pytestmark = pytest.mark.slow

STEPS, GROUP, GROUPS, ETA = 4, 4, 2, 1
NEVER = ("/pause_generation", "/continue_generation", "/update_weights_from_disk", "/flush_cache")


async def test_a_lora_run_loads_versioned_adapters_and_never_pauses_the_engine(
    redis, redis_url, run_name, tmp_path, make_train_config, spawn_worker, auditor
):
    engine = await serve(
        ReferenceBackend(ReferenceConfig(model="tiny", max_running=16)),
        EngineServerConfig(port=0, enable_lora=True, weights_root=str(tmp_path)),
    )
    audit = await auditor(run_name)
    spawn_worker(redis_url, run_name, "--concurrency", "8", "--engine", engine.url)
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text('{"prompt": "Write a number using digits only."}\n' * 2)
    cfg = make_train_config(
        engine=[engine.url],
        steps=STEPS,
        group_size=GROUP,
        groups_per_step=GROUPS,
        max_staleness=ETA,
        lora_rank=4,
        lr=5e-2,
        eval_dataset=str(held_out),
        eval_every=0,  # before the first step and after the last
        workflow_kwargs={**WORKFLOW_KWARGS, "max_new_tokens": 8},
    )
    policy = Policy(cfg)
    pool = EnginePool(PoolConfig(urls=[engine.url]))
    try:
        trainer = Trainer(cfg, redis, pool, progress=io.StringIO(), policy=policy)
        msgspec.to_builtins(await trainer.run())
        calls = engine.server.control_calls
        assert not any(calls[route] for route in NEVER), dict(calls)
        assert calls["/load_lora_adapter"] == STEPS  # versions 1..STEPS; version 0 is the base model
        # and the metrics say so: no step paused generation, each published its adapter (issue 46: pause_s was the
        # publish cycle, so a dashboard showed pauses a LoRA run never makes)
        steps = [msgspec.json.decode(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
        assert [r["pause_s"] for r in steps] == [0.0] * STEPS
        assert all(r["publish_s"] > 0 for r in steps), [r["publish_s"] for r in steps]
        assert {(r["sync"], r["aborted_requests"], r["retracted_requests"]) for r in steps} == {("adapter", 0, 0)}
        assert engine.server.weight_version == "default"  # the base weights never changed
        assert adapter_name(run_name, STEPS) in engine.server.adapters
        assert adapter_name(run_name, 1) not in engine.server.adapters  # outside the window: unloaded

        # the engine serves exactly the trainer's adapter: the logprobs of the policy for what it generates
        prompt = policy.tokenizer.encode("Write a number using digits only.")
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
            "lora_path": adapter_name(run_name, STEPS),
        }
        client = pool.engines()[0].client
        out = await client._json_object("POST", "/generate", json=body)
        ids = prompt + out["output_ids"]
        with torch.no_grad():
            want = policy.token_logprobs(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want[len(prompt) - 1 :].tolist(), abs=1e-4)

        records = await audit.check_run(
            tmp_path / "run" / "metrics.jsonl", steps=STEPS, group_size=GROUP, groups_per_step=GROUPS, eta=ETA
        )
        # every sample's tokens carry the one adapter version its group was admitted under (the engine's own
        # weight_version stayed "default": stamping by it would have given -1 and nothing would have trained)
        trained: list[Trajectory] = [t for r in records for g in r["groups"] for t in audit.seen[g]]
        group_versions = {}
        for t in trained:
            versions = {int(v) for s in t.sequences for v in trained_versions(s)}
            assert len(versions) == 1, (t.job_id, versions)
            assert group_versions.setdefault(t.job_id, versions) == versions, t.job_id
        assert max(v for vs in group_versions.values() for v in vs) >= 1  # groups generated with adapters
        evals = [msgspec.json.decode(line) for line in (tmp_path / "run" / "eval.jsonl").read_bytes().splitlines()]
        # the last evaluation ran on the last version's adapter (the first on the base: this engine's "default")
        assert [e["step"] for e in evals] == [0, STEPS] and evals[-1]["token_versions"] == [STEPS]
        # decoded samples of every step (the defaults: 4 each), the adapter's completions as the tokenizer reads them
        lines = samples.read(tmp_path / "run" / samples.SAMPLES_FILE)
        assert [r.step for r in lines] == [step for step in range(1, STEPS + 1) for _ in range(4)]
        for r in lines:
            [t] = [t for t in audit.seen[r.group] if t.sample_index == r.sample_index]
            ids = list(t.sequences[0].input_ids)
            assert r.prompt + r.completion == policy.tokenizer.decode(ids) and r.completion_tokens > 0
    finally:
        await pool.close()
        await engine.close()
