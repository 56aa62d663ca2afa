"""Content-addressed payloads: a job's data stored once in the run's blob store (RunKeys.blob) and referenced by the
SHA-256 of its bytes (`Job.data_ref`), so the n samples of a prompt, and every job with the same data, share one
copy in Redis. Pure functions; the producers write blobs in their submit scripts, workers read them."""

from __future__ import annotations

import hashlib
from typing import Any

from rollq.protocol.codec import Codec

# Data whose encoding is at least this large travels by reference. Below it a copy per sample costs less than the
# worker's extra read (the queue's hot path: small prompts, n = 1).
BLOB_MIN_BYTES = 256
# How long a stored blob lives by default: the producers' retention of a submission (seen_ttl_s), also what the
# workers give the images of a trajectory they store (a consumer reads them long before).
DEFAULT_BLOB_TTL_S = 7 * 24 * 3600
# A sequence's images (VisionInputs) at least this large go to the blob store; smaller ones ride in the trajectory.
VISION_INLINE_BYTES = 256 << 10


def digest_of(payload: bytes) -> str:
    """The name of `payload` in the blob store: its SHA-256, hex."""
    return hashlib.sha256(payload).hexdigest()


class DataBlob:
    """A job's data encoded for the blob store: `payload` (msgpack) named `digest`."""

    __slots__ = ("digest", "payload")

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.digest = digest_of(payload)


def data_blob(codec: Codec, data: Any, min_bytes: int = BLOB_MIN_BYTES) -> DataBlob | None:
    """`data` as a blob when it is large enough to travel by reference (None: keep it inline)."""
    if data is None:
        return None
    payload = codec.encode(data)
    return DataBlob(payload) if len(payload) >= min_bytes else None


__all__ = ["BLOB_MIN_BYTES", "DEFAULT_BLOB_TTL_S", "VISION_INLINE_BYTES", "DataBlob", "data_blob", "digest_of"]
