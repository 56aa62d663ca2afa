"""Checkpoints: model, optimizer and the trainer's own state in one file, replaced atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import torch

from rollq.trainer.settled import SettledGroups, TrainedPart


class TrainerState(msgspec.Struct, kw_only=True):
    """Everything besides model and optimizer that a restarted trainer needs to continue exactly."""

    run_id: str  # prefix of this run's group ids: groups of another run sharing the stream are not ours
    model: str = ""  # the base model trained (`tiny`, `smollm2` or a directory): its tokenizer goes with an export
    step: int = 0
    version: int = 0  # policy version = optimizer steps taken
    next_group: int = 0  # groups offered to the ledger so far; a restart re-offers from here
    unacked_groups: list[str] = []  # trained and checkpointed, not yet acked: a restart acks them, never retrains
    trained_samples: int = 0
    dropped: dict[str, int] = {}  # samples per drop reason, whole run
    staleness: dict[int, int] = {}  # trained samples per staleness, whole run
    settled: SettledGroups = msgspec.field(default_factory=SettledGroups)  # groups trained or dropped, by index
    split: dict[str, TrainedPart] = {}  # groups trained in part so far (split_groups), by group id


def save(path: Path, policy_state: dict[str, Any], state: TrainerState) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"policy": policy_state, "state": msgspec.to_builtins(state)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a crash leaves the previous checkpoint or this one, never half of one


def load(path: Path, device: str = "cpu") -> tuple[dict[str, Any], TrainerState] | None:
    if not path.exists():
        return None
    saved = torch.load(path, map_location=device, weights_only=False)
    return saved["policy"], msgspec.convert(saved["state"], TrainerState, strict=False)


__all__ = ["TrainerState", "load", "save"]
