"""Checkpoints: RUN_DIR/checkpoints/step-NNNNNNNN/ holds the model and optimizer as a distributed checkpoint (each
rank's shards, readable by any number of ranks) and the trainer's own state (`trainer_state.json`);
RUN_DIR/checkpoints/latest names the newest complete one.

`latest` is replaced atomically after everything else is on disk: a crash mid-save leaves the previous checkpoint in
force and a step directory nothing points to (removed by the next save). The previous checkpoint is kept besides the
latest; older ones go.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from rollq.trainer.settled import SettledGroups, TrainedPart

if TYPE_CHECKING:
    from rollq.trainer.policy_protocol import TrainerPolicy

CHECKPOINTS = "checkpoints"
LEGACY_FILE = "checkpoint.pt"  # the single-file checkpoint of rollq before sharded checkpoints: not read
LATEST = "latest"
STATE_FILE = "trainer_state.json"
KEEP = 2  # the latest and the one before it


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
    ranks: int = 1  # trainer ranks that wrote the checkpoint (any number can read it)


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint's directory, or None."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    directory = pointer.parent / pointer.read_text().strip()
    return directory if (directory / STATE_FILE).exists() else None


def save(run_dir: Path, policy: TrainerPolicy, state: TrainerState) -> Path:
    """Rank 0 (the other ranks write their shards when told, trainer/follower.py): the checkpoint of `state.step`."""
    root = Path(run_dir) / CHECKPOINTS
    directory = root / f"step-{state.step:08d}"
    shutil.rmtree(directory, ignore_errors=True)  # a save of this step a crash cut short
    directory.mkdir(parents=True)
    policy.save_checkpoint(directory)
    write_state(directory, msgspec.structs.replace(state, ranks=policy.ranks.world_size))
    tmp = root / (LATEST + ".tmp")
    _fsync_write(tmp, directory.name.encode())
    os.replace(tmp, root / LATEST)
    keep = {directory.name}
    for old in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        if old.name not in keep and len(keep) < KEEP and (old / STATE_FILE).exists():
            keep.add(old.name)
        elif old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
    return directory


def load(run_dir: Path, policy: TrainerPolicy) -> TrainerState | None:
    """Rank 0: the latest checkpoint into `policy` (on however many ranks it runs now) and its trainer state; None
    when the run has none."""
    directory = latest(run_dir)
    if directory is None:
        return None
    policy.load_checkpoint(directory)
    return read_state(directory)


def write_state(directory: Path, state: TrainerState) -> None:
    _fsync_write(Path(directory) / STATE_FILE, msgspec.json.encode(state))


def read_state(directory: Path) -> TrainerState:
    return msgspec.json.decode((Path(directory) / STATE_FILE).read_bytes(), type=TrainerState, strict=False)


__all__ = ["CHECKPOINTS", "LEGACY_FILE", "TrainerState", "latest", "load", "read_state", "save", "write_state"]
