"""The secrets compose.yaml requires, written once per session by deploy/make_secrets.py itself."""

from __future__ import annotations

import pytest

from tests.deploy.compose import Secrets, generate_secrets


@pytest.fixture(scope="session")
def compose_secrets(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    out, secrets = generate_secrets(tmp_path_factory.mktemp("compose-secrets"))
    assert out.returncode == 0, out.stderr
    return secrets
