"""The workflow allowlist: every import a job causes (its workflow, a reward function, tools) is checked before
anything is imported or constructed; a job naming anything else is dead-lettered, having run nothing."""

import asyncio
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from rollq.producer import Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.messages import Job
from rollq.workers.loader import WorkflowCache
from rollq.workers.resolver import (
    Allowlist,
    ImportNotAllowed,
    WorkflowLoadError,
    enforcing,
    resolve,
)
from rollq.workers.rewards.processes import RewardError
from rollq.workers.rewards.worker import RewardFunctions
from tests.helpers import running_worker


@pytest.fixture
def side_effect_module(tmp_path, monkeypatch):
    """A module whose import writes a marker file: proof of whether it was imported at all."""
    marker = tmp_path / "imported"
    (tmp_path / "sneaky_mod.py").write_text(
        textwrap.dedent(f"""
        import os
        open({str(marker)!r}, "w").close()
        from os import system  # a re-export of something outside the allowlist

        def score(*args, **kwargs):
            return 1.0

        class Workflow:
            async def arun_episode(self, engine, data):
                return None
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("sneaky_mod", None)


def test_a_path_outside_the_allowlist_is_refused_before_its_module_is_imported(side_effect_module):
    allowlist = Allowlist(patterns=("tests",), setting="--allow")
    refused = r"'sneaky_mod:score' is not allowed.*--allow \(e.g. 'sneaky_mod:score'\)"
    with pytest.raises(ImportNotAllowed, match=refused):
        resolve("sneaky_mod:score", allowlist=allowlist)
    assert not side_effect_module.exists()
    with enforcing(allowlist), pytest.raises(ImportNotAllowed):
        resolve("sneaky_mod.Workflow")  # the dotted form is checked the same way
    assert not side_effect_module.exists()
    assert resolve("sneaky_mod:score")(0) == 1.0  # outside a worker (no allowlist) imports are the caller's own


def test_patterns_cover_what_is_below_them_and_defining_modules_are_checked(side_effect_module):
    for patterns in (("sneaky_mod",), ("sneaky_mod.*",), ("sneaky_mod.score",), ("sneaky_*",)):
        assert resolve("sneaky_mod:score", allowlist=Allowlist(patterns=patterns))(0) == 1.0
    allowed = Allowlist(patterns=("sneaky_mod",))
    assert not Allowlist(patterns=("sneaky_mod.score",)).allows("sneaky_mod.Workflow")
    with pytest.raises(ImportNotAllowed, match="names posix.system, defined in a module the allowlist does not cover"):
        resolve("sneaky_mod:system", allowlist=allowed)  # re-exported from os: not a way around the list
    with pytest.raises(WorkflowLoadError, match="names a module"):
        resolve("sneaky_mod:os", allowlist=allowed)
    with pytest.raises(WorkflowLoadError, match="private attribute"):
        resolve("sneaky_mod:score.__globals__", allowlist=allowed)
    with pytest.raises(ImportNotAllowed):
        resolve("sneaky_mod:score", allowlist=Allowlist(patterns=("sneaky",)))  # a name, not a prefix of one


def test_rollq_builtins_are_allowed_by_default():
    allowlist = Allowlist()
    assert resolve("rollq.workers.builtin.rlvr:RLVRWorkflow", allowlist=allowlist).__name__ == "RLVRWorkflow"
    assert resolve("rollq.tasks.digits:digits_reward", allowlist=allowlist).__name__ == "digits_reward"
    assert resolve("rollq.tasks.addition:addition_reward", allowlist=allowlist).__name__ == "addition_reward"
    with pytest.raises(ImportNotAllowed):  # rollq's other modules are not the built-ins
        resolve("rollq.trainer.data:load_prompts", allowlist=allowlist)


def test_commands_are_named_in_the_same_list():
    allowlist = Allowlist(patterns=("command:python3", "my_pkg"))
    allowlist.check_command("python3", shutil.which("python3"))
    with pytest.raises(ImportNotAllowed, match="command 'bash' is not allowed"):
        allowlist.check_command("bash", shutil.which("bash"))


@pytest.fixture
def two_modules(tmp_path, monkeypatch):
    """`allowed_pkg` (the operator allows it) re-exports a class of `foreign_mod` (not allowed) and holds objects."""
    (tmp_path / "foreign_mod.py").write_text(
        textwrap.dedent("""
        import json

        class Foreign:
            TOOL = json.JSONDecoder().scan_once  # a callable object (a C scanner) held by a foreign class
        """)
    )
    (tmp_path / "allowed_pkg.py").write_text(
        textwrap.dedent("""
        import functools
        import json
        import os
        from foreign_mod import Foreign

        HELPER = json.JSONDecoder()  # an object the module built: its attributes come from anywhere
        TOOLS = [len]
        run = functools.partial(os.system, "touch RAN")  # a callable that is neither a class nor a routine

        class Caller:
            def __call__(self):
                return "called"

        CALLER = Caller()  # an instance with __call__

        class Wf:
            LIMIT = 3
            helper = functools.partial(os.system, "touch RAN")

            def method(self):
                return "method"

            class Inner:
                NAME = "inner"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield Allowlist(patterns=("allowed_pkg",))
    for name in ("allowed_pkg", "foreign_mod"):
        sys.modules.pop(name, None)


def test_a_path_walks_only_through_modules_and_classes_defined_in_allowed_modules(two_modules):
    """F12a: a path that walked into an object's attributes handed out a callable from outside the list (a json
    scanner); so did a class attribute of a re-exported foreign class."""
    allowed = two_modules
    with pytest.raises(WorkflowLoadError, match="goes into the attributes of a JSONDecoder object"):
        resolve("allowed_pkg:HELPER.scan_once", allowlist=allowed)
    with pytest.raises(WorkflowLoadError, match="goes into the attributes"):
        resolve("allowed_pkg:HELPER.scan_once")  # the same rule without an allowlist: a path means one thing
    with pytest.raises(ImportNotAllowed, match="names foreign_mod.Foreign, defined in a module the allowlist"):
        resolve("allowed_pkg:Foreign.TOOL", allowlist=allowed)
    # What legitimate paths name still resolves: a module's objects, classes, their attributes and methods.
    assert type(resolve("allowed_pkg:HELPER", allowlist=allowed)).__name__ == "JSONDecoder"
    assert resolve("allowed_pkg:TOOLS", allowlist=allowed) == [len]
    assert resolve("allowed_pkg:Wf.LIMIT", allowlist=allowed) == 3
    assert resolve("allowed_pkg:Wf.method", allowlist=allowed)(None) == "method"
    assert resolve("allowed_pkg:Wf.Inner.NAME", allowlist=allowed) == "inner"
    assert resolve("rollq.workers.builtin.rlvr:RLVRWorkflow.arun_episode", allowlist=Allowlist()) is not None


def test_a_callable_that_is_neither_a_class_nor_a_routine_is_refused(two_modules):
    """F12 residual (a): `functools.partial(os.system, ...)` held by an allowed module (or class) had no module of
    its own to check, so it resolved and a job could call os.system through it."""
    allowed = two_modules
    for path in ("allowed_pkg:run", "allowed_pkg:Wf.helper", "allowed_pkg:CALLER"):
        with pytest.raises(ImportNotAllowed, match=r"names a callable (partial|Caller) object, neither a class nor"):
            resolve(path, allowlist=allowed)
    # The class itself and plain data still resolve.
    assert resolve("allowed_pkg:Caller", allowlist=allowed)()() == "called"
    assert resolve("allowed_pkg:Wf.LIMIT", allowlist=allowed) == 3


@pytest.fixture
def agents(tmp_path):
    """A folder of agent programs: `run.sh` (writes a marker), links to it, and links out of the folder."""
    folder = tmp_path / "agents"
    folder.mkdir()
    run = folder / "run.sh"
    run.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\necho 1.0\n")
    run.chmod(0o755)
    (folder / "link.sh").symlink_to("run.sh")  # a link to another allowed file
    (folder / "sh").symlink_to(shutil.which("sh"))  # a link out of the folder
    (folder / "bin").symlink_to(Path(shutil.which("sh")).parent)  # a linked folder inside the allowed one
    return folder


async def run_command(workflow: str, allowlist: Allowlist) -> object:
    with enforcing(allowlist):
        wf = WorkflowCache().get(workflow, None)
    return await asyncio.wait_for(wf.target.run({}, "http://127.0.0.1:9/v1", "k", "http://127.0.0.1:9"), 10)


async def test_command_links_are_resolved_before_they_are_matched(agents, tmp_path, monkeypatch):
    """F12b: `agents/sh -> /bin/sh` inside an allowed folder ran `id`; a link is checked as the file it leads to."""
    allowlist = Allowlist(patterns=(f"command:{agents}/*",))
    ran = tmp_path / "ran"
    for program in (agents / "sh", agents / "bin" / "sh"):
        with pytest.raises(ImportNotAllowed, match="symbolic link .* to a file that no command: pattern allows"):
            await run_command(f"exec:{program} -c 'touch {ran}'", allowlist)
    assert not ran.exists()
    assert await run_command(f"exec:{agents}/link.sh", allowlist) == 1.0  # a link to an allowed file runs
    assert ran.exists()
    # An operator who lists the link's target too allows it (any pattern may cover the real file).
    target = Allowlist(patterns=(f"command:{agents}/*", f"command:{os.path.realpath(shutil.which('sh'))}"))
    assert await run_command(f"exec:{agents}/sh -c 'echo 0.5'", target) == 0.5


async def test_a_linked_checkout_path_and_relative_patterns_still_match(agents, tmp_path, monkeypatch):
    """The patterns' own folders are resolved too: an allowed folder reached through a linked parent still is one."""
    linked = tmp_path / "checkout"
    linked.symlink_to(tmp_path)  # as /work -> /old_root/work
    via_link = Allowlist(patterns=(f"command:{linked}/agents/*",))
    assert await run_command(f"exec:{linked}/agents/run.sh", via_link) == 1.0
    with pytest.raises(ImportNotAllowed, match="symbolic link"):
        await run_command(f"exec:{linked}/agents/sh -c 'echo 1'", via_link)
    monkeypatch.chdir(linked)  # relative patterns are relative to the worker's folder
    relative = Allowlist(patterns=("command:agents/*",))
    assert await run_command("exec:agents/run.sh", relative) == 1.0
    with pytest.raises(ImportNotAllowed, match="symbolic link"):
        await run_command("exec:agents/sh -c 'echo 1'", relative)
    with pytest.raises(ImportNotAllowed, match="'..' path component"):
        await run_command("exec:agents/../agents/run.sh", relative)


async def test_bare_names_are_checked_as_what_the_path_finds(agents, monkeypatch):
    """A bare name listed by name runs what the worker's PATH finds; one that is not is checked as that file."""
    monkeypatch.setenv("PATH", f"{agents}{os.pathsep}{os.environ['PATH']}")
    in_folder = Allowlist(patterns=(f"command:{agents}/*",))
    assert await run_command("exec:run.sh", in_folder) == 1.0  # found in an allowed folder
    with pytest.raises(ImportNotAllowed, match="symbolic link"):
        await run_command("exec:sh -c 'echo 1'", in_folder)  # PATH finds agents/sh, a link out of the folder
    with pytest.raises(ImportNotAllowed, match="command 'true' is not allowed"):
        await run_command("exec:true", in_folder)
    assert await run_command("exec:sh -c 'echo 0.25'", Allowlist(patterns=("command:sh",))) == 0.25  # by name


async def test_a_reward_worker_refuses_reward_functions_outside_its_allowlist(side_effect_module):
    rewards = RewardFunctions(1, 5.0, Allowlist(patterns=("tests",), setting="--allow"))
    try:
        with pytest.raises(RewardError, match="cannot load reward function 'sneaky_mod:score'.*not allowed"):
            rewards.get("sneaky_mod:score")
        assert not side_effect_module.exists()
        assert rewards.get("tests.reward_fns:exact_match") is not None
    finally:
        await rewards.close()


async def test_jobs_naming_paths_outside_the_allowlist_run_nothing_and_are_dead_lettered(
    redis, redis_url, run_name, tmp_path, side_effect_module
):
    touched = tmp_path / "touched"
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name, max_attempts=3):
        # The report that opened this: a job whose "workflow" is subprocess.Popen ran a command on the worker.
        await producer.submit("subprocess:Popen", job_id="popen", workflow_kwargs={"args": ["touch", str(touched)]})
        await producer.submit("sneaky_mod:Workflow", job_id="module")
        await producer.submit("rlvr", {"prompt": "hi"}, job_id="reward", workflow_kwargs={"reward_fn": "os:system"})
        await producer.submit("tool_agent", {"prompt": "hi"}, job_id="tools", workflow_kwargs={"tools": "sneaky_mod:T"})
        await producer.submit("tests.workflows:Echo", {"i": 1}, job_id="fine")
        expected = {"popen": 1, "module": 1, "reward": 1, "tools": 1, "fine": 1}
        trajs = {t.job_id: t async for t in producer.wait_for(expected, timeout_s=20)}
    assert not touched.exists() and not side_effect_module.exists()
    assert trajs["fine"].status == "ok"
    for job_id, path in (
        ("popen", "subprocess:Popen"),
        ("module", "sneaky_mod:Workflow"),
        ("reward", "os:system"),
        ("tools", "sneaky_mod:T"),
    ):
        error = trajs[job_id].error
        assert trajs[job_id].status == "error" and error.type == "ImportNotAllowed", (job_id, error)
        assert f"import path {path!r} is not allowed" in error.message
        assert "--allow PATTERN (worker.allow, ROLLQ_WORKER_ALLOW)" in error.message
        assert error.attempt == 1  # deterministic: dead-lettered at once, not retried
    dead = await redis.xrange(f"rollq:{{{run_name}}}:dead")
    assert len(dead) == 4


async def test_the_allowlist_holds_on_every_submission_path(redis, redis_url, run_name, tmp_path):
    """The same refused job (subprocess.Popen running `touch`) by every path another service can take: the `rollq
    enqueue` CLI, raw stream entries in msgpack and in JSON (what a non-Python producer writes), and a command agent
    (`exec:touch ...`) without a `command:` pattern. Nothing runs; each is dead-lettered with the allowlist's message.
    (The Python producer is covered above, the HTTP ingress in tests/producer.)"""
    touched = {name: tmp_path / f"touched-{name}" for name in ("cli", "msgpack", "json", "exec")}
    popen = "subprocess:Popen"
    jobs_file = tmp_path / "jobs.jsonl"
    jobs_file.write_text('{"data": null}\n')
    keys = RunKeys(run_name)
    codec = Codec()
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name, max_attempts=3):
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollq", "enqueue", str(jobs_file), "--workflow", popen, "--kwargs",
            json.dumps({"args": ["touch", str(touched["cli"])]}), "--redis", redis_url, "--run", run_name,
            "--wait", "--timeout", "30", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(cli.communicate(), 60)
        assert b"ImportNotAllowed" in out + err, (out, err)
        raw = Job(
            job_id="msgpack",
            workflow=popen,
            workflow_kwargs={"args": ["touch", str(touched["msgpack"])]},
            reply_to=producer.reply_to,
        )
        await redis.xadd(keys.jobs, {PAYLOAD_FIELD: codec.encode(raw)})
        as_json = {
            "job_id": "json",
            "workflow": popen,
            "workflow_kwargs": {"args": ["touch", str(touched["json"])]},
            "reply_to": producer.reply_to,
        }
        await redis.xadd(keys.jobs, {PAYLOAD_FIELD: json.dumps(as_json)})
        await producer.submit(f"exec:touch {touched['exec']}", job_id="exec")
        trajs = {t.job_id: t async for t in producer.wait_for({"msgpack": 1, "json": 1, "exec": 1}, timeout_s=20)}
    assert not any(path.exists() for path in touched.values())
    for job_id in ("msgpack", "json"):
        error = trajs[job_id].error
        assert trajs[job_id].status == "error" and error.type == "ImportNotAllowed", error
        assert f"import path {popen!r} is not allowed" in error.message
    error = trajs["exec"].error
    assert error.type == "ImportNotAllowed" and "command 'touch' is not allowed" in error.message, error
