"""The trained model: a decoupled-PPO step on the tiny model, micro-batching, weights for the engines."""

import msgspec
import torch

from rollq.trainer.batch import Group, build_batch
from rollq.trainer.config import TrainConfig
from rollq.trainer.policy import Policy
from tests.trainer.test_batch import traj


def batch_of_two(policy: Policy):
    prompt = policy.tokenizer.encode("Write a number using digits only.")
    good, bad = [prompt + [20, 21, 22], prompt + [300, 301, 302]]
    mask = [0] * len(prompt) + [1, 1, 1]
    with torch.no_grad():
        behav = [
            policy.token_logprobs(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0].tolist()
            for s in (good, bad)
        ]
    samples = []
    for i, (ids, lp, reward) in enumerate(((good, behav[0], 1.0), (bad, behav[1], 0.0))):
        t = traj("g", i, ids, mask, [0] * len(ids), reward)
        t.sequences[0].logprobs = type(t.sequences[0].logprobs)([0.0] + lp)  # on-policy behaviour logprobs
        samples.append(t)
    return build_batch([Group(job_id="g", samples=samples)], policy.pad_id)


def test_a_step_moves_probability_towards_the_better_sample():
    policy = Policy(TrainConfig(lr=1e-2))
    batch = batch_of_two(policy)
    before = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    stats = policy.train_step(batch)
    after = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    gain = ((after - before) * batch.loss_mask).sum(dim=1)
    assert gain[0] > 0 > gain[1]
    assert stats.capped_fraction == 0 and abs(stats.importance_mean - 1) < 1e-3 and stats.grad_norm > 0


def test_micro_batching_changes_the_cost_not_the_update():
    whole, split = (
        Policy(TrainConfig(max_tokens_per_microbatch=1 << 20)),
        Policy(TrainConfig(max_tokens_per_microbatch=8)),
    )
    batch = batch_of_two(whole)
    whole.train_step(batch)
    split.train_step(batch)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_weights_are_written_for_the_engines_and_load_back(tmp_path):
    from transformers import AutoModelForCausalLM

    policy = Policy(TrainConfig())
    with torch.no_grad():
        next(policy.model.parameters()).add_(0.5)
    out = policy.save_weights(tmp_path / "weights" / "v3")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not list((tmp_path / "weights").glob("*.tmp"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for (name, a), (_, b) in zip(policy.model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    state = policy.state()
    other = Policy(msgspec.structs.replace(TrainConfig(), seed=1))
    other.load_state(state)
    assert torch.equal(next(other.model.parameters()), next(policy.model.parameters()))


def test_a_bfloat16_compute_step_learns_the_same_direction_with_float32_weights():
    policy = Policy(TrainConfig(lr=1e-2, compute_dtype="bfloat16"))  # autocast on CPU; on a GPU the same path
    batch = batch_of_two(policy)
    before = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    assert before.dtype == torch.float32
    policy.train_step(batch)
    after = policy.token_logprobs(batch.input_ids, batch.attention_mask).detach()
    gain = ((after - before) * batch.loss_mask).sum(dim=1)
    assert gain[0] > 0 > gain[1]
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # master weights stay float32
