"""deploy/kubernetes/components/keda{,-cluster}: `rollq keda`'s output for the defaults, valid KEDA objects by KEDA's
own types (cloudcoil-models-keda's models, from the package registry: never a copy of the CRDs here), rendered by
kustomize as a Component, and reading the run's streams as the Secret's `keda` user."""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from rollq.cli import main
from rollq.keda import KedaConfig, render, streams, trigger_name
from tests.deploy.acl import acl_users
from tests.deploy.compose import SECRETS_SCRIPT
from tests.deploy.keda_types import validate_keda
from tests.helpers import REPO_ROOT

COMPONENTS = REPO_ROOT / "deploy" / "kubernetes" / "components"


@pytest.mark.parametrize(("folder", "flags"), [("keda", []), ("keda-cluster", ["--cluster"])])
def test_the_components_are_rollq_kedas_output_for_the_defaults(folder, flags, capsys):
    assert main(["keda", *flags]) == 0
    committed = (COMPONENTS / folder / "keda.yaml").read_text()
    assert capsys.readouterr().out == committed, f"regenerate: rollq keda {' '.join(flags)} > {folder}/keda.yaml"
    kustomization = yaml.safe_load((COMPONENTS / folder / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Component" and kustomization["resources"] == ["keda.yaml"]


def test_tls_and_the_scale_down_pace_reach_every_trigger_and_the_autoscaler(capsys):
    assert main(["keda", "--tls", "--scale-down-per-minute", "3", "--partitions", "2"]) == 0
    scaled = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o["kind"] == "ScaledObject"][0]
    assert all(t["metadata"]["enableTLS"] == "true" for t in scaled["spec"]["triggers"])
    assert len(scaled["spec"]["triggers"]) == 4
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 3, "periodSeconds": 60}]


def objects(text: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


def test_every_stream_of_every_class_and_partition_has_both_triggers_in_the_formula():
    cfg = KedaConfig(run="r1", partitions=3, job_class=["train", "eval.v2"], cluster=True, concurrency=8)
    so = objects(render(cfg))["ScaledObject"]["spec"]
    triggers = {t["name"]: t for t in so["triggers"]}
    assert len(triggers) == 2 * 3 * 2
    formula = so["advanced"]["scalingModifiers"]["formula"]
    assert so["advanced"]["scalingModifiers"]["target"] == "8" and so["minReplicaCount"] == 0
    for p, c, stream in streams(cfg):
        length, lag = triggers[trigger_name("inflight", p, c)], triggers[trigger_name("queued", p, c)]
        for t in (length, lag):
            assert t["type"] == "redis-cluster-streams" and t["metadata"]["stream"] == stream
            assert re.search(rf"\b{t['name']}\b", formula)
        assert "consumerGroup" not in length["metadata"]  # XLEN mode (redis_streams_scaler.go:88-91)
        assert lag["metadata"]["consumerGroup"] == "workers" and lag["metadata"]["lagCount"] != "0"  # lag mode
    assert {s for _, _, s in streams(cfg)} == {
        "rollq:{r1}:jobs", "rollq:{r1}:jobs:eval.v2", "rollq:{r1/p1}:jobs", "rollq:{r1/p1}:jobs:eval.v2",
        "rollq:{r1/p2}:jobs", "rollq:{r1/p2}:jobs:eval.v2",
    }  # fmt: skip


def test_the_trigger_authentication_reads_the_keda_users_password_from_the_secret():
    secrets = runpy.run_path(str(SECRETS_SCRIPT))["SECRETS"]  # the Secret's keys (run_name: main() stays off)
    docs = objects((COMPONENTS / "keda" / "keda.yaml").read_text())
    (ref,) = docs["TriggerAuthentication"]["spec"]["secretTargetRef"]
    assert ref == {"parameter": "password", "name": "rollq-secrets", "key": "ROLLQ_REDIS_KEDA_PASSWORD"}
    assert ref["key"] in secrets
    for t in docs["ScaledObject"]["spec"]["triggers"]:
        assert t["authenticationRef"]["name"] == docs["TriggerAuthentication"]["metadata"]["name"]
        assert t["metadata"]["username"] in acl_users()


def test_the_objects_are_valid_keda_objects():
    docs = []
    for text in (
        (COMPONENTS / "keda" / "keda.yaml").read_text(),
        (COMPONENTS / "keda-cluster" / "keda.yaml").read_text(),
        render(KedaConfig(run="r1", partitions=2, job_class=["train", "eval"], tls=True)),
    ):
        docs += list(yaml.safe_load_all(text))
    for doc in docs:
        validate_keda(doc)
    misspelt = dict(docs[-1], spec=dict(docs[-1]["spec"], pollInterval=5))  # a field KEDA does not know
    mistyped = dict(docs[-1], spec=dict(docs[-1]["spec"], minReplicaCount="none"))
    for wrong in (misspelt, mistyped):
        with pytest.raises((AssertionError, ValueError)):  # pydantic's ValidationError is a ValueError
            validate_keda(wrong)


def test_kustomize_renders_the_component():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize v5) missing: install the Kubernetes client, as docs/kubernetes.md says")
    build = REPO_ROOT / "build"
    build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as tmp:
        for folder in ("keda", "keda-cluster"):
            rel = Path("..", "..", "deploy", "kubernetes", "components", folder)
            Path(tmp, "kustomization.yaml").write_text(
                f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\ncomponents:\n  - {rel.as_posix()}\n"
            )
            out = subprocess.run([kubectl, "kustomize", tmp], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            rendered = objects(out.stdout)
            assert set(rendered) == {"ScaledObject", "TriggerAuthentication"}
            assert rendered["ScaledObject"]["metadata"]["namespace"] == "rollq"
            assert rendered["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == "worker"
