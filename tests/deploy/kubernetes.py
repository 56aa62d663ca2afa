"""deploy/kubernetes/, rendered by the real kustomize and run without a cluster.

`render()` copies deploy/kubernetes/ to a scratch folder, writes its secrets there with deploy/make_secrets.py
`--kubernetes` (as a user does), and asks `kubectl kustomize` (kustomize v5) for each overlay's objects.
`container_env()` resolves a container's environment as the kubelet does: `envFrom`, then `env` in order, each
`$(VAR)` expanded from what is defined before it, Secret and ConfigMap keys, the downward API. `compose_model()`
turns the rendered workloads into the model tests/deploy/compose.py's `LocalStack` runs, so the Kubernetes stack
starts as local processes by the same machinery as compose's: each container's command and args (expanded), its
environment, its volumes (ConfigMaps as files, each PersistentVolumeClaim one folder shared by every pod that mounts
it, emptyDirs one per pod) and its readiness probe as the healthcheck. What only a cluster provides is rewritten:
Service names and ports as LocalStack does for compose, the pod IP as 127.0.0.1, the trainer's rendezvous host
(trainer-0.trainer) as 127.0.0.1 and its port as a free one, JOB_COMPLETION_INDEX per trainer pod.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollq.local import free_port
from tests.deploy.compose import SECRETS_SCRIPT, LocalStack, Replica, Secrets
from tests.helpers import REPO_ROOT

KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
NAMESPACE = "rollq"
SECRET = "rollq-secrets"
ROLLQ_IMAGE = "rollq"  # the image name the base uses for every rollq container (overlays set its tag)
# Kubernetes versions the objects are validated against: the oldest the docs name and the newest the schemas know
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
KUSTOMIZE_MAJOR = 5
INSTALL_KUBECTL = (
    "install a kubectl with kustomize v5 (kubectl >= 1.27; Debian's kubernetes-client 1.20 is too old): "
    "https://kubernetes.io/docs/tasks/tools/ or the Google Cloud SDK's `kubectl` component, on PATH"
)
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
JOB_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def kubectl_problem() -> str | None:
    """None when `kubectl` is on PATH with kustomize v5; else what is wrong and what to install."""
    binary = shutil.which("kubectl")
    if binary is None:
        return f"kubectl is not on PATH: {INSTALL_KUBECTL}"
    out = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
    try:
        version = json.loads(out.stdout).get("kustomizeVersion", "")
    except json.JSONDecodeError:
        version = ""
    found = re.match(r"v(\d+)\.", version)
    if not found or int(found.group(1)) < KUSTOMIZE_MAJOR:
        return f"{binary} has kustomize {version or 'none'}: {INSTALL_KUBECTL}"
    return None


def write_secrets(tree: Path) -> Secrets:
    """`python3 deploy/make_secrets.py --kubernetes TREE/base/secrets.env`, standard library only (python -S)."""
    path = tree / "base" / "secrets.env"
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(SECRETS_SCRIPT), "--kubernetes", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    values = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return Secrets(path, values)


def render_tree(tree: Path, overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize TREE/overlays/OVERLAY`: the objects, in kustomize's order."""
    import yaml

    out = subprocess.run(
        ["kubectl", "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def copy_tree(directory: Path) -> Path:
    """deploy/kubernetes/ without any secrets file of the checkout's (a developer's secrets never reach a test)."""
    tree = directory / "kubernetes"
    shutil.copytree(KUBERNETES_DIR, tree, ignore=shutil.ignore_patterns("secrets.env", ".env.*"))
    return tree


def by_kind(objects: Iterable[Mapping[str, Any]], kind: str) -> dict[str, Mapping[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in WORKLOADS}


def pod_spec(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(objects: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(workload, container) for every container of every workload (init containers included)."""
    return [
        (w, c)
        for w in workloads(objects).values()
        for c in [*pod_spec(w).get("initContainers", []), *pod_spec(w)["containers"]]
    ]


def is_rollq_container(container: Mapping[str, Any]) -> bool:
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == ROLLQ_IMAGE


def data_of(obj: Mapping[str, Any]) -> dict[str, str]:
    """A ConfigMap's or Secret's values, decoded."""
    values = dict(obj.get("data") or {})
    if obj["kind"] == "Secret":
        values = {k: base64.b64decode(v).decode() for k, v in values.items()}
        values.update(obj.get("stringData") or {})
    return values


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined name is replaced, an undefined one stays as written, `$$` is `$`."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(one, text)


def container_env(
    objects: Iterable[Mapping[str, Any]],
    container: Mapping[str, Any],
    fields: Mapping[str, str],
    initial: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment as the kubelet builds it. `fields`: the downward API's values by fieldPath
    (status.podIP, metadata.name, the Job's completion index annotation ...)."""
    objects = list(objects)
    sources = {("ConfigMap", n): data_of(o) for n, o in by_kind(objects, "ConfigMap").items()}
    sources.update({("Secret", n): data_of(o) for n, o in by_kind(objects, "Secret").items()})

    def lookup(kind: str, ref: Mapping[str, Any]) -> str | None:
        values = sources.get((kind, ref["name"]))
        if values is None or ref["key"] not in values:
            assert ref.get("optional"), f"{container['name']}: {kind} {ref['name']} has no key {ref['key']}"
            return None
        return values[ref["key"]]

    env: dict[str, str] = dict(initial or {})
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            kind, ref = "ConfigMap", source["configMapRef"]
        else:
            kind, ref = "Secret", source["secretRef"]
        values = sources.get((kind, ref["name"]))
        assert values is not None or ref.get("optional"), f"{container['name']}: no {kind} {ref['name']}"
        env.update({source.get("prefix", "") + k: v for k, v in (values or {}).items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = ""
            continue
        if "secretKeyRef" in source:
            value = lookup("Secret", source["secretKeyRef"])
        elif "configMapKeyRef" in source:
            value = lookup("ConfigMap", source["configMapKeyRef"])
        elif "fieldRef" in source:
            value = fields[source["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"{container['name']}: env {item['name']} from {source} is not handled here")
        if value is not None:
            env[item["name"]] = value
    return env


def argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args, each `$(VAR)` expanded from the container's environment."""
    return [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]


# --- probes ---------------------------------------------------------------------------------------------------------

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def named_port(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert found, f"{container['name']}: no port named {port}"
    return found[0]


def probe_check(container: Mapping[str, Any], probe: Mapping[str, Any]) -> list[str]:
    """A probe as a compose healthcheck test (["CMD", ...] or ["CMD-SHELL", ...]) that LocalStack runs: an HTTP GET
    succeeding on 200-399 within timeoutSeconds (the kubelet's rule), a TCP connect, or the exec command."""
    timeout = probe.get("timeoutSeconds", 1)
    if "httpGet" in probe:
        get = probe["httpGet"]
        url = f"http://127.0.0.1:{named_port(container, get['port'])}{get.get('path', '/')}"
        code = f"import urllib.request; urllib.request.urlopen({url!r}, timeout={timeout})"
        return ["CMD", sys.executable, "-c", code]
    if "tcpSocket" in probe:
        port = named_port(container, probe["tcpSocket"]["port"])
        address = f"127.0.0.1:{port}"  # one word, so LocalStack maps the port as in a URL
        code = f"import socket; h, p = {address!r}.split(':'); socket.create_connection((h, int(p)), {timeout}).close()"
        return ["CMD", sys.executable, "-c", code]
    if "exec" in probe:
        command = list(probe["exec"]["command"])
        if command[:2] == ["sh", "-c"]:
            return ["CMD-SHELL", command[2]]
        return ["CMD", *command]
    raise AssertionError(f"{container['name']}: probe {probe} is not handled here")


# --- the rendered stack as compose's model ----------------------------------------------------------------------------


def service_name(workload: Mapping[str, Any], container: Mapping[str, Any]) -> str:
    """A workload's first container is the workload's name (what Services and the tests call it); a sidecar is
    `workload.container`."""
    first = pod_spec(workload)["containers"][0]["name"]
    name = workload["metadata"]["name"]
    return name if container["name"] == first else f"{name}.{container['name']}"


def replicas_of(workload: Mapping[str, Any]) -> int:
    spec = workload["spec"]
    if workload["kind"] == "Job":
        return int(spec.get("completions", 1))
    return int(spec.get("replicas", 1))


def volumes(workload: Mapping[str, Any], container: Mapping[str, Any], configs: Path, objects) -> list[dict]:
    """The container's mounts as compose volumes: a ConfigMap as a folder of its files, a PersistentVolumeClaim
    (or a StatefulSet's claim template) as a named volume shared by every pod that mounts it."""
    declared = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    maps = by_kind(objects, "ConfigMap")
    out = []
    for mount in container.get("volumeMounts", []):
        name, target = mount["name"], mount["mountPath"]
        if name in templates:
            out.append({"type": "volume", "source": f"{workload['metadata']['name']}-{name}", "target": target})
            continue
        volume = declared[name]
        if "configMap" in volume:
            folder = configs / volume["configMap"]["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for key, value in data_of(maps[volume["configMap"]["name"]]).items():
                (folder / key).write_text(value)
            out.append({"type": "bind", "source": str(folder), "target": target})
        elif "persistentVolumeClaim" in volume:
            out.append({"type": "volume", "source": volume["persistentVolumeClaim"]["claimName"], "target": target})
        elif "emptyDir" in volume:
            out.append({"type": "volume", "source": f"{workload['metadata']['name']}-{name}", "target": target})
        else:
            raise AssertionError(f"{container['name']}: volume {volume} is not handled here")
    return out


class KubeStack(LocalStack):
    """The rendered workloads run by compose's LocalStack (see the module docstring). `fields` of each pod: the pod
    IP is loopback; a Job's pods get JOB_COMPLETION_INDEX (0, 1, ...) as the Job controller sets it."""

    def __init__(
        self, objects: list[dict[str, Any]], workdir: Path, *, only: Iterable[str] | None = None, scale=None
    ) -> None:
        self.objects = objects
        self.specs: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
        # service -> variables a test sets on top of the rendered environment (as an operator would, e.g. a
        # shorter run through ROLLQ_TRAINER_STEPS); applied last
        self.overrides: dict[str, dict[str, str]] = {}
        self.rendezvous_port = free_port()
        services: dict[str, Any] = {}
        configs = workdir / "configmaps"
        for workload, container in containers(objects):
            name = service_name(workload, container)
            if only is not None and workload["metadata"]["name"] not in only:
                continue
            self.specs[name] = (workload, container)
            env = container_env(objects, container, {"status.podIP": "127.0.0.1"})
            grace = pod_spec(workload).get("terminationGracePeriodSeconds", 30)
            probe = container.get("readinessProbe") or container.get("startupProbe")
            service: dict[str, Any] = {
                "image": container["image"],
                "command": argv(container, env),
                "environment": env,
                "expose": [
                    str(p)
                    for p in sorted(
                        {named_port(c, p["containerPort"]) for c in [container] for p in c.get("ports", [])}
                    )
                ],  # fmt: skip
                "volumes": volumes(workload, container, configs, objects),
                "stop_grace_period": f"{grace}s",
                "scale": replicas_of(workload),
            }
            if is_rollq_container(container):
                service["build"] = {"context": str(REPO_ROOT)}
            if probe is not None:
                service["healthcheck"] = {"test": probe_check(container, probe), "timeout": "30s"}
            services[name] = service
        super().__init__({"services": services}, workdir, scale=scale)
        for name, (workload, _) in self.specs.items():  # a pod's containers share its network: a sidecar its ports
            pod = workload["metadata"]["name"]
            if name != pod and pod in self.replicas:
                for sidecar, first in zip(self.replicas[name], self.replicas[pod], strict=True):
                    sidecar.ports = first.ports

    def index(self, replica: Replica) -> int:
        return replica.index - 1

    def pod_env(self, replica: Replica) -> dict[str, str] | None:
        """A Job pod's environment with its completion index (None for other workloads: the model's is theirs)."""
        workload, container = self.specs[replica.service]
        if workload["kind"] != "Job":
            return None
        index = str(self.index(replica))
        fields = {"status.podIP": "127.0.0.1", JOB_INDEX_FIELD: index}
        # the Job controller puts JOB_COMPLETION_INDEX first in every container's env
        return container_env(self.objects, container, fields, initial={"JOB_COMPLETION_INDEX": index})

    def rendezvous(self, text: str) -> str:
        """The trainer's rendezvous: the first pod's DNS name (<job>-0.<subdomain>) is this machine, its port free."""
        for workload in by_kind(self.objects, "Job").values():
            subdomain = pod_spec(workload).get("subdomain")
            if subdomain:
                host = f"{workload['metadata']['name']}-0.{subdomain}"
                text = re.sub(rf"{re.escape(host)}(\.[\w.-]*)?", "127.0.0.1", text)
        return re.sub(r"^(--master-port=)\d+$", rf"\g<1>{self.rendezvous_port}", text)

    def environment(self, replica: Replica) -> dict[str, str]:
        env = super().environment(replica)
        own = self.pod_env(replica)
        if own is not None:
            env.update({k: self.rewrite(v, replica, token=True) for k, v in own.items()})
        env.update(self.overrides.get(replica.service, {}))
        return env

    def command(self, replica: Replica) -> list[str]:
        workload, container = self.specs[replica.service]
        own = self.pod_env(replica)
        words = argv(container, own) if own is not None else list(self.services[replica.service]["command"])
        return [self.rendezvous(self.rewrite(w, replica, token=True)) for w in words]


def render(directory: Path, overlays: Iterable[str] = OVERLAYS) -> tuple[Secrets, dict[str, list[dict[str, Any]]]]:
    """Secrets written by the script, and each overlay's rendered objects."""
    tree = copy_tree(directory)
    secrets = write_secrets(tree)
    return secrets, {overlay: render_tree(tree, overlay) for overlay in overlays}
