"""What the tests watch of the reference engine's shared-prefix decode."""

from __future__ import annotations

from typing import Any


def watch_sharing(backend: Any) -> list[tuple[int, int]]:
    """Record (rows, rows decoding against a shared prefix) at every decode step of `backend` (a ReferenceBackend):
    a spy on its batch's decode, which it then calls unchanged."""
    seen: list[tuple[int, int]] = []
    batch = backend._batch
    decode = batch.decode

    def watched(model, tokens, adapters=None):
        seen.append((batch.size, sum(p is not None for p in batch._shared)))
        return decode(model, tokens, adapters)

    batch.decode = watched
    return seen
