"""Groups of trajectories -> one padded training batch, with GRPO's group-normalised advantages."""

from __future__ import annotations

import array

import msgspec
import numpy as np
import torch

from rollq.protocol.codec import Codec
from rollq.protocol.messages import Sequence, Trajectory, VisionInputs


def _column(values, dtype: str) -> np.ndarray:
    """A per-token column as numpy: zero-copy for the decoded typed arrays, converted for plain lists."""
    if isinstance(values, array.array) and len(values):
        return np.frombuffer(values, dtype=dtype)
    return np.asarray(values, dtype=dtype)


def trained_versions(seq: Sequence) -> np.ndarray:
    """Policy versions of the tokens the loss trains on (loss_mask 1)."""
    return _column(seq.versions, "<i4")[_column(seq.loss_mask, "u1").astype(bool)]


def model_tokens(traj: Trajectory) -> int:
    """Tokens of a trajectory the model generated (loss_mask 1)."""
    return sum(int(_column(s.loss_mask, "u1").sum()) for s in traj.sequences)


class Group(msgspec.Struct, kw_only=True):
    """The n samples of one prompt: admitted, trained and dropped as one unit (or, split, in parts: see
    `context_rewards`)."""

    job_id: str
    samples: list[Trajectory]
    # Rewards of the group's sequences trained at earlier steps (split_groups): they join the advantages'
    # normalisation, so a group's last part is normalised over the whole group, but are not trained again.
    context_rewards: list[float] = []

    @property
    def ok(self) -> bool:
        return all(t.status == "ok" and t.sequences for t in self.samples)

    def version_range(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version behind any trained token; None when nothing is trained."""
        columns = [trained_versions(s) for t in self.samples for s in t.sequences]
        columns = [c for c in columns if c.size]
        if not columns:
            return None
        joined = np.concatenate(columns)
        return int(joined.min()), int(joined.max())

    def invalid(self, vocab_size: int, takes_images: bool = False, image_token_id: int | None = None) -> str | None:
        """Why these sequences can't be trained by a model of `vocab_size` tokens, with or without a vision tower
        (None: they can); with `image_token_id`, image tokens that the sequence's images don't account for (a
        forward would fail on them)."""
        for t in self.samples:
            for s in t.sequences:
                ids = _column(s.input_ids, "<i4")
                if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    return f"token ids outside the model's vocabulary [0, {vocab_size})"
                if ids.size < 2:
                    return "a sequence needs at least 2 tokens"
                if s.vision is not None and not takes_images:  # never the text alone: the logprobs were of both
                    return "it has images, and the trainer's model takes none"
                if s.vision is not None and s.vision.inline is None:
                    return "its images were not read from the blob store"
                if image_token_id is not None:
                    slots = int((ids == image_token_id).sum())
                    inline = s.vision.inline if s.vision else None
                    filled = sum(Codec().decode(inline, VisionInputs).mm_token_type_ids) if inline is not None else 0
                    if slots != filled:
                        return f"{slots} image tokens where its images fill {filled}"
        return None

    @property
    def model_tokens(self) -> int:
        return sum(map(model_tokens, self.samples))

    @property
    def rewards(self) -> list[float]:
        """What the advantages are normalised over: the earlier parts' rewards, then each sequence's."""
        return [*self.context_rewards, *(s.reward for t in self.samples for s in t.sequences)]

    @property
    def uniform(self) -> bool:
        """All of at least two rewards equal: every advantage is zero, so training the group changes nothing (what
        DAPO's dynamic sampling filters out). A lone reward is not `uniform`: it would be filtered every time."""
        rewards = self.rewards
        return len(rewards) >= 2 and min(rewards) == max(rewards)


class Batch(msgspec.Struct, kw_only=True):
    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T-1], aligned with the predicted tokens input_ids[:, 1:]
    behav_logprobs: torch.Tensor  # [N, T-1]
    versions: torch.Tensor  # [N, T-1]
    advantages: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N]
    masked_tokens: int = 0  # generated tokens left out of the loss as older than `min_version`
    group_ids: list[str] = []  # [N] the group (prompt) of each row (rollq.trainer.seam hands them out)
    vision: list[VisionInputs | None] = []  # [N] each row's images (a vision-language model's), or [] for none

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def micro_batches(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """`rows` split into micro-batches of similar length whose padded size (rows x longest) stays within
    `max_tokens` (a longer row goes alone): padding to the batch's longest sequence would multiply the compute on
    long-tailed lengths."""
    out: list[list[int]] = []
    current: list[int] = []
    for i in sorted(rows, key=lambda r: lengths[r]):
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, std_norm: bool = True) -> torch.Tensor:
    """(r - mean) / (std + eps) within the group, or r - mean without `std_norm` (Dr. GRPO; verl's
    `norm_adv_by_std_in_grpo=False`); a group whose rewards are all equal teaches nothing (all zero)."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if std_norm else centred


def build_batch(groups: list[Group], pad_id: int = 0, min_version: int | None = None, std_norm: bool = True) -> Batch:
    """One row per sequence. A sample with several sequences (an agent's completions) shares its group's
    normalisation: the advantage is computed over every sequence of the group, and over its `context_rewards` (parts
    trained earlier). With `min_version`, generated tokens of an older policy version are left out of the loss
    (counted in `masked_tokens`). `std_norm`: see grpo_advantages."""
    seqs: list[Sequence] = []
    group_ids: list[str] = []
    advantages: list[torch.Tensor] = []
    for group in groups:
        members = [s for t in group.samples for s in t.sequences]
        rewards = torch.tensor([*group.context_rewards, *(s.reward for s in members)], dtype=torch.float32)
        advantages.append(grpo_advantages(rewards, std_norm=std_norm)[len(group.context_rewards) :])
        seqs += members
        group_ids += [group.job_id] * len(members)
    if not seqs:
        raise ValueError("build_batch needs at least one sequence")
    width = max(len(s.input_ids) for s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    behav = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        k = len(s.input_ids)
        input_ids[i, :k] = torch.from_numpy(_column(s.input_ids, "<i4").astype(np.int64))
        attention[i, :k] = 1
        mask[i, :k] = torch.from_numpy(_column(s.loss_mask, "u1").astype(np.float32))
        behav[i, :k] = torch.from_numpy(_column(s.logprobs, "<f4").copy())
        versions[i, :k] = torch.from_numpy(_column(s.versions, "<i4").astype(np.int64))
    codec = Codec()
    vision = [_vision_of(s, codec) for s in seqs]
    masked = 0
    if min_version is not None:
        old = (mask > 0) & (versions < min_version)
        masked = int(old.sum().item())
        mask[old] = 0.0
    # Token t is predicted at position t-1: the per-token columns drop their first entry.
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=mask[:, 1:],
        behav_logprobs=behav[:, 1:],
        versions=versions[:, 1:],
        advantages=torch.cat(advantages),
        rewards=torch.tensor([s.reward for s in seqs], dtype=torch.float32),
        masked_tokens=masked,
        group_ids=group_ids,
        vision=vision if any(v is not None for v in vision) else [],
    )


def _vision_of(seq: Sequence, codec: Codec) -> VisionInputs | None:
    """A sequence's images, decoded (the collector has read the stored ones: every ref is inline here)."""
    if seq.vision is None:
        return None
    if seq.vision.inline is None:
        raise ValueError("a sequence's images were not read from the blob store")
    vision = codec.decode(seq.vision.inline, VisionInputs)
    if len(vision.mm_token_type_ids) != len(seq.input_ids):
        raise ValueError(f"mm_token_type_ids has {len(vision.mm_token_type_ids)} entries for {len(seq.input_ids)} ids")
    return vision


__all__ = ["Batch", "Group", "build_batch", "grpo_advantages", "micro_batches", "model_tokens", "trained_versions"]
