"""What one tenant's requests may cost (issue 24, findings F3, F5, F9, F11, F13 of the security probe): a job's data
stored once however many samples it asks for, a bound on what a request takes in Redis, a per-tenant quota, SSE
streams that share a Redis reader instead of a connection each, bad bytes and damaged records answered with 4xx,
tenant patterns applied to the import paths inside workflow_kwargs. A real Redis, a real ingress on loopback and,
where results matter, a real worker."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from rollq.local import RedisServer
from rollq.producer.ingress import IngressConfig
from rollq.producer.producer import Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.redis_client import redis_client
from tests.helpers import running_worker
from tests.producer.ingress_helpers import running_ingress

ECHO = "tests.workflows:Echo"


def auth(token: str = "tok-acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def entry_sizes(redis, stream: str) -> list[int]:
    return [len(fields[PAYLOAD_FIELD]) for _, fields in await redis.xrange(stream)]


async def test_a_jobs_data_is_stored_once_however_many_samples_it_asks_for(redis_url, run_name, redis, http):
    """F3: 100 KB of data with n = 1024 was 1024 copies (112 MB in Redis); now one blob and 1024 small entries."""
    data = {"reward": 7, "pad": "x" * 100_000}
    async with running_ingress(redis_url, run_name) as (_, url):
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 1024, "data": data}, headers=auth())
        assert r.status_code == 202, r.text
        # the same data again (another job): still one stored copy
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 2, "data": data}, headers=auth())
        assert r.status_code == 202, r.text
    keys = RunKeys(run_name)
    sizes = await entry_sizes(redis, keys.jobs)
    assert len(sizes) == 1026 and max(sizes) < 1024, max(sizes)
    blobs = await redis.keys(f"{keys.prefix}:blob:*")
    assert len(blobs) == 1 and 100_000 < await redis.strlen(blobs[0]) < 101_000
    assert 86_000 < await redis.ttl(blobs[0]) <= 86_400  # the ingress's retention
    # a worker runs the samples with the data (Echo's reward comes from it)
    async with running_ingress(redis_url, run_name) as (_, url), running_worker(redis_url, run_name):
        r = await http.post(
            f"{url}/v1/jobs", json={"workflow": ECHO, "n": 3, "data": data, "job_id": "b"}, headers=auth()
        )
        assert r.status_code == 202
        async with http.stream("GET", f"{url}/v1/jobs/b/events", headers=auth()) as events:
            text = "".join([chunk async for chunk in events.aiter_text()])
        assert text.count("event: sample") == 3 and '"reward":7.0' in text and "event: done" in text


async def test_the_producer_stores_large_data_once_too(redis, run_name):
    from rollq.protocol.blobs import BLOB_MIN_BYTES

    producer = Producer(redis, run_name)
    big = {"prompt": "y" * (4 * BLOB_MIN_BYTES)}
    await producer.submit(ECHO, big, n=8)
    await producer.submit(ECHO, {"small": 1}, n=2)
    codec = Codec()
    jobs = [codec.decode_job(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(RunKeys(run_name).jobs)]
    assert [bool(j.data_ref) for j in jobs] == [True] * 8 + [False] * 2
    assert all(j.data is None and j.schema == 2 for j in jobs[:8])
    assert jobs[8].data == {"small": 1} and jobs[8].schema == 1  # small data travels inline, readable by older workers
    stored = await redis.get(RunKeys(run_name).blob(jobs[0].data_ref))
    assert codec.decode_data(stored) == big


async def test_a_worker_dead_letters_a_job_whose_data_is_gone_or_altered(redis_url, run_name, redis):
    producer = Producer(redis, run_name, reply_to=RunKeys(run_name).reply_stream("mine"))
    await producer.submit(ECHO, {"reward": 1, "pad": "z" * 1000}, job_id="gone")
    await producer.submit(ECHO, {"reward": 2, "pad": "q" * 1000}, job_id="altered")
    codec = Codec()
    refs = {
        j.job_id: j.data_ref
        for j in (codec.decode_job(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(RunKeys(run_name).jobs))
    }
    keys = RunKeys(run_name)
    await redis.delete(keys.blob(refs["gone"]))
    await redis.set(keys.blob(refs["altered"]), codec.encode({"reward": 99}))
    async with running_worker(redis_url, run_name):
        got = {}
        async for traj in producer.wait_for({"gone": 1, "altered": 1}, timeout_s=20):
            got[traj.job_id] = traj
    assert got["gone"].status == "error" and got["gone"].error.type == "JobDataMissing"
    assert got["altered"].status == "error" and got["altered"].error.type == "JobDataCorrupt"
    assert await redis.xlen(keys.dead) == 2


async def test_a_request_whose_jobs_would_take_too_much_redis_is_413(redis_url, run_name, redis, http):
    """F3: a body of a few hundred bytes asking for 1000 x 1024 samples is refused before anything is encoded."""
    async with running_ingress(redis_url, run_name, max_request_bytes=256 * 1024) as (app, url):
        small = {"jobs": [{"workflow": ECHO, "n": 1024, "data": {"i": i}} for i in range(10)]}
        r = await http.post(f"{url}/v1/jobs", json=small, headers=auth())
        assert r.status_code == 413, r.text
        assert "max_request_bytes" in r.json()["message"] and r.json()["field"].startswith("$.jobs[")
        assert await redis.xlen(RunKeys(run_name).jobs) == 0
        assert (await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 1024}, headers=auth())).is_success
        assert app.stats.refused_too_large == 1


async def test_a_tenant_past_its_quota_gets_429_with_retry_after_until_its_samples_start(
    redis_url, run_name, redis, http
):
    """F3: no quota before; now max_tenant_queued bounds each tenant's waiting samples (others are unaffected)."""
    assert IngressConfig().max_tenant_queued == 100_000 and IngressConfig().max_queued > 0  # closed by default
    async with running_ingress(redis_url, run_name, max_tenant_queued=10) as (app, url):
        assert (
            await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 8, "job_id": "a"}, headers=auth())
        ).is_success
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 3}, headers=auth())
        assert r.status_code == 429 and r.json()["error"] == "quota"
        assert int(r.headers["Retry-After"]) >= 1 and "max_tenant_queued" in r.json()["message"]
        # another tenant has its own quota
        assert (
            await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 8}, headers=auth("tok-globex"))
        ).is_success
        # cancelling gives the samples that never started back
        assert (await http.delete(f"{url}/v1/jobs/a", headers=auth())).status_code == 200
        assert (
            await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 10, "job_id": "b"}, headers=auth())
        ).is_success
        assert app.stats.refused_quota == 1
        # a worker starting the samples gives them back too (each once, cancelled ones not again)
        async with running_worker(redis_url, run_name):
            async with http.stream("GET", f"{url}/v1/jobs/b/events", headers=auth()) as events:
                assert "event: done" in "".join([chunk async for chunk in events.aiter_text()])
        assert int(await redis.get(RunKeys(run_name).tenant_queued("acme")) or 0) == 0
        assert (await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 10}, headers=auth())).is_success


async def test_sse_streams_share_a_redis_reader_and_are_capped(tmp_path, run_name, http):
    """F5: 216 streams exhausted a Redis with maxclients 200. Now 60 streams on a Redis that takes 40 clients all get
    their events, and the caps answer 429."""
    server = RedisServer().start()
    try:
        admin = redis_client(server.url)
        await admin.config_set("maxclients", 40)
        await admin.aclose()
        async with running_ingress(server.url, run_name, max_event_streams_per_tenant=60) as (app, url):
            r = await http.post(
                f"{url}/v1/jobs",
                json={"jobs": [{"workflow": ECHO, "job_id": f"j{i}"} for i in range(60)]},
                headers=auth(),
            )
            assert r.status_code == 202, r.text
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(timeout=30, limits=limits) as many:

                async def follow(i: int) -> str:
                    async with many.stream("GET", f"{url}/v1/jobs/j{i}/events", headers=auth()) as events:
                        return "".join([chunk async for chunk in events.aiter_text()])

                followers = [asyncio.create_task(follow(i)) for i in range(60)]
                await asyncio.wait_for(_until(lambda: app.stats.event_streams_open == 60), 20)
                over = await http.get(f"{url}/v1/jobs/j0/events", headers=auth())
                assert over.status_code == 429 and over.json()["error"] == "quota" and "Retry-After" in over.headers
                clients = int((await app.redis.info("clients"))["connected_clients"])
                assert clients < 20, clients  # not one per stream
                async with running_worker(server.url, run_name):
                    texts = await asyncio.wait_for(asyncio.gather(*followers), 30)
            assert all(t.count("event: sample") == 1 and "event: done" in t for t in texts)
            assert app.stats.event_streams_open == 0
        async with running_ingress(server.url, run_name, max_event_streams=1) as (app, url):
            async with http.stream("GET", f"{url}/v1/jobs/j0/events", headers=auth()) as first:
                assert first.status_code == 200  # j0 is done: the stream ends at once
                assert "event: done" in "".join([chunk async for chunk in first.aiter_text()])
    finally:
        server.close()


async def _until(check) -> None:
    while not check():
        await asyncio.sleep(0.01)


async def test_invalid_utf8_and_damaged_records_are_4xx_never_500(redis_url, run_name, redis, http):
    """F9: invalid UTF-8 gave 500 and a traceback; F13: a control record with a bad `n` gave 500 on GET/DELETE."""
    async with running_ingress(redis_url, run_name) as (app, url):
        r = await http.post(f"{url}/v1/jobs", content=b'{"workflow": "rlvr\xff\xfe"}', headers=auth())
        assert r.status_code == 400 and r.json()["error"] == "invalid", r.text
        keys = RunKeys(run_name)
        await redis.hset(keys.job_control("acme:bad"), mapping={"n": "abc"})
        await redis.hset(keys.job_control("acme:huge"), mapping={"n": "2000000"})
        for job in ("bad", "huge"):
            for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/events")):
                r = await http.request(method, f"{url}/v1/jobs/{job}{path}", headers=auth())
                assert r.status_code == 404 and "unreadable" in r.json()["message"], (job, method, path, r.text)
        # a results entry that is not a trajectory is skipped
        await redis.hset(keys.job_control("acme:ok"), mapping={"n": "1"})
        await redis.xadd(keys.job_results("acme:ok"), {"d": b"garbage"})
        assert (await http.get(f"{url}/v1/jobs/ok", headers=auth())).json()["samples"] == ["queued"]


async def test_tenant_patterns_cover_import_paths_inside_workflow_kwargs(redis_url, run_name, redis, http):
    """F11: a restricted tenant got 202 for `reward_fn: rollq.tasks.addition:...`."""
    async with running_ingress(redis_url, run_name) as (_, url):
        body = {"workflow": ECHO, "workflow_kwargs": {"reward_fn": "rollq.tasks.addition:reward"}}
        r = await http.post(f"{url}/v1/jobs", json=body, headers=auth("tok-narrow"))
        assert r.status_code == 403, r.text
        assert r.json()["field"] == "$.workflow_kwargs.reward_fn" and "rollq.tasks.addition" in r.json()["message"]
        nested = {"workflow": ECHO, "workflow_kwargs": {"tools": ["tests.workflows:Echo", {"fn": "os:system"}]}}
        r = await http.post(f"{url}/v1/jobs", json=nested, headers=auth("tok-narrow"))
        assert r.status_code == 403 and r.json()["field"] == "$.workflow_kwargs.tools[1].fn"
        assert await redis.xlen(RunKeys(run_name).jobs) == 0
        # what it may use passes, and the job carries the tenant's patterns for the workers to enforce
        ok = {"workflow": ECHO, "workflow_kwargs": {"note": "tests.workflows:Echo"}}
        assert (await http.post(f"{url}/v1/jobs", json=ok, headers=auth("tok-narrow"))).is_success
    ((_, fields),) = await redis.xrange(RunKeys(run_name).jobs)
    job = Codec().decode_job(fields[PAYLOAD_FIELD])
    assert job.allow == ["tests.workflows.Echo", "command:echo"] and job.tenant == "narrow" and job.schema == 2


def test_jobs_an_older_worker_must_not_run_say_schema_2_on_the_wire():
    """An older worker ignores fields it doesn't know: it would run a tenant's job with its whole allowlist, or a
    job without its data. Such jobs carry schema 2 explicitly (absent means 1), which it refuses (SchemaTooNew)."""
    import msgspec

    from rollq.protocol.messages import Job

    codec = Codec()
    plain = msgspec.msgpack.decode(codec.encode(Job(job_id="a", workflow="w", data={"x": 1})))
    assert "schema" not in plain
    for extra in ({"data_ref": "0" * 64}, {"tenant": "acme"}, {"allow": ["pkg"]}):
        wire = msgspec.msgpack.decode(codec.encode(Job(job_id="a", workflow="w", **extra)))
        assert wire["schema"] == 2, extra


async def test_a_worker_refuses_a_job_of_a_newer_schema(redis_url, run_name, redis):
    from rollq.protocol.messages import SCHEMA_VERSION, Job

    keys = RunKeys(run_name)
    producer = Producer(redis, run_name, reply_to=keys.reply_stream("mine"))
    await producer.submit(ECHO, {"reward": 1}, job_id="ok")  # creates the stream, its group and the reply stream
    job = Job(
        job_id="new", workflow=ECHO, data={"reward": 1}, reply_to=keys.reply_stream("mine"), schema=SCHEMA_VERSION + 1
    )
    await redis.xadd(keys.jobs, {"d": Codec().encode(job)})
    async with running_worker(redis_url, run_name):
        got = {t.job_id: t async for t in producer.wait_for({"ok": 1, "new": 1}, timeout_s=20)}
    assert got["ok"].status == "ok"
    assert got["new"].status == "error" and got["new"].error.type == "SchemaTooNew"


async def test_workers_hold_a_tenants_job_to_its_patterns_for_everything_it_imports(redis_url, run_name, redis):
    """F11 at the boundary that counts: the worker narrows its allowlist to the job's `allow` (its tenant's patterns)
    for the workflow, its kwargs' paths in any form, and remote reward paths; rollq's built-ins stay usable."""
    from rollq.protocol.messages import Job

    keys = RunKeys(run_name)
    reply = keys.reply_stream("mine")
    producer = Producer(redis, run_name, reply_to=reply)
    await producer.submit(ECHO, {"reward": 1}, job_id="plain")  # the stream, its group, the reply stream
    allow = ["tests.workflows.Echo"]
    jobs = {
        "echo": Job(job_id="echo", workflow=ECHO, data={"reward": 3}, allow=allow),
        "boom": Job(job_id="boom", workflow="tests.workflows:Boom", data={}, allow=allow),
        # a dotted reward path (no colon: the ingress's up-front check does not see it) in a built-in loop
        "reward": Job(
            job_id="reward", workflow="rlvr", workflow_kwargs={"reward_fn": "tests.reward_fns.exact_match"}, allow=allow
        ),
        "remote": Job(
            job_id="remote",
            workflow="rlvr",
            workflow_kwargs={"reward_fn": "tests.reward_fns.exact_match", "reward_mode": "remote"},
            allow=["rollq.workers.builtin"],
        ),
    }
    for job in jobs.values():
        await redis.xadd(keys.jobs, {"d": Codec().encode(msgspec.structs.replace(job, reply_to=reply))})
    async with running_worker(redis_url, run_name, max_attempts=1):
        got = {t.job_id: t async for t in producer.wait_for(dict.fromkeys([*jobs, "plain"], 1), timeout_s=20)}
    assert got["plain"].status == "ok" and got["echo"].status == "ok"  # the worker's own allowlist has `tests`
    for refused in ("boom", "reward", "remote"):
        err = got[refused].error
        assert got[refused].status == "error" and err.type == "ImportNotAllowed", (refused, err)
        assert "tenant" in err.message, err.message


async def test_clients_joining_a_followed_stream_get_every_sample_once(redis_url, run_name, redis, http):
    """Two SSE clients of one job share the reader; the second joins after a sample was read for the first (it reads
    that backlog itself), a third resumes after that sample: each gets each sample once, then `done`."""
    from rollq.protocol.messages import Trajectory

    keys = RunKeys(run_name)
    stream = keys.job_results("acme:j")

    async def publish(i: int) -> str:
        traj = Trajectory(job_id="acme:j", sample_index=i, n=3, status="ok")
        return (await redis.xadd(stream, {"d": Codec().encode(traj)})).decode()

    async def follow(client: httpx.AsyncClient, url: str, last: str = "") -> list[str]:
        headers = {**auth(), **({"Last-Event-ID": last} if last else {})}
        async with client.stream("GET", f"{url}/v1/jobs/j/events", headers=headers) as events:
            text = "".join([chunk async for chunk in events.aiter_text()])
        return [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]

    async with running_ingress(redis_url, run_name) as (app, url), httpx.AsyncClient(timeout=20) as many:
        assert (
            await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "n": 3, "job_id": "j"}, headers=auth())
        ).is_success
        first = asyncio.create_task(follow(many, url))
        await asyncio.wait_for(_until(lambda: app.stats.event_streams_open == 1), 10)
        sample0 = await publish(0)
        await asyncio.wait_for(_until(lambda: app.stats.events_sent == 1), 10)  # the reader has read past it
        second = asyncio.create_task(follow(many, url))
        third = asyncio.create_task(follow(many, url, last=sample0))
        await asyncio.wait_for(_until(lambda: app.stats.event_streams_open == 3), 10)
        await publish(1)
        await publish(1)  # a duplicate result of sample 1 (a retried publish): not sent again
        await publish(2)
        got = await asyncio.wait_for(asyncio.gather(first, second, third), 20)
    assert got[0] == got[1] == ["sample", "sample", "sample", "done"]
    assert got[2] == ["sample", "sample", "done"]
