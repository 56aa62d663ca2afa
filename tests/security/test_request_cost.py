"""What one tenant's request may cost, round two (security round 2: F3's residual, N2 and N10): a tenant's byte quota
(what its unfinished jobs hold in Redis), a job's blob freed with the job (finished or cancelled) but never while a
queued or running sample of any job still needs it, a job's images bounded at the ingress from their headers, and
an operator's maximum for agent.timeout_seconds. A real Redis, a real ingress on loopback and, where samples must
run, a real worker."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest
from PIL import Image

from rollq.producer.producer import Producer
from rollq.protocol.keys import RunKeys
from tests.helpers import running_worker, wait_until
from tests.producer.ingress_helpers import GATE, running_ingress

ECHO = "tests.workflows:Echo"
GATE_WF = "tests.producer.ingress_helpers:Gate"


def auth(token: str = "tok-acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=20) as client:
        yield client


@pytest.fixture
def gate():
    GATE.__init__()
    yield GATE
    GATE.release.set()


def data(tag: str, size: int = 100_000) -> dict:
    return {"tag": tag, "pad": tag[0] * size}


async def blobs(redis, run: str) -> list[bytes]:
    return sorted(await redis.keys(f"{RunKeys(run).prefix}:blob:*"))


async def run_memory(redis, run: str) -> int:
    """What the run's keys take in Redis (MEMORY USAGE): the server is shared with tests running beside this one."""
    total = 0
    async for key in redis.scan_iter(match=f"{RunKeys(run).prefix}:*", count=1000):
        total += await redis.memory_usage(key) or 0
    return total


async def held(redis, run: str, tenant: str = "acme") -> int:
    return int(await redis.hget(RunKeys(run).tenant_bytes(tenant), "total") or 0)


async def test_a_tenant_past_its_byte_quota_gets_429_until_its_jobs_are_done_or_cancelled(
    redis_url, run_name, redis, http
):
    """F3 residual: the quota counted samples only; 30 requests of 7 MB each added 228 MB to Redis for a count of 30.
    Now a tenant's unfinished jobs are bounded in bytes too."""
    async with running_ingress(redis_url, run_name, max_tenant_queued_bytes=250_000) as (app, url):
        for tag in ("a", "b"):
            r = await http.post(
                f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": tag, "data": data(tag)}, headers=auth()
            )
            assert r.status_code == 202, r.text
        assert 200_000 < await held(redis, run_name) < 250_000
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "data": data("c")}, headers=auth())
        assert r.status_code == 429 and r.json()["error"] == "quota", r.text
        assert int(r.headers["Retry-After"]) >= 1 and "max_tenant_queued_bytes" in r.json()["message"]
        # another tenant has its own
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "data": data("c")}, headers=auth("tok-globex"))
        assert r.status_code == 202, r.text
        # cancelling a job frees its bytes at once: the next one fits
        assert (await http.delete(f"{url}/v1/jobs/a", headers=auth())).status_code == 200
        assert 100_000 < await held(redis, run_name) < 125_000
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": "c", "data": data("c")}, headers=auth())
        assert r.status_code == 202, r.text
        # finished jobs free theirs too
        async with running_worker(redis_url, run_name):
            for tag in ("b", "c"):
                async with http.stream("GET", f"{url}/v1/jobs/{tag}/events", headers=auth()) as events:
                    assert "event: done" in "".join([chunk async for chunk in events.aiter_text()])
            await wait_until(lambda: _none_queued(redis, run_name), 10, what="globex's job to be done too")
        assert await held(redis, run_name) == 0
        assert await redis.zcard(RunKeys(run_name).tenant_charges("acme")) == 0
        assert await blobs(redis, run_name) == []  # every job done or cancelled: no blob left
        assert app.stats.refused_quota == 1


async def test_cancelling_frees_a_jobs_blob_but_never_one_another_job_still_needs(redis_url, run_name, redis, http):
    """A blob outlived its job by its retention (86,400 s). Now the last job holding it frees it; a job that shares
    it, or a producer's job that stored it, keeps it."""
    keys = RunKeys(run_name)
    async with running_ingress(redis_url, run_name) as (_, url):
        for job_id, tag in (("a", "shared"), ("b", "shared"), ("c", "own")):
            r = await http.post(
                f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": job_id, "n": 3, "data": data(tag)}, headers=auth()
            )
            assert r.status_code == 202, r.text
        shared, own = [await redis.hget(keys.job_control(f"acme:{j}"), "ref") for j in ("a", "c")]
        assert shared != own and len(await blobs(redis, run_name)) == 2
        used = await run_memory(redis, run_name)
        await http.delete(f"{url}/v1/jobs/a", headers=auth())
        assert await redis.exists(keys.blob(shared.decode())) == 1  # b, still queued, needs it
        await http.delete(f"{url}/v1/jobs/c", headers=auth())
        assert await redis.exists(keys.blob(own.decode())) == 0  # nobody needs it
        await http.delete(f"{url}/v1/jobs/b", headers=auth())
        assert await blobs(redis, run_name) == [] and await held(redis, run_name) == 0
        assert await run_memory(redis, run_name) < used - 150_000  # the bytes themselves are gone
        # a producer's job with the same data: the blob is its too, and an ingress job's cancel leaves it
        await Producer(redis, run_name).submit(ECHO, data("shared"), job_id="trainer")
        r = await http.post(
            f"{url}/v1/jobs", json={"workflow": ECHO, "job_id": "d", "data": data("shared")}, headers=auth()
        )
        assert r.status_code == 202, r.text
        await http.delete(f"{url}/v1/jobs/d", headers=auth())
        assert await redis.exists(keys.blob(shared.decode())) == 1


async def test_a_running_sample_keeps_its_blob_past_its_jobs_cancel(redis_url, run_name, redis, http, gate):
    """Cancelling a job whose sample is running frees nothing that sample may still read (a retry, or another
    worker's, after a crash, reads the data again); its end frees it."""
    keys = RunKeys(run_name)
    async with running_ingress(redis_url, run_name) as (_, url), running_worker(redis_url, run_name, concurrency=1):
        r = await http.post(
            f"{url}/v1/jobs", json={"workflow": GATE_WF, "job_id": "g", "n": 3, "data": data("gated")}, headers=auth()
        )
        assert r.status_code == 202, r.text
        async with gate.started:
            await asyncio.wait_for(gate.started.wait_for(lambda: len(gate.runs) == 1), 10)
        r = await http.delete(f"{url}/v1/jobs/g", headers=auth())
        assert r.json()["started"] == [0] and r.json()["cancelled"] == [1, 2]
        [blob] = await blobs(redis, run_name)
        assert await held(redis, run_name) > 100_000 and await redis.exists(blob) == 1
        gate.release.set()
        await wait_until(lambda: _gone(redis, blob), 10, what="the blob to go with the job's last sample")
        assert await held(redis, run_name) == 0
        assert await redis.hget(keys.job_control("acme:g"), "d") == b"3"  # each sample counted once


async def _none_queued(redis, run: str) -> bool:
    return await redis.xlen(RunKeys(run).jobs) == 0


async def _gone(redis, key) -> bool:
    return await redis.exists(key) == 0


def png_uri(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_the_ingress_refuses_a_jobs_images_past_its_limits_from_their_headers(redis_url, run_name, redis, http):
    """N2 at the door: 16 PNGs of 4096 x 4096 (one colour: a 1.25 MB body) are 268 M pixels; 100 small ones are too
    many. Refused with 413 naming the limit, nothing queued, nothing decoded."""
    bomb, small = png_uri(4096, 4096), png_uri(8, 8)
    async with running_ingress(redis_url, run_name) as (_, url):
        r = await http.post(
            f"{url}/v1/jobs", json={"workflow": ECHO, "data": {"images": [bomb] * 16}, "n": 2}, headers=auth()
        )
        assert r.status_code == 413 and "max_job_image_pixels=67,108,864" in r.text, r.text
        assert r.json()["field"] == "$.data"
        r = await http.post(
            f"{url}/v1/jobs", json={"jobs": [{"workflow": ECHO, "data": {"m": [{"u": small}] * 100}}]}, headers=auth()
        )
        assert r.status_code == 413 and "$.jobs[0].data has 100 images, over max_job_images=64" in r.text, r.text
        # written with JSON's escapes ("\/"), still images
        uri = b'"' + bomb.replace("/", "\\/").encode() + b'"'
        r = await http.post(
            f"{url}/v1/jobs",
            content=b'{"workflow": "%s", "data": {"images": [%s]}}' % (ECHO.encode(), b", ".join([uri] * 5)),
            headers={**auth(), "Content-Type": "application/json"},
        )
        assert r.status_code == 413 and "max_job_image_pixels" in r.text, r.text
        not_png = {"workflow": ECHO, "data": {"images": ["data:image/png;base64,AAAA"]}}
        r = await http.post(f"{url}/v1/jobs", json=not_png, headers=auth())
        assert r.status_code == 400 and "not an image file" in r.text, r.text
        r = await http.post(f"{url}/v1/jobs", json={"workflow": ECHO, "data": {"images": [bomb] * 3}}, headers=auth())
        assert r.status_code == 202, r.text  # 50 M pixels: within
    assert await redis.xlen(RunKeys(run_name).jobs) == 1


async def test_agent_timeout_seconds_has_an_operator_maximum(redis_url, run_name, redis, http):
    """N10: `{"agent": {"timeout_seconds": 1e9}}` was accepted: one job could hold a worker's slot for 31 years."""
    async with running_ingress(redis_url, run_name, max_agent_timeout=900) as (_, url):
        r = await http.post(
            f"{url}/v1/jobs", json={"workflow": ECHO, "agent": {"timeout_seconds": 1e9}}, headers=auth()
        )
        assert r.status_code == 400 and r.json()["field"] == "$.agent.timeout_seconds", r.text
        assert "1e+09 is over max_agent_timeout=900" in r.text
        r = await http.post(
            f"{url}/v1/jobs", json={"workflow": ECHO, "agent": {"timeout_seconds": 900}}, headers=auth()
        )
        assert r.status_code == 202, r.text
