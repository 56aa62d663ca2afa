"""Agents cannot write where the worker imports or executes from (issue 43, N1 and F12 residual b).

An agent used to run in the worker's working directory, which was the worker's `sys.path[0]`: a module it wrote
there (`arq/__init__.py`, a module of an allowed package) ran inside the worker on the next job that imported it,
with the Redis password and engine keys in reach, and a copy of /bin/sh in an allowed command folder made
`command:agents/*` allow anything. Now every agent works in a fresh folder of its own, no rollq process has its
working directory on sys.path (user modules come from `module_paths`), and with `agent_user` agents run as another
user, which must not be able to write an allowed command folder or anything on sys.path (the worker refuses to
start otherwise). Real `rollq worker` processes on a real redis-server; CI runs as root, so agent_user 65534 is
real here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollq.local import Processes
from rollq.producer.producer import JobRequest, Producer
from rollq.workers.agents.agent_user import AgentUser, become
from rollq.workers.agents.hosts import AgentHosts
from rollq.workers.agents.subproc import agent_result, run_agent
from rollq.workers.agents.writable import AgentCanWrite, check_agent_writable, writable_places
from rollq.workers.context import ContextConfig
from rollq.workers.rewards.processes import AsyncRewardWrapper
from tests.helpers import shared_folder, wait_registered

NOBODY = AgentUser(65534, 65534)
# The agents that report where they run: a module that imports nothing new (as uid 65534 a child cannot read the
# rest of the standard library here, which lies in root's home)
WHERE = "tests.security.where_agents"
URLS = {"base_url": "http://127.0.0.1:9/v1", "anthropic_base_url": "http://127.0.0.1:9"}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching agents to uid 65534 needs root")

PROBE_WORKFLOW = """
class ImportsPlanted:
    # Imports what an agent would have planted: a name only an agent creates, found only where it planted it.
    async def arun_episode(self, engine, data):
        for name in ("rollq_planted_in_cwd", "rollq_planted_in_worker_dir"):
            try:
                __import__(name)
            except ImportError:
                pass
        return {"input_ids": [1, 2], "loss_mask": [0, 1], "logprobs": [0.0, -0.5], "versions": [-1, 0], "reward": 1.0}
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder uid 65534 can reach, removed after."""
    with shared_folder("rollq-planting-", 0o755) as path:
        yield path


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def folder(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o755)
    return path


def worker_argv(redis_url: str, run: str, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "rollq", "worker", "--redis", redis_url, "--run", run, "--name", name,
            "--tokenizer", "tiny", "--max-attempts", "1", *args]  # fmt: skip


async def results(redis: Any, run: str, jobs: list[JobRequest], log: Any, timeout_s: float = 60) -> dict[str, Any]:
    """Submit the jobs one after another (each after the one before finished); their trajectories by job id.
    `log()`: the worker's log, shown when a result does not come."""
    producer = Producer(redis, run)
    consumer = producer.consumer()
    await consumer.setup()
    got = {}
    for job in jobs:
        await producer.submit_many([job])
        try:
            async for trajectory in producer.wait_for({job.job_id: 1}, timeout_s=timeout_s, consumer=consumer):
                got[trajectory.job_id] = trajectory
        except TimeoutError:
            raise AssertionError(f"no result for {job.job_id}; the worker's log:\n{log()[-6000:]}") from None
    return got


def start_worker(procs: Processes, name: str, argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    return procs.start(name, argv, cwd=cwd)


# -- (i) an agent's planted module never runs in the worker --------------------------------------------------------


@pytest.mark.slow  # a real worker process
async def test_a_module_an_agent_plants_is_not_imported_by_the_worker(redis, redis_url, run_name, tmp_path, tiny_dir):
    """The probe's attack: a command agent writes a module into its working directory (which used to be the
    worker's, and so its sys.path[0]) and into the worker's folder by its absolute path; the next job's workflow
    imports that module name in the worker. It finds neither: the agent's working directory is its own episode
    HOME (gone after the episode), and the worker's folder is not on its sys.path. Its log names what its agents
    (its own user here) can write."""
    worker_dir, modules, agents = folder(tmp_path / "wcwd"), folder(tmp_path / "mods"), folder(tmp_path / "agents")
    (modules / "probe_wf.py").write_text(PROBE_WORKFLOW)
    marker, seen_cwd = tmp_path / "planted-ran", tmp_path / "agent-cwd"
    planted = f"open({str(marker)!r}, 'a').write('planted module imported\\n')\n"
    plant = script(
        agents / "plant.sh",
        f"""\
        printf '%s' "{planted}" > rollq_planted_in_cwd.py
        printf '%s' "{planted}" > {worker_dir}/rollq_planted_in_worker_dir.py
        pwd > {seen_cwd}
        echo null
        """,
    )
    name = f"w-{uuid.uuid4().hex[:6]}"
    argv = worker_argv(redis_url, run_name, name, "--allow", f"command:{agents}/*", "--allow", "probe_wf",
                       "--module-path", str(modules))  # fmt: skip
    with Processes(tmp_path) as procs:
        worker = start_worker(procs, name, argv, worker_dir)
        await wait_registered(redis, run_name, name, timeout_s=60)
        got = await results(
            redis,
            run_name,
            [
                JobRequest(job_id="plant", workflow=f"exec:{plant}", data={}),
                JobRequest(job_id="victim", workflow="probe_wf:ImportsPlanted", data={}),
            ],
            lambda: procs.tail(worker, 20_000),
        )
        log = procs.tail(worker, 20_000)
    assert got["plant"].status == "rejected", got["plant"]  # the agent ran to its end (its result: null)
    assert (worker_dir / "rollq_planted_in_worker_dir.py").exists()  # the same user could write there...
    assert got["victim"].status == "ok", got["victim"].error
    assert not marker.exists(), "a module an agent planted ran inside the worker"  # ...but nothing imports it
    agent_cwd = Path(seen_cwd.read_text().strip())
    assert agent_cwd != worker_dir and not (worker_dir / "rollq_planted_in_cwd.py").exists()
    assert agent_cwd.name.startswith("rollq-agent-") and not agent_cwd.exists()  # its episode HOME, removed after
    # agent_user is unset: one WARNING naming what its agents can write (root here: each place)
    [warning] = [line for line in log.splitlines() if "agent_user is unset" in line]
    assert "WARNING" in warning and str(agents) in warning and str(modules) in warning and str(worker_dir) in warning


@pytest.mark.slow  # a real worker process
async def test_a_worker_imports_user_modules_from_module_paths_never_its_working_directory(
    redis, redis_url, run_name, tmp_path, tiny_dir
):
    start_dir, elsewhere = folder(tmp_path / "start"), folder(tmp_path / "elsewhere")
    for where in (start_dir, elsewhere):
        (where / "probe_wf.py").write_text(PROBE_WORKFLOW)
    with Processes(tmp_path) as procs:
        for name, extra in (("plain", []), ("with-paths", ["--module-path", str(elsewhere)])):
            run = f"{run_name}-{name}"
            worker = start_worker(
                procs, name, worker_argv(redis_url, run, name, "--allow", "probe_wf", *extra), start_dir
            )
            await wait_registered(redis, run, name, timeout_s=60)
            job = JobRequest(job_id="j", workflow="probe_wf:ImportsPlanted")
            [got] = (await results(redis, run, [job], lambda w=worker: procs.tail(w, 20_000))).values()
            procs.stop(worker)
            if not extra:  # the module lies in its working directory only: not found, and the error says where to
                assert got.status == "error" and "No module named 'probe_wf'" in got.error.message, got
                assert "module_paths" in got.error.message and "--module-path" in got.error.message
            else:
                assert got.status == "ok", got.error


# -- (ii), (iii) agent_user: the worker refuses to start where its agents could write ------------------------------


def refused(redis_url: str, cwd: Path, *args: str, user: str = "65534:65534") -> subprocess.CompletedProcess[str]:
    argv = worker_argv(redis_url, "refused", "w-refused", "--agent-user", user, *args)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_root
def test_an_allowed_command_folder_the_agents_user_can_write_stops_the_worker(shared_dir, unused_redis_url):
    agents = folder(shared_dir / "agents")
    script(agents / "agent.sh", "echo null\n")
    os.chown(agents, 65534, 65534)  # the agents could put a copy of /bin/sh here
    out = refused(unused_redis_url, shared_dir, "--allow", f"command:{agents}/*")
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("rollq worker: agent_user 65534:65534 can write") and str(agents) in line, line
    assert "an allowed command folder" in line and "agent_user" in line


@needs_root
def test_an_allowed_command_folder_a_uid_of_the_agents_range_owns_stops_the_worker(shared_dir, unused_redis_url):
    """A1: with a uid range every uid of it is the agents' (a command agent runs as any of them)."""
    agents = folder(shared_dir / "agents")
    script(agents / "agent.sh", "echo null\n")
    os.chown(agents, 61002, 0)  # neither the range's first uid nor its group: a command agent's uid
    out = refused(unused_redis_url, shared_dir, "--allow", f"command:{agents}/*", user="61000-61003:61000")
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("rollq worker: agent_user 61000-61003:61000 can write") and str(agents) in line, line


@needs_root
def test_an_allowed_package_on_sys_path_the_agents_user_can_write_stops_the_worker(shared_dir, unused_redis_url):
    modules = folder(shared_dir / "mods")
    package = folder(modules / "probe_pkg")
    (package / "__init__.py").write_text("")
    os.chown(package, 65534, 65534)  # the agents could add probe_pkg/pwn2.py, which `probe_pkg` allows
    out = refused(unused_redis_url, shared_dir, "--allow", "probe_pkg", "--module-path", str(modules))
    assert out.returncode == 2, out.stderr
    assert f"can write {package} (in {modules}), a sys.path entry" in out.stderr, out.stderr


@needs_root
@pytest.mark.slow  # a real worker process
async def test_agents_as_another_user_cannot_put_a_program_into_an_allowed_folder(
    redis, redis_url, run_name, shared_dir, tiny_dir
):
    """F12b: the folder is root's, so the agent (uid 65534) cannot copy /bin/sh into it; the worker started."""
    agents = folder(shared_dir / "agents")
    copier = script(agents / "copier.sh", f"id -u >&2\ncp /bin/sh {agents}/sh2 || exit 3\necho null\n")
    name = f"w-{uuid.uuid4().hex[:6]}"
    argv = worker_argv(redis_url, run_name, name, "--agent-user", "65534:65534", "--allow", f"command:{agents}/*")
    with Processes(shared_dir) as procs:
        worker = start_worker(procs, name, argv, shared_dir)
        await wait_registered(redis, run_name, name, timeout_s=60)
        job = JobRequest(job_id="copy", workflow=f"exec:{copier}")
        [got] = (await results(redis, run_name, [job], lambda: procs.tail(worker, 20_000))).values()
    assert got.status == "error", got
    assert "exited with code 3" in got.error.message and "Permission denied" in got.error.message, got.error
    assert "65534" in got.error.message  # it ran as the agents' user
    assert not (agents / "sh2").exists()


def _places_as_nobody(conn: Any, patterns: list[str], path: list[str], cwd: str) -> None:
    become(NOBODY)
    conn.send([[w.path, w.kind] for w in writable_places(patterns, None, path=path, cwd=cwd)])


@needs_root
def test_what_the_workers_own_user_can_write_is_named_and_what_it_cannot_is_not(shared_dir):
    """Same-uid agents: the places the worker's own user can write are named, the others not (a process of uid
    65534 here, forked from this one: root can write everything, and the venv's python lies in root's home)."""
    own, theirs = folder(shared_dir / "own"), folder(shared_dir / "theirs")
    os.chown(own, 65534, 65534)
    patterns = [f"command:{own}/*", f"command:{theirs}/*"]
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_places_as_nobody, args=(send, patterns, [str(theirs)], str(theirs))
    )
    child.start()
    try:
        assert receive.poll(30), "the child sent nothing"
        found = receive.recv()
    finally:
        child.join(10)
    assert found == [[str(own), "command folder"]]


def test_the_check_walks_into_the_folders_and_names_the_first_writable_file(tmp_path):
    modules = folder(tmp_path / "mods")
    package = folder(modules / "pkg")
    module = package / "mod.py"
    module.write_text("")
    module.chmod(0o666)  # anyone may rewrite it
    with pytest.raises(AgentCanWrite, match=f"can write {module} \\(in {modules}\\), a sys.path entry"):
        check_agent_writable([], NOBODY, path=[str(modules)], cwd="/")
    module.chmod(0o644)
    assert writable_places([], NOBODY, path=[str(modules)], cwd="/") == []
    missing = tmp_path / "open" / "not-yet"
    folder(tmp_path / "open").chmod(0o777)  # a missing entry in a folder it can write: it could create it
    [found] = writable_places([], NOBODY, path=[str(missing)], cwd="/")
    assert found.path == str(tmp_path / "open") and found.place == str(missing)


# -- subproc agents and agent hosts: a fresh folder of their own ---------------------------------------------------


def where(value: dict[str, float]) -> tuple[str, int, int]:
    [key] = value
    cwd, uid, owner = key.rsplit(" ", 2)
    return cwd, int(uid), int(owner)


@pytest.mark.parametrize("user", ["", "65534:65534"], ids=["same-user", "agent-user"])
async def test_each_subproc_episode_works_in_a_fresh_folder_of_its_own(user):
    if user and os.geteuid() != 0:
        pytest.skip("switching agents to uid 65534 needs root")
    folders = [os.path.join(tempfile.gettempdir(), f"rollq-test-{uuid.uuid4().hex}") for _ in range(2)]
    pool = AsyncRewardWrapper(run_agent, 30, 1, 0, start_method="spawn", accept=agent_result, what="agent")
    try:
        async with pool:
            seen = [
                where((await pool(f"{WHERE}:WhereAmI", "{}", {}, URLS, "k", None, workdir, user))[1])
                for workdir in folders  # the same child (max_workers 1) for both episodes
            ]
        uid = 65534 if user else os.getuid()
        assert seen == [(folders[0], uid, uid), (folders[1], uid, uid)]
    finally:
        for path in folders:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("user", ["", "65534:65534"], ids=["same-user", "agent-user"])
async def test_an_agent_host_works_in_a_fresh_folder_removed_after_it(user):
    if user and os.geteuid() != 0:
        pytest.skip("switching agents to uid 65534 needs root")
    hosts = AgentHosts(1, ContextConfig(agent_user=user), start_method="spawn")
    try:
        reply = await asyncio.wait_for(hosts.run(f"{WHERE}:AsyncWhereAmI", "{}", {}, URLS, "k", None, None, 30), 60)
    finally:
        await hosts.close()
    assert reply[0] == "ok", reply
    cwd, uid, owner = where(reply[3])
    expected = 65534 if user else os.getuid()
    assert cwd != os.getcwd() and os.path.basename(cwd).startswith("rollq-agent-host-")
    assert (uid, owner) == (expected, expected)
    assert not os.path.exists(cwd)  # removed once the host exited


def test_a_program_allowed_by_name_is_checked_where_the_worker_looks_it_up(tmp_path):
    """`command:NAME` runs the first NAME on the worker's PATH: an agent that can write a folder on it (or the program
    itself) puts its own program of that name first, and the pattern allows anything (re-probe of F12)."""
    early, late = folder(tmp_path / "early"), folder(tmp_path / "late")
    program = late / "mytool"
    program.write_text("#!/bin/sh\necho 1\n")
    program.chmod(0o755)
    search = os.pathsep.join([str(early), str(late)])
    assert writable_places(["command:mytool"], NOBODY, path=[], cwd="/", search_path=search) == []
    early.chmod(0o777)  # anyone may create `early/mytool`, found before the real one
    with pytest.raises(AgentCanWrite, match=f"can write {early}, a folder on the worker's PATH"):
        check_agent_writable(["command:mytool"], NOBODY, path=[], cwd="/", search_path=search)
    assert writable_places(["command:agents/*"], NOBODY, path=[], cwd="/", search_path=search) == []  # no name
    early.chmod(0o755)
    program.chmod(0o757)  # anyone may rewrite the program itself
    [found] = writable_places(["command:mytool"], NOBODY, path=[], cwd="/", search_path=search)
    assert (found.path, found.kind) == (str(program), "allowed program")
