"""`rollq ingress`: serve the HTTP ingress until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop
from aiohttp import web
from prometheus_client import start_http_server

from rollq.producer.ingress.app import Ingress
from rollq.producer.ingress.config import IngressConfig
from rollq.producer.metrics import ingress_registry

log = logging.getLogger("rollq.ingress")


async def serve(cfg: IngressConfig, *, started: asyncio.Event | None = None) -> int:
    ingress = Ingress(cfg)
    runner = web.AppRunner(ingress.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    metrics = None
    if cfg.metrics_port:  # served from prometheus_client's thread: a scrape never waits for the event loop
        metrics, _ = start_http_server(
            cfg.metrics_port, addr="0.0.0.0", registry=ingress_registry(ingress.stats, cfg.redis_url, cfg.run)
        )
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
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
            metrics.shutdown()
            metrics.server_close()
        await runner.cleanup()
    return 0


def ingress(cfg: IngressConfig) -> int:
    return uvloop.run(serve(cfg))


__all__ = ["ingress", "serve"]
