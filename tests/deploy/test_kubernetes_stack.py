"""The overlays' containers run for real, as local processes (tests/deploy/kubernetes.py's KubeStack, on compose's
LocalStack): each container's command and args as rendered, $(VAR) expanded from its environment (the Secret's
values, the ConfigMaps, the downward API), its volumes and its probes.

- The trainer Job's torchrun rendezvous (scenario, ~17-22 s here): its two pods' command (JOB_COMPLETION_INDEX 0
  and 1, the rendezvous host trainer-0.trainer -> 127.0.0.1) runs as two local torchrun nodes against the overlay's
  Redis, engine and a worker; they form one group of two ranks and train one step (2 groups of 2, set through the
  environment as an operator would).
- The whole cpu overlay (scenario, ~26-30 s): every workload at its replica count, the trainer's two pods included,
  comes up, passes every probe, serves jobs from a producer and through the ingress, trains, and stops on SIGTERM
  within each pod's grace period.
- In CI: the gpu overlay's registration sidecar beside a stand-in for SGLang (which needs a GPU). The cpu overlay's
  engine runs in CI in test_kubernetes_probes.py, and every rollq command parses with its environment in
  test_kubernetes_manifests.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rollq.trainer import checkpoint
from tests.deploy.compose import json_lines
from tests.deploy.kubernetes import PROBES, KubeStack, probe_check
from tests.deploy.test_compose_stack import TOKEN, submit_and_wait, submit_via_ingress
from tests.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "toy"  # the ConfigMap's ROLLQ_RUN
ORDER = ("redis", "engine", "worker", "reward-worker", "ingress", "trainer")  # what a cluster's restarts converge to


def small_run(stack: KubeStack, steps: int, **settings: str) -> None:
    """The trainer pods' environment with a short run (the ROLLQ_TRAINER_* an operator would set)."""
    env = stack.overrides.setdefault("trainer", {})
    env.update({"ROLLQ_TRAINER_STEPS": str(steps), **{f"ROLLQ_TRAINER_{k.upper()}": v for k, v in settings.items()}})


async def start(stack: KubeStack, names, timeout_s: float = 120.0) -> None:
    for name in names:
        stack.start(name)
        if name != "trainer":  # a Job's pods have no readiness: they run to completion
            await asyncio.to_thread(stack.wait_healthy, name, timeout_s)


async def trained(stack: KubeStack, timeout_s: float) -> list[str]:
    """Wait for every trainer pod to exit; each one's output."""
    pods = stack.replicas["trainer"]
    await wait_until(
        lambda: all(p.proc is not None and p.proc.poll() is not None for p in pods),
        timeout_s,
        interval_s=0.2,
        what="the trainer's pods to finish",
    )
    for pod in pods:
        assert pod.proc is not None and pod.proc.returncode == 0, f"{pod.name}:\n{pod.tail()}"
    return [pod.tail(20000) for pod in pods]


@pytest.mark.scenario  # ~22 s (two torchrun nodes, Redis, an engine, a worker): over CI's budget per test
async def test_the_trainer_jobs_torchrun_rendezvous_forms_one_group_and_trains(kube, tmp_path):
    _, rendered = kube
    stack = KubeStack(rendered["cpu"], tmp_path, only=["redis", "engine", "worker", "trainer"], scale={"worker": 1})
    small_run(stack, 1, group_size="2", groups_per_step="2")
    try:
        await start(stack, ("redis", "engine", "worker", "trainer"))
        nodes = stack.replicas["trainer"]
        assert len(nodes) == 2
        for node, pod in enumerate(nodes):  # what each pod ran: its node rank, loopback for trainer-0.trainer
            assert f"--node-rank={node}" in pod.argv and "--master-addr=127.0.0.1" in pod.argv, pod.argv
        outputs = await trained(stack, 200)
        summary = json.loads(outputs[0].strip().splitlines()[-1])
        assert summary["steps"] == 1, summary
        run_dir = stack.volumes["runs"] / RUN
        assert checkpoint.read_state(checkpoint.latest(run_dir)).ranks == 2, "both pods' ranks trained as one group"
        records = json_lines(run_dir / "metrics.jsonl")
        assert [r["step"] for r in records] == [1] and records[0]["trained_samples"] == 4
        assert any((stack.volumes["weights"] / RUN).glob("v*")), "the policy went to the engines' volume"
    finally:
        stack.close()


def probes_pass(stack: KubeStack, name: str) -> dict[str, bool]:
    """Every probe of every replica of `name`, as LocalStack runs a healthcheck."""
    _, container = stack.specs[name]
    results = {}
    for kind in PROBES:
        probe = container.get(kind)
        if probe is None:
            continue
        stack.services[name]["healthcheck"] = {"test": probe_check(container, probe), "timeout": "30s"}
        results[kind] = all(stack.healthy(replica) for replica in stack.replicas[name])
    return results


@pytest.mark.scenario  # every container of the overlay for real (~a minute of CPU); its parts run in CI above
async def test_the_cpu_overlay_runs_locally(kube, tmp_path):
    _, rendered = kube
    stack = KubeStack(rendered["cpu"], tmp_path)
    small_run(stack, 2, group_size="4", groups_per_step="2")
    stack.overrides["ingress"] = {"ROLLQ_INGRESS_TOKENS": f"{{{TOKEN}: kubernetes-test}}"}
    assert set(stack.services) == set(ORDER)
    started = time.monotonic()
    timings: dict[str, float] = {}
    try:
        await start(stack, ORDER)
        timings["up"] = time.monotonic() - started
        for name in ORDER:
            if name != "trainer":
                results = await asyncio.to_thread(probes_pass, stack, name)
                assert results and all(results.values()), (name, results)
        producer_url = stack.replicas["ingress"][0].env["ROLLQ_REDIS_URL"]
        assert producer_url.startswith("redis://producer:"), producer_url
        trajectories = await submit_and_wait(producer_url, RUN)
        assert len(trajectories) == 8 and all(t.status == "ok" for t in trajectories), trajectories
        views = await submit_via_ingress(f"http://127.0.0.1:{stack.address('ingress', 8300)}")
        assert len(views) == 4 and all(v.status == "ok" and v.sequences for v in views), views
        timings["jobs"] = time.monotonic() - started
        outputs = await trained(stack, 240)
        assert json.loads(outputs[0].strip().splitlines()[-1])["steps"] == 2
        timings["trained"] = time.monotonic() - started
        # the kubelet's stop: SIGTERM, then SIGKILL after terminationGracePeriodSeconds
        await stack.stop_in_order()
        timings["stopped"] = time.monotonic() - started
    finally:
        stack.close()
        print("kubernetes stack timings (s):", {k: round(v, 1) for k, v in timings.items()})


async def test_the_sglang_registration_sidecar_registers_its_pod_once_sglang_generates(kube, tmp_path):
    """overlays/gpu's engine pod: SGLang needs a GPU, so a plain HTTP server on the pod's port stands in for its
    /health_generate; the sidecar's command runs as rendered beside it. It registers the pod's address only once
    SGLang generates (compose waits for the same), with its weight agent's address, keeps it registered, and
    deregisters on SIGTERM."""
    from aiohttp import web

    from rollq.engine.registry import EngineRegistry
    from rollq.redis_client import redis_client

    _, rendered = kube
    stack = KubeStack(rendered["gpu"], tmp_path, only=["redis", "engine"])
    sidecar_name = "engine.sglang-register"
    asked: list[int] = []

    async def health_generate(request: web.Request) -> web.Response:
        asked.append(status := 200 if asked else 503)  # loading, then generating
        return web.Response(status=status)

    app = web.Application()
    app.router.add_get("/health_generate", health_generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = stack.replicas["engine"][0].ports[30000]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await start(stack, ("redis",))
        stack.start(sidecar_name)
        sidecar = stack.replicas[sidecar_name][0]
        url = sidecar.env["SGLANG_URL"]
        assert url == f"http://127.0.0.1:{port}", "the pod's own address (status.podIP) and SGLang's port"
        redis = redis_client(sidecar.env["ROLLQ_REDIS_URL"])
        try:
            registry = EngineRegistry(redis, RUN, key=sidecar.env["ROLLQ_ENGINE_ADMIN_API_KEY"])
            await wait_until(lambda: len(asked) >= 1, 30, interval_s=0.1, what="the sidecar to ask SGLang")
            assert await registry.live() == [], "not registered while SGLang does not generate"
            await asyncio.to_thread(stack.wait_healthy, sidecar_name, 60.0)  # its readiness: registered
            assert await registry.live() == [url] and asked[-1] == 200
            agent = sidecar.env["WEIGHT_AGENT_URL"]  # the pod's weight agent, named in the engine's signed entry
            assert agent.startswith("http://127.0.0.1:") and await registry.live_members() == {url: agent}
            assert stack.stop_replica(sidecar, stack.stop_grace("engine")) == 0
            assert await registry.live() == []
        finally:
            await redis.aclose()
    finally:
        stack.close()
        await runner.cleanup()
