"""What the Trainer (trainer/loop.py) and its checkpoints (trainer/checkpoint.py) use of the model they train: the
whole seam between rollq's queue side and a training loop.

rollq's own `Policy` (trainer/policy.py: decoupled PPO on a transformers model, on one rank or sharded over many)
is one implementation; `rollq.trainer.seam` provides another, which hands each batch to a training loop of the
user's and takes its weights back (docs/byo-trainer.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from rollq.trainer.batch import Batch
from rollq.trainer.metrics import TrainStats
from rollq.trainer.ranks import RankGroup


class TrainerPolicy(Protocol):
    """The trained policy as the Trainer drives it: one step per batch, then its weights for the engines, then (every
    `checkpoint_every` steps) its checkpoint beside the trainer's own state. Called from a worker thread of the
    trainer's event loop, one call at a time."""

    @property
    def ranks(self) -> RankGroup:
        """The trainer's processes: the Trainer runs on rank 0 (`leader`); a checkpoint records `world_size`."""
        ...

    @property
    def pad_id(self) -> int:
        """The token id that pads a batch's rows (Batch.input_ids)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids at or above this are dropped as `invalid` before they reach a batch."""
        ...

    @property
    def fused_prox(self) -> bool:
        """Whether rows can join a step while it trains (`join_late`): one optimizer step per batch, no dropout."""
        ...

    def train_step(self, batch: Batch, late: Callable[[], Batch | None] | None = None) -> TrainStats:
        """Train on `batch` (policy version v -> v + 1). `late` (join_late only) returns rows that join the step."""
        ...

    def save_weights(self, directory: Path) -> Path:
        """Write the current weights for the engines (weight_sync disk) into `directory`, atomically; returns the
        path the engines load (usually `directory`)."""
        ...

    def gather_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The current weights in buckets of about `bucket_bytes` (weight_sync distributed: each bucket is broadcast
        to the engines); closed when the update ends, possibly early."""
        ...

    def save_checkpoint(self, directory: Path) -> None:
        """Save what a restart needs besides the trainer's state (model, optimizer) into `directory`."""
        ...

    def load_checkpoint(self, directory: Path) -> None:
        """Load what `save_checkpoint` wrote into `directory`."""
        ...


__all__ = ["TrainerPolicy"]
