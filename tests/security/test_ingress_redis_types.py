"""Keys of another Redis type than the ingress writes (security round 2, F13 residual): anyone with Redis write access
can plant one, e.g. `SET rollq:{run}:ctl:<tenant>:<id> notahash`; the ingress answered 500 with a WRONGTYPE
traceback. A real redis-server and the real ingress app on loopback."""

from __future__ import annotations

import httpx
import pytest

from rollq.protocol.keys import RunKeys
from tests.producer.ingress_helpers import running_ingress

ROUTES = (("GET", ""), ("DELETE", ""), ("GET", "/events"))


def auth() -> dict[str, str]:
    return {"Authorization": "Bearer tok-acme"}


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def test_a_job_key_of_the_wrong_type_is_a_404_on_every_job_route(redis_url, run_name, redis, http):
    keys = RunKeys(run_name)
    await redis.set(keys.job_control("acme:corrupt5"), "notahash")  # the control record: a string, not a hash
    await redis.hset(keys.job_control("acme:results"), mapping={"n": "1"})  # a sound record...
    await redis.set(keys.job_results("acme:results"), "notastream")  # ...whose results stream is a string
    async with running_ingress(redis_url, run_name) as (_, url):
        for job in ("corrupt5", "results"):
            for method, path in ROUTES:
                r = await http.request(method, f"{url}/v1/jobs/{job}{path}", headers=auth())
                assert r.status_code == 404, (job, method, path, r.text)
                assert r.json() == {
                    "error": "not_found",
                    "message": f"no job {job!r} (its record in Redis is unreadable)",
                    "field": None,
                }
        # A client resuming its SSE stream (Last-Event-ID) gets the same answer.
        r = await http.get(f"{url}/v1/jobs/results/events", headers={**auth(), "Last-Event-ID": "1-0"})
        assert r.status_code == 404, r.text


async def test_a_run_key_of_the_wrong_type_is_a_503_naming_it_never_a_500(redis_url, run_name, redis, http):
    keys = RunKeys(run_name)
    await redis.set(keys.classes, "notahash")  # the run's job classes, read by every submit
    async with running_ingress(redis_url, run_name) as (_, url):
        r = await http.post(f"{url}/v1/jobs", json={"workflow": "tests.workflows:Echo"}, headers=auth())
        assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
        assert "Redis refused a command (WRONGTYPE" in r.json()["message"]
    assert await redis.xlen(keys.jobs) == 0
