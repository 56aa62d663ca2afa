"""Scripted engines for agent tests: a real engine server (SyntheticBackend with the tiny model's ChatML tokenizer)
whose assistant turns reply with given texts, offline and without a model."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from rollq.engine.server.app import EngineServerConfig, ServerHandle, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig, load_tokenizer


@asynccontextmanager
async def scripted_engine(replies: list[str], **config: Any) -> AsyncIterator[ServerHandle]:
    """Serve replies[n] for the conversation's n-th assistant turn (the last reply beyond the list) on loopback;
    `config` goes to SyntheticConfig (latency, seed, turn_marker...)."""
    config.setdefault("tokenizer", "tiny")
    backend = SyntheticBackend(SyntheticConfig(replies=replies, **config))
    handle = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0))
    try:
        yield handle
    finally:
        await handle.close()


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """The tiny model's HF tokenizer (the one scripted engines use), loaded once per test process."""
    return load_tokenizer("tiny")[0]
