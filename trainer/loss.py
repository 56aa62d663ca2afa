"""AReaL's decoupled PPO objective.

Samples come from a behaviour policy (the engines, up to eta versions old). The PPO ratio is taken against the
proximal policy (the trainer's weights at the start of the step, recomputed), and the off-policy gap behaviour ->
proximal is corrected by an importance weight pi_prox / pi_behav; tokens whose weight exceeds the cap are left out.
"""

from __future__ import annotations

import msgspec
import torch


class LossSums(msgspec.Struct, kw_only=True):
    """Per-token sums over the trained tokens of one micro-batch, to be added up over a step."""

    tokens: float = 0.0
    clipped: float = 0.0  # tokens whose ratio was clipped
    capped: float = 0.0  # tokens left out for an importance weight above the cap
    importance: float = 0.0  # sum of pi_prox / pi_behav

    def add(self, other: LossSums) -> None:
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    behav_imp_cap: float,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """Per-token tensors are [N, T], advantages [N]; mask is 1 on trained tokens. The loss is the sum over trained
    tokens divided by `denominator` (default: their count), so micro-batches of one minibatch add up to its mean."""
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - prox_logprobs)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    weight = torch.exp(prox_logprobs - behav_logprobs).detach()
    keep = mask * (weight <= behav_imp_cap).to(mask.dtype)
    kept_weight = torch.where(keep > 0, weight, torch.zeros_like(weight))  # an overflowing weight must not make NaN
    if denominator is None:
        denominator = mask.sum().clamp(min=1.0)
    loss = (pg * kept_weight).sum() / denominator
    with torch.no_grad():
        was_clipped = ((ratio - clipped).abs() > 1e-8).to(mask.dtype) * mask
        sums = LossSums(
            tokens=float(mask.sum()),
            clipped=float(was_clipped.sum()),
            capped=float((mask - keep).sum()),
            importance=float(kept_weight.sum()),
        )
    return loss, sums


__all__ = ["LossSums", "decoupled_ppo_loss"]
