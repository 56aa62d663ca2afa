"""A run's rollouts as trace trees in a real MLflow tracking server (the `mlflow` wheel, pinned in MLFLOW_PIN, in a
virtualenv of its own: its dependencies are not rollq's), started by the test on loopback with a sqlite store and
its telemetry off: the trainer and a worker subprocess export OTLP/HTTP to its /v1/traces with the
x-mlflow-experiment-id header, and MLflow's own client finds each trained sample's trace by its sample id.

A scenario (MLflow takes a minute to start here): see CONTRIBUTING.md for the loop and the one-time set-up
(`python3 -m venv .venv-mlflow && .venv-mlflow/bin/pip install mlflow==3.17.2`)."""

import asyncio
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from rollq.local import Processes, free_port
from tests.helpers import REPO_ROOT
from tests.rollq.test_tracing_processes import GROUP, GROUPS, STEPS, traced_run

pytestmark = [pytest.mark.scenario, pytest.mark.slow, pytest.mark.timeout(600)]  # MLflow starts in about a minute

MLFLOW_PIN = "3.17.2"
MLFLOW_PYTHON = Path(os.environ.get("ROLLQ_MLFLOW_PYTHON", REPO_ROOT / ".venv-mlflow" / "bin" / "python"))
QUIET = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}  # nothing leaves loopback

# Run with MLflow's own client: each trained sample's trace, found by the sample id its attempt span carries (MLflow
# 3.17 stores attribute values JSON-encoded: `=` on one finds nothing, LIKE finds it; the ids here cannot contain
# one another, as a job's tenth sample would its first).
SEARCH = """
import json, sys, time
import mlflow

mlflow.set_tracking_uri(sys.argv[1])
experiment, expected, samples = sys.argv[2], set(sys.argv[3].split(",")), sys.argv[4:]
deadline = time.monotonic() + 60  # the worker's last spans follow its export delay: bounded polling
while True:
    out = {}
    for sample_id in samples:
        found = mlflow.search_traces(
            locations=[experiment],
            filter_string=f"span.attributes.rollq.sample_id LIKE '%{sample_id}%'",
            return_type="list",
        )
        out[sample_id] = [
            {"trace_id": t.info.trace_id, "spans": [[s.name, s.span_id, s.parent_id] for s in t.data.spans]}
            for t in found
        ]
    whole = all(len(t) == 1 and expected <= {n for n, _, _ in t[0]["spans"]} for t in out.values())
    if whole or time.monotonic() > deadline:
        break
    time.sleep(1)
print(json.dumps({"version": mlflow.__version__, "traces": out}))
"""


def compose_service() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())["services"]["mlflow"]


def compose_command(tmp_path: Path, port: int) -> list[str]:
    """compose.yaml's MLflow command as written, its store, artifacts and port moved to the test's: loopback."""
    moved = {
        "--host": "127.0.0.1",
        "--port": str(port),
        "--backend-store-uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--default-artifact-root": str(tmp_path / "artifacts"),
    }
    command = compose_service()["command"]
    assert command[:2] == ["mlflow", "server"], command
    out = ["mlflow", "server"]
    for arg in command[2:]:
        flag, _, value = arg.partition("=")
        out.append(f"{flag}={moved.get(flag, value)}")
    return out


def compose_environment() -> dict[str, str]:
    env = {k: str(v) for k, v in compose_service()["environment"].items()}
    assert env.items() >= QUIET.items()  # the compose service keeps MLflow's telemetry off too
    return env


@pytest.fixture
async def mlflow_server(tmp_path):
    if not MLFLOW_PYTHON.exists():
        setup = f"python3 -m venv .venv-mlflow && .venv-mlflow/bin/pip install mlflow=={MLFLOW_PIN}"
        pytest.skip(f"no MLflow at {MLFLOW_PYTHON}: {setup}")
    port = free_port()
    procs = Processes(tmp_path, cwd=tmp_path)
    argv = [str(MLFLOW_PYTHON), "-m", *compose_command(tmp_path, port)]
    proc = procs.start("mlflow", argv, env=compose_environment())
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(f"{url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    await procs.wait_until(healthy, 240, "MLflow healthy", watch=proc, interval_s=0.5)
    yield url
    procs.stop_all(grace_s=5)


async def test_a_runs_rollouts_arrive_in_mlflow_whole_and_searchable_by_sample_id(
    mlflow_server, redis_url, run_name, tmp_path, engine_process, spawn_worker, redis
):
    async with httpx.AsyncClient(base_url=mlflow_server, timeout=30) as client:
        created = await client.post("/api/2.0/mlflow/experiments/create", json={"name": f"rollq-{run_name}"})
        created.raise_for_status()
    experiment = created.json()["experiment_id"]
    await traced_run(
        redis_url,
        run_name,
        tmp_path,
        engine_process,
        spawn_worker,
        f"{mlflow_server}/v1/traces",
        headers=f"x-mlflow-experiment-id={experiment}",
    )
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    job_ids = [g for m in metrics for g in m["groups"]]
    samples = [f"{job}#{i}" for job in job_ids for i in range(GROUP)]
    assert len(samples) == STEPS * GROUPS * GROUP

    expected = {"submit", "attempt", "episode", "engine.generate", "reward", "train"}
    result = await asyncio.to_thread(
        subprocess.run,
        [str(MLFLOW_PYTHON), "-c", SEARCH, mlflow_server, experiment, ",".join(sorted(expected)), *samples],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **QUIET},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["version"] == MLFLOW_PIN
    for sample in samples:
        [trace] = found["traces"][sample]
        spans = {span_id: (name, parent) for name, span_id, parent in trace["spans"]}
        names = [name for name, _ in spans.values()]
        assert expected <= set(names), (sample, names)
        # whole: every span's parent is in the trace, one root (the job's submit)
        roots = [name for name, parent in spans.values() if parent is None]
        assert roots == ["submit"] and all(p in spans for _, p in spans.values() if p is not None), trace
