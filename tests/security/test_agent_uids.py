"""Each running command agent has a uid of its own (issue 43, A1): with one `agent_user` uid for all agents, one
tenant's agent read another's proxy key from /proc/PID/environ and wrote completions into that tenant's episode.
With `agent_user` a uid range (`FIRST-LAST:GID`) every command-agent episode takes a free uid of the range for its
whole life, and every process of that uid is killed before the uid is handed out again.

Real command agents (the loader's CommandAgent under an allowlist) inside a real WorkflowContext; CI runs as root, so
the uids (61000-61003, no passwd entry) are real. The agents' programs meet through named pipes in a folder all of
them can reach: every wait on one is bounded by the test's own timeout, which kills the agents.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollq.workers.agents.agent_user import AgentUser, AgentUsers, parse_agent_user, parse_agent_users
from rollq.workers.agents.command import context_uid_pool
from rollq.workers.agents.writable import AgentCanWrite, check_agent_writable
from rollq.workers.context import ContextConfig, WorkflowContext
from rollq.workers.loader import WorkflowCache
from rollq.workers.resolver import Allowlist, enforcing
from tests.helpers import shared_folder

RANGE = "61000-61003:61000"  # 61000 runs Python agents; command agents get 61001-61003
ONE_COMMAND_UID = "61000-61001:61000"
URLS = {"base_url": "http://127.0.0.1:9/v1", "anthropic_base_url": "http://127.0.0.1:9"}
TIMEOUT_S = 60
# One xdist process for the whole module: its tests hand out the same uids, and a test's kill_uid helper (running as
# 61001, kill(-1, SIGKILL)) killed another test's helper of that uid when two tests ran at once (CI, stop 50).
pytestmark = pytest.mark.xdist_group("agent-uids-61000")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running agents as uids 61000-61003 needs root")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder the agents' uids can reach and write, removed after."""
    with shared_folder("rollq-uids-", 0o1777) as path:
        yield path


def program(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def pipe(path: Path) -> Path:
    os.mkfifo(path, 0o666)
    path.chmod(0o666)
    return path


def command(workflow: str, folder: Path) -> Any:
    """The command agent a job builds in a worker (the loader, under the worker's allowlist)."""
    with enforcing(Allowlist(patterns=(f"command:{folder}/*",))):
        return WorkflowCache().get(workflow, None).target


def episode(agent: Any, key: str) -> Any:
    """One episode of `agent` with proxy key `key` (a coroutine)."""
    return agent.run({"q": 1}, URLS["base_url"], key, URLS["anthropic_base_url"])


async def read_pipe(path: Path) -> str:
    """What one writer writes into the named pipe `path` (bounded: the reader is killed at the timeout)."""
    cat = await asyncio.create_subprocess_exec("cat", str(path), stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(cat.communicate(), TIMEOUT_S)
    finally:
        if cat.returncode is None:
            cat.kill()
            await cat.wait()
    return out.decode().strip()


async def write_pipe(path: Path, text: str) -> None:
    """Write `text` into the named pipe `path` once a reader opened it (bounded)."""
    sh = await asyncio.create_subprocess_exec("sh", "-c", 'printf "%s\\n" "$1" > "$2"', "sh", text, str(path))
    try:
        await asyncio.wait_for(sh.wait(), TIMEOUT_S)
    finally:
        if sh.returncode is None:
            sh.kill()
            await sh.wait()


def live_uid_processes(uid: int) -> list[str]:
    """'PID STATE' of every process (zombies aside) whose real, effective or saved uid is `uid`."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{name}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        state, uids = fields["State"].split()[0], [int(x) for x in fields["Uid"].split()[:3]]
        if state not in ("Z", "X") and uid in uids:
            found.append(f"{name} {state}")
    return found


def test_a_uid_range_is_parsed_and_checked():
    users = parse_agent_users(RANGE)
    assert users == AgentUsers(61000, 61003, 61000, pooled=True) and str(users) == RANGE
    assert list(users.command_uids()) == [61001, 61002, 61003]
    assert parse_agent_user(RANGE) == AgentUser(61000, 61000)  # Python agents: the first uid
    assert parse_agent_users("61000:61000") == AgentUsers(61000, 61000, 61000)  # one uid, shared, as before
    assert not parse_agent_users("61000:61000").command_uids()
    for bad, message in [
        ("61000-61000:61000", "holds 2 to 65536 uids"),
        ("61003-61000:61000", "holds 2 to 65536 uids"),
        ("1-70000:5", "holds 2 to 65536 uids"),
        ("61000-61003", "a uid range is FIRST-LAST:GID"),
        ("0-10:5", "holds root"),
        ("10-20:0", "holds root"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_agent_users(bad)


# -- A1: two command agents running at once -----------------------------------------------------------------------

READER = """\
    # B: read A's environment (its proxy key) through /proc, write what happened, then let A finish.
    read pid < "$1/a-pid"
    id -u > "$1/b-uid"
    if cat "/proc/$pid/environ" > "$1/b-raw" 2> "$1/b-error"; then echo read > "$1/b-outcome"
    else echo denied > "$1/b-outcome"; fi
    tr '\\0' '\\n' < "$1/b-raw" > "$1/b-read"
    echo done > "$1/go"
    echo 1.0
"""
HOLDER = """\
    # A: tell B its pid, then wait until B is done.
    id -u > "$1/a-uid"
    echo $$ > "$1/a-pid"
    read x < "$1/go"
    echo 1.0
"""


async def run_pair(spec: str, folder: Path) -> str:
    """Agents A and B of two episodes at once under agent_user `spec`; B's outcome reading A's environment."""
    holder, reader = program(folder, "holder.sh", HOLDER), program(folder, "reader.sh", READER)
    pipe(folder / "a-pid"), pipe(folder / "go")
    a, b = command(f"exec:{holder} {folder}", folder), command(f"exec:{reader} {folder}", folder)
    async with WorkflowContext(ContextConfig(agent_user=spec)):
        got = await asyncio.wait_for(asyncio.gather(episode(a, "key-of-tenant-a"), episode(b, "key-of-b")), TIMEOUT_S)
    assert got == [1.0, 1.0]
    return (folder / "b-outcome").read_text().strip()


@needs_root
async def test_command_agents_of_a_range_cannot_read_each_others_environment(shared_dir):
    outcome = await run_pair(RANGE, shared_dir)
    uids = {int((shared_dir / f"{x}-uid").read_text()) for x in "ab"}
    assert len(uids) == 2 and uids <= {61001, 61002, 61003}, uids  # a uid each, never the Python agents' 61000
    assert outcome == "denied", (shared_dir / "b-read").read_text()
    assert "Permission denied" in (shared_dir / "b-error").read_text()
    assert "key-of-tenant-a" not in (shared_dir / "b-read").read_text()


@needs_root
async def test_command_agents_sharing_one_uid_can_read_each_others_environment(shared_dir):
    """Why a range: with one agent_user uid (as before, and documented) B reads A's proxy key."""
    outcome = await run_pair("61000:61000", shared_dir)
    assert {int((shared_dir / f"{x}-uid").read_text()) for x in "ab"} == {61000}
    assert outcome == "read"
    assert "OPENAI_API_KEY=key-of-tenant-a" in (shared_dir / "b-read").read_text().splitlines()


# -- leftovers: what an episode left running dies before its uid is handed out again ---------------------------------

LEAVER = """\
    # Leave a process outside the episode's process group (a double fork into a session of its own) that would
    # outlive the episode, then end.
    id -u > "$1/uid"
    ( setsid sh -c 'echo $$ > "$1/left"; exec sleep 300' sh "$1" < /dev/null > /dev/null 2>&1 & )
    read left < "$1/left"
    echo "$left" > "$1/left-pid"
    echo 1.0
"""


@needs_root
async def test_a_process_an_episode_leaves_behind_is_dead_before_its_uid_runs_again(shared_dir):
    leaver = program(shared_dir, "leaver.sh", LEAVER)
    pipe(shared_dir / "left")
    agent = command(f"exec:{leaver} {shared_dir}", shared_dir)
    async with WorkflowContext(ContextConfig(agent_user=ONE_COMMAND_UID)):
        assert await asyncio.wait_for(episode(agent, "k1"), TIMEOUT_S) == 1.0
        uid, left = int((shared_dir / "uid").read_text()), int((shared_dir / "left-pid").read_text())
        assert uid == 61001
        # Once run() returned: the process it left (not in its group) is dead, and nothing else runs as its uid.
        state = Path(f"/proc/{left}/status").read_text() if os.path.exists(f"/proc/{left}/status") else ""
        assert "State:\tZ" in state or not state, state
        assert live_uid_processes(uid) == []


# -- a range of one command uid: a second episode waits for the first ---------------------------------------------

TURN = """\
    # $2: a or b. Take a lock no other running episode may hold; A keeps it until the test lets it go.
    mkdir "$1/busy" || { echo "overlap $2" >> "$1/log"; exit 3; }
    echo "start $2 $(id -u)" >> "$1/log"
    if [ "$2" = a ]; then echo inside > "$1/inside"; read x < "$1/hold"; fi
    rmdir "$1/busy"
    echo "end $2" >> "$1/log"
    echo 1.0
"""


@needs_root
async def test_with_no_free_uid_an_episode_waits_for_one_then_runs(shared_dir):
    turn = program(shared_dir, "turn.sh", TURN)
    pipe(shared_dir / "inside"), pipe(shared_dir / "hold")
    a = command(f"exec:{turn} {shared_dir} a", shared_dir)
    b = command(f"exec:{turn} {shared_dir} b", shared_dir)
    async with WorkflowContext(ContextConfig(agent_user=ONE_COMMAND_UID)):
        first = asyncio.ensure_future(episode(a, "ka"))
        second = None
        try:
            assert await read_pipe(shared_dir / "inside") == "inside"  # A runs, holding the only command uid
            pool = context_uid_pool()
            assert pool is not None and pool.waiting == 0
            second = asyncio.ensure_future(episode(b, "kb"))
            await asyncio.sleep(0)  # B's first step: it asks the pool for a uid (no await comes before that)
            assert pool.waiting == 1 and not second.done()
            assert (shared_dir / "log").read_text().splitlines() == ["start a 61001"]
            await write_pipe(shared_dir / "hold", "go")
            got = await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT_S)
        finally:
            for task in (first, second):
                if task is not None and not task.done():
                    task.cancel()
    assert got == [1.0, 1.0]
    assert (shared_dir / "log").read_text().splitlines() == ["start a 61001", "end a", "start b 61001", "end b"]


# -- the start-up check: any uid of the range counts as the agents' -----------------------------------------------


@needs_root
def test_a_place_owned_by_a_uid_inside_the_range_is_refused(tmp_path):
    users = parse_agent_users(RANGE)
    assert users is not None
    modules = tmp_path / "mods"
    package = modules / "pkg"
    package.mkdir(parents=True)
    (package / "mod.py").write_text("")
    assert check_agent_writable([], users, path=[str(modules)], cwd="/") == []
    os.chown(package / "mod.py", 61002, 0)  # a command agent's uid, not the range's first
    with pytest.raises(AgentCanWrite, match=f"agent_user {RANGE} can write {package / 'mod.py'}"):
        check_agent_writable([], users, path=[str(modules)], cwd="/")
    os.chown(package / "mod.py", 0, 61000)  # the range's group, with group-write
    (package / "mod.py").chmod(0o664)
    with pytest.raises(AgentCanWrite, match="a sys.path entry"):
        check_agent_writable([], users, path=[str(modules)], cwd="/")
    os.chown(package / "mod.py", 61004, 0)  # just past the range: not the agents'
    (package / "mod.py").chmod(0o644)
    assert check_agent_writable([], users, path=[str(modules)], cwd="/") == []
