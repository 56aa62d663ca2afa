"""The commit-msg hook (.ci/commit-msg, run by pre-commit at the commit-msg stage): subjects of at most 72
characters, a blank line before the body."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

HOOK = REPO_ROOT / ".ci" / "commit-msg"


def check(tmp_path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([sys.executable, str(HOOK), str(path)], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "message",
    [
        "Short subject\n",
        "Short subject\n\nA body line that is longer than seventy-two characters is fine: the detail goes here.\n",
        "# a comment git adds\nShort subject\n",
        "Merge branch 'x' of somewhere with a name long enough to pass seventy-two characters easily\n",
    ],
)
def test_good_messages_pass(tmp_path, message):
    assert check(tmp_path, message).returncode == 0


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ("x" * 73 + "\n", "73 characters; at most 72"),
        ("Subject\nbody right below\n", "second line must be blank"),
        ("\n# only comments\n", "empty"),
    ],
)
def test_bad_messages_fail_naming_the_problem(tmp_path, message, problem):
    res = check(tmp_path, message)
    assert res.returncode == 1 and problem in res.stderr
