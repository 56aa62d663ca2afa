"""Environment jobs (`verifiers:ENV_ID`, `openenv:NAME`) refused before anything of theirs runs, in a real worker on
a real Redis: not allowed, malformed, not configured, not installed (the driver's own check). Each is dead-lettered at
once, naming what is missing; the ingress refuses a tenant's job naming an environment outside its patterns."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import JobRequest, Producer
from rollq.workers.agents.agent_user import parse_agent_users
from rollq.workers.agents.writable import AgentCanWrite, check_agent_writable
from rollq.workers.context import ContextConfig, WorkflowContext
from rollq.workers.environments.agent import EnvironmentAgent
from rollq.workers.environments.naming import parse_environment
from rollq.workers.environments.settings import EnvironmentSettings
from rollq.workers.resolver import Allowlist, ImportNotAllowed, WorkflowLoadError
from tests.helpers import running_worker
from tests.producer.ingress_helpers import running_ingress
from tests.scripted import scripted_engine

# The project's own interpreter: a Python without verifiers or openenv installed.
NO_VERIFIERS = sys.executable


async def dead_letters(redis, redis_url, run, jobs: dict[str, str], **worker) -> dict[str, tuple[str, str]]:
    """Runs each job (job_id -> workflow) once in a real worker: job_id -> (error type, message)."""
    async with scripted_engine(["7"]) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        async with running_worker(redis_url, run, engine=pool, max_attempts=3, **worker):
            producer = Producer(redis, run)
            consumer = producer.consumer()
            await consumer.setup()
            await producer.submit_many([JobRequest(workflow=wf, job_id=j, data={"idx": 0}) for j, wf in jobs.items()])
            results = [t async for t in producer.wait_for(dict.fromkeys(jobs, 1), timeout_s=60, consumer=consumer)]
    dead = await redis.xrange(f"rollq:{{{run}}}:dead")
    assert len(dead) == len(jobs)
    for t in results:
        assert t.status == "error" and t.attempt == 1, t  # at once: its first run, never retried
    return {t.job_id: (t.error.type, t.error.message) for t in results}


async def test_environment_jobs_are_dead_lettered_naming_what_is_missing(redis, redis_url, run_name):
    got = await dead_letters(
        redis,
        redis_url,
        run_name,
        {
            "not-allowed": "verifiers:other-env",
            "malformed": "verifiers:-rf /",
            "not-installed": "verifiers:my-env",
            "no-server": "openenv:echo",
            "no-python": "openenv:listed",
        },
        allow=["verifiers:my-env", "verifiers:-*", "openenv:*"],
        verifiers_python=NO_VERIFIERS,
        agent_hosts=1,  # an environment runs in the worker's loop all the same: it is a command agent
        openenv_servers={"listed": "http://127.0.0.1:9"},
    )
    assert got["not-allowed"][0] == "ImportNotAllowed" and "'verifiers:other-env'" in got["not-allowed"][1]
    assert got["malformed"][0] == "WorkflowLoadError" and "is not a verifiers environment id" in got["malformed"][1]
    # The driver's own check, quoted: this interpreter has no verifiers.
    assert got["not-installed"][0] == "WorkflowLoadError", got["not-installed"]
    assert f"verifiers is not importable by {NO_VERIFIERS}" in got["not-installed"][1]
    assert "No module named 'verifiers'" in got["not-installed"][1]
    assert "openenv_python setting is empty" in got["no-server"][1]  # checked before the server list
    assert "openenv_python setting is empty" in got["no-python"][1]


async def test_an_unlisted_server_and_an_unset_python_are_named(redis, redis_url, run_name):
    got = await dead_letters(
        redis,
        redis_url,
        run_name,
        {"unlisted": "openenv:echo", "unset": "verifiers:my-env"},
        allow=["verifiers:*", "openenv:*"],
        openenv_python=NO_VERIFIERS,
        openenv_servers={"other": "http://127.0.0.1:9"},
    )
    assert got["unlisted"][0] == "WorkflowLoadError"
    assert "openenv_servers setting lists no server 'echo' (it lists: other)" in got["unlisted"][1]
    assert "verifiers_python setting is empty" in got["unset"][1]


def test_environment_names_and_patterns():
    assert parse_environment("verifiers:my-env_2").name == "my-env_2"
    assert parse_environment("openenv:team/echo@1").name == "team/echo@1"  # an operator's key, looked up as written
    for bad in ("verifiers:", "openenv: x", "verifiers:a;b", "verifiers:" + "a" * 129, "openenv:-x"):
        with pytest.raises(WorkflowLoadError):
            parse_environment(bad)
    # verifiers imports `name.rsplit("/")[-1].split("@")[0]` (verifiers/v1/utils/loaders.py _import_plugin): an owner
    # or version would choose nothing a pattern could check, a dot a submodule of any package, and case folds.
    for bad in ("owner/my-env", "my-env@0.1", "trusted/x/../../other", "os.path", "My-Env"):
        with pytest.raises(WorkflowLoadError, match="not a verifiers environment id"):
            parse_environment(f"verifiers:{bad}")
    allow = Allowlist(patterns=("verifiers:math-*", "openenv:team/*"))
    allow.check_environment("verifiers", "math-add")
    allow.check_environment("openenv", "team/echo")
    for kind, name in (("verifiers", "code-x"), ("openenv", "other/x"), ("verifiers", "team/echo")):
        with pytest.raises(ImportNotAllowed, match=f"'{kind}:{name}'"):
            allow.check_environment(kind, name)
    with pytest.raises(ImportNotAllowed, match="tenant"):  # narrowed by the job's own patterns too
        allow.narrowed(["verifiers:math-sub"]).check_environment("verifiers", "math-add")


async def test_the_ingress_refuses_an_environment_outside_a_tenants_patterns(redis_url, run_name):
    tenants = {"narrow": ["verifiers:math-add", "env:HF_*"]}  # as a whole: not `verifiers:math-add-x`
    async with running_ingress(redis_url, run_name, tokens={"tok": "narrow"}, tenant_workflows=tenants) as (_, url):
        async with httpx.AsyncClient(timeout=10) as http:
            auth = {"Authorization": "Bearer tok"}
            ok = await http.post(f"{url}/v1/jobs", json={"workflow": "verifiers:math-add"}, headers=auth)
            assert ok.status_code == 202, ok.text
            for workflow in ("verifiers:code-x", "openenv:math-add", "verifiers:math-add-x"):
                r = await http.post(f"{url}/v1/jobs", json={"workflow": workflow}, headers=auth)
                assert r.status_code == 403, r.text
                assert f"{workflow!r}" in r.json()["message"]
            # Variables for the driver, by the tenant's `env:` patterns too (the workers check both lists).
            job = {"workflow": "verifiers:math-add", "workflow_kwargs": {"env": {"HF_HOME": "/c", "PYTHONPATH": "/t"}}}
            r = await http.post(f"{url}/v1/jobs", json=job, headers=auth)
            assert r.status_code == 403 and "'env:PYTHONPATH'" in r.json()["message"], r.text
            assert r.json()["field"] == "$.workflow_kwargs.env.PYTHONPATH"
            job["workflow_kwargs"] = {"env": {"HF_HOME": "/c"}}
            assert (await http.post(f"{url}/v1/jobs", json=job, headers=auth)).status_code == 202
            # A malformed name is invalid whoever sends it (the workers would dead-letter it at once).
            bad = await http.post(f"{url}/v1/jobs", json={"workflow": "verifiers:-rm"}, headers=auth)
            assert bad.status_code == 400, bad.text
            assert bad.json()["field"] == "$.jobs[0].workflow" or "workflow" in bad.json()["message"]
            assert "'-rm' is not a verifiers environment id" in bad.json()["message"]


@pytest.mark.skipif(os.geteuid() != 0, reason="files owned by another uid need root")
def test_a_worker_refuses_agents_that_can_write_an_environments_virtualenv(tmp_path):
    """The next episode runs the code in it: an agent that could write it would change what later ones run."""
    site = tmp_path / "venv" / "lib" / "site-packages" / "my_env"
    site.mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir()
    (site / "__init__.py").write_text("")
    settings = EnvironmentSettings(verifiers_python=str(tmp_path / "venv" / "bin" / "python"))
    assert settings.virtualenvs() == [str(tmp_path / "venv")]
    user = parse_agent_users("61010:61010")
    assert user is not None
    assert check_agent_writable([], user.shared, path=[], cwd="/", virtualenvs=settings.virtualenvs()) == []
    os.chown(site / "__init__.py", 61010, 0)
    with pytest.raises(AgentCanWrite, match="the virtualenv of an environment's interpreter"):
        check_agent_writable([], user.shared, path=[], cwd="/", virtualenvs=settings.virtualenvs())


def test_a_jobs_openenv_options_and_variables_are_checked_before_anything_runs():
    """What the driver would refuse is refused while the workflow is built (a dead letter at once, not retries), and
    variables for the driver pass only as `env:NAME` patterns allow, as a command agent's."""
    settings = EnvironmentSettings(openenv_python=NO_VERIFIERS, openenv_servers={"e": "http://127.0.0.1:9"})
    echo = parse_environment("openenv:e")
    for kwargs, said in (
        ({"max_turns": 1000}, "max_turns must be a whole number from 1 to 256"),
        ({"max_turns": True}, "max_turns must be"),
        ({"system_prompt": ["x"]}, "system_prompt must be a string"),
        ({"sampling": {"model": "other", "messages": []}}, "may not set messages, model"),
        ({"sampling": {"temperature": 0.5, "tools": [], "extra_body": {}}}, "may not set extra_body, tools"),
        ({"server": "http://evil"}, "'server' are not openenv environment options"),
    ):
        with pytest.raises(WorkflowLoadError, match=said):
            EnvironmentAgent(echo, kwargs, settings)
    verifiers = EnvironmentSettings(verifiers_python=NO_VERIFIERS)
    with pytest.raises(WorkflowLoadError, match="may not set messages"):  # the task's prompt is the environment's
        EnvironmentAgent(parse_environment("verifiers:x"), {"sampling": {"messages": []}}, verifiers)
    allow = Allowlist(patterns=("openenv:e", "env:HF_*"))
    agent = EnvironmentAgent(echo, {"env": {"HF_HUB_OFFLINE": "1"}, "max_turns": 3}, settings, allow)
    assert agent.command.env == {"HF_HUB_OFFLINE": "1"} and agent.kwargs == {"max_turns": 3}  # env: not the driver's
    for env in ({"PYTHONPATH": "/tmp"}, {"OPENAI_BASE_URL": "http://evil"}):
        with pytest.raises(ImportNotAllowed):
            EnvironmentAgent(echo, {"env": env}, settings, allow)


async def test_an_environment_is_checked_once_per_process_whatever_the_jobs_kwargs(tmp_path):
    """The driver's --check costs an interpreter's start (seconds for verifiers): one per (interpreter, name) in a
    worker process, shared by the agents of every job's kwargs."""
    counter = tmp_path / "checks"
    python = tmp_path / "python"  # a stand-in interpreter that counts its --check runs and loads nothing
    python.write_text(f'#!/bin/sh\necho x >> {counter}\necho "no such environment" >&2\nexit 3\n')
    python.chmod(0o755)
    settings = EnvironmentSettings(verifiers_python=str(python))
    async with WorkflowContext(ContextConfig(environments=settings)):
        agents = [
            EnvironmentAgent(parse_environment("verifiers:my-env"), {"sampling": {"temperature": t}}, settings)
            for t in (0.0, 0.5, 1.0)
        ]
        checks = [a.checked("http://x/v1", "k", "http://x") for a in [*agents, agents[0]]]
        results = await asyncio.gather(*checks, return_exceptions=True)
    assert counter.read_text().count("x") == 1
    assert all(isinstance(r, WorkflowLoadError) and "no such environment" in str(r) for r in results), results
