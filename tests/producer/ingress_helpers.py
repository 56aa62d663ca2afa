"""The ingress under test: a real aiohttp server on loopback over the test's Redis, and workflows the ingress tests
run in an in-process worker (so they can share this module's state with the test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from rollq.http_server import start_site
from rollq.producer.ingress import Ingress, IngressConfig
from rollq.workers.context import workflow_context
from tests.workflows import trajectory

TOKENS = {"tok-acme": "acme", "tok-globex": "globex", "tok-narrow": "narrow"}
TENANT_WORKFLOWS = {"narrow": ["tests.workflows.Echo", "command:echo"]}


class GateState:
    """What Gate saw (sample indices, in start order) and what lets it finish."""

    def __init__(self) -> None:
        self.runs: list[tuple[Any, int]] = []
        self.release = asyncio.Event()
        self.started = asyncio.Condition()


GATE = GateState()


class Gate:
    """Records each run (data tag, sample index), then waits until the test releases it."""

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        async with GATE.started:
            GATE.runs.append((data.get("tag") if isinstance(data, dict) else None, workflow_context.get().sample_index))
            GATE.started.notify_all()
        await asyncio.wait_for(GATE.release.wait(), 30)
        return trajectory(4)


@asynccontextmanager
async def running_ingress(redis_url: str, run: str, **config: Any) -> AsyncIterator[tuple[Ingress, str]]:
    """(the Ingress, its base URL) served on a free loopback port."""
    config.setdefault("tokens", TOKENS)
    config.setdefault("tenant_workflows", TENANT_WORKFLOWS)
    config.setdefault("keepalive", 0.5)
    cfg = IngressConfig(redis_url=redis_url, run=run, host="127.0.0.1", port=0, **config)
    ingress = Ingress(cfg)
    runner, port = await start_site(  # as `rollq ingress` serves it (producer/ingress/commands.py)
        ingress.app(),
        "127.0.0.1",
        0,
        header_timeout_s=cfg.header_timeout,
        body_timeout_s=cfg.body_timeout,
        handler_cancellation=True,
        access_log=None,
    )
    try:
        yield ingress, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
