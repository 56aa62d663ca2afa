"""AReaL's decoupled PPO objective.

Samples come from a behaviour policy (the engines, possibly several versions old). The PPO ratio is taken against
the proximal policy (the trainer's weights at the start of the step, recomputed), and the off-policy gap
behaviour -> proximal is corrected by an importance weight; tokens whose weight exceeds the cap are left out.
"""

from __future__ import annotations

import msgspec
import torch


class LossStats(msgspec.Struct, kw_only=True):
    loss: float
    clip_fraction: float
    capped_fraction: float  # tokens dropped for an importance weight above the cap
    importance_mean: float


def decoupled_ppo_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float, behav_imp_cap: float,
                       ) -> tuple[torch.Tensor, LossStats]:
    """All [N, T] except advantages [N]; mask is 1 on trained tokens. Returns the loss (mean over trained tokens)."""
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - prox_logprobs)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    weight = torch.exp(prox_logprobs - behav_logprobs)
    keep = mask * (weight <= behav_imp_cap).float()
    denom = mask.sum().clamp(min=1.0)
    loss = (pg * weight.detach() * keep).sum() / denom
    with torch.no_grad():
        stats = LossStats(
            loss=float(loss.item()),
            clip_fraction=float((((ratio - clipped).abs() > 1e-8).float() * mask).sum() / denom),
            capped_fraction=float(((mask - keep).sum() / denom).item()),
            importance_mean=float(((weight * mask).sum() / denom).item()),
        )
    return loss, stats


__all__ = ["LossStats", "decoupled_ppo_loss"]
