"""Rollout traces across real processes: `rollq train` (submit, train), a `rollq worker` subprocess (attempt,
episode, engine call, reward) and a synthetic engine, every process exporting OTLP/HTTP to one loopback receiver
(rollq.trace_sink, spans kept in memory). One trace per job; a dead-lettered sample's trace carries its error."""

import asyncio
import json
import os
import subprocess
import sys

from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import RunKeys
from rollq.trace_sink import SinkSpan, TraceSink
from rollq.tracing import Tracing
from tests.helpers import REPO_ROOT
from tests.trainer.helpers import WORKFLOW_KWARGS

STEPS, GROUP, GROUPS = 2, 2, 1
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the standard batch-processor variable: export every 50 ms


def chain(spans: list[SinkSpan], leaf: SinkSpan) -> list[SinkSpan]:
    """`leaf` and its ancestors, leaf first (as far as they arrived)."""
    by_id = {s.span_id: s for s in spans}
    out = [leaf]
    while out[-1].parent_id in by_id:
        out.append(by_id[out[-1].parent_id])
    return out


def children(spans: list[SinkSpan], parent: SinkSpan, name: str) -> list[SinkSpan]:
    return [s for s in spans if s.parent_id == parent.span_id and s.name == name]


async def traced_run(redis_url, run, tmp_path, engine_process, spawn_worker, endpoint, headers="") -> str:
    """A synthetic engine, a `rollq worker` subprocess and `rollq train` (STEPS steps) exporting to `endpoint`;
    returns the engine's URL once the trainer has exited (flushing its spans)."""
    _, url = await engine_process("--tokenizer", "tiny", "--sampled")
    env = {"ROLLQ_TRACE_ENDPOINT": endpoint, "ROLLQ_TRACE_HEADERS": headers, **FAST_EXPORT}
    spawn_worker(redis_url, run, "--engine", url, "--concurrency", "4", env=env)
    config = tmp_path / "rollq.yaml"
    config.write_text(
        json.dumps(
            {
                "redis_url": redis_url,
                "run": run,
                "trace_endpoint": endpoint,  # the file's shared keys (the worker took the variables)
                "trace_headers": headers,
                "trainer": {
                    "run_dir": str(tmp_path / "run"),
                    "engine": [url],
                    "steps": STEPS,
                    "group_size": GROUP,
                    "groups_per_step": GROUPS,
                    "workflow_kwargs": WORKFLOW_KWARGS,
                },
            }
        )
    )
    trainer = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "rollq", "train", "--config", str(config)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    return url


async def test_a_trained_samples_trace_spans_submit_to_train_across_processes(
    redis_url, run_name, tmp_path, engine_process, spawn_worker
):
    async with TraceSink() as sink:
        url = await traced_run(redis_url, run_name, tmp_path, engine_process, spawn_worker, sink.endpoint)

        # The trainer flushed its spans as it exited; the worker's follow within its export delay.
        def whole(spans: list[SinkSpan]) -> bool:
            ids = {s.span_id for s in spans}
            trained = [s for s in spans if s.name == "train"]
            return len(trained) >= STEPS * GROUP * GROUPS and all(s.parent_id in ids for s in trained)

        spans = await sink.wait_for(whole, 30)

    trained = [s for s in spans if s.name == "train"]
    assert sorted({s.attributes["rollq.step"] for s in trained}) == list(range(1, STEPS + 1))
    for leaf in trained:
        names = [s.name for s in chain(spans, leaf)]
        assert names == ["train", "attempt", "submit"], names  # the worker's attempt, the trainer's submit
        train, attempt, submit = chain(spans, leaf)
        assert train.trace_id == attempt.trace_id == submit.trace_id and submit.parent_id == ""
        assert (submit.service, attempt.service, train.service) == ("rollq-trainer", "rollq-worker", "rollq-trainer")
        assert attempt.attributes["rollq.sample_id"] == train.attributes["rollq.sample_id"]
        assert submit.attributes["rollq.job_id"] == attempt.attributes["rollq.job_id"]
        assert submit.attributes["rollq.n"] == GROUP and attempt.attributes["rollq.outcome"] == "ok"
        [episode] = children(spans, attempt, "episode")
        [engine_call] = children(spans, episode, "engine.generate")  # rlvr: one generation per sample
        [reward] = children(spans, episode, "reward")
        assert engine_call.attributes["rollq.engine"] == url
        assert engine_call.attributes["rollq.tokens_out"] > 0 and engine_call.attributes["rollq.tokens_in"] > 0
        assert engine_call.attributes["rollq.finish_reason"] in ("stop", "length")
        assert engine_call.attributes["rollq.policy_version"] <= train.attributes["rollq.version"]
        assert reward.attributes["rollq.reward"] == train.attributes["rollq.reward"][0]
        assert attempt.start_ns <= episode.start_ns <= engine_call.start_ns <= reward.start_ns
        assert reward.end_ns <= episode.end_ns <= attempt.end_ns and attempt.start_ns < train.start_ns
    # closed by default: no text, no token ids
    assert not [k for s in spans for k in s.attributes if k in ("rollq.prompt", "rollq.completion")]
    # the samples of one job share a trace (one submit), each sample its own attempt
    jobs = {s.attributes["rollq.job_id"]: s.trace_id for s in spans if s.name == "submit"}
    assert len(set(jobs.values())) == len(jobs)
    assert {t.trace_id for t in trained} <= set(jobs.values())


async def test_a_dead_lettered_samples_trace_carries_its_error(redis, redis_url, run_name, spawn_worker):
    """With trace_text on, its message too (off, its type alone: test_tracing_privacy.py)."""
    async with TraceSink() as sink:
        env = {"ROLLQ_TRACE_ENDPOINT": sink.endpoint, "ROLLQ_WORKER_MAX_ATTEMPTS": "2", "ROLLQ_TRACE_TEXT": "true"}
        env.update(FAST_EXPORT)
        spawn_worker(redis_url, run_name, env=env)
        # batched: exported from its own thread (the receiver runs on this event loop)
        tracing = Tracing.exporting(exporter_to(sink.endpoint), service="a-caller")
        producer = Producer(redis, run_name, tracing=tracing)
        try:
            [result] = await producer.submit_many([JobRequest(workflow="tests.workflows:Boom", data={"i": 7})])
        finally:
            await asyncio.to_thread(tracing.shutdown)

        def failed(spans: list[SinkSpan]) -> bool:
            return any(s.attributes.get("rollq.outcome") == "dead_lettered" for s in spans)

        spans = await sink.wait_for(failed, 60)
    [submit] = [s for s in spans if s.name == "submit"]
    assert submit.service == "a-caller" and submit.attributes["rollq.job_id"] == result.job_id
    attempts = sorted((s for s in spans if s.name == "attempt"), key=lambda s: s.start_ns)
    assert [a.parent_id for a in attempts] == [submit.span_id] * len(attempts) and len(attempts) == 2
    retried, last = attempts
    assert retried.status == "ERROR" and retried.status_message == "retried: RuntimeError: boom on 7"
    assert last.status == "ERROR" and last.status_message == "RuntimeError: boom on 7"
    assert last.attributes["rollq.error.type"] == "RuntimeError" and "exception" in last.events
    [episode] = children(spans, last, "episode")
    assert episode.status == "ERROR" and "exception" in episode.events  # raised through it: recorded there


def exporter_to(endpoint: str):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


async def test_rollq_enqueue_begins_each_jobs_trace_with_its_submit_span(redis, redis_url, run_name, tmp_path):
    """The standard OTEL_EXPORTER_OTLP_ENDPOINT is enough: `rollq enqueue` exports a submit span per job, and the job
    in the stream carries that span's context, so a worker's attempt joins its trace (it used to start one)."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"job_id": "a", "x": 1}\n{"job_id": "b", "x": 2}\n')
    async with TraceSink() as sink:
        base = sink.endpoint.removesuffix("/v1/traces")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLQ_TRACE", "OTEL_"))}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = base
        argv = [sys.executable, "-m", "rollq", "enqueue", str(jobs), "--workflow", "tests.workflows:Echo"]
        argv += ["--n", "2", "--redis", redis_url, "--run", run_name]
        res = await asyncio.to_thread(
            subprocess.run, argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env
        )
        assert res.returncode == 0, res.stderr
        spans = await sink.wait_for(lambda got: len([s for s in got if s.name == "submit"]) >= 2, 30)
    submits = {s.attributes["rollq.job_id"]: s for s in spans if s.name == "submit"}
    assert sorted(submits) == ["a", "b"]
    assert all(s.service == "rollq-enqueue" and s.parent_id == "" for s in submits.values())
    entries = await redis.xrange(RunKeys(run_name).jobs)
    queued = [Codec().decode_job(fields[b"d"]) for _, fields in entries]
    assert sorted((j.job_id, j.sample_index) for j in queued) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    for job in queued:
        _, trace_id, span_id, _ = job.traceparent.split("-")
        submit = submits[job.job_id]
        assert (trace_id, span_id) == (submit.trace_id, submit.span_id)
