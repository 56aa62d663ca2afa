"""The decoupled PPO objective and the policy's micro-batched step."""

import torch

from rollq.trainer.loss import decoupled_ppo_loss

KW = {"clip_eps": 0.2, "behav_imp_cap": 5.0}


def test_on_policy_the_gradient_is_the_policy_gradient():
    logits = torch.tensor([[0.1, -0.3, 0.5]], requires_grad=True)
    logprobs = torch.log_softmax(logits, dim=-1)  # treat the 3 entries as 3 tokens' logprobs
    fixed = logprobs.detach()
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, sums = decoupled_ppo_loss(logprobs, fixed, fixed, adv, mask, **KW)
    loss.backward()
    expected = torch.autograd.grad(-(2.0 * torch.log_softmax(logits, -1) * mask).sum() / 2, logits)[0]
    assert torch.allclose(logits.grad, expected, atol=1e-6)
    assert sums.tokens == 2 and sums.clipped == 0 and sums.capped == 0 and abs(sums.importance - 2.0) < 1e-6


def test_a_ratio_beyond_the_clip_stops_the_gradient_in_the_advantage_direction():
    prox = torch.log(torch.tensor([[0.2, 0.2]]))
    logprobs = torch.log(torch.tensor([[0.3, 0.21]])).requires_grad_()  # ratios 1.5 (clipped) and 1.05
    loss, sums = decoupled_ppo_loss(logprobs, prox, prox, torch.tensor([1.0]), torch.ones(1, 2), **KW)
    loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] < 0
    assert sums.clipped == 1


def test_tokens_too_far_off_policy_are_left_out_and_never_nan():
    behav = torch.tensor([[-1.0, -1.0, -1e4]])  # token 2: pi_prox / pi_behav overflows
    prox = torch.tensor([[-1.0, 1.0 - 1.0, -1.0]])  # token 1: weight e^1 = 2.7 (kept); token 2 capped
    logprobs = prox.clone().requires_grad_()
    loss, sums = decoupled_ppo_loss(logprobs, prox, behav, torch.tensor([1.0]), torch.ones(1, 3), **KW)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 2] == 0 and sums.capped == 1
    assert abs(logprobs.grad[0, 1] / logprobs.grad[0, 0] - torch.e) < 1e-4  # importance-weighted
    behav_capped = torch.tensor([[-1.0, -3.0, -1.0]])  # weight e^2 = 7.4 > 5: out
    _, sums = decoupled_ppo_loss(prox, prox, behav_capped, torch.tensor([1.0]), torch.ones(1, 3), **KW)
    assert sums.capped == 1


def test_micro_batches_with_a_shared_denominator_add_up_to_the_whole_batch():
    torch.manual_seed(0)
    logprobs = torch.randn(4, 6).clamp(max=0)
    prox, behav = logprobs - 0.05 * torch.rand(4, 6), logprobs - 0.1 * torch.rand(4, 6)
    adv, mask = torch.randn(4), (torch.rand(4, 6) > 0.3).float()
    whole, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask, **KW)
    denominator = mask.sum()
    parts = [
        decoupled_ppo_loss(logprobs[r], prox[r], behav[r], adv[r], mask[r], denominator=denominator, **KW)[0]
        for r in ([0, 3], [1], [2])
    ]
    assert torch.allclose(sum(parts), whole, atol=1e-6)
