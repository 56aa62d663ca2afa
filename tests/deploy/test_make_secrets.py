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
