"""Agents never hold the worker's secrets (issue 24, F4): a command agent starts from a minimal environment plus what
the job passes (names the operator allowed); subproc-mode agents and agent hosts run without the worker's ROLLQ_* and
REDIS* variables, and so does what they start."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from rollq.shield import NOT_SECRET
from rollq.workers.agents.hosts import AgentHosts
from rollq.workers.agents.subproc import agent_result, run_agent
from rollq.workers.context import ContextConfig
from rollq.workers.loader import WorkflowCache
from rollq.workers.resolver import Allowlist, ImportNotAllowed, WorkflowLoadError, enforcing
from rollq.workers.rewards.processes import AsyncRewardWrapper

SECRET_URL = "redis://:hunter2-secret@10.9.8.7:6379/0"
SECRETS = {
    "ROLLQ_REDIS_URL": SECRET_URL,
    "ROLLQ_WORKER_ENGINE_API_KEY": "engine-secret",
    "ROLLQ_WORKER_ENGINE_ADMIN_API_KEY": "admin-secret",
    "REDISCLI_AUTH": "hunter2-secret",
}
URLS = {"base_url": "http://127.0.0.1:9/v1", "anthropic_base_url": "http://127.0.0.1:9"}
SHELL_OWN = {"PWD", "SHLVL", "_", "OLDPWD"}  # what sh itself exports


@pytest.fixture
def worker_secrets(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORKER_ONLY", "the worker's own setting")


# -- command agents ------------------------------------------------------------------------------------------------


@pytest.fixture
def printenv(tmp_path):
    """An agent program that writes its environment to the file named by its argument, then rewards 1.0 when its
    HOME and TMPDIR are folders it can write to."""
    folder = tmp_path / "agents"
    folder.mkdir()
    program = folder / "printenv.sh"
    program.write_text('#!/bin/sh\nenv > "$1"\ntouch "$HOME/x" "$TMPDIR/y" && echo 1.0\n')
    program.chmod(0o755)
    return program


def command(workflow: str, kwargs: dict[str, Any] | None, allowlist: Allowlist) -> Any:
    """The command agent a job builds in a worker (the loader, under the worker's allowlist)."""
    with enforcing(allowlist):
        return WorkflowCache().get(workflow, kwargs).target


async def run_printenv(agent: Any, out: Any) -> dict[str, str]:
    result = await asyncio.wait_for(agent.run({"q": 1}, URLS["base_url"], "sess-key", URLS["anthropic_base_url"]), 30)
    assert result == 1.0  # HOME and TMPDIR were writable folders
    return dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)


async def test_a_command_agent_gets_a_minimal_environment_never_the_workers(worker_secrets, printenv, tmp_path):
    out = tmp_path / "env.txt"
    agent = command(f"exec:{printenv} {out}", None, Allowlist(patterns=(f"command:{printenv.parent}/*",)))
    env = await run_printenv(agent, out)
    locale = {name for name in os.environ if name.startswith("LC_")}
    expected = {"PATH", "HOME", "TMPDIR", "LANG", *locale}
    expected |= {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"}
    assert set(env) - SHELL_OWN == expected  # nothing else of the worker's: no ROLLQ_*, REDIS*, WORKER_ONLY
    assert "hunter2" not in out.read_text() and "engine-secret" not in out.read_text()
    assert env["PATH"] == os.environ["PATH"] and env["LANG"]
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["OPENAI_API_KEY"] == "sess-key"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["ANTHROPIC_API_KEY"] == "sess-key"
    # HOME is a fresh folder of the episode's (TMPDIR inside it), not the worker's, and gone after the episode.
    assert env["HOME"] != os.environ.get("HOME") and env["TMPDIR"] == os.path.join(env["HOME"], "tmp")
    assert os.path.dirname(env["HOME"]) == tempfile.gettempdir()
    assert not os.path.exists(env["HOME"])


async def test_a_variable_the_job_passes_arrives_when_the_operator_allows_its_name(worker_secrets, printenv, tmp_path):
    out = tmp_path / "env.txt"
    allowlist = Allowlist(patterns=(f"command:{printenv.parent}/*", "env:AGENT_*"))
    agent = command(f"exec:{printenv} {out}", {"env": {"AGENT_MODE": "eval", "AGENT_SEED": "7"}}, allowlist)
    env = await run_printenv(agent, out)
    assert (env["AGENT_MODE"], env["AGENT_SEED"]) == ("eval", "7")
    assert "ROLLQ_REDIS_URL" not in env and "WORKER_ONLY" not in env


@pytest.mark.parametrize(
    "kwargs, patterns, error, message",
    [
        ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, (), ImportNotAllowed, "'LD_PRELOAD' may not be set by a job here"),
        ({"env": {"PATH": "/tmp/evil"}}, ("env:AGENT_*",), ImportNotAllowed, "e.g. 'env:PATH'"),
        ({"env": {"ROLLQ_REDIS_URL": SECRET_URL}}, ("env:*",), ImportNotAllowed, "may not set 'ROLLQ_REDIS_URL'"),
        ({"env": {"OPENAI_BASE_URL": "http://evil/v1"}}, ("env:*",), ImportNotAllowed, "may not set 'OPENAI_BASE"),
        ({"env": {"1ST": "x"}}, ("env:*",), WorkflowLoadError, "'1ST' is not an environment variable name"),
        ({"env": {"A=B": "x"}}, ("env:*",), WorkflowLoadError, "'A=B' is not an environment variable name"),
        ({"env": {"A": "x\0y"}}, ("env:*",), WorkflowLoadError, "holds a NUL character"),
        ({"env": {"A": 1}}, ("env:*",), WorkflowLoadError, "Expected `str`, got `int`"),
        ({"env": ["A"]}, ("env:*",), WorkflowLoadError, "Expected `object`, got `array`"),
        ({"args": ["-c", "id"]}, ("env:*",), WorkflowLoadError, "may hold only env"),
    ],
)
def test_what_a_job_passes_is_checked_before_anything_runs(printenv, tmp_path, kwargs, patterns, error, message):
    out = tmp_path / "env.txt"
    allowlist = Allowlist(patterns=(f"command:{printenv.parent}/*", *patterns))
    with pytest.raises(error, match=message):
        command(f"exec:{printenv} {out}", kwargs, allowlist)


# -- Python agents in processes of their own -----------------------------------------------------------------------


def secrets_seen() -> dict[str, float]:
    """{name: 1.0} for each of the worker's secrets this process, or a program it starts, can see; plus PATH (the
    environment is there at all) and OPENAI_BASE_URL when set (subproc mode sets it)."""
    started = subprocess.run(["env"], capture_output=True, text=True, check=True, timeout=10).stdout
    names = set(os.environ) | {line.split("=", 1)[0] for line in started.splitlines() if "=" in line}
    seen = {name: 1.0 for name in names if name.startswith(("ROLLQ_", "REDIS")) or name == "WORKER_ONLY"}
    return seen | {name: 1.0 for name in ("PATH", "OPENAI_BASE_URL") if name in os.environ}


class EnvAgent:
    """An async agent (agent hosts run these) reporting what it sees."""

    async def run(self, data: Any, **extra: Any) -> dict[str, float]:
        return secrets_seen()


class SyncEnvAgent:
    """A sync agent (subproc mode) reporting what it sees."""

    def run(self, data: Any) -> dict[str, float]:
        return secrets_seen()


# The forkserver (the workers' default) starts once per process with the environment of that moment, so a test in a
# long session could not know what its children inherited; spawn starts each child from the environment as it is now.


async def test_subproc_agents_run_without_the_workers_secrets(worker_secrets):
    pool = AsyncRewardWrapper(run_agent, 30, 1, 0, start_method="spawn", accept=agent_result, what="agent")
    async with pool:
        kind, value = await pool(f"{__name__}:SyncEnvAgent", "{}", {}, URLS, "sess-key", None)
    assert kind == "rewards"
    assert value == {"PATH": 1.0, "OPENAI_BASE_URL": 1.0, "WORKER_ONLY": 1.0}  # no ROLLQ_*, no REDIS*


async def test_agent_hosts_run_without_the_workers_secrets(worker_secrets):
    # The host still gets the Redis URL its agents' remote rewards use, in its config (not its environment).
    hosts = AgentHosts(1, ContextConfig(redis_url=SECRET_URL), start_method="spawn")
    try:
        reply = await hosts.run(f"{__name__}:EnvAgent", "{}", {}, URLS, "sess-key", None, None, 30)
    finally:
        await hosts.close()
    assert reply[0] == "ok", reply
    assert reply[2:] == ["rewards", {"PATH": 1.0, "WORKER_ONLY": 1.0}]


def test_rollq_worker_sheds_its_secrets_before_it_starts_anything():
    """The worker's settings are read before `shield_secrets`: what it starts afterwards (every agent process) begins
    without ROLLQ_* / REDIS*, and on Linux the worker turns non-dumpable, so a same-user agent can't read its
    /proc/<pid>/environ or memory."""
    script = (
        "import ctypes, os, subprocess\n"
        "from rollq.workers.commands import shield_secrets\n"
        "shield_secrets()\n"
        "child = subprocess.run(['cat', '/proc/self/environ'], capture_output=True).stdout\n"
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), b'ROLLQ_' in child, b'REDISCLI_AUTH' in child,"
        " 'ROLLQ_REDIS_URL' in os.environ, 'KEEP_ME' in os.environ)\n"
    )
    own = {k: v for k, v in os.environ.items() if k not in NOT_SECRET}  # kept by design (the suite sets one)
    env = {**own, "ROLLQ_REDIS_URL": "redis://:pw@h:6379/0", "REDISCLI_AUTH": "pw", "KEEP_ME": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dumpable, child_rollq, child_redis, own_rollq, kept = out.stdout.split()
    assert dumpable == "0" and (child_rollq, child_redis, own_rollq) == ("False", "False", "False") and kept == "True"
