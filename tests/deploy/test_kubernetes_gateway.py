"""deploy/kubernetes/components/gateway: SGLang's gateway (smg) added to the cpu overlay, rendered by the real
kustomize, validated offline, its NetworkPolicy evaluated, each role's environment read by rollq's own parser, and
the gateway's own container command run with the real smg 1.13.0 (its flags parsed by smg, its keys from the
environment, none on its command line)."""

from __future__ import annotations

import json
import sys

import pytest

from rollq.cli import parse
from rollq.local import Processes, free_port
from tests.deploy.kubernetes import (
    JOB_INDEX_FIELD,
    NAMESPACE,
    argv,
    by_kind,
    container_env,
    containers,
    copy_tree,
    render_tree,
    workloads,
    write_secrets,
)
from tests.deploy.test_kubernetes_manifests import FIELDS, allowed, validate
from tests.gateways import smg_env
from tests.helpers import answers

PORT = 30080


@pytest.fixture(scope="module")
def gateway_stack(tmp_path_factory):
    """(the secrets, the cpu overlay's objects with components/gateway added)."""
    from tests.deploy.kubernetes import kubectl_problem

    problem = kubectl_problem()
    if problem:
        pytest.fail(problem)
    tree = copy_tree(tmp_path_factory.mktemp("kubernetes"))
    secrets = write_secrets(tree)
    overlay = tree / "overlays" / "cpu" / "kustomization.yaml"
    text = overlay.read_text()
    assert "  - ../../components/keda\n" in text
    overlay.write_text(
        text.replace("  - ../../components/keda\n", "  - ../../components/keda\n  - ../../components/gateway\n")
    )
    return secrets, render_tree(tree, "cpu")


def test_the_component_validates(gateway_stack):
    _, objects = gateway_stack
    assert {"gateway", "engine", "worker"} <= set(workloads(objects))
    assert {"gateway", "gateway-members"} <= set(by_kind(objects, "Service"))
    assert "gateway" in by_kind(objects, "PodDisruptionBudget")
    for obj in objects:
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rollq", obj["metadata"]


def test_workers_trainer_and_engines_reach_the_gateway_and_nobody_else(gateway_stack):
    _, objects = gateway_stack
    policies = list(by_kind(objects, "NetworkPolicy").values())
    roles = ["engine", "worker", "reward-worker", "ingress", "trainer", "redis", "gateway", "something-else"]

    def role(name: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": name}

    gateway = {r for r in roles if allowed(policies, role("gateway"), role(r), NAMESPACE, PORT)}
    assert gateway == {"worker", "trainer", "engine"}
    assert not allowed(policies, role("gateway"), role("worker"), "other", PORT), "another namespace's pods"
    assert not allowed(policies, role("gateway"), role("worker"), NAMESPACE, 29000)
    assert allowed(policies, role("engine"), role("gateway"), NAMESPACE, 30000), "its health checks and generation"


def test_the_gateway_holds_only_its_two_keys_and_no_secret_is_in_a_pod_spec(gateway_stack):
    secrets, objects = gateway_stack
    gateway = workloads(objects)["gateway"]
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    assert "envFrom" not in container
    refs = {i["valueFrom"]["secretKeyRef"]["key"] for i in container["env"] if "secretKeyRef" in i.get("valueFrom", {})}
    assert refs == {"ROLLQ_GATEWAY_ADMIN_API_KEY", "ROLLQ_ENGINE_API_KEY"}
    text = json.dumps(list(workloads(objects).values()))
    assert not [name for name, value in secrets.values.items() if value in text]


def test_each_role_is_pointed_at_the_gateway(gateway_stack, tmp_path):
    """The engines join it (and leave the Redis registry), the workers and the trainer use it, each with the Secret's
    gateway admin key: read by rollq's own parser from each container's command and environment."""
    secrets, objects = gateway_stack
    admin = secrets.values["ROLLQ_GATEWAY_ADMIN_API_KEY"]
    assert admin
    seen = {}
    for workload, container in containers(objects):
        name = workload["metadata"]["name"]
        if name not in ("engine", "worker", "trainer"):
            continue
        env = container_env(objects, container, {**FIELDS, JOB_INDEX_FIELD: "0"})
        words = argv(container, env)
        if "torch.distributed.run" in words:
            words = words[words.index("rollq") :]
        seen[name] = (words, env)
    config = tmp_path / "rollq.yaml"
    config.write_text(data_of_config(objects))
    for name, (words, env) in seen.items():
        words = [str(config) if w == "/etc/rollq/rollq.yaml" else w for w in words]
        cfg = parse(words[1:], env=env).settings[0]
        if name == "engine":
            assert cfg.gateway_url == f"http://gateway-members:{PORT}" and not cfg.register
            assert cfg.gateway_admin_api_key == admin
        else:
            assert cfg.engine == [f"http://gateway:{PORT}"], name
            assert cfg.gateway_admin_api_key == admin, name
    assert set(seen) == {"engine", "worker", "trainer"}


def data_of_config(objects) -> str:
    [config] = [o for n, o in by_kind(objects, "ConfigMap").items() if n.startswith("rollq-config")]
    return config["data"]["rollq.yaml"]


async def test_the_gateways_command_runs_smg_with_its_keys_from_the_environment(gateway_stack, tmp_path):
    """The container's command as written, its two listening addresses moved to loopback: smg's own parser takes its
    flags, its admin key guards /workers, and neither key is on the process's command line."""
    secrets, objects = gateway_stack
    [container] = workloads(objects)["gateway"]["spec"]["template"]["spec"]["containers"]
    env = container_env(objects, container, FIELDS)
    port, metrics = free_port(), free_port()
    moved = {"--host=0.0.0.0": "--host=127.0.0.1", f"--port={PORT}": f"--port={port}"}
    moved |= {
        "--prometheus-host=0.0.0.0": "--prometheus-host=127.0.0.1",
        "--prometheus-port=29000": f"--prometheus-port={metrics}",
    }
    words = [moved.get(w, w) for w in argv(container, env)]
    assert sum(w in moved.values() for w in words) == 4
    assert words[0] == "python"
    procs = Processes(tmp_path)
    try:
        proc = procs.start("gateway", [sys.executable, *words[1:]], env={**env, **smg_env()})
        url = f"http://127.0.0.1:{port}"
        await procs.wait_until(lambda: answers(url + "/liveness"), 60, "smg up", watch=proc, interval_s=0.05)
        admin = secrets.values["ROLLQ_GATEWAY_ADMIN_API_KEY"]
        assert not await answers(url + "/workers")
        assert await answers(url + "/workers", {"Authorization": f"Bearer {admin}"})
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
        assert admin not in cmdline and secrets.values["ROLLQ_ENGINE_API_KEY"] not in cmdline
    finally:
        procs.stop_all(grace_s=5)
