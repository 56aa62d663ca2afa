"""deploy/make_secrets.py: the one command that writes compose.yaml's secrets (.env), run as a user runs it, with the
standard library only (python -S: no site-packages)."""

from __future__ import annotations

import re
import stat

from tests.deploy.compose import generate_secrets


def test_writes_a_private_file_of_distinct_random_secrets(tmp_path):
    out, secrets = generate_secrets(tmp_path)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(secrets.path.stat().st_mode) == 0o600
    values = list(secrets.values.values())
    assert len(values) >= 10 and len(set(values)) == len(values), "one distinct secret per name"
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{43}", v) for v in values), "32 random bytes, URL- and .env-safe"
    # names are printed, values never
    assert all(name in out.stdout for name in secrets.values)
    assert not [v for v in values if v in out.stdout + out.stderr]
    # another run draws other values
    (tmp_path / "again").mkdir()
    _, again = generate_secrets(tmp_path / "again")
    assert not set(again.values.values()) & set(values)


def test_refuses_to_overwrite_without_force(tmp_path):
    first, secrets = generate_secrets(tmp_path)
    assert first.returncode == 0, first.stderr
    before = secrets.path.read_text()
    out, _ = generate_secrets(tmp_path)
    assert out.returncode == 1
    assert "--force" in out.stderr and "exists" in out.stderr
    assert secrets.path.read_text() == before, "an existing file is left as it was"
    forced, replaced = generate_secrets(tmp_path, "--force")
    assert forced.returncode == 0, forced.stderr
    assert stat.S_IMODE(replaced.path.stat().st_mode) == 0o600
    assert set(replaced.values) == set(secrets.values)
    assert not set(replaced.values.values()) & set(secrets.values.values()), "--force changes every secret"
    assert [p.name for p in tmp_path.iterdir()] == [".env"], "no temporary file left behind"


def test_kubernetes_writes_the_secret_generators_env_file(tmp_path):
    """--kubernetes PATH: the same names, fresh values, mode 0600, the format kustomize's secretGenerator reads
    (NAME=VALUE lines, # comments); it refuses to overwrite without --force, as for .env."""
    import subprocess
    import sys

    from tests.deploy.compose import SECRETS_SCRIPT

    def run(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-I", "-S", str(SECRETS_SCRIPT), "--kubernetes", str(path), *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    path = tmp_path / "secrets.env"
    _, compose_secrets = generate_secrets(tmp_path)
    out = run()
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    values = dict(line.split("=", 1) for line in lines)
    assert list(values) == list(compose_secrets.values), "the Secret's keys are the script's names"
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{43}", v) for v in values.values())
    assert not set(values.values()) & set(compose_secrets.values.values())
    assert "rollq-secrets" in path.read_text() and not [v for v in values.values() if v in out.stdout]
    assert run().returncode == 1 and run("--force").returncode == 0
    assert not (tmp_path / ".env.tmp").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        ".env",
        "secrets.env",
    ]
    both = subprocess.run(
        [sys.executable, "-S", str(SECRETS_SCRIPT), "--kubernetes", str(path), "--env-file", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_kubernetes_default_path_is_the_bases_git_ignored_file():
    import importlib.util
    import subprocess

    from tests.deploy.compose import SECRETS_SCRIPT
    from tests.helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location("make_secrets", SECRETS_SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    default = REPO_ROOT / "deploy" / "kubernetes" / "base" / "secrets.env"
    assert module.KUBERNETES_ENV_FILE == default  # what base/kustomization.yaml's secretGenerator reads
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default)], cwd=REPO_ROOT, timeout=30)
    assert ignored.returncode == 0, "the Kubernetes secrets file must be ignored by git"
    assert "deploy/kubernetes/base/secrets.env" in (REPO_ROOT / ".dockerignore").read_text().splitlines()
