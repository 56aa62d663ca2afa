"""F7: every /metrics server binds the address its service is configured with, never 0.0.0.0 by itself. The ingress
and the engine serve /metrics on their `host`; the worker, trainer and reward worker on `metrics_host`, which
defaults to loopback (compose sets 0.0.0.0 where Prometheus scrapes). Each service runs in this process, as its
command runs it, and the listening socket's own address is read from the kernel (psutil)."""

from __future__ import annotations

import asyncio
import io
import urllib.request
from collections.abc import Awaitable

import psutil
import pytest

from rollq.local import free_port
from tests.helpers import wait_until


def listening_hosts(port: int) -> set[str]:
    """The addresses this process listens on at `port` (TCP), as the kernel reports them."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


async def bound_host(service: Awaitable, port: int) -> set[str]:
    """Run `service` until it listens on `port`; its listening addresses there, checked to serve /metrics."""
    task = asyncio.ensure_future(service)
    try:

        async def listening() -> bool:
            if task.done():
                task.result()  # its start-up error
            return bool(listening_hosts(port))

        await wait_until(listening, 30, interval_s=0.05, what=f"/metrics on port {port}")
        hosts = listening_hosts(port)
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5))
        assert b"# TYPE" in body.read()
        return hosts
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_worker_metrics_bind_loopback_by_default(redis_url, run_name):
    from rollq.workers.commands import serve
    from rollq.workers.config import WorkerConfig

    port = free_port()
    assert await bound_host(serve(WorkerConfig(redis_url=redis_url, run=run_name, metrics_port=port)), port) == {
        "127.0.0.1"
    }


async def test_reward_worker_metrics_bind_loopback_by_default(redis_url, run_name):
    from rollq.workers.rewards.config import RewardWorkerConfig
    from rollq.workers.rewards.worker import serve

    port = free_port()
    cfg = RewardWorkerConfig(redis_url=redis_url, run=run_name, metrics_port=port)
    assert await bound_host(serve(cfg), port) == {"127.0.0.1"}


@pytest.mark.slow  # alone it spends ~10 s importing torch and transformers (shared with the trainer tests)
async def test_trainer_metrics_bind_loopback_by_default(redis, make_train_config):
    from rollq.engine.pool import EnginePool, PoolConfig
    from rollq.trainer.loop import Trainer

    port = free_port()
    cfg = make_train_config(metrics_port=port)
    pool = EnginePool(PoolConfig(urls=[]))  # no engine: the trainer serves /metrics while it waits for one
    try:
        trainer = Trainer(cfg, redis, pool, progress=io.StringIO())
        assert await bound_host(trainer.run(), port) == {"127.0.0.1"}
    finally:
        await pool.close()


async def test_ingress_metrics_bind_its_host(redis_url, run_name):
    from rollq.producer.ingress.commands import serve
    from rollq.producer.ingress.config import IngressConfig

    port = free_port()
    cfg = IngressConfig(redis_url=redis_url, run=run_name, host="127.0.0.1", port=free_port(), metrics_port=port)
    assert await bound_host(serve(cfg), port) == {"127.0.0.1"}


async def test_engine_metrics_bind_its_host():
    """The engine's /metrics is a route of its HTTP server, so it follows `host` (a guard: it did already)."""
    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig

    port = free_port()
    handle = await serve(SyntheticBackend(SyntheticConfig()), EngineServerConfig(host="127.0.0.1", port=port))
    try:
        assert listening_hosts(port) == {"127.0.0.1"}
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5))
        assert b"# TYPE" in body.read()
    finally:
        await handle.close()


@pytest.mark.parametrize("section", ["worker", "trainer", "reward_worker"])
def test_metrics_host_is_a_setting_with_a_loopback_default(section):
    """ROLLQ_<SECTION>_METRICS_HOST opens it (compose: 0.0.0.0, where Prometheus scrapes over the network)."""
    from rollq.cli import parse

    command = {"worker": "worker", "trainer": "train", "reward_worker": "reward-worker"}[section]
    assert parse([command], env={}).settings[0].metrics_host == "127.0.0.1"
    env = {f"ROLLQ_{section.upper()}_METRICS_HOST": "0.0.0.0"}
    assert parse([command], env=env).settings[0].metrics_host == "0.0.0.0"
