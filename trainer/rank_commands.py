"""What rank 0 tells the trainer's other ranks to do (trainer/ranks.py carries it; trainer/follower.py obeys).

Each command is a collective: every rank runs the same Policy method with the same arguments, in the same order,
so their FSDP collectives meet. Tensors travel as raw bytes with dtype and shape (msgpack, never pickle).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch


class PackedTensor(msgspec.Struct, array_like=True, gc=False):
    """A CPU tensor as bytes."""

    dtype: str  # numpy's dtype string, e.g. "<f4"
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> PackedTensor:
        a = t.detach().cpu().contiguous().numpy()
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def tensor(self) -> torch.Tensor:
        a = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        return torch.from_numpy(a.copy())


class ShardRows(msgspec.Struct, kw_only=True, gc=False):
    """One rank's rows of a step's batch (trainer.batch.Batch's training columns, cut to the shard's longest row)."""

    input_ids: PackedTensor
    attention_mask: PackedTensor
    loss_mask: PackedTensor
    behav_logprobs: PackedTensor
    advantages: PackedTensor


class Minibatch(msgspec.Struct, kw_only=True, gc=False):
    """One optimizer step of a training step: each rank's rows in it (indices into its shard) and the per-token
    mean's denominator over the whole minibatch on every rank, so N ranks take the update one process would."""

    rows: list[list[int]]  # by rank
    denominator: float


class TrainStep(msgspec.Struct, tag="train", kw_only=True, gc=False):
    shards: list[ShardRows]  # by rank
    minibatches: list[Minibatch]


class WriteWeights(msgspec.Struct, tag="write_weights", kw_only=True):
    """The full weights as an HF safetensors directory (rank 0 writes; every rank gathers its shards)."""

    directory: str


class GatherWeights(msgspec.Struct, tag="gather_weights", kw_only=True):
    """The full weights, bucket by bucket, to rank 0 (which broadcasts them to the engines)."""

    bucket_bytes: int


class SaveCheckpoint(msgspec.Struct, tag="save", kw_only=True):
    directory: str


class LoadCheckpoint(msgspec.Struct, tag="load", kw_only=True):
    directory: str


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = TrainStep | WriteWeights | GatherWeights | SaveCheckpoint | LoadCheckpoint | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


def encode(command: Command) -> bytes:
    return _encoder.encode(command)


def decode(payload: bytes) -> Command:
    return _decoder.decode(payload)


__all__ = [
    "Command",
    "GatherWeights",
    "LoadCheckpoint",
    "Minibatch",
    "PackedTensor",
    "SaveCheckpoint",
    "ShardRows",
    "Stop",
    "TrainStep",
    "WriteWeights",
    "decode",
    "encode",
]
