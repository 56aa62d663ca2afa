import subprocess
import sys

import pytest

from rollq.engine.server.sglang_launcher import SGLangLaunch, sglang_installed
from tests.helpers import REPO_ROOT


def test_launch_command_has_the_flags_rollq_relies_on(tmp_path):
    launch = SGLangLaunch(model_path="/models/qwen", port=31000, tp_size=2, weight_version="step-0", api_key="k")
    cmd = launch.command(launch.write_secrets(tmp_path))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for flag in (
        "--model-path /models/qwen",
        "--port 31000",
        "--tp-size 2",
        "--enable-metrics",
        "--skip-tokenizer-init",
        "--weight-version step-0",
        f"--config {tmp_path / 'sglang-keys.yaml'}",  # the key itself: in that file (tests/security/test_engine_auth)
    ):
        assert flag in joined
    assert "--api-key" not in cmd and "k" not in cmd


@pytest.mark.skipif(sglang_installed(), reason="sglang is installed: the missing-sglang message cannot be shown")
def test_sglang_backend_says_clearly_when_sglang_is_missing():
    res = subprocess.run(
        [sys.executable, "-m", "rollq", "engine", "--backend", "sglang", "--model", "/m"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2
    assert "sglang is not installed" in res.stderr and "Traceback" not in res.stderr
