"""`rollq ingress`: serve the HTTP ingress until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop

from rollq.http_server import start_site
from rollq.metrics_server import MetricsServer
from rollq.producer.ingress.app import Ingress
from rollq.producer.ingress.config import IngressConfig
from rollq.producer.metrics import ingress_registry
from rollq.shield import shield_secrets

log = logging.getLogger("rollq.ingress")


async def serve(cfg: IngressConfig, *, started: asyncio.Event | None = None) -> int:
    ingress = Ingress(cfg)
    runner, _ = await start_site(
        ingress.app(),
        cfg.host,
        cfg.port,
        header_timeout_s=cfg.header_timeout,
        body_timeout_s=cfg.body_timeout,
        handler_cancellation=True,
        access_log=None,
    )
    metrics = None
    if cfg.metrics_port:  # served from prometheus_client's thread: a scrape never waits for the event loop
        metrics = MetricsServer(ingress_registry(ingress.stats, cfg.redis_url, cfg.run), cfg.metrics_port, cfg.host)
    try:
        log.info("rollq ingress: run %r, listening on http://%s:%d", cfg.run, cfg.host, cfg.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if started is not None:
            started.set()
        await stop.wait()
    finally:
        if metrics is not None:
            metrics.close()
        await runner.cleanup()
    return 0


def ingress(cfg: IngressConfig) -> int:
    shield_secrets()  # its Redis URL and the tenants' tokens (rollq/shield.py)
    return uvloop.run(serve(cfg))


__all__ = ["ingress", "serve"]
