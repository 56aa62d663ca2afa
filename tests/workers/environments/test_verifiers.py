"""verifiers environments as rollq workloads, with the real verifiers 0.4.0 from PyPI in a virtualenv of its own
(built once from cached wheels) and a test environment written in verifiers' API (verifiers_env.py): its rewards
equal verifiers' own evaluation (`vf-eval`) of the same tasks through the same recording proxy, a failing episode is
dead-lettered naming the error after its retries, groups work, and `rollq up` trains on it. Scenarios: each builds
or reuses the virtualenv, and every episode starts an interpreter that imports verifiers (seconds of CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.messages import AgentOptions
from tests.helpers import REPO_ROOT, running_worker
from tests.scripted import tiny_tokenizer
from tests.workers.environments.verifiers_env import ENV_ID, verifiers_python

pytestmark = [pytest.mark.scenario, pytest.mark.slow]

WORKFLOW = f"verifiers:{ENV_ID}"
TASKS = 4
SAMPLING = {"temperature": 0.0, "max_tokens": 12}
KWARGS = {"sampling": SAMPLING, "env_args": {"num_tasks": TASKS}}
TIMEOUT_S = 240.0  # an episode: an interpreter importing verifiers on a shared CPU, then one short completion


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> Path:
    return verifiers_python(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
async def engine(tmp_path):
    """The tiny model greedily, one request at a time (a batch's composition can't change a greedy token)."""
    server = await serve(
        ReferenceBackend(ReferenceConfig(model="tiny", max_running=1)),
        EngineServerConfig(port=0, weights_root=str(tmp_path)),
    )
    async with EnginePool(PoolConfig(urls=[server.url])) as pool:
        yield pool
    await server.close()


async def run_jobs(redis, redis_url, run, engine, jobs: list[JobRequest], **worker) -> list:
    async with running_worker(redis_url, run, engine=engine, concurrency=8, max_agent_timeout=TIMEOUT_S, **worker):
        producer = Producer(redis, run)
        consumer = producer.consumer()
        await consumer.setup()
        await producer.submit_many(jobs)
        expected = {j.job_id: j.n for j in jobs}
        got = [t async for t in producer.wait_for(expected, timeout_s=3 * TIMEOUT_S, consumer=consumer)]
    return sorted(got, key=lambda t: (t.job_id, t.sample_index))


def job(job_id: str, idx: int, kwargs=KWARGS, n: int = 1) -> JobRequest:
    return JobRequest(
        workflow=WORKFLOW,
        job_id=job_id,
        n=n,
        data={"idx": idx},
        workflow_kwargs=kwargs,
        agent=AgentOptions(timeout_seconds=TIMEOUT_S),
    )


def checksum(reply: str) -> float:
    """The test environment's reward for a reply (verifiers_env.py DigitsTask.checksum)."""
    return (sum(ord(c) for c in reply if c.isascii() and c.isalnum()) % 11) / 10


def reply_text(completion: str) -> str:
    """The reply the proxy answered (its message content) for a completion decoded with its special tokens (the
    end-of-turn token the model stopped at): without them, stripped (rollq.workers.proxy.chat)."""
    for token in tiny_tokenizer().all_special_tokens:
        completion = completion.replace(token, "")
    return completion.strip()


def vf_eval_rewards(python: Path, out: Path) -> dict[int, float]:
    """task idx -> reward of vf-eval's own traces (verifiers' Trace.reward, read by verifiers itself)."""
    [traces] = list(out.rglob("traces.jsonl"))
    read = (
        "import json, sys\n"
        "from verifiers.v1 import Episode\n"
        "out = {}\n"
        "for line in open(sys.argv[1]):\n"
        "    episode = Episode.model_validate_json(line)\n"
        "    assert episode.ok, episode.errors\n"
        "    [trace] = episode.traces\n"
        "    out[episode.task.data.idx] = trace.reward\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(python), "-c", read, str(traces)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads(proc.stdout).items()}


async def test_rollq_rewards_equal_vf_evals_own_through_the_same_proxy(
    redis, redis_url, run_name, engine, python, tmp_path
):
    # verifiers' own evaluation, run by the worker as a command agent: its model calls go through rollq's
    # recording proxy (OPENAI_BASE_URL, the episode's key) to the same engine.
    out = tmp_path / "vf-eval"
    script = tmp_path / "vf-eval.sh"
    vf_eval = python.parent / "vf-eval"
    script.write_text(
        "#!/bin/sh\nset -e\n"
        f"{vf_eval} {ENV_ID} -n {TASKS} -m rollq --no-rich --no-push -o {out} --run.name eval"
        f" --env.taskset.num-tasks {TASKS} --env.agent.runtime.type subprocess"
        f" --sampling.temperature 0 --sampling.max-tokens {SAMPLING['max_tokens']}"
        ' --client.base-url "$OPENAI_BASE_URL" --client.api-key-var OPENAI_API_KEY >&2\n'
        "echo 0\n"
    )
    script.chmod(0o755)
    evaluation = JobRequest(
        workflow=f"exec:{script}", job_id="vf-eval", data={}, agent=AgentOptions(timeout_seconds=TIMEOUT_S)
    )
    jobs = [evaluation] + [job(f"t{i}", i) for i in range(TASKS)]
    got = await run_jobs(
        redis, redis_url, run_name, engine, jobs, allow=[WORKFLOW, f"command:{script}"], verifiers_python=str(python)
    )
    by_job = {t.job_id: t for t in got}
    assert all(t.status == "ok" for t in got), [t.error for t in got if t.error]
    assert len(by_job["vf-eval"].sequences) == TASKS  # vf-eval's completions, recorded by the proxy
    theirs = vf_eval_rewards(python, out)
    ours = {}
    for i in range(TASKS):
        [seq] = by_job[f"t{i}"].sequences  # one completion, the proxy's recorded tokens
        assert 1 in seq.loss_mask and len(seq.versions) == len(seq.input_ids)
        ours[i] = seq.reward
    assert ours == theirs
    assert len(set(ours.values())) >= 2, ours  # the rewards depend on the replies: equality could have failed
    # the same replies, token for token: vf-eval's completions are rollq's
    assert sorted(tuple(s.input_ids) for s in by_job["vf-eval"].sequences) == sorted(
        tuple(by_job[f"t{i}"].sequences[0].input_ids) for i in range(TASKS)
    )


async def test_a_failing_episode_is_dead_lettered_naming_its_error_and_groups_work(
    redis, redis_url, run_name, engine, python
):
    failing = {**KWARGS, "env_args": {"num_tasks": TASKS, "failing": True}}
    # What a job may not choose: verifiers' own taskset fields (a file read as the prompt, a reward function named
    # by a file, judges with their URLs), a string field, a field the environment lacks, a task it lacks.
    refused = {
        "prompt-file": ({"system_prompt": "/etc/hostname"}, 0, "may not set 'system_prompt'"),
        "planted-fn": ({"task": {"rewards": {"r": {"fn": "/tmp/x.py:f"}}}}, 0, "may not set 'task'"),
        "string": ({"greeting": "hi"}, 0, "may not set 'greeting'"),
        "unknown": ({"nope": 1}, 0, "has no config field 'nope'"),
        "bad-value": ({"num_tasks": "many"}, 0, "env_args: 1 validation error"),
        "no-task": ({"num_tasks": TASKS}, 99, "has no task 99"),
    }
    jobs = [job("fails", 0, failing), job("group", 1, {**KWARGS, "sampling": {"max_tokens": 12}}, n=3)]
    jobs += [job(name, idx, {**KWARGS, "env_args": args}) for name, (args, idx, _) in refused.items()]
    got = await run_jobs(
        redis, redis_url, run_name, engine, jobs, allow=[WORKFLOW], verifiers_python=str(python), max_attempts=2
    )
    [fails] = [t for t in got if t.job_id == "fails"]
    assert fails.status == "error" and fails.attempt == 2, fails  # retried once, then dead-lettered
    assert "the checksum reward failed on purpose" in fails.error.message
    for name, (_, _, said) in refused.items():
        [t] = [t for t in got if t.job_id == name]
        assert t.status == "error" and t.attempt == 1, t  # the job's own values: at once, no retry
        assert t.error.type == "WorkflowLoadError" and said in t.error.message, t.error
    assert len(await redis.xrange(f"rollq:{{{run_name}}}:dead")) == 1 + len(refused)
    group = [t for t in got if t.job_id == "group"]
    assert [t.sample_index for t in group] == [0, 1, 2] and all(t.status == "ok" for t in group)
    assert all(len(t.sequences) == 1 and 1 in t.sequences[0].loss_mask for t in group)


def test_rollq_up_trains_a_few_steps_on_the_environment(python, tmp_path):
    """`rollq up` with the environment as its workflow: the workers run it (verifiers_python from ROLLQ_WORKER_*),
    its rewards train the tiny model for 2 steps on the proxy's recorded tokens."""
    prompts = tmp_path / "tasks.jsonl"
    prompts.write_text("".join(json.dumps({"idx": i}) + "\n" for i in range(TASKS)))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLQ_") or k == "ROLLQ_CACHE"}
    env["ROLLQ_WORKER_VERIFIERS_PYTHON"] = str(python)
    env["ROLLQ_WORKER_MAX_AGENT_TIMEOUT"] = str(TIMEOUT_S)
    argv = [sys.executable, "-m", "rollq", "up", "--workflow", WORKFLOW, "--dataset", str(prompts)]
    argv += ["--workflow-kwargs", json.dumps({"sampling": {"max_tokens": 12}, "env_args": {"num_tasks": TASKS}})]
    argv += ["--agent-timeout", str(TIMEOUT_S), "--concurrency", "8"]
    argv += ["steps=2", "group_size=2", "groups_per_step=2", "eval_dataset=", f"run_dir={run_dir}"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 2 * 2, summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    rewards = [r["reward_mean"] for r in records]
    assert all(0.0 <= r <= 1.0 for r in rewards), rewards  # the checksum's range: the environment's rewards
    assert (run_dir / "checkpoints" / "latest").exists()
    # What was trained, decoded from the trajectories: the proxy's recorded turns of the environment's own prompts,
    # each rewarded with the environment's checksum of that very completion.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("Write the number" in s["prompt"] for s in samples)
    mismatched = [s for s in samples if s["reward"] != checksum(reply_text(s["completion"]))]
    assert mismatched == [], [(s["completion"], s["reward"], checksum(reply_text(s["completion"]))) for s in mismatched]
