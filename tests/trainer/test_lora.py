"""LoRA training (trainer/lora.py) on the tiny model, checked against peft itself: the base stays frozen, only the
adapter is optimised and checkpointed, and what leaves the trainer (PEFT's adapter format, merged weights) is what
peft and transformers read back to the same model."""

import json

import msgspec
import pytest
import torch

from rollq.trainer import checkpoint
from rollq.trainer.checkpoint import TrainerState
from rollq.trainer.config import LORA_LR, LORA_STEPS, TrainConfig
from rollq.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_adapter
from rollq.trainer.policy import Policy
from tests.trainer.test_policy import batch_of_two

LORA = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2)


def base_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}


def test_a_lora_step_moves_the_adapter_only_and_towards_the_better_sample():
    policy = Policy(LORA)
    assert policy.params and all("lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in policy.params) < 0.2 * sum(p.numel() for p in policy.model.parameters())
    frozen = base_weights(policy)
    batch = batch_of_two(policy)
    before = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    stats = policy.train_step(batch)
    after = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    gain = ((after - before) * batch.loss_mask).sum(dim=1)
    assert gain[0] > 0 > gain[1] and stats.grad_norm > 0
    for name, p in policy.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, frozen[name]), name


def test_the_adapter_is_what_peft_loads_and_the_merged_weights_are_what_it_merges(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = Policy(LORA)
    batch = batch_of_two(policy)
    for _ in range(2):
        policy.train_step(batch)
    adapter = write_adapter(tmp_path / "adapter", policy.model)
    assert sorted(p.name for p in adapter.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

    expected = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    base = AutoModelForCausalLM.from_pretrained(policy.path, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        got = served(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    got = torch.log_softmax(got, -1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, expected, atol=1e-5)

    merged_dir = policy.save_weights(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    peft_merged = served.merge_and_unload()
    for (name, a), (_, b) in zip(merged.named_parameters(), peft_merged.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_lora_checkpoint_holds_the_adapter_alone_and_resumes_the_same_training(tmp_path):
    policy = Policy(LORA)
    batch = batch_of_two(policy)
    policy.train_step(batch)
    written = checkpoint.save(tmp_path, policy, TrainerState(run_id="x", step=1, version=1))
    full = tmp_path / "full"
    Policy(TrainConfig()).save_checkpoint(full)
    size = sum(p.stat().st_size for p in written.iterdir())
    assert size < 0.25 * sum(p.stat().st_size for p in full.iterdir())  # no base weights in it
    other = Policy(msgspec.structs.replace(LORA, seed=1))
    assert checkpoint.load(tmp_path, other) is not None
    for resumed in (policy, other):
        torch.manual_seed(7)  # the same split of the rows (the step's plan draws it), so the same sums
        resumed.train_step(batch)
    for (name, a), (_, b) in zip(policy.model.named_parameters(), other.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_lora_run_takes_the_lora_learning_rate_and_steps_unless_given():
    from rollq.config import build

    lora = build(TrainConfig, "trainer", {"lora_rank": 8})
    assert (lora.lr, lora.steps) == (LORA_LR, LORA_STEPS)
    given = build(TrainConfig, "trainer", {"lora_rank": 8, "lr": 3e-4, "steps": 9})
    assert (given.lr, given.steps) == (3e-4, 9)
    plain = build(TrainConfig, "trainer", {})
    assert (plain.lr, plain.steps) == (TrainConfig().lr, TrainConfig().steps) != (LORA_LR, LORA_STEPS)


def test_target_modules_the_model_lacks_are_a_clear_error():
    with pytest.raises(ValueError, match="lora_target_modules"):
        Policy(msgspec.structs.replace(LORA, lora_target_modules=["no_such_proj"]))


def test_export_writes_the_adapter_and_on_request_the_merged_model(tmp_path):
    """`rollq export` of a LoRA run: PEFT's adapter directory by default, which peft loads onto the base model to
    the trained policy; `--merged`, a plain model directory transformers loads to the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollq.trainer.hf_export import MARKER, ExportError, export_run

    policy = Policy(msgspec.structs.replace(LORA, lr=5e-2))
    batch = batch_of_two(policy)
    for _ in range(2):
        policy.train_step(batch)
    checkpoint.save(tmp_path / "run", policy, TrainerState(run_id="x", model="tiny", step=2, version=2))
    policy.model.eval()
    with torch.no_grad():
        want = policy.model(input_ids=batch.input_ids).logits

    adapter = export_run(tmp_path / "run", tmp_path / "adapter")
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER} <= {p.name for p in adapter.iterdir()}
    assert json.loads((adapter / MARKER).read_text())["lora"] == "adapter"
    base = AutoModelForCausalLM.from_pretrained(policy.path, dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=batch.input_ids).logits
        got = PeftModel.from_pretrained(base, adapter).eval()(input_ids=batch.input_ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(plain, want, atol=1e-3)

    merged = export_run(tmp_path / "run", tmp_path / "merged", merged=True)
    assert not (merged / ADAPTER_CONFIG).exists()
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(input_ids=batch.input_ids).logits
    assert torch.allclose(got, want, atol=1e-5)

    full = tmp_path / "full-run"
    checkpoint.save(full, Policy(TrainConfig()), TrainerState(run_id="x", model="tiny", step=1, version=1))
    with pytest.raises(ExportError, match="--merged is for a LoRA run"):
        export_run(full, tmp_path / "nope", merged=True)


def test_a_checkpoint_resumes_only_with_the_kind_of_training_it_holds(tmp_path):
    checkpoint.save(tmp_path / "lora", Policy(LORA), TrainerState(run_id="x", step=1, version=1))
    with pytest.raises(ValueError, match="holds a LoRA adapter, and this run has lora_rank 0"):
        checkpoint.load(tmp_path / "lora", Policy(TrainConfig()))
    checkpoint.save(tmp_path / "full", Policy(TrainConfig()), TrainerState(run_id="x", step=1, version=1))
    with pytest.raises(ValueError, match="holds full weights, and this run has lora_rank 4"):
        checkpoint.load(tmp_path / "full", Policy(LORA))
