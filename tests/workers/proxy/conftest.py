"""A recording proxy in front of a real engine server: a scripted synthetic engine with the tiny ChatML tokenizer
(tool call, then answer), reached through the real EnginePool."""

from __future__ import annotations

import pytest

from tests.workers.proxy.helpers import make_stack


@pytest.fixture
async def stack():
    async with make_stack() as s:
        yield s


@pytest.fixture
async def slow_stack():
    """The engine takes 5 ms per decode step, so a streamed answer takes a while to generate."""
    async with make_stack(per_token_latency_s=0.005) as s:
        yield s
