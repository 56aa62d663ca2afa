"""The `/metrics` server every rollq service that exposes Prometheus metrics uses (the worker, trainer, reward worker
and ingress; `--metrics-port`): prometheus_client's threaded HTTP server, its connections under a socket timeout, over
a registry of the service's own. What each service collects lives with the service (rollq.workers.metrics,
rollq.producer.metrics, rollq.engine.metrics, rollq.trainer.prometheus_metrics)."""

from __future__ import annotations

import threading
from typing import Any, cast

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server

DEFAULT_METRICS_TIMEOUT_S = 10.0  # Prometheus' default scrape_timeout


def process_registry() -> CollectorRegistry:
    """A registry of one's own (tests run several services in one process) with the process, platform and GC
    collectors that prometheus_client's default registry has."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def start_metrics_server(
    port: int,
    addr: str,
    registry: CollectorRegistry,
    *,
    timeout_s: float = DEFAULT_METRICS_TIMEOUT_S,
) -> tuple[Any, threading.Thread]:
    """prometheus_client.start_http_server, whose connections time out: its wsgiref server gives each connection a
    thread that otherwise waits forever on a silent client. `timeout_s` is a socket timeout, so it bounds each read
    and write, not a whole request: a client that sends a byte within every `timeout_s` is not cut. Returns
    (server, thread) as start_http_server does (`server.shutdown(); server.server_close()` stops it)."""
    server, thread = start_http_server(port, addr=addr, registry=registry)
    # start_http_server takes no handler class; socketserver makes each connection's handler from this attribute
    # (a connection accepted in the instant before this line gets none), and StreamRequestHandler.setup() applies
    # the class's `timeout` to the connection's socket.
    handler = cast(type, server.RequestHandlerClass)  # prometheus_client's quiet WSGIRequestHandler
    server.RequestHandlerClass = type("TimedMetricsHandler", (handler,), {"timeout": timeout_s})
    return server, thread


class MetricsServer:
    """`/metrics` of `registry` on `host:port`, served from a thread: a scrape never waits for the event loop, and
    collectors read the service's objects and Redis there."""

    def __init__(
        self, registry: CollectorRegistry, port: int, host: str, *, timeout_s: float = DEFAULT_METRICS_TIMEOUT_S
    ) -> None:
        self.registry = registry
        self._server, self._thread = start_metrics_server(port, host, registry, timeout_s=timeout_s)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


__all__ = ["DEFAULT_METRICS_TIMEOUT_S", "MetricsServer", "process_registry", "start_metrics_server"]
