"""rollq.tracing in one process: where spans go (settings over the standard OTEL_* variables), sampling decided at
the root and followed downstream, text closed by default and capped when opened, nothing on the wire when off, and an
agent's completions through the recording proxy as children of its episode."""

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rollq.config import RunSettings, load
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.codec import Codec
from rollq.protocol.messages import Job
from rollq.trace_sink import TraceSink
from rollq.tracing import Tracing, child_env, parse_headers, traceparent, traces_endpoint
from tests.agents import SCRIPT
from tests.helpers import running_worker
from tests.scripted import scripted_engine


def memory_tracing(**kwargs) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing.exporting(exporter, batch=False, **kwargs), exporter


@pytest.mark.parametrize(
    ("setting", "env", "expected"),
    [
        ("", {}, ""),  # closed by default
        (
            "http://a:5000/v1/traces",
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b/v1/traces"},
            "http://a:5000/v1/traces",
        ),
        ("off", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318"}, ""),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b/custom"}, "http://b/custom"),  # as is, per the spec
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318/"}, "http://b:4318/v1/traces"),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318", "OTEL_SDK_DISABLED": "true"}, ""),
    ],
)
def test_where_spans_go(setting, env, expected):
    assert traces_endpoint(setting, env) == expected


def test_headers_parse_as_the_otel_variable_does():
    assert parse_headers("x-mlflow-experiment-id=12, Authorization=Bearer%20t") == {
        "x-mlflow-experiment-id": "12",
        "authorization": "Bearer t",
    }
    with pytest.raises(ValueError, match="'oops' is not key=value"):
        parse_headers("a=1,oops")
    with pytest.raises(ValueError, match="trace_sample_rate: 1.5"):
        RunSettings(trace_sample_rate=1.5)


async def test_settings_win_over_the_otel_variables(monkeypatch):
    """Service name and headers: the rollq setting, else OTEL_SERVICE_NAME / OTEL_EXPORTER_OTLP_HEADERS (read by the
    real OTLP exporter), else rollq-COMMAND; what arrives at a real OTLP/HTTP receiver says which."""
    async with TraceSink() as sink:
        monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-mlflow-experiment-id=7")
        cases = [
            (RunSettings(trace_endpoint=sink.endpoint), "from-env", "7"),
            (
                RunSettings(
                    trace_endpoint=sink.endpoint, trace_service="mine", trace_headers="x-mlflow-experiment-id=9"
                ),
                "mine",
                "9",
            ),
        ]
        for settings, service, experiment in cases:
            tracing = Tracing.from_settings(settings, "worker")
            tracing.start("probe").end()
            await asyncio.to_thread(tracing.shutdown)  # exports synchronously: the receiver is on this loop
            assert sink.spans[-1].service == service and sink.headers[-1]["x-mlflow-experiment-id"] == experiment
        monkeypatch.delenv("OTEL_SERVICE_NAME")
        tracing = Tracing.from_settings(RunSettings(trace_endpoint=sink.endpoint), "trainer")
        tracing.start("probe").end()
        await asyncio.to_thread(tracing.shutdown)
        assert sink.spans[-1].service == "rollq-trainer"


def test_rollq_up_hands_its_tracing_settings_to_the_workers_it_starts():
    given = RunSettings(trace_endpoint="http://m:5000/v1/traces", trace_headers="k=v", trace_sample_rate=0.25)
    opened = RunSettings(trace_endpoint="http://m:5000/v1/traces", trace_text=True, trace_text_chars=99)
    from rollq.workers.config import WorkerConfig

    for settings in (given, opened, RunSettings()):
        worker = load(WorkerConfig, "worker", env=child_env(settings))  # as the worker reads its environment
        names = ("trace_endpoint", "trace_headers", "trace_sample_rate", "trace_text", "trace_text_chars")
        assert [getattr(worker, n) for n in names] == [getattr(settings, n) for n in names]


def test_the_roots_sampling_decision_holds_downstream(monkeypatch):
    unsampled, _ = memory_tracing(sample_rate=0.0)
    downstream, exported = memory_tracing()  # its own default: every trace, unless the parent said no
    root = unsampled.start("submit")
    tp = traceparent(root)
    assert not int(tp.rsplit("-", 1)[1], 16) & 1  # valid, not sampled: carried so the next process follows it
    downstream.start("attempt", parent=tp).end()
    assert exported.get_finished_spans() == ()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    by_env, exported = memory_tracing()  # no rollq rate: the standard variables decide
    by_env.start("submit").end()
    assert exported.get_finished_spans() == ()


def test_off_costs_nothing_on_the_wire():
    tracing = Tracing.disabled()
    with tracing.span("episode") as span:
        assert not span.is_recording() and traceparent() == ""
    assert tracing.text("a prompt") is None
    plain = Job(job_id="j", workflow="w")
    assert Codec().encode(plain) == Codec().encode(Job(job_id="j", workflow="w", traceparent=""))


def test_text_is_closed_by_default_and_capped_when_opened():
    closed, exported = memory_tracing()
    with closed.span("engine.generate") as span:
        closed.set_text(span, "rollq.prompt", "secret")
    assert "rollq.prompt" not in exported.get_finished_spans()[0].attributes
    opened, exported = memory_tracing(text_chars=5)
    with opened.span("engine.generate") as span:
        opened.set_text(span, "rollq.prompt", "0123456789")
    assert exported.get_finished_spans()[0].attributes["rollq.prompt"] == "01234... [5 more characters]"


@pytest.mark.parametrize("text", [0, 4096])
async def test_an_agents_completions_are_children_of_its_episode(redis, redis_url, run_name, text):
    tracing, exported = memory_tracing(text_chars=text)
    async with (
        scripted_engine(SCRIPT) as engine,
        EnginePool(PoolConfig(urls=[engine.url])) as pool,
        running_worker(redis_url, run_name, engine=pool, max_attempts=1, tracing=tracing),
    ):
        producer = Producer(redis, run_name, tracing=tracing)
        consumer = producer.consumer()
        await consumer.setup()
        await producer.submit_many(
            [JobRequest(workflow="tests.agents:CalculatorAgent", job_id="j", data={"question": "What is 2 + 3?"})]
        )
        [traj] = [t async for t in producer.wait_for({"j": 1}, timeout_s=60, consumer=consumer)]
    assert traj.status == "ok" and traj.traceparent
    spans = {s.context.span_id: s for s in exported.get_finished_spans()}

    def named(name):
        return [s for s in spans.values() if s.name == name]

    [submit], [attempt], [episode], [reward] = named("submit"), named("attempt"), named("episode"), named("reward")
    assert attempt.parent.span_id == submit.context.span_id and episode.parent.span_id == attempt.context.span_id
    assert traj.traceparent.split("-")[2] == format(attempt.context.span_id, "016x")  # what the trainer continues
    completions = sorted(named("proxy.completion"), key=lambda s: s.start_time)
    assert len(completions) == 2 and all(c.parent.span_id == episode.context.span_id for c in completions)
    assert [c.attributes["rollq.tool_calls"] for c in completions] == [("add",), ()]
    assert [c.attributes["rollq.finish_reasons"] for c in completions] == [("tool_calls",), ("stop",)]
    assert all(
        c.attributes["rollq.model"] == "policy" and c.attributes["rollq.completion_tokens"] > 0 for c in completions
    )
    calls = named("engine.generate")
    assert sorted(spans[c.parent.span_id].name for c in calls) == ["proxy.completion"] * 2
    assert reward.parent.span_id == episode.context.span_id and reward.attributes["rollq.reward"] == 1.0
    if text:
        assert "What is 2 + 3?" in completions[0].attributes["rollq.messages"]
        assert "The answer is 5." in completions[1].attributes["rollq.completion"]
    else:
        assert not any(k in s.attributes for s in spans.values() for k in ("rollq.messages", "rollq.completion"))


async def test_the_ingress_continues_the_callers_trace(redis, redis_url, run_name, monkeypatch):
    """A job submitted over HTTP with a W3C `traceparent` header: its submit span is a child of the caller's span,
    and the queued job carries the submit's context to the worker."""
    import httpx

    from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
    from tests.producer.ingress_helpers import running_ingress

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's own variable: export every 50 ms
    async with TraceSink() as sink, running_ingress(redis_url, run_name, trace_endpoint=sink.endpoint) as (_, url):
        caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(
                f"{url}/v1/jobs",
                json={
                    "jobs": [{"workflow": "tests.workflows:Echo", "job_id": "a"}, {"workflow": "tests.workflows:Echo"}]
                },
                headers={"Authorization": "Bearer tok-acme", "traceparent": caller},
            )
        assert r.status_code == 202, r.text
        spans = await sink.wait_for(lambda s: len([x for x in s if x.name == "submit"]) == 2, 30)
    submits = [s for s in spans if s.name == "submit"]
    assert {s.trace_id for s in submits} == {"0af7651916cd43dd8448eb211c80319c"}
    assert {s.parent_id for s in submits} == {"b7ad6b7169203331"} and {s.service for s in submits} == {"rollq-ingress"}
    assert sorted(s.attributes["rollq.admitted"] for s in submits) == [True, True]
    entries = await redis.xrange(RunKeys(run_name).jobs)
    carried = {Codec().decode_job(fields[PAYLOAD_FIELD]).traceparent.split("-")[2] for _, fields in entries}
    assert carried == {s.span_id for s in submits}
