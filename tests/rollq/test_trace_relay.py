"""rollq.trace_relay: rollq's spans in, forwarded to one backend with the relay's own headers (compose's tracing
profile puts it between the services and MLflow). A real relay on loopback, exported to by the OpenTelemetry SDK,
forwarding to a real receiver (rollq.trace_sink) standing for MLflow."""

from __future__ import annotations

import asyncio
import gzip

import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from rollq.trace_relay import TraceRelay, main, parser
from rollq.trace_sink import TraceSink
from rollq.tracing import Tracing


async def test_spans_pass_through_with_the_relays_headers_and_nothing_else_does():
    async with TraceSink() as backend, TraceRelay(backend.endpoint, {"x-mlflow-experiment-id": "7"}) as relay:
        tracing = Tracing.exporting(OTLPSpanExporter(endpoint=relay.endpoint), service="rollq-worker")
        tracing.start("attempt", attributes={"rollq.job_id": "j"}).end()
        await asyncio.to_thread(tracing.shutdown)  # exports, through the relay (served on this loop)
        [span] = backend.spans
        assert (span.name, span.service, span.attributes) == ("attempt", "rollq-worker", {"rollq.job_id": "j"})
        assert backend.headers[-1]["x-mlflow-experiment-id"] == "7"
        async with httpx.AsyncClient(timeout=10) as http:
            body = (await http.get(f"http://127.0.0.1:{relay.port}/v1/traces")).status_code
            assert body == 405  # nothing is read back through it
            for junk in (b"\xff" * 64, gzip.compress(b"\xff" * 64)):
                headers = {"Content-Type": "application/x-protobuf"}
                if junk[:2] == b"\x1f\x8b":
                    headers["Content-Encoding"] = "gzip"
                r = await http.post(relay.endpoint, content=junk, headers=headers)
                assert r.status_code == 400 and "not an OTLP" in r.json()["error"], r.text
            bomb = gzip.compress(b"\0" * (33 * 1024 * 1024))  # 33 MiB of zeros in ~33 KB
            r = await http.post(relay.endpoint, content=bomb, headers={"Content-Encoding": "gzip"})
            assert r.status_code == 413, r.text  # aiohttp bounds what a body unpacks to
            health = (await http.get(f"http://127.0.0.1:{relay.port}/health")).json()
        assert backend.requests == 1 and health == {"forwarded": 1, "refused": 2}


async def test_a_backend_that_is_away_is_a_502():
    async with TraceSink() as gone:
        endpoint = gone.endpoint
    async with TraceRelay(endpoint) as relay, httpx.AsyncClient(timeout=10) as http:
        r = await http.post(relay.endpoint, content=b"", headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 502 and "not answering" in r.json()["error"]


def test_the_command_line():
    args = parser().parse_args(["--to", "http://mlflow:5000/v1/traces", "--header", "x-mlflow-experiment-id=0"])
    assert (args.to, args.header, args.host, args.port) == (
        "http://mlflow:5000/v1/traces",
        "x-mlflow-experiment-id=0",
        "127.0.0.1",
        4318,
    )
    assert callable(main)
