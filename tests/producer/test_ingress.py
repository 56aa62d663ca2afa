"""The HTTP ingress against a real Redis, a real server on loopback and (where results are needed) a real worker:
auth and tenants, validation, limits, idempotency, cancellation, SSE with resume, retention."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from rollq.producer.ingress import IngressClient, IngressError, JobSpec
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from tests.helpers import running_worker, wait_until
from tests.producer.ingress_helpers import GATE, running_ingress

ECHO = "tests.workflows:Echo"
GATE_WF = "tests.producer.ingress_helpers:Gate"


def auth(token: str = "tok-acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def gate():
    GATE.__init__()
    yield GATE
    GATE.release.set()


@pytest.fixture
async def ingress(redis_url, run_name):
    async with running_ingress(redis_url, run_name) as (app, url):
        yield app, url


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def queued(redis, run) -> int:
    return await redis.xlen(RunKeys(run).jobs)


# -- auth and tenants ------------------------------------------------------------------------------------------


async def test_requests_without_a_known_token_are_refused(ingress, http, redis, run_name):
    _, url = ingress
    body = {"workflow": ECHO, "data": {"x": 1}}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic tok-acme"}):
        r = await http.post(f"{url}/v1/jobs", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"] == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await http.get(f"{url}/v1/jobs/anything")).status_code == 401
    assert await queued(redis, run_name) == 0
    health = await http.get(f"{url}/healthz")  # no token needed
    assert health.status_code == 200 and health.json() == {"ok": True, "redis": True}


async def test_a_tenant_sees_only_its_own_jobs_and_ids_are_scoped_per_tenant(ingress, http, redis, run_name):
    app, url = ingress
    r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": "same", "n": 2}, headers=auth())
    assert r.status_code == 202, r.text
    assert r.json() == {"jobs": [{"job_id": "same", "admitted": True, "n": 2}]}
    # another tenant: the same id is another job, and the first tenant's job is invisible to it
    assert (await http.get(f"{url}/v1/jobs/same", headers=auth("tok-globex"))).status_code == 404
    assert (await http.delete(f"{url}/v1/jobs/same", headers=auth("tok-globex"))).status_code == 404
    assert (await http.get(f"{url}/v1/jobs/same/events", headers=auth("tok-globex"))).status_code == 404
    r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": "same"}, headers=auth("tok-globex"))
    assert r.json()["jobs"][0]["admitted"] is True
    assert await queued(redis, run_name) == 3
    mine = (await http.get(f"{url}/v1/jobs/same", headers=auth())).json()
    theirs = (await http.get(f"{url}/v1/jobs/same", headers=auth("tok-globex"))).json()
    assert (mine["n"], theirs["n"]) == (2, 1)
    assert mine["samples"] == ["queued", "queued"] and mine["done"] is False
    # inside, the job ids are namespaced by tenant
    ids = {Codec().decode_job(f[PAYLOAD_FIELD]).job_id for _, f in await redis.xrange(RunKeys(run_name).jobs)}
    assert ids == {"acme:same", "globex:same"}


async def test_the_same_job_id_twice_is_queued_once(ingress, http, redis, run_name):
    _, url = ingress
    batch = {"jobs": [{"workflow": ECHO, "job_id": "a"}, {"workflow": ECHO, "job_id": "b", "n": 2}]}
    first = await http.post(f"{url}/v1/jobs", json=batch, headers=auth())
    assert [j["admitted"] for j in first.json()["jobs"]] == [True, True]
    batch["jobs"].append({"workflow": ECHO, "job_id": "c"})
    again = await http.post(f"{url}/v1/jobs", json=batch, headers=auth())
    assert again.status_code == 202
    assert [(j["job_id"], j["admitted"]) for j in again.json()["jobs"]] == [("a", False), ("b", False), ("c", True)]
    assert await queued(redis, run_name) == 4
    generated = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO}, headers=auth())
    assert len(generated.json()["jobs"][0]["job_id"]) == 32  # the ingress made one up


async def test_a_tenant_restricted_to_workflow_patterns_gets_403_naming_the_workflow(ingress, http, redis, run_name):
    _, url = ingress
    ok = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO}, headers=auth("tok-narrow"))
    assert ok.status_code == 202, ok.text
    batch = {"jobs": [{"workflow": ECHO}, {"workflow": "subprocess:Popen", "workflow_kwargs": {"args": ["true"]}}]}
    r = await http.post(f"{url}/v1/jobs", json=batch, headers=auth("tok-narrow"))
    assert r.status_code == 403
    assert r.json()["field"] == "$.jobs[1].workflow" and "subprocess.Popen" in r.json()["message"]
    for refused in ({"workflow": "exec:sh -c 'touch /tmp/x'"}, {"workflow": ECHO, "data": {"agent_name": "rlvr"}}):
        r = await http.post(f"{url}/v1/jobs", json=refused, headers=auth("tok-narrow"))
        assert r.status_code == 403, r.text
    assert (await http.post(f"{url}/v1/jobs", json={"workflow": "exec:echo hi"}, headers=auth("tok-narrow"))).is_success
    assert await queued(redis, run_name) == 2  # the two allowed ones; nothing of the refused batches


# -- validation and limits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"jobs": [{"workflow": ECHO}, {"workflow": ECHO}, {"workflow": ECHO, "n": 0}]}, "$.jobs[2].n"),
        ({"jobs": [{"workflow": ECHO}, {"workflow": ""}]}, "$.jobs[1].workflow"),
        ({"jobs": [{"workflow": ECHO}, {"data": 1}]}, "$.jobs[1]"),  # workflow missing
        ({"jobs": [{"workflow": ECHO, "nn": 2}]}, "$.jobs[0]"),  # unknown field
        ({"jobs": [{"workflow": ECHO, "job_id": "bad id/"}]}, "$.jobs[0].job_id"),
        ({"jobs": [{"workflow": ECHO, "agent": {"turn_discount": 3}}]}, "$.jobs[0].agent"),
        ({"jobs": [{"workflow": ECHO, "job_id": "x"}, {"workflow": ECHO, "job_id": "x"}]}, "$.jobs[1].job_id"),
        ({"jobs": [{"workflow": ECHO, "n": 5000}]}, "$.jobs[0].n"),  # over max_n
        ({"jobs": [{"workflow": ECHO, "job_class": "nosuch"}]}, "$.jobs[0].job_class"),
        ({"jobs": "no"}, "$.jobs"),
        ({"jobs": []}, "$.jobs"),
        ({"workflow": ECHO, "n": "3"}, "$.n"),
        # JSON allows any integer, msgpack 64 bits (found by the schemathesis fuzz: a 500)
        ({"jobs": [{"workflow": ECHO}, {"workflow": ECHO, "data": [[-(2**85)]]}]}, "$.jobs[1].data"),
        ({"workflow": ECHO, "workflow_kwargs": {"k": 2**64}}, "$.workflow_kwargs"),
    ],
)
async def test_a_bad_item_is_a_400_naming_its_field_and_nothing_is_queued(ingress, http, redis, run_name, body, field):
    _, url = ingress
    r = await http.post(f"{url}/v1/jobs", json=body, headers=auth())
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "invalid" and r.json()["field"] == field
    assert field in r.json()["message"]
    assert await queued(redis, run_name) == 0
    assert await redis.keys(f"{RunKeys(run_name).prefix}:ctl:*") == []


async def test_bodies_that_are_not_json_are_400(ingress, http):
    _, url = ingress
    for content in (b"{", b"", b"\xff\xfe"):
        r = await http.post(f"{url}/v1/jobs", content=content, headers=auth())
        assert r.status_code == 400 and r.json()["error"] == "invalid"


async def test_oversize_bodies_and_batches_are_413_and_nothing_is_queued(redis_url, run_name, redis, http):
    async with running_ingress(redis_url, run_name, max_body_bytes=4096, max_batch=3) as (_, url):
        big = {"workflow": ECHO, "data": "x" * 5000}
        r = await http.post(f"{url}/v1/jobs", json=big, headers=auth())
        assert r.status_code == 413 and r.json()["error"] == "too_large"

        async def chunked():  # no Content-Length: the server stops reading at the limit
            for _ in range(10):
                yield b" " * 1000

        r = await http.post(f"{url}/v1/jobs", content=chunked(), headers=auth())
        assert r.status_code == 413
        r = await http.post(f"{url}/v1/jobs", json={"jobs": [{"workflow": ECHO}] * 4}, headers=auth())
        assert r.status_code == 413 and r.json()["field"] == "$.jobs" and "max_batch=3" in r.json()["message"]
        assert (await http.post(f"{url}/v1/jobs", json={"jobs": [{"workflow": ECHO}] * 3}, headers=auth())).is_success
        assert await queued(redis, run_name) == 3


async def test_a_batch_that_does_not_fit_the_queue_bound_is_refused_whole(redis_url, run_name, redis, http):
    async with running_ingress(redis_url, run_name, max_queued=5) as (app, url):
        r = await http.post(f"{url}/v1/jobs", json={"jobs": [{"workflow": ECHO, "n": 2}] * 2}, headers=auth())
        assert r.status_code == 202
        r = await http.post(f"{url}/v1/jobs", json={"jobs": [{"workflow": ECHO}, {"workflow": ECHO}]}, headers=auth())
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert await queued(redis, run_name) == 4  # not 5: the batch's first job was not admitted either
        assert (await http.post(f"{url}/v1/jobs", json={"workflow": ECHO}, headers=auth())).status_code == 202
        assert app.stats.refused_busy == 1 and app.stats.samples_admitted == 5
        # duplicates need no room
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": "d"}, headers=auth())
        assert r.status_code == 429


async def test_jobs_carry_retention_ttls_and_the_job_streams_layout(redis_url, run_name, redis, http):
    async with running_ingress(redis_url, run_name, retention=120) as (_, url):
        await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": "j", "n": 2}, headers=auth())
        keys = RunKeys(run_name)
        assert 100 < await redis.ttl(keys.job_control("acme:j")) <= 120
        assert 100 < await redis.ttl(keys.job_results("acme:j")) <= 120
        jobs = [Codec().decode_job(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(keys.jobs)]
        assert [(j.sample_index, j.n, j.cancellable, j.reply_to) for j in jobs] == [
            (0, 2, True, keys.job_results("acme:j")),
            (1, 2, True, keys.job_results("acme:j")),
        ]


# -- results, SSE, cancellation --------------------------------------------------------------------------------


async def read_events(http, url, job_id, last_event_id=None, stop_after=None):
    """(event, id, data) tuples of one SSE connection (closing it after `stop_after` sample events)."""
    headers = auth() | ({"Last-Event-ID": last_event_id} if last_event_id else {})
    out = []
    async with http.stream("GET", f"{url}/v1/jobs/{job_id}/events", headers=headers) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = {}
        async for line in resp.aiter_lines():
            if line.startswith(":"):
                continue
            if line:
                name, _, value = line.partition(": ")
                event[name] = value
                continue
            if not event:  # the blank line after a keepalive comment
                continue
            out.append((event.get("event"), event.get("id"), json.loads(event["data"])))
            event = {}
            if stop_after is not None and sum(e == "sample" for e, _, _ in out) >= stop_after:
                break
    return out


async def test_sse_streams_samples_as_they_finish_and_resumes_without_gaps_or_duplicates(
    ingress, http, redis_url, run_name, gate
):
    _, url = ingress
    r = await http.post(f"{url}/v1/jobs", json={"workflow": GATE_WF, "job_id": "s", "n": 5}, headers=auth())
    assert r.status_code == 202
    async with running_worker(redis_url, run_name, concurrency=8):
        gate.release.set()
        first = await asyncio.wait_for(read_events(http, url, "s", stop_after=2), 20)
        assert [e for e, _, _ in first] == ["sample", "sample"]
        rest = await asyncio.wait_for(read_events(http, url, "s", last_event_id=first[-1][1]), 20)
    assert [e for e, _, _ in rest][-1] == "done"
    samples = first + rest[:-1]
    assert sorted(d["sample_index"] for _, _, d in samples) == [0, 1, 2, 3, 4]  # no gap, no duplicate
    ids = [i for _, i, _ in samples]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-")))) and len(set(ids)) == 5
    assert all(d["job_id"] == "s" and d["status"] == "ok" and d["sequences"] for _, _, d in samples)
    assert rest[-1][2] == {"job_id": "s", "n": 5, "counts": {**ZERO, "ok": 5}}
    # a stream opened after the end replays everything and ends; one resumed at the last id only ends
    replay = await read_events(http, url, "s")
    assert [e for e, _, _ in replay] == ["sample"] * 5 + ["done"]
    assert [e for e, _, _ in await read_events(http, url, "s", last_event_id=ids[-1])] == ["done"]
    status = (await http.get(f"{url}/v1/jobs/s", headers=auth())).json()
    assert status["done"] and status["counts"]["ok"] == 5 and len(status["trajectories"]) == 5
    assert status["trajectories"][0]["sequences"][0]["input_ids"][:2] == [100, 101]
    brief = (await http.get(f"{url}/v1/jobs/s?trajectories=false", headers=auth())).json()
    assert brief["trajectories"] is None
    bad = await http.get(f"{url}/v1/jobs/s/events", headers=auth() | {"Last-Event-ID": "nope"})
    assert bad.status_code == 400


ZERO = {"queued": 0, "running": 0, "ok": 0, "rejected": 0, "error": 0, "cancelled": 0}


async def test_cancel_before_start_means_no_sample_ever_runs(ingress, http, redis, redis_url, run_name, gate):
    _, url = ingress
    await http.post(f"{url}/v1/jobs", json={"workflow": GATE_WF, "job_id": "c", "n": 3}, headers=auth())
    r = await http.delete(f"{url}/v1/jobs/c", headers=auth())
    assert r.status_code == 200
    assert r.json() == {"job_id": "c", "n": 3, "already_cancelled": False, "started": [], "cancelled": [0, 1, 2]}
    events = await asyncio.wait_for(read_events(http, url, "c"), 10)  # all accounted for at once
    assert [(e, d.get("status")) for e, _, d in events] == [("sample", "cancelled")] * 3 + [("done", None)]
    gate.release.set()
    async with running_worker(redis_url, run_name, concurrency=4):
        await wait_until(lambda: _is_zero(queued(redis, run_name)), 10, what="the cancelled samples to be acked")
    assert gate.runs == []
    status = (await http.get(f"{url}/v1/jobs/c", headers=auth())).json()
    assert status["cancelled"] and status["done"] and status["counts"] == {**ZERO, "cancelled": 3}
    assert await redis.xlen(RunKeys(run_name).job_results("acme:c")) == 3  # the worker published no second result
    again = await http.delete(f"{url}/v1/jobs/c", headers=auth())
    assert again.json()["already_cancelled"] is True


async def _is_zero(value) -> bool:
    return await value == 0


async def test_cancel_after_some_started_names_them_and_only_they_run(ingress, http, redis_url, run_name, gate):
    _, url = ingress
    async with IngressClient(url, "tok-acme") as client:
        await client.submit(JobSpec(workflow=GATE_WF, job_id="p", n=5, data={"tag": "p"}))
        async with running_worker(redis_url, run_name, concurrency=2):
            async with gate.started:
                await asyncio.wait_for(gate.started.wait_for(lambda: len(gate.runs) == 2), 10)
            cancelled = await client.cancel("p")
            started = sorted(i for _, i in gate.runs)
            assert cancelled.started == started
            assert sorted(cancelled.cancelled + cancelled.started) == [0, 1, 2, 3, 4]
            mid = await client.get("p", trajectories=False)
            assert mid.counts.running == 2 and mid.counts.cancelled == 3 and not mid.done
            gate.release.set()
            results = await asyncio.wait_for(client.wait("p"), 20)
        assert sorted(gate.runs) == [("p", i) for i in started]  # the cancelled samples never ran
        assert {t.sample_index: t.status for t in results} == {
            i: "ok" if i in started else "cancelled" for i in range(5)
        }
        with pytest.raises(IngressError) as err:
            await client.get("nope")
        assert err.value.status == 404


async def test_client_events_resume_after_a_dropped_connection(ingress, http, redis_url, run_name, gate):
    _, url = ingress
    async with IngressClient(url, "tok-acme") as client:
        await client.submit_many([JobSpec(workflow=GATE_WF, job_id="r", n=4)])
        gate.release.set()
        async with running_worker(redis_url, run_name, concurrency=4):
            seen = []
            async for event in client.events("r"):
                seen.append(event)
                if len(seen) == 2:
                    break  # the connection is dropped here
            rest = [e async for e in client.events("r", last_event_id=seen[-1].id)]
    indices = [e.trajectory.sample_index for e in seen + rest]
    assert sorted(indices) == [0, 1, 2, 3]


async def test_the_workers_allowlist_holds_for_ingress_jobs(ingress, http, redis, redis_url, run_name, tmp_path):
    """Issue 13: `subprocess:Popen` with kwargs {"args": ["touch", FILE]} must never run; the job ends as an error
    result (and a dead letter) saying why."""
    _, url = ingress
    target = tmp_path / "x"
    job = {"workflow": "subprocess:Popen", "workflow_kwargs": {"args": ["touch", str(target)]}, "job_id": "evil"}
    r = await http.post(f"{url}/v1/jobs", json=job, headers=auth())
    assert r.status_code == 202  # this tenant has no workflow restriction: the workers' allowlist decides
    async with running_worker(redis_url, run_name):
        events = await asyncio.wait_for(read_events(http, url, "evil"), 20)
    assert [e for e, _, _ in events] == ["sample", "done"]
    result = events[0][2]
    assert result["status"] == "error"
    assert "not allowed" in result["error"]["message"] and "--allow" in result["error"]["message"]
    assert not target.exists()
    assert await redis.xlen(RunKeys(run_name).dead) == 1
    assert not os.path.exists(target)


async def test_openapi_lists_the_endpoints_and_schemas(ingress, http):
    _, url = ingress
    doc = (await http.get(f"{url}/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/healthz"} <= set(doc["paths"])
    assert {"JobSpec", "JobBatch", "JobStatus", "Trajectory", "Sequence", "Done", "CancelResponse"} <= set(
        doc["components"]["schemas"]
    )


async def test_stats_count_what_happened(ingress, http):
    app, url = ingress
    await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 3}, headers=auth())
    await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 0}, headers=auth())
    await http.post(f"{url}/v1/jobs", json={"workflow": ECHO})
    assert (app.stats.jobs_admitted, app.stats.samples_admitted) == (1, 3)
    assert (app.stats.refused_invalid, app.stats.refused_unauthorized) == (1, 1)


# -- decoded text ----------------------------------------------------------------------------------------------

TEXT_KWARGS = {"reward_fn": "rollq.tasks.digits:digits_reward", "max_new_tokens": 6, "tokenizer": "tiny"}


async def test_a_job_that_asks_for_text_gets_each_sequence_decoded_and_others_get_none(
    ingress, http, redis_url, run_name, engine_process, spawn_worker
):
    """`"text": true` over real HTTP, the built-in rlvr loop in a worker against a real (synthetic) engine: the
    worker decodes each sequence with the workflow's tokenizer, split where the model's tokens begin; a job that
    does not ask (the default) carries no text. A value that is not a boolean is a 400 naming `text`."""
    from transformers import AutoTokenizer

    from rollq.engine.models import model_dir

    _, url = ingress
    _, engine = await engine_process("--tokenizer", "tiny", "--sampled")
    prompt = {"prompt": "Write a number using digits only."}
    jobs = [
        {"workflow": "rlvr", "job_id": "t", "n": 2, "data": prompt, "workflow_kwargs": TEXT_KWARGS, "text": True},
        {"workflow": "rlvr", "job_id": "plain", "data": prompt, "workflow_kwargs": TEXT_KWARGS},
    ]
    r = await http.post(f"{url}/v1/jobs", json={"jobs": jobs}, headers=auth())
    assert r.status_code == 202, r.text
    spawn_worker(redis_url, run_name, "--engine", engine)  # a `rollq worker`, its --tokenizer tiny by default
    events = await asyncio.wait_for(read_events(http, url, "t"), 60)
    plain = await asyncio.wait_for(read_events(http, url, "plain"), 60)
    tokenizer = AutoTokenizer.from_pretrained(model_dir("tiny"))
    samples = [d for e, _, d in events if e == "sample"]
    assert len(samples) == 2 and all(d["status"] == "ok" for d in samples)
    for d in samples:
        [seq] = d["sequences"]
        cut = seq["loss_mask"].index(1)
        assert seq["text"] == {
            "prompt": tokenizer.decode(seq["input_ids"][:cut]),
            "completion": tokenizer.decode(seq["input_ids"][cut:]),
        }
        assert seq["text"]["prompt"].startswith("<|im_start|>user\nWrite a number using digits only.<|im_end|>")
    status = (await http.get(f"{url}/v1/jobs/t", headers=auth())).json()
    assert [t["sequences"][0]["text"] for t in status["trajectories"]] == [d["sequences"][0]["text"] for d in samples]
    [untexted] = [d for e, _, d in plain if e == "sample"]
    assert untexted["status"] == "ok" and "text" not in untexted["sequences"][0]  # off by default: no bytes spent

    bad = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "text": "yes"}, headers=auth())
    assert bad.status_code == 400 and bad.json()["field"] == "$.text", bad.text
    assert "bool" in bad.json()["message"]
