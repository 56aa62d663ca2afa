"""uv.lock is what the set-up installs and CI tests: it matches pyproject.toml, the set-up's environment is exactly
the lock (torch aside, which the lock leaves out: the set-up pins its version), the lock covers what torch itself
needs, the pins written in several places agree, and the Docker image installs from the same lock, with hashes."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.compose import DOCKERFILE, dockerfile_instructions
from tests.helpers import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
LOCK = tomllib.loads((REPO_ROOT / "uv.lock").read_text())


def uv_binary() -> str | None:
    beside = Path(sys.executable).with_name("uv")  # the set-up installs uv into .venv
    return str(beside) if beside.exists() else shutil.which("uv")


needs_uv = pytest.mark.skipif(uv_binary() is None, reason="uv missing (the set-up installs it into .venv)")


def uv(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([uv_binary() or "uv", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def setup_command() -> str:
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    return ci[ci.index("# 1. set-up") + 1]


def pin(name: str) -> str:
    """The version the set-up command pins `name` to (`name==X`)."""
    found = re.findall(rf"\b{re.escape(name)}==([\w.+]+)", setup_command())
    assert len(found) == 1, (name, found)
    return found[0]


def dockerfile_arg(name: str) -> str:
    (value,) = [a.split("=", 1)[1] for w, a in dockerfile_instructions() if w == "ARG" and a.startswith(f"{name}=")]
    return value


@needs_uv
def test_the_lock_matches_pyproject():
    """`uv lock --check` without the network: fails when pyproject.toml changed and the lock was not updated."""
    out = uv("lock", "--check", "--offline")
    assert out.returncode == 0, f"uv.lock is out of date: run `.venv/bin/uv lock`\n{out.stderr}"


@needs_uv
@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (REPO_ROOT / ".venv").resolve(), reason="not the set-up's .venv (e.g. .ci/newest's)"
)
def test_the_environment_is_the_lock():
    """Every locked package is installed at its locked version (`uv sync --check`; --inexact: torch, which the set-up
    installs after the lock, and on a GPU machine its NVIDIA libraries may stay), and torch is the set-up's pin."""
    out = uv("sync", "--check", "--locked", "--inexact", "--no-install-project", "--extra", "dev", "--offline")
    assert out.returncode == 0, f"the environment differs from uv.lock: rerun the set-up\n{out.stderr}"
    torch_version = importlib.metadata.version("torch")
    assert torch_version.split("+")[0] == pin("torch"), torch_version


def test_the_lock_holds_what_torch_needs():
    """torch is left out of the lock; what it requires is locked through the torch-deps group, so the set-up's
    `pip install torch==...` finds it all installed and adds torch alone (on a GPU machine: and its CUDA libraries)."""
    assert "torch" in PYPROJECT["tool"]["uv"]["exclude-dependencies"]
    assert not [p for p in LOCK["package"] if p["name"] == "torch"]
    group = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependency-groups"]["torch-deps"]}
    locked = {p["name"] for p in LOCK["package"]}
    assert group <= locked
    needs = set()
    for spec in importlib.metadata.requires("torch") or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            needs.add(canonicalize_name(req.name))
    cuda = {n for n in needs if n.startswith(("nvidia-", "cuda-")) or n == "triton"}  # a CUDA build's own, pinned
    assert needs - cuda <= group, f"add to [dependency-groups] torch-deps: {sorted(needs - cuda - group)}"


def test_the_pins_agree():
    """torch and uv are pinned by the set-up command; the Dockerfile installs the same versions, and pyproject asks
    for a uv at least that new."""
    assert dockerfile_arg("TORCH_VERSION") == pin("torch")
    assert dockerfile_arg("UV_VERSION") == pin("uv")
    assert PYPROJECT["tool"]["uv"]["required-version"] == f">={pin('uv')}"
    assert "uv sync -q --locked --extra dev" in setup_command()


@needs_uv
def test_the_image_installs_from_the_lock(tmp_path):
    """The Dockerfile's `uv export` (its default ROLLQ_EXTRAS, run on this checkout) gives every dependency of rollq
    and the extras, pinned with hashes, without rollq, torch or the dev tools; pip installs it with --require-hashes."""
    (run,) = [a for w, a in dockerfile_instructions() if w == "RUN" and "uv export" in a]
    assert "uv pip install --system --no-deps --require-hashes -r" in run
    export = shlex.split(re.search(r"(uv export .*?) -o ", run).group(1))
    assert "--locked" in export
    export = [a.replace("${ROLLQ_EXTRAS}", dockerfile_arg("ROLLQ_EXTRAS")) for a in export]
    export = [str(REPO_ROOT) if a == "/tmp/rollq-deps" else a for a in export]
    out = uv(*export[1:], "-o", str(tmp_path / "requirements.txt"), "--offline", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "requirements.txt").read_text()
    blocks = [b for b in re.split(r"\n(?=[a-z0-9])", text) if re.match(r"[a-z0-9]", b)]
    pins = [re.match(r"([a-z0-9][a-z0-9._-]*)==[^\s;]+ ", b) for b in blocks]
    assert all(pins) and all("--hash=sha256:" in b for b in blocks)  # every requirement a pin with its hashes
    names = {m.group(1) for m in pins if m}
    assert {"redis", "msgspec", "transformers", "peft", "matplotlib", "sympy"} <= names
    assert not {"rollq", "torch", "pytest", "ruff"} & names
    assert "COPY pyproject.toml uv.lock" in DOCKERFILE.read_text()
