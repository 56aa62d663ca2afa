"""Rollout traces: OpenTelemetry spans for every sample, one trace per submitted job across every process.

    submit (producer / ingress)  ->  attempt (worker, one per sample and try)  ->  episode (workflow or agent)
        ->  engine.generate (each engine call; under proxy.completion for an agent's)  ->  reward
        ->  train / drop (the trainer: the step that trained it, or why it was dropped)

The context travels in the stream entries as W3C `traceparent` strings (Job.traceparent, Trajectory.traceparent),
so one trace spans processes and machines; a caller in any language may pass its own (the ingress takes the
`traceparent` header too).

Closed by default: nothing is exported unless an endpoint is set (`trace_endpoint`, else the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT), and text is recorded only with `trace_text` on,
cut to `trace_text_chars`, because traces leave the trust boundary: prompts, completions and token ids, but also
error messages (an agent's error quotes its stdout, a refusal what the job named) and a command agent's arguments.
Without it an error is recorded by its type alone (`Tracing.error`; spans never record exceptions themselves).
The standard OTEL_* variables are honoured (headers, sampler, service name, batch processor); a rollq setting wins
over them.

A process holds one Tracing (its tracer, or none). Code deep in a call (an engine call, a reward) reaches it through
the `current` context variable, set by the worker for its tasks; without one, or with tracing off, a span is a
no-op that costs a context-variable read."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind, Status, StatusCode, use_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from rollq.config import RunSettings

TRACEPARENT = "traceparent"
OFF = "off"
_PROPAGATOR = TraceContextTextMapPropagator()
_NOOP = contextlib.nullcontext(INVALID_SPAN)  # reusable: entering it does nothing
NO_SPAN = _NOOP

# The process's Tracing, for code that has no handle on it (engine calls, rewards): set by the worker for its tasks.
current: contextvars.ContextVar[Tracing | None] = contextvars.ContextVar("rollq_tracing", default=None)


def traces_endpoint(setting: str, env: Mapping[str, str] | None = None) -> str:
    """Where spans go: the setting ('off': nowhere, whatever the environment says), else the standard variables
    (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is; OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, as the OTLP spec says);
    '' = tracing off. OTEL_SDK_DISABLED=true turns it off too, unless the setting names an endpoint."""
    env = os.environ if env is None else env
    if setting:
        return "" if setting == OFF else setting
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return f"{base.rstrip('/')}/v1/traces" if base else ""


def parse_headers(text: str) -> dict[str, str]:
    """`k=v,k2=v2` (the OTEL_EXPORTER_OTLP_HEADERS form; values may be %-encoded) -> a dict; a pair without `=` is
    an error naming it."""
    from urllib.parse import unquote

    headers: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"trace_headers: {pair!r} is not key=value")
        headers[unquote(key.strip()).lower()] = unquote(value.strip())
    return headers


class Tracing:
    """One process's tracer, or none (`Tracing.disabled()`): spans, the context they hand on, and text capping."""

    def __init__(self, provider: TracerProvider | None = None, *, text_chars: int = 0) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("rollq") if provider is not None else None
        self.text_chars = text_chars  # 0: no prompt or completion text (nor token ids) in any span

    @classmethod
    def disabled(cls) -> Tracing:
        return cls()

    @classmethod
    def from_settings(cls, settings: RunSettings, component: str) -> Tracing:
        """The process's tracing from its settings and the OTEL_* environment; off without an endpoint."""
        endpoint = traces_endpoint(settings.trace_endpoint)
        if not endpoint:
            return cls.disabled()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        headers = parse_headers(settings.trace_headers) if settings.trace_headers else None  # None: OTEL_* headers
        return cls.exporting(
            OTLPSpanExporter(endpoint=endpoint, headers=headers),
            service=settings.trace_service or os.environ.get("OTEL_SERVICE_NAME") or f"rollq-{component}",
            sample_rate=settings.trace_sample_rate,
            text_chars=settings.trace_text_chars if settings.trace_text else 0,
        )

    @classmethod
    def exporting(
        cls,
        exporter: SpanExporter,
        *,
        service: str = "rollq",
        sample_rate: float | None = None,
        text_chars: int = 0,
        batch: bool = True,
    ) -> Tracing:
        """Spans to `exporter` (batched on a background thread, or synchronously: tests' in-memory exporter).
        `sample_rate` None: OTEL_TRACES_SAMPLER / _ARG, else every trace; a rate samples whole traces at their root
        (the submit) and every later process follows the root's decision (parent-based)."""
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        sampler = None if sample_rate is None else ParentBased(TraceIdRatioBased(sample_rate))
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}), sampler=sampler)
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider, text_chars=text_chars)

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def span(
        self, name: str, *, attributes: Mapping[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL
    ) -> contextlib.AbstractContextManager[Span]:
        """A child of the current span, itself the current one inside the block. An exception leaving the block is
        recorded on it and marks it an error."""
        if self.tracer is None or _unsampled(trace.get_current_span()):
            return _NOOP  # off, or in a trace not sampled: what the SDK would make records nothing, for more CPU
        return self._errors_recorded(
            self.tracer.start_as_current_span(
                name, kind=kind, attributes=attributes, record_exception=False, set_status_on_exception=False
            )
        )

    @contextlib.contextmanager
    def _errors_recorded(self, block: contextlib.AbstractContextManager[Span]) -> Iterator[Span]:
        """`block`'s span, marked failed by an exception leaving it: its type, its message only with text on (the
        SDK's own recording would export the message and the stack whatever the setting)."""
        with block as span:
            try:
                yield span
            except BaseException as exc:
                self.error(span, type(exc).__name__, str(exc) or repr(exc))
                raise

    def start(
        self,
        name: str,
        *,
        parent: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        start_time: int | None = None,
        links: Sequence[str] = (),
    ) -> Span:
        """A span that is not made current (end it with `.end()`; `within` makes it current for a block): a child
        of `parent`, a traceparent string from a stream entry, else of the current span; INVALID_SPAN when off.
        `start_time`: ns since the epoch, when it began before now. `links`: traceparent strings of related spans
        that are not its parent (a caller's context the ingress does not join); invalid ones are left out."""
        if self.tracer is None:
            return INVALID_SPAN
        context = extract(parent) if parent else None
        above = trace.get_current_span(context)
        if _unsampled(above):  # the SDK's sampler (parent-based) would record nothing: the parent, handed on as is
            return above
        linked = [trace.get_current_span(extract(link)).get_span_context() for link in links if link]
        return self.tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            start_time=start_time,
            links=[Link(c) for c in linked if c.is_valid] or None,
        )

    def within(self, span: Span) -> contextlib.AbstractContextManager[Any]:
        """`span` (from `start`) as the current span in the block, without ending it there. A span not sampled is
        current too (when tracing is on), so the spans begun in the block follow its decision instead of starting
        traces of their own. An exception leaving the block marks it failed (`error`)."""
        if not span.get_span_context().is_valid:
            return _NOOP
        return self._errors_recorded(
            use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)
        )

    def text(self, value: Any) -> str | None:
        """`value` as recordable text (cut to text_chars, the cut said), or None when text is not recorded."""
        if not self.text_chars or value is None:
            return None
        text = value if isinstance(value, str) else str(value)
        if len(text) <= self.text_chars:
            return text
        return f"{text[: self.text_chars]}... [{len(text) - self.text_chars} more characters]"

    def error(self, span: Span, kind: str, message: str, *, retried: bool = False) -> None:
        """Marks `span` failed: the error's type always, its message only with text on (an error's message quotes
        what it met: an agent's stdout, the job's names, a tenant's patterns). `retried`: the try failed and is
        run again."""
        if not span.is_recording():
            return
        text = self.text(message) if message else None
        status = f"{kind}: {text}" if text else kind
        span.set_status(Status(StatusCode.ERROR, (f"retried: {status}" if retried else status)[:1024]))
        span.set_attribute("rollq.error.type", kind)
        event = {"exception.type": kind}
        if text:
            event["exception.message"] = text
        span.add_event("exception", event)

    def workflow(self, name: str) -> str:
        """A job's workflow as a span records it: a command agent (`exec:PROGRAM ARGS...`) by its program alone
        unless text is on (its arguments may hold what the job passes it)."""
        if self.text_chars or not name.startswith("exec:"):
            return name
        return name.split(maxsplit=1)[0]

    def set_text(self, span: Span, key: str, value: Any) -> None:
        """span[key] = value's text, when text is recorded and the span is."""
        if self.text_chars and span.is_recording():
            text = self.text(value)
            if text is not None:
                span.set_attribute(key, text)

    def shutdown(self) -> None:
        """Exports what is buffered, then stops (a process's last act: spans of a SIGKILLed one are lost)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = self.tracer = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Tracing]:
        """This Tracing as `current` in the block (and the tasks started in it)."""
        token = current.set(self)
        try:
            yield self
        finally:
            current.reset(token)


def _unsampled(span: Span) -> bool:
    """`span` records nothing, in a trace whose root decided not to sample it (every span of it follows: parent-based).
    Ending it, or setting its attributes, does nothing."""
    context = span.get_span_context()
    return context.is_valid and not context.trace_flags.sampled and not span.is_recording()


def child_env(settings: RunSettings) -> dict[str, str]:
    """The tracing settings given to this process, as the ROLLQ_TRACE_* variables of a process it starts (`rollq
    up`'s workers): in the environment, not on the command line, as the headers may hold a token."""
    values = {
        "ROLLQ_TRACE_ENDPOINT": settings.trace_endpoint,
        "ROLLQ_TRACE_HEADERS": settings.trace_headers,
        "ROLLQ_TRACE_SERVICE": settings.trace_service,
        "ROLLQ_TRACE_SAMPLE_RATE": "" if settings.trace_sample_rate is None else repr(settings.trace_sample_rate),
        "ROLLQ_TRACE_TEXT": "true" if settings.trace_text else "",
        "ROLLQ_TRACE_TEXT_CHARS": str(settings.trace_text_chars) if settings.trace_text else "",
    }
    return {k: v for k, v in values.items() if v}


def active() -> Tracing | None:
    """The Tracing set for this task, if it traces."""
    tracing = current.get()
    return tracing if tracing is not None and tracing.tracer is not None else None


def span(name: str, **kwargs: Any) -> contextlib.AbstractContextManager[Span]:
    """A span of the current task's Tracing (a no-op without one)."""
    tracing = current.get()
    return _NOOP if tracing is None else tracing.span(name, **kwargs)


async def reward(mode: str, call: Awaitable[Any]) -> Any:
    """Awaits a reward call, inside a `reward` span (its mode, its value when a number) when this task traces."""
    if active() is None:
        return await call
    with span("reward", attributes={"rollq.reward_mode": mode}) as reward_span:
        value = await call
        if isinstance(value, int | float):
            reward_span.set_attribute("rollq.reward", float(value))
        return value


async def generation(traced: Tracing, req: Any, call: Awaitable[Any]) -> Any:
    """Awaits an engine call (`req`: its ModelRequest) inside an `engine.generate` span, recorded by
    `record_generation`."""
    with traced.span("engine.generate", kind=SpanKind.CLIENT) as span:
        resp = await call
        record_generation(traced, span, req, resp)
        return resp


def traceparent(of: Span | None = None) -> str:
    """The context of `of` (default: the current span) as a W3C traceparent ('' when tracing is off). A span not
    sampled has one too, its sampled flag clear: the next process follows the decision."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(of) if of is not None else None)
    return carrier.get(TRACEPARENT, "")


def extract(value: str) -> Context:
    return _PROPAGATOR.extract({TRACEPARENT: value})


def sample_attributes(traj: Any) -> dict[str, Any]:
    """What names a sample (a rollq.protocol Trajectory) on the trainer's spans, as the worker's attempt does. A
    leaf module, this one knows the trajectory by its fields."""
    return {
        "rollq.job_id": traj.job_id,
        "rollq.sample_index": traj.sample_index,
        "rollq.sample_id": f"{traj.job_id}#{traj.sample_index}",
        "rollq.status": traj.status,
        "rollq.reward": [s.reward for s in traj.sequences],
    }


def record_generation(traced: Tracing, span: Span, req: Any, resp: Any) -> None:
    """An engine call's span: tokens in and out, latency, engine, policy versions, finish reason (and the tokens
    themselves, decoded when the request has a tokenizer, only with trace_text on). `req` and `resp`: the
    engine's ModelRequest and ModelResponse (rollq.engine.types), known here by their fields."""
    if not span.is_recording():
        return
    versions = [v for v in resp.output_versions if v >= 0]
    span.set_attributes(
        {
            "rollq.engine": resp.engine,
            "rollq.tokens_in": len(resp.input_tokens),
            "rollq.tokens_out": len(resp.output_tokens),
            "rollq.latency_s": resp.latency_s,
            "rollq.finish_reason": resp.stop_reason,
            "rollq.policy_version": max(versions, default=-1),
            "rollq.policy_version_min": min(versions, default=-1),
            "rollq.resubmissions": resp.resubmissions,
        }
    )
    if traced.text_chars:
        tokenizer = req.tokenizer
        decode = getattr(tokenizer, "decode", None)
        prompt: Any = decode(resp.input_tokens) if decode else resp.input_tokens
        completion: Any = decode(resp.output_tokens) if decode else resp.output_tokens
        traced.set_text(span, "rollq.prompt", prompt)
        traced.set_text(span, "rollq.completion", completion)


__all__ = [
    "INVALID_SPAN",
    "NO_SPAN",
    "OFF",
    "TRACEPARENT",
    "Span",
    "SpanKind",
    "Tracing",
    "active",
    "child_env",
    "current",
    "extract",
    "generation",
    "parse_headers",
    "record_generation",
    "reward",
    "sample_attributes",
    "span",
    "traceparent",
    "traces_endpoint",
    "use_span",
]
