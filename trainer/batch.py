"""Completed groups -> one padded training batch, with GRPO's group-normalised advantages."""

from __future__ import annotations

import msgspec
import torch

from protocol.messages import Trajectory


class Group(msgspec.Struct, kw_only=True):
    """The n samples of one prompt; admitted, trained and dropped as one unit."""

    job_id: str
    samples: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        """The oldest policy version behind any trained token (-1 if an engine reported none)."""
        oldest = None
        for traj in self.samples:
            for seq in traj.sequences:
                for v, m in zip(seq.versions, seq.loss_mask):
                    if m and (oldest is None or v < oldest):
                        oldest = v
        return -1 if oldest is None else oldest

    @property
    def ok(self) -> bool:
        return all(t.status == "ok" and t.sequences for t in self.samples)


class Batch(msgspec.Struct, kw_only=True):
    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T-1], aligned with the predicted tokens input_ids[:, 1:]
    behav_logprobs: torch.Tensor  # [N, T-1]
    versions: torch.Tensor  # [N, T-1]
    advantages: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N]

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) within the group; a group with equal rewards teaches nothing (all zero)."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def build_batch(groups: list[Group], pad_id: int = 0) -> Batch:
    rows: list[tuple[list[int], list[int], list[float], list[int]]] = []
    advantages: list[torch.Tensor] = []
    rewards: list[float] = []
    for group in groups:
        seqs = [s for t in group.samples for s in t.sequences]
        r = torch.tensor([s.reward for s in seqs], dtype=torch.float32)
        advantages.append(grpo_advantages(r))
        rewards += r.tolist()
        rows += [(list(s.input_ids), list(s.loss_mask), list(s.logprobs), list(s.versions)) for s in seqs]
    width = max(len(ids) for ids, *_ in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    behav = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for i, (ids, m, lp, v) in enumerate(rows):
        k = len(ids)
        input_ids[i, :k] = torch.tensor(ids)
        attention[i, :k] = 1
        mask[i, :k] = torch.tensor(m, dtype=torch.float32)
        behav[i, :k] = torch.tensor(lp, dtype=torch.float32)
        versions[i, :k] = torch.tensor(v)
    # Token t is predicted from position t-1: drop the first column of the per-token arrays.
    return Batch(input_ids=input_ids, attention_mask=attention, loss_mask=mask[:, 1:], behav_logprobs=behav[:, 1:],
                 versions=versions[:, 1:], advantages=torch.cat(advantages), rewards=torch.tensor(rewards))


__all__ = ["Batch", "Group", "build_batch", "grpo_advantages"]
