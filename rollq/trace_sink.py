"""A loopback OTLP/HTTP trace receiver that keeps what it is sent in memory: where the tests and bench/tracing.py
point every process's `trace_endpoint` to read the spans back whole (what a collector or MLflow would receive), and
a way to look at a run's spans without a tracing backend (`python -m rollq.trace_sink`, JSON lines on stdout).

It takes OTLP's protobuf encoding (what opentelemetry-exporter-otlp-proto-http sends), gzip or not, at /v1/traces."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import sys
from typing import Any

import msgspec
from aiohttp import web

TRACES_PATH = "/v1/traces"
MAX_BODY_BYTES = 32 * 1024 * 1024


class SinkSpan(msgspec.Struct, kw_only=True):
    """One span as received."""

    name: str
    trace_id: str  # hex
    span_id: str  # hex
    parent_id: str  # hex; "" for a root
    service: str  # its resource's service.name
    attributes: dict[str, Any]
    status: str  # UNSET | OK | ERROR
    status_message: str = ""
    events: list[str] = []  # event names
    links: list[str] = []  # span ids linked to
    start_ns: int = 0
    end_ns: int = 0


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    value = getattr(any_value, kind)
    if kind == "array_value":
        return [_value(v) for v in value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.values}
    return value


def decode(body: bytes) -> list[SinkSpan]:
    """An ExportTraceServiceRequest -> its spans."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    request = ExportTraceServiceRequest.FromString(body)
    spans: list[SinkSpan] = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    SinkSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        service=str(resource.get("service.name", "")),
                        attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        status=Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
                        status_message=span.status.message,
                        events=[e.name for e in span.events],
                        links=[link.span_id.hex() for link in span.links],
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return spans


class TraceSink:
    """`async with TraceSink() as sink:` serves on 127.0.0.1 (a free port): `sink.endpoint` is the URL to export
    to, `sink.spans` what arrived, `await sink.wait_for(predicate, timeout_s)` waits for what a test expects."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, on_spans: Any = None) -> None:
        self.host, self.port = host, port
        self.spans: list[SinkSpan] = []
        self.requests = 0
        self.received = 0  # spans received (kept or not)
        self.keep = True  # False: count only (a long run's receiver)
        self.headers: list[dict[str, str]] = []  # each request's headers (names lower-cased)
        self.on_spans = on_spans  # called with each request's spans
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    async def __aenter__(self) -> TraceSink:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(TRACES_PATH, self._receive)
        app.router.add_get("/count", self._count)
        app.router.add_get("/health", self._count)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if not self.port:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # the bound port
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _count(self, request: web.Request) -> web.Response:
        return web.json_response({"spans": self.received, "requests": self.requests})

    async def _receive(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        try:
            spans = decode(body)
        except Exception as exc:  # not OTLP protobuf: the exporter is told, as a collector would
            return web.json_response({"error": f"not an OTLP ExportTraceServiceRequest: {exc}"}, status=400)
        async with self._arrived:
            self.received += len(spans)
            if self.keep:
                self.spans += spans
            self.requests += 1
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            self._arrived.notify_all()
        if self.on_spans is not None:
            self.on_spans(spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def wait_for(self, done: Any, timeout_s: float) -> list[SinkSpan]:
        """Waits (bounded) until `done(spans)` is true; returns the spans. TimeoutError names what arrived."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._arrived:
                    await self._arrived.wait_for(lambda: done(self.spans))
        except TimeoutError:
            names = sorted({s.name for s in self.spans})
            raise TimeoutError(
                f"{len(self.spans)} spans arrived in {timeout_s} s, not what was awaited: {names}"
            ) from None
        return self.spans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollq.trace_sink", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=4318, help="port (default: OTLP/HTTP's 4318)")
    parser.add_argument("--count-only", action="store_true", help="print nothing; GET /count says how many spans came")
    args = parser.parse_args(argv)
    encoder = msgspec.json.Encoder()

    def write(spans: list[SinkSpan]) -> None:
        for span in spans:
            sys.stdout.buffer.write(encoder.encode(span) + b"\n")
        sys.stdout.flush()

    async def serve() -> None:
        async with TraceSink(args.host, args.port, on_spans=None if args.count_only else write) as sink:
            sink.keep = False
            print(f"OTLP/HTTP traces: {sink.endpoint}", file=sys.stderr, flush=True)
            await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
