"""OpenEnv environments (`openenv:NAME`) as rollq workloads, with the real openenv 0.10.0 from PyPI in a virtualenv
of its own (tests/environments/openenv-requirements.txt, built once from cached wheels) and a test environment
written in OpenEnv's own API (tests/environments/openenv_length_env.py), its server a local process.

The scenario tests (real worker, real Redis, the tiny reference model): the rewards of rollq's rollouts equal the
environment's own evaluation on the same examples with greedy decoding; `rollq up` trains on it; a server the worker
starts runs as the agent does and is gone after the episode; a server that cannot start dead-letters its job with
its output. The CI tests: the driver's own parsing (a file of the standard library only, loaded here as it is), and
an interpreter without openenv refused by name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.local import Processes, free_port
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.messages import AgentOptions
from rollq.workers.environments.agent import driver_path
from tests.helpers import REPO_ROOT, answers, pid_alive, running_worker, shared_folder, wait_registered, wait_until
from tests.scripted import scripted_engine, tiny_tokenizer
from tests.third_party import VENV_DONE, venv, wheels_dir

ENVIRONMENTS = REPO_ROOT / "tests" / "environments"
REQUIREMENTS = ENVIRONMENTS / "openenv-requirements.txt"
LENGTH_ENV = ENVIRONMENTS / "openenv_length_env.py"
REFERENCE = ENVIRONMENTS / "openenv_reference.py"
DRIVER = driver_path("openenv")
# The length task's examples: reply with `length` characters for `turns` turns (2-3 turns: multi-turn episodes).
EXAMPLES = [
    {"length": 4, "turns": 2},
    {"length": 12, "turns": 3},
    {"length": 25, "turns": 2},
    {"length": 60, "turns": 3},
]
SYSTEM = "Reply to each observation with one action."
GREEDY = {"temperature": 0.0, "max_tokens": 12}
MAX_TURNS = 4
TIMEOUT_S = 240  # an episode: the driver's and the server's imports (openenv imports gradio: seconds of CPU each)


@pytest.fixture(scope="module")
def openenv_python() -> str:
    return str(venv("openenv", REQUIREMENTS))


def sequence_rewards(traj: Any) -> list[float]:
    return [s.reward for s in traj.sequences]


def trained_texts(traj: Any) -> list[str]:
    tok = tiny_tokenizer()
    return [tok.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]) for s in traj.sequences]


async def serve_length_env(procs: Processes, python: str, *extra: str) -> str:
    """The length environment's server as an operator runs it (the URL form): its URL once /health answers."""
    port = free_port()
    proc = procs.start(f"length-env-{port}", [python, str(LENGTH_ENV), "--port", str(port), *extra])
    url = f"http://127.0.0.1:{port}"
    await procs.wait_until(
        lambda: answers(f"{url}/health"), 120, f"the OpenEnv server {url}", watch=proc, interval_s=0.1
    )
    return url


def allow_python(python: str) -> list[str]:
    """`command:` patterns for an interpreter named by its path: the path and the file it links to."""
    return [f"command:{python}", f"command:{os.path.realpath(python)}"]


# -- (1) rewards equal the environment's own evaluation -----------------------------------------------------------


@pytest.mark.scenario
@pytest.mark.timeout(600)
async def test_rewards_equal_the_environments_own_evaluation(
    redis, redis_url, run_name, engine_process, openenv_python, tmp_path
):
    """The same examples, greedy, the same model behind one worker's recording proxy: rollq's rollouts
    (`openenv:length`, the driver) and the reference loop (OpenEnv's own client, tests/environments/
    openenv_reference.py, run as a command agent) drive the same server and get the same reward per example."""
    procs = Processes(tmp_path, cwd=REPO_ROOT)
    try:
        url = await serve_length_env(procs, openenv_python)
        _, engine = await engine_process("--backend", "reference", "--model", "tiny")
        jobs = []
        for i, example in enumerate(EXAMPLES):
            kwargs = {"max_turns": MAX_TURNS, "system_prompt": SYSTEM, "sampling": GREEDY}
            jobs.append(
                JobRequest(workflow="openenv:length", job_id=f"rollq-{i}", data=example, workflow_kwargs=kwargs)
            )
            reference = {"server": url, "reset": example, "system_prompt": SYSTEM, "sampling": GREEDY}
            reference["max_turns"] = MAX_TURNS
            workflow = f"exec:{openenv_python} {REFERENCE}"
            jobs.append(JobRequest(workflow=workflow, job_id=f"reference-{i}", data=reference))
        worker = {
            "allow": ["openenv:length", *allow_python(openenv_python)],
            "openenv_python": openenv_python,
            "openenv_servers": {"length": url},
            "tokenizer": "tiny",
            "concurrency": 1,  # one episode at a time: no batch shares the engine, greedy is exactly greedy
            "max_attempts": 1,
        }
        started = time.monotonic()
        async with EnginePool(PoolConfig(urls=[engine])) as pool:
            async with running_worker(redis_url, run_name, engine=pool, **worker):
                producer = Producer(redis, run_name)
                await producer.submit_many(jobs)
                expected = {j.job_id: 1 for j in jobs}
                got = {t.job_id: t async for t in producer.wait_for(expected, timeout_s=TIMEOUT_S * len(jobs) / 4)}
        print(f"{len(jobs)} episodes in {time.monotonic() - started:.1f}s")
    finally:
        procs.stop_all(grace_s=5)
    assert {k: t.status for k, t in got.items()} == dict.fromkeys(expected, "ok"), {
        k: t.error for k, t in got.items() if t.error
    }
    rewards = {}
    for i, example in enumerate(EXAMPLES):
        ours, theirs = got[f"rollq-{i}"], got[f"reference-{i}"]
        # a sequence per turn, each the episode's summed reward (a float result; turn_discount 1.0)
        assert len(ours.sequences) == example["turns"], trained_texts(ours)
        assert trained_texts(ours) == trained_texts(theirs)  # the same replies, turn by turn
        assert sequence_rewards(ours) == sequence_rewards(theirs)
        rewards[i] = ours.sequences[-1].reward
    print("rewards per example:", rewards)
    assert len(set(rewards.values())) >= 2, rewards  # the reward follows the model's text


# -- (2) rollq up ----------------------------------------------------------------------------------------------------


@pytest.mark.scenario
@pytest.mark.timeout(900)
def test_rollq_up_trains_on_an_openenv_environment_its_worker_starts(openenv_python, tmp_path):
    """`rollq up workflow=openenv:length`: its worker starts the server per episode (the command form), and the run
    trains its steps on the episodes' recorded tokens and the environment's rewards."""
    from tests.helpers import env_without_settings

    dataset = tmp_path / "resets.jsonl"
    dataset.write_text("".join(json.dumps({"length": 5 + 7 * i, "turns": 2}) + "\n" for i in range(8)))
    server = f"{openenv_python} {LENGTH_ENV} --port {{port}}"
    env = env_without_settings() | {
        "ROLLQ_WORKER_OPENENV_PYTHON": openenv_python,
        "ROLLQ_WORKER_OPENENV_SERVERS": json.dumps({"length": server}),
    }
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "rollq", "up", "workflow=openenv:length", f"dataset={dataset}", "steps=2"]
    argv += ["group_size=2", "groups_per_step=2", "eval_dataset=", "eval_every=0", "dynamic_sampling=false"]
    argv += ["workflow_kwargs={max_turns: 2, sampling: {max_tokens: 8}}", f"run_dir={run_dir}"]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=840, env=env)
    print(f"rollq up: {time.monotonic() - started:.1f}s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["trained_samples"] >= 2 * 4 and not summary["dropped"], summary
    assert not (run_dir / "dead-letters.jsonl").exists(), (run_dir / "dead-letters.jsonl").read_text()[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["trained_tokens"] > 0 for m in metrics), metrics
    print("rewards per step:", [m["reward_mean"] for m in metrics])


# -- (3) a server the worker starts runs as the agent does -------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running agents as uid 65534 needs root")
AGENT_USER = "65534:65534"


def agent_readable_venv(python: str) -> str:
    """The OpenEnv virtualenv where uid 65534 can run it: built on the system's Python 3.11 (this one lies in root's
    home, 0700) in a root-owned folder of the temporary directory, from the cached wheels the first `venv()` fetched;
    once per requirements file. Skipped where the system has no Python 3.11."""
    system = shutil.which("python3.11", path="/usr/bin:/usr/local/bin")
    if system is None:
        pytest.skip("needs a Python 3.11 outside root's home (/usr/bin/python3.11) for the agent user to run")
    target = Path(venv_root()) / Path(python).parent.parent.name
    done = target / VENV_DONE
    if not done.is_file():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([system, "-m", "venv", "--without-pip", str(target)], check=True, timeout=120)
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(target / "bin" / "python")]
        pip += ["install", "-q", "--no-deps", "--no-index", "--find-links", str(wheels_dir()), "-r", str(REQUIREMENTS)]
        subprocess.run(pip, check=True, timeout=600, capture_output=True)
        done.write_text(REQUIREMENTS.read_text())
    return str(target / "bin" / "python")


def venv_root() -> str:
    """A root-owned folder no other user can write (anyone can read it): refused otherwise."""
    root = Path(tempfile.gettempdir()) / "rollq-agent-venvs"
    root.mkdir(mode=0o755, exist_ok=True)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise AssertionError(f"{root} is not a folder of root's that only root can write")
    return str(root)


@pytest.fixture
def shared_dir():
    """A folder the agent's uid can write its report into."""
    with shared_folder("rollq-openenv-", 0o1777) as path:
        yield path


@needs_root
@pytest.mark.scenario
@pytest.mark.timeout(600)
async def test_a_started_server_runs_as_the_agent_and_dies_with_the_episode(
    redis, redis_url, run_name, openenv_python, shared_dir, tmp_path
):
    python = agent_readable_venv(openenv_python)
    report = shared_dir / "where.json"
    server = f"{python} {LENGTH_ENV} --port {{port}} --report {report}"
    # A `rollq worker` of its own (not spawn_worker's: that one imports the tests from the checkout, whose .venv
    # has files anyone can write, and a worker with agent_user refuses such a sys.path entry), in a folder of root's.
    argv = [sys.executable, "-m", "rollq", "worker", "--redis", redis_url, "--run", run_name, "--tokenizer", "tiny"]
    argv += ["--max-attempts", "1", "--agent-user", AGENT_USER, "--allow", "openenv:length"]
    argv += ["--openenv-python", python, "--openenv-servers", json.dumps({"length": server})]
    secrets = {"REDIS_PASSWORD": "do-not-leak", "OPENAI_API_KEY": "the-workers-own", "HF_TOKEN": "do-not-leak"}
    async with scripted_engine(["12345", "1234567"]) as engine:
        with Processes(tmp_path) as procs:
            worker = procs.start("worker", [*argv, "--engine", engine.url, "--name", "w"], env=secrets, cwd=tmp_path)
            try:  # a worker that refuses to start says why at once
                await wait_registered(redis, run_name, "w", timeout_s=60)
            except TimeoutError:
                raise AssertionError(f"the worker did not start; its log:\n{procs.tail(worker, 4000)}") from None
            producer = Producer(redis, run_name)
            await producer.submit(
                "openenv:length", {"length": 5, "turns": 2}, job_id="e", workflow_kwargs={"max_turns": 3}
            )
            try:
                [traj] = [t async for t in producer.wait_for({"e": 1}, timeout_s=TIMEOUT_S)]
            except TimeoutError:
                raise AssertionError(f"no result; the worker's log:\n{procs.tail(worker, 4000)}") from None
    assert traj.status == "ok", traj.error
    assert sequence_rewards(traj) == [1.6, 1.6]  # "12345": 1.0, "1234567": 1 - 2/5; each the episode's sum
    where = json.loads(report.read_text())
    assert where["uid"] == 65534
    assert where["cwd"] == where["home"] and Path(where["home"]).name.startswith("rollq-agent-"), where
    assert not Path(where["home"]).exists()  # the episode's HOME, removed after it
    proxy = {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"}
    leaked = [n for n in where["env"] if n.startswith(("ROLLQ_", "REDIS", "HF_")) or n in proxy]
    assert not leaked, where["env"]  # neither the worker's secrets nor the episode's proxy key
    assert {n for n in where["env"] if not n.startswith("LC_")} <= {"PATH", "HOME", "TMPDIR", "LANG"}, where["env"]
    # gone with its episode (stopped by the driver; its process group killed when the driver exited)
    await wait_until(lambda: not pid_alive(where["pid"]), 10, what="the server to be gone")


# -- (4) a server that cannot start ------------------------------------------------------------------------------

BROKEN = """\
raise RuntimeError("broken environment: its data file is missing")
"""


@pytest.mark.scenario
@pytest.mark.timeout(600)
async def test_a_server_that_fails_to_start_dead_letters_its_job_with_its_output(
    redis, redis_url, run_name, openenv_python, tmp_path
):
    broken = tmp_path / "broken_env.py"
    broken.write_text(BROKEN)
    worker = {
        "allow": ["openenv:broken"],
        "openenv_python": openenv_python,
        "openenv_servers": {"broken": f"{openenv_python} {broken} --port {{port}}"},
        "tokenizer": "tiny",
        "max_attempts": 2,
    }
    async with scripted_engine(["x"]) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        async with running_worker(redis_url, run_name, engine=pool, **worker):
            producer = Producer(redis, run_name)
            job = JobRequest(
                workflow="openenv:broken", data={}, job_id="b", agent=AgentOptions(timeout_seconds=TIMEOUT_S)
            )
            await producer.submit_many([job])
            [traj] = [t async for t in producer.wait_for({"b": 1}, timeout_s=TIMEOUT_S * 2)]
    assert traj.status == "error" and traj.attempt == 2, traj  # retried, then dead-lettered
    message = traj.error.message
    assert "exited with code 1 before it answered" in message and "broken_env.py" in message, message
    assert "RuntimeError: broken environment: its data file is missing" in message, message
    [(_, dead)] = await redis.xrange(f"rollq:{{{run_name}}}:dead")
    assert b"openenv:broken" in b"".join(dead.values()) and b"its data file is missing" in b"".join(dead.values())


# -- CI: the driver's parsing, and an interpreter without openenv -------------------------------------------------


def load_driver() -> ModuleType:
    """The driver file as a module of this process (it imports only the standard library at its top)."""
    spec = importlib.util.spec_from_file_location("openenv_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ONE_TEXT_FIELD = {"properties": {"message": {"type": "string"}}, "required": ["message"]}
TWO_FIELDS = {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}


def test_a_reply_becomes_an_action():
    driver = load_driver()
    assert driver.parse_action('{"x": 1, "y": 2}', TWO_FIELDS) == {"x": 1, "y": 2}
    assert driver.parse_action('```json\n{"x": 1, "y": 2}\n```', TWO_FIELDS) == {"x": 1, "y": 2}
    assert driver.parse_action("  hello there \n", ONE_TEXT_FIELD) == {"message": "hello there"}
    assert driver.parse_action("42", ONE_TEXT_FIELD) == {"message": "42"}  # a text field keeps text
    assert driver.parse_action("42", {"required": ["n"], "properties": {"n": {"type": "integer"}}}) == {"n": 42}
    for reply, schema in (("", ONE_TEXT_FIELD), ("   ", ONE_TEXT_FIELD), ("go left", TWO_FIELDS)):
        with pytest.raises(driver.NoAction):
            driver.parse_action(reply, schema)


def test_the_payload_is_checked():
    driver = load_driver()
    payload = driver.read_payload(json.dumps({"name": "x", "server": "http://127.0.0.1:9", "data": None}))
    assert payload["data"] == {} and payload["kwargs"]["max_turns"] == 8
    assert payload["kwargs"]["system_prompt"] == driver.DEFAULT_SYSTEM_PROMPT
    for bad, said in (
        ({"data": [1]}, "must be a JSON object"),
        ({"server": ""}, "names no server"),
        ({"kwargs": {"max_turns": 0}}, "max_turns must be"),
        ({"kwargs": {"max_turns": True}}, "max_turns must be"),
        ({"kwargs": {"temperature": 0}}, "may hold only"),
        ({"kwargs": {"sampling": {"model": "x"}}}, "the rest of the request"),
        ({"kwargs": {"sampling": {"messages": []}}}, "the rest of the request"),
        ({"kwargs": {"sampling": {"extra_body": {"tools": []}}}}, "the rest of the request"),
    ):
        # The job's own values are InvalidJob (exit 4: dead-lettered at once); a missing server is the worker's.
        refused = driver.EpisodeError if "server" in bad else driver.InvalidJob
        with pytest.raises(refused, match=said):
            driver.read_payload(json.dumps({"name": "x", "server": "http://127.0.0.1:9", **bad}))


async def test_an_interpreter_without_openenv_is_refused_by_name(redis, redis_url, run_name):
    async with scripted_engine(["x"]) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        worker = {
            "allow": ["openenv:*"],
            "openenv_python": sys.executable,
            "openenv_servers": {"e": "http://127.0.0.1:9"},
        }
        async with running_worker(redis_url, run_name, engine=pool, max_attempts=3, **worker):
            producer = Producer(redis, run_name)
            await producer.submit("openenv:e", {}, job_id="j")
            [traj] = [t async for t in producer.wait_for({"j": 1}, timeout_s=60)]
    assert traj.status == "error" and traj.attempt == 1 and traj.error.type == "WorkflowLoadError", traj
    assert f"openenv is not importable by {sys.executable}: ModuleNotFoundError" in traj.error.message


def test_rollq_up_allows_the_environment_it_trains_as_written():
    from rollq.config import build as build_settings
    from rollq.trainer.config import TrainConfig
    from rollq.up import UpConfig, worker_allowlist

    def allowlist(workflow: str, *allow: str) -> list[str]:
        cfg = build_settings(TrainConfig, "trainer", {"workflow": workflow, "dataset": "toy:digits"})
        return worker_allowlist(cfg, UpConfig(allow=list(allow)))

    assert allowlist("openenv:length") == ["openenv:length"]  # that one, as a job writes it (not `openenv.length`)
    assert allowlist("openenv:length", "openenv:*") == ["openenv:*"]  # already allowed
    with pytest.raises(ValueError, match="is not an OpenEnv server name"):
        allowlist("openenv:-x")
