"""Default size limits on what travels through Redis (the settings that override them name these)."""

from __future__ import annotations

MiB = 1 << 20

MAX_JOB_BYTES = 16 * MiB  # one encoded job (a stream entry's payload): producers refuse, workers dead-letter
MAX_TRAJECTORY_BYTES = 64 * MiB  # one encoded trajectory: workers publish an `error` result instead


def describe_bytes(n: int) -> str:
    """`17,825,792 bytes (17.0 MiB)`: a size for error messages."""
    return f"{n:,} bytes ({n / MiB:.1f} MiB)"


__all__ = ["MAX_JOB_BYTES", "MAX_TRAJECTORY_BYTES", "MiB", "describe_bytes"]
