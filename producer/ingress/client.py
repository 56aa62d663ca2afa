"""A typed Python client of the HTTP ingress (httpx): submit, get, follow (Server-Sent Events, resumed after a
dropped connection from the last event id) and cancel. Other languages use plain HTTP (docs/ingress.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from rollq.producer.ingress.models import (
    Admitted,
    CancelResponse,
    Done,
    ErrorBody,
    JobBatch,
    JobSpec,
    JobStatus,
    SubmitResponse,
)
from rollq.protocol.codec import Codec
from rollq.protocol.messages import Trajectory


class IngressError(Exception):
    """A refused request: its HTTP status, the error kind, the message and the field it names (if any)."""

    def __init__(self, status: int, kind: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status, self.kind, self.message, self.field = status, kind, message, field


class SampleEvent(msgspec.Struct, frozen=True):
    """One `sample` event: its id (pass it as `last_event_id` to resume after it) and the finished sample (its job_id
    is the one the caller gave)."""

    id: str
    trajectory: Trajectory


class _Event(msgspec.Struct):
    event: str = "message"
    id: str | None = None
    data: str = ""


class IngressClient:
    """`async with IngressClient("http://ingress:8300", token) as c: await c.submit(JobSpec(workflow=..., data=...))`"""

    def __init__(
        self, base_url: str, token: str, *, timeout_s: float = 30.0, client: httpx.AsyncClient | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = client is None
        self.http = client or httpx.AsyncClient(timeout=timeout_s)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.codec = Codec()  # what holds a Trajectory: its token arrays are lists in JSON

    async def __aenter__(self) -> IngressClient:
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    def _url(self, job_id: str, tail: str = "") -> str:
        return f"{self.base_url}/v1/jobs/{quote(job_id, safe='')}{tail}"

    @staticmethod
    def _check(resp: httpx.Response) -> None:
        if resp.status_code >= 400:
            try:
                body = msgspec.json.decode(resp.content, type=ErrorBody)
            except (msgspec.DecodeError, msgspec.ValidationError):
                body = ErrorBody("http", resp.text[:500])
            raise IngressError(resp.status_code, body.error, body.message, body.field)

    async def submit_many(self, jobs: Sequence[JobSpec]) -> list[Admitted]:
        """Submit a batch, all or nothing; each job's id (given or generated) and whether it was newly admitted."""
        resp = await self.http.post(
            f"{self.base_url}/v1/jobs",
            content=msgspec.json.encode(JobBatch(list(jobs))),
            headers={**self.headers, "Content-Type": "application/json"},
        )
        self._check(resp)
        return msgspec.json.decode(resp.content, type=SubmitResponse).jobs

    async def submit(self, job: JobSpec) -> Admitted:
        return (await self.submit_many([job]))[0]

    async def get(self, job_id: str, *, trajectories: bool = True) -> JobStatus:
        resp = await self.http.get(
            self._url(job_id), params={"trajectories": str(trajectories).lower()}, headers=self.headers
        )
        self._check(resp)
        return self.codec.decode_json(resp.content, JobStatus)

    async def cancel(self, job_id: str) -> CancelResponse:
        resp = await self.http.delete(self._url(job_id), headers=self.headers)
        self._check(resp)
        return msgspec.json.decode(resp.content, type=CancelResponse)

    async def events(
        self, job_id: str, *, last_event_id: str | None = None, reconnects: int = 5, read_timeout_s: float = 60.0
    ) -> AsyncIterator[SampleEvent]:
        """Each sample as it finishes, once, until every sample has a result. A dropped connection is resumed from
        the last event seen (up to `reconnects` times in a row). `read_timeout_s` must exceed the server's keepalive."""
        failures = 0
        while True:
            try:
                async with aclosing(self._stream(job_id, last_event_id, read_timeout_s)) as stream:
                    async for event in stream:
                        failures = 0
                        if event.event == "sample" and event.id is not None:
                            last_event_id = event.id
                            yield SampleEvent(event.id, self.codec.decode_json(event.data, Trajectory))
                        elif event.event == "done":
                            msgspec.json.decode(event.data, type=Done)
                            return
                        elif event.event == "expired":
                            raise IngressError(410, "expired", f"job {job_id!r} passed its retention")
                raise httpx.RemoteProtocolError("the event stream ended before `done`")
            except (httpx.TransportError, httpx.RemoteProtocolError):
                failures += 1
                if failures > reconnects:
                    raise
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))

    async def _stream(
        self, job_id: str, last_event_id: str | None, read_timeout_s: float
    ) -> AsyncGenerator[_Event, None]:
        headers = dict(self.headers, Accept="text/event-stream")
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(self.http.timeout.connect, read=read_timeout_s)
        async with self.http.stream("GET", self._url(job_id, "/events"), headers=headers, timeout=timeout) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                self._check(resp)
            event = _Event()
            data: list[str] = []
            async for line in resp.aiter_lines():
                if not line:
                    if data or event.event != "message":
                        event.data = "\n".join(data)
                        yield event
                    event, data = _Event(), []
                    continue
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data":
                    data.append(value)
                elif name == "event":
                    event.event = value
                elif name == "id":
                    event.id = value

    async def wait(self, job_id: str, **kwargs: Any) -> list[Trajectory]:
        """Every sample's result, in sample order, once all have one."""
        out = [e.trajectory async for e in self.events(job_id, **kwargs)]
        return sorted(out, key=lambda t: t.sample_index)


__all__ = ["IngressClient", "IngressError", "SampleEvent"]
