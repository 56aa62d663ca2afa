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
from rollq.tracing import span as tracing_span
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
    attempt = downstream.start("attempt", parent=tp)
    with downstream.installed(), downstream.within(attempt):  # the worker's shape: episode, engine call, reward
        with tracing_span("episode"), tracing_span("engine.generate"):
            pass
        assert traceparent(attempt).split("-")[1] == tp.split("-")[1]  # the trajectory carries the decision on
    attempt.end()
    assert exported.get_finished_spans() == ()  # not one span of its own trace, nor of a new one
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    by_env, exported = memory_tracing()  # no rollq rate: the standard variables decide
    by_env.start("submit").end()
    assert exported.get_finished_spans() == ()


async def test_a_job_that_waits_for_room_stays_one_trace(redis, redis_url, run_name):
    """Backpressure: jobs refused for room are tried again; each keeps the one submit span it began with (its tries
    on it) rather than a new trace per try, and the span ends when the job is admitted, or with the error that gave up
    on it (QueueFull)."""
    from rollq.producer.producer import QueueFull
    from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys

    tracing, exported = memory_tracing()
    producer = Producer(redis, run_name, max_inflight=2, poll_interval_s=0.01, tracing=tracing)
    reqs = [JobRequest(workflow="tests.workflows:Echo", data={"i": i}, job_id=f"j{i}") for i in range(4)]
    with pytest.raises(QueueFull):
        await producer.submit_many(reqs[:3], wait=False)  # room for two: the third is refused, not waited for
    first = {s.attributes["rollq.job_id"]: s for s in exported.get_finished_spans() if s.name == "submit"}
    assert {j: s.attributes.get("rollq.admitted") for j, s in first.items()} == {"j0": True, "j1": True, "j2": None}
    assert first["j2"].status.description.startswith("QueueFull") and first["j2"].events[0].name == "exception"
    entries = await redis.xrange(RunKeys(run_name).jobs)  # queued, no worker yet: each carries its submit's context
    carried = {job.job_id: job.traceparent for job in (Codec().decode_job(f[PAYLOAD_FIELD]) for _, f in entries)}
    assert {j: int(tp.split("-")[2], 16) for j, tp in carried.items()} == {j: first[j].context.span_id for j in carried}
    assert sorted(carried) == ["j0", "j1"]
    exported.clear()
    consumer = producer.consumer()
    await consumer.setup()
    async with running_worker(redis_url, run_name, concurrency=4):
        submit = asyncio.create_task(producer.submit_many(reqs[2:]))  # wait until j0 and j1 are consumed
        got = 0
        while got < 4:
            batch = await consumer.read(count=4, block_ms=2000)
            got += len(batch)
            await consumer.commit(batch)  # frees room for the waiting jobs
        assert all(r.admitted for r in await asyncio.wait_for(submit, 10))
    spans = {s.attributes["rollq.job_id"]: s for s in exported.get_finished_spans() if s.name == "submit"}
    assert sorted(spans) == ["j2", "j3"]
    assert all(s.attributes["rollq.admitted"] and s.attributes["rollq.submit_tries"] >= 2 for s in spans.values())
    assert len({s.context.trace_id for s in spans.values()}) == 2


async def test_a_traced_engine_call_hands_its_span_to_the_engine():
    """/generate carries the W3C `traceparent` of the caller's span (what SGLang with --enable-trace makes its request's
    root span a child of), plain and streamed; untraced calls carry none. The headers as aiohttp sent them to a real
    engine server on loopback."""
    import aiohttp

    from rollq.engine.client import SGLangClient
    from rollq.engine.types import SamplingParams

    tracing, _ = memory_tracing()
    sent: list[dict[str, str]] = []

    async def on_request_start(session, context, params) -> None:
        sent.append(dict(params.headers))

    hooks = aiohttp.TraceConfig()
    hooks.on_request_start.append(on_request_start)
    sampling = SamplingParams(max_new_tokens=2)
    async with scripted_engine(["hi"]) as engine, aiohttp.ClientSession(trace_configs=[hooks]) as http:
        client = SGLangClient(engine.url, http)
        await client.generate([1, 2, 3], sampling)
        with tracing.installed(), tracing.span("engine.generate") as span:
            await client.generate([1, 2, 3], sampling)
            await client.generate([1, 2, 3], sampling, on_progress=lambda ids, logprobs: None)
            expected = traceparent(span)
    assert "traceparent" not in sent[0]
    assert [h.get("traceparent") for h in sent[1:]] == [expected, expected]
    assert expected.split("-")[2] == format(span.get_span_context().span_id, "016x")


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
    """A job submitted over HTTP with a W3C `traceparent` header, where the operator trusts callers with it
    (trace_client_parent): its submit span is a child of the caller's span, and the queued job carries the submit's
    context to the worker (without the setting, a trace of its own linked to the caller's: test_tracing_privacy.py).
    A request refused halfway (413 at its second job) ends the spans it began, failed."""
    import httpx

    from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
    from tests.producer.ingress_helpers import running_ingress

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's own variable: export every 50 ms
    async with (
        TraceSink() as sink,
        running_ingress(
            redis_url, run_name, trace_endpoint=sink.endpoint, max_request_bytes=1024, trace_client_parent=True
        ) as (_, url),
    ):
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
            big = {"workflow": "tests.workflows:Echo", "job_id": "c", "n": 16}  # 16 entries: over 1024 bytes
            refused = await http.post(
                f"{url}/v1/jobs",
                json={"jobs": [{"workflow": "tests.workflows:Echo", "job_id": "b"}, big]},
                headers={"Authorization": "Bearer tok-acme"},
            )
        assert refused.status_code == 413, refused.text
        spans = await sink.wait_for(lambda s: len([x for x in s if x.name == "submit"]) == 4, 30)
    failed = [s for s in spans if s.name == "submit" and s.attributes.get("rollq.client_job_id") in ("b", "c")]
    assert sorted(s.attributes["rollq.client_job_id"] for s in failed) == ["b", "c"]
    assert {s.attributes["rollq.error.type"] for s in failed} == {"HttpError"}
    submits = [s for s in spans if s.name == "submit" and s not in failed]
    assert {s.trace_id for s in submits} == {"0af7651916cd43dd8448eb211c80319c"}
    assert {s.parent_id for s in submits} == {"b7ad6b7169203331"} and {s.service for s in submits} == {"rollq-ingress"}
    assert sorted(s.attributes["rollq.admitted"] for s in submits) == [True, True]
    entries = await redis.xrange(RunKeys(run_name).jobs)
    carried = {Codec().decode_job(fields[PAYLOAD_FIELD]).traceparent.split("-")[2] for _, fields in entries}
    assert carried == {s.span_id for s in submits}
