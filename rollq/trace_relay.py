"""An OTLP/HTTP trace relay: takes the spans rollq's processes export (POST /v1/traces) and forwards them to one
backend, adding headers of its own, so the processes reach the relay and only the relay reaches the backend.

Why: compose's tracing profile (compose.yaml) puts MLflow on a network of its own. MLflow's tracking server has no
authentication there, and worker containers run agents, the code under training: on a network with MLflow they could
read and change every run's traces. The relay is the one service on both networks, and it only takes spans in (a
body that is not an OTLP ExportTraceServiceRequest is refused, not forwarded); nothing reads traces back through it.

    python -m rollq.trace_relay --to http://mlflow:5000/v1/traces --header x-mlflow-experiment-id=0

It takes OTLP's protobuf encoding (what opentelemetry-exporter-otlp-proto-http sends), gzip or not, and forwards it
uncompressed; the backend's answer (status and body) is the exporter's answer."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from rollq.http_server import read_body, start_site
from rollq.trace_sink import MAX_BODY_BYTES, TRACES_PATH
from rollq.tracing import parse_headers

log = logging.getLogger("rollq.trace_relay")
FORWARD_TIMEOUT_S = 30.0


class TraceRelay:
    """`async with TraceRelay(to, headers) as relay:` serves POST /v1/traces (and GET /health) on host:port (0: a
    free one; `relay.endpoint` says where), forwarding each request to `to` with `headers` added."""

    def __init__(self, to: str, headers: dict[str, str] | None = None, host: str = "127.0.0.1", port: int = 0):
        self.to, self.headers = to, dict(headers or {})
        self.host, self.port = host, port
        self.forwarded = 0  # requests the backend took
        self.refused = 0  # requests that were not OTLP
        self._runner: web.AppRunner | None = None
        self._client: ClientSession | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    async def __aenter__(self) -> TraceRelay:
        self._client = ClientSession(timeout=ClientTimeout(total=FORWARD_TIMEOUT_S))
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(TRACES_PATH, self._relay)
        app.router.add_get("/health", self._health)
        self._runner, self.port = await start_site(app, self.host, self.port, access_log=None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"forwarded": self.forwarded, "refused": self.refused})

    async def _relay(self, request: web.Request) -> web.Response:
        body = await read_body(request)  # unpacked by aiohttp (gzip, deflate), at most MAX_BODY_BYTES so (else 413)
        try:
            _check_otlp(body)
        except ValueError as exc:
            self.refused += 1
            return web.json_response({"error": f"not an OTLP ExportTraceServiceRequest: {exc}"}, status=400)
        assert self._client is not None
        headers = {**self.headers, "Content-Type": "application/x-protobuf"}
        try:
            async with self._client.post(self.to, data=body, headers=headers) as reply:
                answer = await reply.read()
                status, content_type = reply.status, reply.headers.get("Content-Type", "application/x-protobuf")
        except (ClientError, OSError, TimeoutError) as exc:
            log.warning("trace relay: %s is not answering (%s)", self.to, type(exc).__name__)
            return web.json_response(
                {"error": f"the trace backend is not answering ({type(exc).__name__})"}, status=502
            )
        if status < 300:
            self.forwarded += 1
        return web.Response(body=answer, status=status, headers={"Content-Type": content_type})


def _check_otlp(body: bytes) -> None:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise ValueError(str(exc) or "undecodable") from None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rollq.trace_relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--to", required=True, help="the backend's OTLP/HTTP traces URL (e.g. MLflow's /v1/traces)")
    parser.add_argument("--header", default="", help="k=v,k2=v2 added to every forwarded request")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=4318, help="port (default: OTLP/HTTP's 4318)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    headers: dict[str, Any] = parse_headers(args.header) if args.header else {}

    async def serve() -> None:
        async with TraceRelay(args.to, headers, args.host, args.port) as relay:
            log.info("OTLP/HTTP traces: %s -> %s", relay.endpoint, args.to)
            await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
