"""schemathesis against the ingress's /openapi.json: generated requests (valid and not) never get a 5xx, and the
answers conform to the document. The ingress runs as `rollq ingress` in a subprocess (its CLI and env config too)."""

from __future__ import annotations

import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from rollq.local import Processes, free_port, wait_until_sync
from tests.helpers import REPO_ROOT


@pytest.fixture(scope="module")
def ingress_url(redis_server, tmp_path_factory):
    port = free_port()
    procs = Processes(tmp_path_factory.mktemp("ingress"), cwd=REPO_ROOT)
    env = {
        "ROLLQ_REDIS_URL": redis_server.url,
        "ROLLQ_RUN": "openapi",
        "ROLLQ_INGRESS_PORT": str(port),
        "ROLLQ_INGRESS_TOKENS": "{tok-fuzz: fuzz}",
        "ROLLQ_INGRESS_MAX_N": "8",
        "ROLLQ_INGRESS_MAX_BATCH": "8",
        "ROLLQ_INGRESS_MAX_BODY_BYTES": "65536",
    }
    proc = procs.start("ingress", [sys.executable, "-m", "rollq", "ingress"], env=env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        procs.check(proc)
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until_sync(healthy, 30, 0.05, "rollq ingress to answer /healthz")
    yield url
    proc.terminate()
    assert proc.wait(10) == 0  # SIGTERM: a clean exit


TOKEN = {"Authorization": "Bearer tok-fuzz"}


def test_generated_requests_never_get_a_server_error(ingress_url):
    schema = schemathesis.openapi.from_url(f"{ingress_url}/openapi.json")
    # the event stream of an existing job stays open until its samples finish (no workers here)
    schema = schema.exclude(path="/v1/jobs/{job_id}/events")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/jobs", "GET /v1/jobs/{job_id}", "DELETE /v1/jobs/{job_id}"} <= {op.label for op in operations}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            # no 5xx; (400s for schema-valid data are expected: AgentOptions' cross-field rules, max_n and the run's
            # job classes are checked by the server, not expressible in the schema)
            case.call_and_validate(headers=TOKEN, timeout=10, checks=[not_a_server_error])

        check()


def test_a_job_and_its_events_through_the_cli_service(ingress_url):
    headers = {"Authorization": "Bearer tok-fuzz"}
    r = httpx.post(f"{ingress_url}/v1/jobs", json={"workflow": "x:y", "job_id": "cli-1", "n": 2}, headers=headers)
    assert r.status_code == 202, r.text
    assert httpx.delete(f"{ingress_url}/v1/jobs/cli-1", headers=headers).json()["cancelled"] == [0, 1]
    with httpx.stream("GET", f"{ingress_url}/v1/jobs/cli-1/events", headers=headers, timeout=10) as resp:
        text = "".join(resp.iter_text())
    assert text.count("event: sample") == 2 and text.rstrip().split("\n")[-2] == "event: done"
