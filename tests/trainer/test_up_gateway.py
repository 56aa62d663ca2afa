"""`rollq up --gateway smg`: SGLang's gateway (the real smg 1.13.0) on loopback in front of two reference engines
that joined it; the worker generates through it, the trainer's weight updates reach both engines (each logs every
version it loaded), and the run trains 2 steps. Without smg installed, `rollq up --gateway smg` says how to install
it before starting anything."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.gateways import smg_env
from tests.helpers import REPO_ROOT, env_without_settings


def rollq_up(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rollq", "up", *args]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.scenario  # 29 s here (tests/engine/test_gateway.py covers the pool behind smg in CI)
def test_rollq_up_with_smg_in_front_trains_through_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = rollq_up(
        "--gateway", "smg", "--engines", "2", "steps=2", f"run_dir={run_dir}", env=env_without_settings() | smg_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 64
    gateway = re.search(r"gateway \(smg\) at (http://127\.0\.0\.1:\d+)", proc.stderr)
    assert gateway, proc.stderr[-2000:]
    logs = run_dir / "logs"
    worker = (logs / "worker-0.log").read_text()
    assert f"{gateway.group(1)} is a gateway" in worker  # its engine: the gateway
    for name in ("engine-0", "engine-1"):
        log = (logs / f"{name}.log").read_text()
        assert f"joined gateway {gateway.group(1)}" in log and f"left gateway {gateway.group(1)}" in log
        # the trainer's control calls reach each engine behind the gateway: versions 0 (start), 1 and 2
        assert re.findall(r"weights loaded from .* \(weight version (\d+)\)", log) == ["0", "1", "2"], log[-2000:]


def test_rollq_up_gateway_without_smg_says_how_to_install_it(tmp_path):
    env = env_without_settings() | {"PATH": "/usr/bin:/bin"}  # neither smg on PATH nor installed beside rollq
    proc = rollq_up("--gateway", "smg", "steps=1", f"run_dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "uv tool install smg==1.13.0" in proc.stderr and "pipx install smg" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # said before anything started
