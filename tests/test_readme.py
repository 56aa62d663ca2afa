"""The README is the front page: at most 12 KB, opening with the two commands CI runs (set-up from the lock, then
the tests), and the benchmark headline block bench/report.py fills. Its links, and its other blocks, are checked with
the other pages' (tests/docs/test_docs.py)."""

import re

from tests.helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
CI_RUN = REPO_ROOT / ".ci" / "run"


def fenced_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_readme_is_a_front_page_of_at_most_12_kb():
    assert len(README.read_bytes()) <= 12 * 1024


def test_the_readme_opens_with_the_two_commands_ci_runs():
    ci = CI_RUN.read_text().splitlines()
    setup = ci[ci.index("# 1. set-up") + 1]
    first, second = fenced_blocks(README.read_text())[:2]
    assert first == setup
    assert second == ".venv/bin/python -m pytest"
    assert any(line.startswith(f"tests=0 && {second} ") for line in ci)


def test_the_set_up_installs_from_the_lock_and_the_docs_repeat_it():
    """The set-up installs uv.lock as it is (`uv sync --locked`: no new resolution), and the pages that show the
    set-up show this very command."""
    ci = CI_RUN.read_text().splitlines()
    setup = ci[ci.index("# 1. set-up") + 1]
    assert "/uv sync -q --locked " in setup and "uv pip install" not in setup
    for page in ("CONTRIBUTING.md", "docs/getting-started.md"):
        assert setup in (REPO_ROOT / page).read_text().splitlines(), page


def test_the_benchmark_headline_block_is_there_once():
    text = README.read_text()
    start, end = "<!-- bench:headline:start -->", "<!-- bench:headline:end -->"
    assert text.count(start) == 1 and text.count(end) == 1
    assert text.index(start) < text.index(end)
