"""The docs run as written: every fenced block of the pages users copy from carries a marker (tests/docs/blocks.py),
the `run` and `file` blocks of each page run in CI in order, and the `scenario` blocks run with them in the
scenario-marked test. So a default that changes breaks a test, not a reader. The pages also name only files that
exist.

A page runs in a scratch folder of its own that looks like a checkout to its blocks (the repository's tracked
top-level entries and `.venv` linked into it: README.md and getting-started run `.venv/bin/rollq` and `--module-path
.` there), with the venv's bin first on PATH and `ROLLQ_REDIS_URL` pointing at a private redis-server (the setting
every command reads when no `--redis` is given; the docs say so). The blocks run as one bash script with
`set -euo pipefail`, so shell variables carry from block to block as in a reader's terminal; a python block runs
with the venv's python (cwd on its path), a js block with node. Whatever the page leaves running (`... &`) is
stopped with the script's process group. An engine a page starts without `--port` binds the free port that
`ROLLQ_ENGINE_PORT` names (its documented default is 30000), so pages run side by side.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollq.local import RedisServer, free_port, wait_until_sync
from tests.docs.blocks import SHELLS, Block, has_markers, page_blocks
from tests.helpers import REPO_ROOT

# The pages users copy commands from; any other page under docs/ joins by carrying a marker.
CORE_PAGES = (
    "README.md",
    "docs/getting-started.md",
    "docs/training.md",
    "docs/workflows.md",
    "docs/agents.md",
    "docs/areal.md",
    "docs/ingress.md",
)
PAGE_TIMEOUT_S = 240  # a page's run/file blocks together (training.md: 20 s alone on 2 cores, 60 s on a busy machine)
SCENARIO_TIMEOUT_S = 40 * 60  # with its scenarios (README.md: rollq up on the tiny model, then on smollm2)
STOP_GRACE_S = 20.0


def pages() -> list[str]:
    marked = sorted(
        str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "docs").rglob("*.md") if has_markers(p.read_text())
    )
    return list(dict.fromkeys([*CORE_PAGES, *marked]))


def blocks_of(page: str) -> list[Block]:
    return page_blocks(page, (REPO_ROOT / page).read_text())[0]


def pages_with(*kinds: str) -> list[str]:
    return [page for page in pages() if any(b.kind in kinds for b in blocks_of(page))]


# -- markers -------------------------------------------------------------------------------------------------------


def test_every_block_of_the_pages_carries_a_known_marker():
    problems = [p for page in pages() for p in page_blocks(page, (REPO_ROOT / page).read_text())[1]]
    assert problems == []


def test_a_block_without_a_marker_or_with_a_bad_one_is_reported():
    text = "\n".join(
        [
            "```bash",
            "echo unmarked",
            "```",
            "<!-- docs: skip -->",
            "```bash",
            "echo no reason",
            "```",
            "<!-- docs: runs -->",
            "```bash",
            "echo unknown",
            "```",
            "<!-- docs: run -->",
            "",
            "<!-- docs: skip output -->",
            "  ```",
            "  shown, not run",
            "  ```",
        ]
    )
    blocks, problems = page_blocks("p.md", text)
    assert [(b.line, b.kind, b.arg, b.text) for b in blocks] == [(15, "skip", "output", "shown, not run\n")]
    assert [p.split(":", 2)[1] for p in problems] == ["1", "4", "8", "12"], problems
    assert "without a <!-- docs" in problems[0] and "needs a reason" in problems[1]
    assert "unknown docs marker" in problems[2] and "not right above" in problems[3]


# -- running a page --------------------------------------------------------------------------------------------------


def checkout_view(scratch: Path) -> None:
    """The repository's tracked top-level entries and the running venv, linked into `scratch`: what a reader in the
    checkout has at hand, while what the blocks write stays in `scratch`."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True, timeout=30
    ).stdout.split(b"\0")
    for name in sorted({entry.split(b"/")[0].decode() for entry in tracked if entry}):
        if (REPO_ROOT / name).exists():
            (scratch / name).symlink_to(REPO_ROOT / name)
    (scratch / ".venv").symlink_to(sys.prefix)


def script_for(blocks: list[Block], scratch: Path) -> str:
    """One bash script running `blocks` in order; each first records where it is (.docs/current), so a failure or a
    hang names its block."""
    parts = ["set -euo pipefail"]
    for n, block in enumerate(blocks):
        saved = scratch / ".docs" / f"block-{n}-line-{block.line}"
        saved.write_text(block.text)
        parts.append(f"printf '%s\\n' {block.where!r} > .docs/current")
        if block.kind == "file":
            parts.append(f"mkdir -p \"$(dirname '{block.arg}')\" && cp '{saved}' '{block.arg}'")
        elif block.lang in (*SHELLS, ""):
            parts.append(block.text)
        elif block.lang == "python":
            parts.append(f"python - < '{saved}'")
        elif block.lang in ("js", "javascript", "mjs"):
            parts.append(f"node --input-type=module < '{saved}'")
        else:
            raise AssertionError(f"{block.where}: a ```{block.lang} block cannot run; mark it `file NAME` or `skip`")
    return "\n".join(parts) + "\n"


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, which only wait for their parent, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(pgid: int) -> None:
    """SIGTERM to the page's process group (what it left running), SIGKILL past the grace period."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            wait_until_sync(lambda: not group_alive(pgid), grace, 0.1, f"process group {pgid} to exit")
            return
        except TimeoutError:
            continue


def run_page(page: str, kinds: set[str], scratch: Path, timeout_s: float) -> None:
    blocks = [b for b in blocks_of(page) if b.kind in kinds]
    (scratch / ".docs").mkdir(parents=True)
    checkout_view(scratch)
    script = scratch / ".docs" / "page.sh"
    script.write_text(script_for(blocks, scratch))
    log = scratch / ".docs" / "output.log"
    with RedisServer() as redis:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLQ_")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["ROLLQ_REDIS_URL"] = redis.url
        env["ROLLQ_ENGINE_PORT"] = str(free_port())
        started = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", str(script)],
                cwd=scratch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            try:
                code: int | None = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
        finally:
            stop_group(proc.pid)
            proc.wait(10)
        elapsed = time.monotonic() - started
    current = (scratch / ".docs" / "current").read_text().strip() if (scratch / ".docs" / "current").exists() else ""
    if code != 0:
        what = f"hung past {timeout_s:g} s" if code is None else f"exited {code}"
        output = log.read_bytes()[-8000:].decode(errors="replace")
        pytest.fail(f"{page}: the block at {current} {what} after {elapsed:.0f} s; the output's end:\n{output}")


@pytest.mark.slow
@pytest.mark.timeout(PAGE_TIMEOUT_S + 60)  # past the page's own bound, so that a hang fails with its output
@pytest.mark.parametrize("page", pages_with("run", "file"))
def test_the_page_runs_as_written(page, tmp_path, tiny_dir):
    run_page(page, {"run", "file"}, tmp_path / Path(page).stem, PAGE_TIMEOUT_S)


@pytest.mark.scenario
@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 120)
@pytest.mark.parametrize("page", pages_with("scenario"))
def test_the_page_runs_with_its_scenarios(page, tmp_path, tiny_dir):
    run_page(page, {"run", "file", "scenario"}, tmp_path / Path(page).stem, SCENARIO_TIMEOUT_S)


# -- the files the pages name ----------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")


def named_paths(page: str) -> list[str]:
    """The local files a page names: its relative links (resolved from the page's folder), and code spans that are
    repository paths (their first part a tracked top-level folder: `rollq/tasks/addition.py`, `tests/workers/`)."""
    text = (REPO_ROOT / page).read_text()
    prose = re.sub(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", "", text, flags=re.S | re.M)  # blocks are not prose
    folder = (REPO_ROOT / page).parent
    found = []
    for target in LINK.findall(prose):
        path = target.split("#")[0]
        if path and not re.match(r"[a-z][a-z0-9+.-]*:", path):
            found.append(os.path.relpath((folder / path).resolve(), REPO_ROOT.resolve()))
    top = {p.name for p in REPO_ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {"runs", "build"}
    for span in CODE_SPAN.findall(prose):
        path = span.rstrip(".,:;")
        if "/" in path and path.split("/")[0] in top and re.fullmatch(r"[\w./-]+", path):
            found.append(path)
    return found


@pytest.mark.parametrize("page", pages())
def test_the_page_names_only_files_that_exist(page):
    missing = sorted({p for p in named_paths(page) if not (REPO_ROOT / p).exists()})
    assert missing == [], f"{page} names files that do not exist"


def test_no_page_names_the_checkpoint_file_runs_no_longer_write():
    """Runs write `checkpoints/{latest,step-N}/` (docs/export.md); a `checkpoint.pt` was the old single file."""
    named = [page for page in pages() if "checkpoint.pt" in (REPO_ROOT / page).read_text()]
    assert named == []


def test_areal_md_names_the_test_of_every_file_it_says_runs():
    """docs/areal.md's file-by-file table: a file that runs in either mode ("ok") names the test that runs it, and
    that test exists (tests/workers/areal_real/); a file that those tests run is not "not yet"."""
    lines = (REPO_ROOT / "docs/areal.md").read_text().splitlines()
    rows = [line for line in lines if re.match(r"\| `[\w/]+\.py` :", line)]  # | `workflow/rlvr.py` : Class | ...
    assert any("vision_rlvr.py" in row for row in rows)
    folder = REPO_ROOT / "tests" / "workers" / "areal_real"
    untested = []
    for row in rows:
        name, mode_b, mode_a, tests = (cell.strip() for cell in row.strip().strip("|").split("|")[:4])
        if not (mode_b.startswith("ok") or mode_a.startswith("ok")):
            path = name.split("`")[1]  # workflow/vision_rlvr.py
            run_by = [t.name for t in folder.glob("test_*.py") if f"areal/{path}" in t.read_text()]
            if run_by and "not yet" in f"{mode_b} {mode_a}":
                untested.append(f"{name}: says not yet, but {', '.join(sorted(run_by))} run it")
            continue
        named = re.findall(r"`([\w/]+\.py)`", tests)
        if not named or not all((folder.parent / n).exists() or (folder / n).exists() for n in named):
            untested.append(f"{name}: {tests}")
    assert untested == []
