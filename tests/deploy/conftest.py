"""The secrets compose.yaml requires, written once per session by deploy/make_secrets.py itself."""

from __future__ import annotations

import pytest

from tests.deploy.compose import Secrets, generate_secrets


@pytest.fixture(scope="session")
def compose_secrets(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    out, secrets = generate_secrets(tmp_path_factory.mktemp("compose-secrets"))
    assert out.returncode == 0, out.stderr
    return secrets


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory):
    """deploy/kubernetes/ rendered once per session: (its secrets, written by make_secrets.py --kubernetes, and each
    overlay's objects). Fails, saying what to install, without a kubectl that has kustomize v5."""
    from tests.deploy.kubernetes import kubectl_problem, render

    problem = kubectl_problem()
    if problem:
        pytest.fail(problem)
    return render(tmp_path_factory.mktemp("kubernetes"))
