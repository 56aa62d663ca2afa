"""What traces may carry and who decides their sampling (security round 2, N8). With `trace_text` off, spans carried
no prompts but did carry error messages verbatim: an agent's last stdout line, a workflow's exception text, and a
command agent's arguments. And the ingress made a tenant's `traceparent` header the submit's parent, so its sampled
flag overrode trace_sample_rate and its spans could join any trace. A real worker and ingress exporting OTLP/HTTP to
a real loopback receiver (rollq.trace_sink)."""

from __future__ import annotations

import httpx
import msgspec

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.trace_sink import SinkSpan, TraceSink
from tests.agents import SCRIPT
from tests.helpers import running_worker
from tests.producer.ingress_helpers import running_ingress
from tests.scripted import scripted_engine

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a tenant's span, sampled


async def traced_jobs(redis, redis_url, run: str, endpoint: str, reqs: list[JobRequest]) -> None:
    """`reqs` run to their end by a worker exporting to `endpoint`, trace_text off; returns once the worker stopped
    (its spans exported as it does)."""
    async with (
        scripted_engine(SCRIPT) as engine,
        EnginePool(PoolConfig(urls=[engine.url])) as pool,
        running_worker(
            redis_url, run, engine=pool, max_attempts=2, allow=["tests", "command:sh"], trace_endpoint=endpoint
        ),
    ):
        producer = Producer(redis, run)
        await producer.submit_many(reqs)
        async for _ in producer.wait_for({r.job_id: 1 for r in reqs if r.job_id}, timeout_s=60):
            pass


async def test_with_trace_text_off_spans_carry_error_types_not_their_text(redis, redis_url, run_name):
    agent = "exec:sh -c 'echo SECRET-ARG >/dev/null; echo SECRET-STDOUT this is not json'"
    reqs = [
        JobRequest(workflow="tests.workflows:Boom", data={"i": "SECRET-MSG"}, job_id="boom"),
        JobRequest(workflow=agent, data={"question": "SECRET-DATA"}, job_id="agent"),
    ]
    async with TraceSink() as sink:
        await traced_jobs(redis, redis_url, run_name, sink.endpoint, reqs)
        spans: list[SinkSpan] = list(sink.spans)
    attempts = [s for s in spans if s.name == "attempt"]
    assert len(attempts) == 4, [s.name for s in spans]  # each job: a retried try, then its dead letter
    errors = {(s.attributes["rollq.job_id"], s.attributes["rollq.error.type"], s.status_message) for s in attempts}
    assert errors == {
        ("boom", "RuntimeError", "retried: RuntimeError"),
        ("boom", "RuntimeError", "RuntimeError"),
        ("agent", "AgentOutputError", "retried: AgentOutputError"),
        ("agent", "AgentOutputError", "AgentOutputError"),
    }
    episodes = [s for s in spans if s.name == "episode"]
    assert {s.status for s in episodes} == {"ERROR"} and {s.status_message for s in episodes} == {
        "RuntimeError",
        "AgentOutputError",
    }
    assert {s.attributes["rollq.workflow"] for s in attempts} == {"tests.workflows:Boom", "exec:sh"}
    exported = msgspec.json.encode(spans).decode()
    assert "SECRET" not in exported  # no stdout, no message, no argument, no data: anywhere in any span


async def test_a_clients_traceparent_is_a_link_and_cannot_force_sampling(redis, redis_url, run_name):
    job = {"workflow": "tests.workflows:Echo", "job_id": "a"}
    headers = {"Authorization": "Bearer tok-acme", "traceparent": CALLER}
    async with TraceSink() as sink:
        # The operator samples nothing: the tenant's sampled flag changes nothing.
        async with running_ingress(redis_url, run_name, trace_endpoint=sink.endpoint, trace_sample_rate=0.0) as (
            _,
            url,
        ):
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(f"{url}/v1/jobs", json=job, headers=headers)
            assert r.status_code == 202, r.text
        assert sink.spans == []  # the ingress exported what it held as it stopped: nothing
        [(_, fields)] = await redis.xrange(RunKeys(run_name).jobs)
        _, trace_id, _, flags = Codec().decode_job(fields[PAYLOAD_FIELD]).traceparent.split("-")
        assert not int(flags, 16) & 1 and trace_id != CALLER.split("-")[1]  # the workers follow the operator's decision
        # Sampled by the operator: a trace of its own, linked to the caller's span, not joined to it.
        async with running_ingress(redis_url, run_name + "b", trace_endpoint=sink.endpoint) as (_, url):
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(f"{url}/v1/jobs", json=job, headers=headers)
            assert r.status_code == 202, r.text
        [submit] = sink.spans
    assert submit.name == "submit" and submit.parent_id == "" and submit.trace_id != CALLER.split("-")[1]
    assert submit.links == [CALLER.split("-")[2]]
