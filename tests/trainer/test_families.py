"""The trainer on each architecture family of tests/families.py (tiny random-weight models built from transformers'
own config classes): two steps of full fine-tuning and two of LoRA, each exported by `rollq export`'s writer
(trainer/hf_export.py) into a directory plain transformers loads to the trainer's logits; LoRA's `all-linear` on the
MoE families adapts their linear layers only (issue 42's E3: not the router or the fused experts, which no engine
serves in mixed batches); and on the windowed families the trainer's logprobs of sequences longer than the window
are transformers' own.

CI runs one dense family (llama), Gemma 2 (logit softcapping, so eager attention, and a windowed layer) and one MoE
family (qwen3_moe), and the logprobs of all three windowed families; the other families are a scenario (`-m
scenario`, the loop in CONTRIBUTING.md). The 2-rank half is in tests/trainer/test_ranks.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch

from rollq.trainer import checkpoint, lora
from rollq.trainer.checkpoint import TrainerState
from rollq.trainer.config import TrainConfig
from rollq.trainer.hf_export import export_run
from rollq.trainer.policy import Policy
from tests.families import FAMILIES, MOE, WINDOW, WINDOWED, build_family
from tests.trainer.test_policy import batch_of_two

CI = ("llama", "gemma2", "qwen3_moe")
LORA = {"lora_rank": 4, "lora_alpha": 8, "lr": 5e-2}
# W + s B A in one matrix rounds otherwise than W x + s B (A x); these models' logits run to about 10
MERGED_ATOL = 1e-4
ROWS = (3 * WINDOW, 2 * WINDOW + 5, WINDOW + 4)  # token counts of the rows compared: each past the window


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: torch's second thread only waits, and on a loaded 2-core machine (CI's four test
    processes) its spinning made these tests 5-15x slower (linear layers of 28 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def matrix(names: tuple[str, ...]) -> list:
    """`names` as parameters, those CI leaves out marked `scenario`."""
    return [pytest.param(n, marks=() if n in CI else pytest.mark.scenario) for n in names]


def long_ids(policy: Policy, n: int = ROWS[0], seed: int = 0) -> torch.Tensor:
    """One row of `n` token ids (ordinary tokens, no pad), longer than the window."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, policy.vocab_size, (1, n), generator=g)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def plain(directory: Path, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **config).eval()


def two_steps(policy: Policy) -> list[float]:
    """Two steps on the toy group (a better and a worse answer): the first moves probability towards the better."""
    batch = batch_of_two(policy)
    before = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    losses = [policy.train_step(batch).loss]
    after = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    gain = ((after - before) * batch.loss_mask).sum(dim=1)
    assert gain[0] > 0 > gain[1], gain
    losses.append(policy.train_step(batch).loss)
    assert all(math.isfinite(x) for x in losses), losses
    return losses


@pytest.mark.parametrize("family", matrix(tuple(FAMILIES)))
def test_two_steps_train_and_the_export_loads_in_transformers_as_the_trained_model(family, tmp_path):
    directory = build_family(family)
    policy = Policy(TrainConfig(model=str(directory), lr=1e-2))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    two_steps(policy)
    moved = [n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) >= 0.9 * len(before), sorted(set(before) - set(moved))

    checkpoint.save(tmp_path / "run", policy, TrainerState(run_id="x", model=str(directory), step=2, version=2))
    exported = export_run(tmp_path / "run", tmp_path / "export")
    ids = long_ids(policy)
    want = logits(policy.model, ids)
    assert torch.allclose(logits(plain(exported), ids), want, atol=1e-5)
    assert not torch.allclose(logits(plain(directory), ids), want, atol=1e-3)  # it trained: the check can fail


@pytest.mark.parametrize("family", matrix(tuple(FAMILIES)))
def test_two_lora_steps_train_the_adapter_of_the_linear_layers_and_both_exports_load(family, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    directory = build_family(family)
    policy = Policy(TrainConfig(model=str(directory), **LORA))
    base = lora.base_model(policy.model)
    adapted = sorted(n for n, m in base.named_modules() if isinstance(m, LoraLayer))
    assert adapted == lora.linear_targets(plain(directory))  # all-linear: the linear layers, nothing else (E3)
    assert lora.parameter_targets(base) == []
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    two_steps(policy)
    for name, p in policy.model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    moved = [n for n, p in policy.model.named_parameters() if n in adapter and not torch.equal(p, adapter[n])]
    assert len(moved) == len(adapter), sorted(set(adapter) - set(moved))

    checkpoint.save(tmp_path / "run", policy, TrainerState(run_id="x", model=str(directory), step=2, version=2))
    ids = long_ids(policy)
    want = logits(policy.model, ids)
    merged = export_run(tmp_path / "run", tmp_path / "merged", merged=True)
    assert torch.allclose(logits(plain(merged), ids), want, atol=MERGED_ATOL)
    as_adapter = export_run(tmp_path / "run", tmp_path / "adapter")
    assert torch.allclose(logits(PeftModel.from_pretrained(plain(directory), as_adapter), ids), want, atol=1e-5)
    assert not torch.allclose(logits(plain(directory), ids), want, atol=1e-3)


# The router and the experts under the names peft maps onto them (transformers 4's: peft 0.21.2,
# utils/transformers_weight_conversion.py:331-344): Parameters on transformers 5, adapted as lora.ParamWrapper.
DIRECT = {"mixtral": ["q_proj", "gate", "w2"], "qwen3_moe": ["q_proj", "gate", "down_proj"]}


@pytest.mark.parametrize("family", matrix(MOE))
def test_all_linear_on_a_moe_leaves_out_the_router_and_experts_peft_would_wrap(family):
    """peft's own all-linear wraps a transformers-5 MoE's router and fused experts as ParamWrapper (what E3 hit);
    the trainer's adapts the same linear layers and nothing else."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear

    directory = build_family(family)
    stock = get_peft_model(plain(directory), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    wrapped = lora.parameter_targets(lora.base_model(stock))
    assert {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name in wrapped} == {
        "gate.weight",
        "experts.gate_up_proj",
        "experts.down_proj",
    }
    ours = lora.base_model(Policy(TrainConfig(model=str(directory), **LORA)).model)
    assert lora.parameter_targets(ours) == []

    def linear(model) -> list[str]:
        return sorted(n for n, m in model.named_modules() if isinstance(m, Linear))

    assert linear(ours) == linear(lora.base_model(stock))


@pytest.mark.parametrize("family", matrix(MOE))
def test_router_or_expert_targets_are_refused_for_adapters_and_merged_into_full_weights(family, tmp_path):
    directory = build_family(family)
    named = TrainConfig(model=str(directory), lora_target_modules=DIRECT[family], **LORA)
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight.*as Parameters \(lora\.ParamWrapper") as refused:
        Policy(named)
    assert "lora_publish merged" in str(refused.value)

    policy = Policy(msgspec.structs.replace(named, lora_publish="merged"))
    assert len(lora.parameter_targets(lora.base_model(policy.model))) == 2 * 2  # router and experts, 2 layers
    two_steps(policy)
    ids = long_ids(policy)
    want = logits(policy.model, ids)
    served = policy.save_weights(tmp_path / "merged")  # what the engines get: every delta merged, ParamWrapper's too
    assert torch.allclose(logits(plain(served), ids), want, atol=MERGED_ATOL)
    assert not torch.allclose(logits(plain(directory), ids), want, atol=1e-3)


@pytest.mark.parametrize("family", WINDOWED)  # all three in CI: a few tenths of a second each
def test_the_trainers_logprobs_past_the_sliding_window_are_transformers_own(family):
    """A padded batch of rows longer than the window, through the trainer, against transformers' forward of each row
    alone; the same weights without a window differ past it (so a window left out would fail this)."""
    directory = build_family(family)
    policy = Policy(TrainConfig(model=str(directory)))
    if family == "gemma2":  # softcapping: SDPA cannot (transformers' _supports_sdpa = False, modeling_gemma2.py:353)
        assert policy.model.config._attn_implementation == "eager"
    rows = [long_ids(policy, n, seed=i)[0] for i, n in enumerate(ROWS)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), policy.pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = r, 1
    with torch.no_grad():
        got = policy.token_logprobs(ids, attn)

    def own(model, row: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits(model, row[None])[0, :-1], dim=-1)
        return lp.gather(-1, row[1:, None])[:, 0]

    windowed, unwindowed = plain(directory), plain(directory, sliding_window=4 * width)
    for i, r in enumerate(rows):
        want = own(windowed, r)
        assert torch.allclose(got[i, : len(r) - 1], want, atol=1e-5), (
            i,
            float((got[i, : len(r) - 1] - want).abs().max()),
        )
        full = own(unwindowed, r)
        assert torch.allclose(full[: WINDOW - 1], want[: WINDOW - 1], atol=1e-5)  # inside the window: the same
        assert float((full[WINDOW:] - want[WINDOW:]).abs().max()) > 1e-2  # past it the window matters
