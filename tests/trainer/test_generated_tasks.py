"""Generated tasks (rollq.tasks.generated): reasoning-gym's datasets and a user's own generator as the trainer's
prompts (sizes, seeds, held-out prompts never trained on, clear errors) and as the reward (reasoning-gym's own
score_answer on the answer its own extraction finds), and the settings `dataset=reasoning-gym:NAME` implies."""

from __future__ import annotations

import sys
import textwrap

import msgspec
import pytest
import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from rollq.cli import parse
from rollq.config import build as build_settings
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer import Producer
from rollq.tasks.generated import TASK_REWARD, TaskError, TaskSpec
from rollq.trainer.config import TrainConfig
from rollq.trainer.data import DatasetError, TaskSettings, load_prompts, run_prompts
from rollq.up import UpConfig, worker_allowlist
from rollq.workers.builtin.task_reward import cached_task, task_reward
from rollq.workers.resolver import Allowlist, ImportNotAllowed, enforcing
from tests.helpers import REPO_ROOT, running_worker
from tests.scripted import scripted_engine

SMALL_SUMS = {
    "min_terms": 2,
    "max_terms": 2,
    "max_digits": 1,
    "operators": ["+"],
    "allow_negation": False,
    "allow_parentheses": False,
}
# The tasks docs/tasks.md names: each one's entries travel in a job and score the same after the trip.
SCORERS_ALLOWED = Allowlist(patterns=("reasoning_gym.*",))  # a worker whose operator allows every task's scorer
CLAIMED = {
    "basic_arithmetic": SMALL_SUMS,
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "leg_counting": {"min_animals": 1, "max_animals": 2},
    "letter_counting": {"min_words": 1, "max_words": 3},
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
    "products": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
}


def train_config(**values) -> TrainConfig:
    return build_settings(TrainConfig, "trainer", values)


def test_prompts_are_the_tasks_entries_as_chats_with_its_system_prompt():
    settings = TaskSettings(size=20, seed=7, config=SMALL_SUMS, system_prompt="direct")
    records = load_prompts("reasoning-gym:basic_arithmetic", settings)
    assert len(records) == 20
    task = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=7, **SMALL_SUMS)
    for i, record in enumerate(records):
        assert record["messages"] == [
            {"role": "system", "content": SYSTEM_PROMPTS["direct"]},
            {"role": "user", "content": task[i]["question"]},
        ]
        assert record["entry"] == msgspec.json.decode(msgspec.json.encode(task[i]))
        assert record["task"] == {
            "source": "reasoning-gym:basic_arithmetic",
            "size": 20,
            "seed": 7,
            "config": SMALL_SUMS,
        }
    assert load_prompts("reasoning-gym:basic_arithmetic", settings) == records  # a seed makes the same prompts
    other = load_prompts("reasoning-gym:basic_arithmetic", TaskSettings(size=20, seed=8, config=SMALL_SUMS))
    assert [r["entry"] for r in other] != [r["entry"] for r in records]
    no_system = load_prompts("reasoning-gym:basic_arithmetic", TaskSettings(size=1, system_prompt=""))
    assert [m["role"] for m in no_system[0]["messages"]] == ["user"]
    own = load_prompts("reasoning-gym:basic_arithmetic", TaskSettings(size=1, system_prompt="Answer in <answer>."))
    assert own[0]["messages"][0] == {"role": "system", "content": "Answer in <answer>."}


def test_held_out_prompts_are_never_among_the_training_prompts():
    # The worst case: held-out from the training seed itself (reasoning-gym seeds entry i with seed + i, so nearby
    # seeds share entries). Every shared question is replaced by another of the held-out seed.
    cfg = train_config(
        dataset="reasoning-gym:basic_arithmetic",
        task_config={"max_digits": 2, "min_terms": 2, "max_terms": 2},
        task_size=200,
        eval_task_size=60,
        eval_task_seed=0,
    )
    assert cfg.eval_dataset == "reasoning-gym:basic_arithmetic"  # implied: the same task, held out
    train, held_out = run_prompts(cfg)
    assert len(train) == 200 and len(held_out) == 60
    trained = {r["entry"]["question"] for r in train}
    assert not trained & {r["entry"]["question"] for r in held_out}
    # the defaults: another seed, far from the training one
    two_digits = {**SMALL_SUMS, "max_digits": 2}
    train, held_out = run_prompts(train_config(dataset="reasoning-gym:basic_arithmetic", task_config=two_digits))
    assert len(train) == 1000 and len(held_out) == 100 and {r["task"]["seed"] for r in held_out} == {1_000_000}
    assert not {r["entry"]["question"] for r in train} & {r["entry"]["question"] for r in held_out}


def test_a_task_with_too_few_distinct_questions_for_its_held_out_prompts_says_so():
    # four questions in all, each among the 100 training prompts
    cfg = train_config(dataset="tests.task_generators:make", task_config={"top": 3}, task_size=100, eval_task_size=2)
    with pytest.raises(DatasetError, match=r"whose question is not among the training prompts.*eval_task_size"):
        run_prompts(cfg)


@pytest.mark.parametrize(
    ("spec", "settings", "message"),
    [
        ("reasoning-gym:basic_arithmetc", TaskSettings(), r"no task 'basic_arithmetc' \(did you mean basic_arithmetic"),
        ("reasoning-gym:nope", TaskSettings(), r"no task 'nope'; reasoning-gym's task names: .*DATASETS"),
        ("reasoning-gym:basic_arithmetic", TaskSettings(config={"max_digitz": 1}), r"rejects its config.*max_digitz"),
        ("reasoning-gym:basic_arithmetic", TaskSettings(config={"min_terms": 0}), r"rejects.*min_terms must be pos"),
        ("reasoning-gym:basic_arithmetic", TaskSettings(config={"seed": 1}), r"size or seed: they are the settings"),
        ("reasoning-gym:basic_arithmetic", TaskSettings(system_prompt="terse"), r"'terse' is not one of reasoning"),
        ("tests.task_generators:make", TaskSettings(config={"top": 0}), r"rejects its config.*top must be >= 1"),
        ("tests.no_such_module:make", TaskSettings(), r"cannot import module 'tests.no_such_module'"),
        ("tests.task_generators:NOTHING", TaskSettings(), r"has no attribute 'NOTHING'"),
    ],
)
def test_a_bad_task_name_or_config_fails_clearly(spec, settings, message):
    with pytest.raises(DatasetError, match=message):
        load_prompts(spec, settings)


def test_a_bad_task_fails_rollq_up_before_anything_starts(tmp_path):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "up", "dataset=reasoning-gym:no_such_task", f"run_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "reasoning-gym has no task 'no_such_task'" in proc.stderr, proc.stderr[-2000:]
    assert "redis at" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", sorted(CLAIMED))
def test_the_reward_is_reasoning_gyms_own_score_of_the_answer_its_extraction_finds(name):
    records = load_prompts(f"reasoning-gym:{name}", TaskSettings(size=12, seed=3, config=CLAIMED[name]))
    task = reasoning_gym.create_dataset(name, size=12, seed=3, **CLAIMED[name])
    for i, data in enumerate(records):
        right = str(task[i]["answer"])
        completions = {
            f"Let me think. <answer>{right}</answer>": 1.0,  # right
            f"<answer>{right}</answer> or <answer>{right}x</answer>": None,  # the last answer counts
            f"<answer>wrong {right}9</answer>": None,  # wrong (partial credit is the task's own)
            right: 0.0,  # badly formatted: no <answer> tags
            f"<answer>{right}": 0.0,  # cut off
        }
        with enforcing(SCORERS_ALLOWED):
            for completion, expected in completions.items():
                own = float(task.score_answer(extract_answer(completion), task[i]))
                reward = task_reward("prompt", completion, **data)
                assert reward == own, (name, completion)
                if expected is not None:
                    assert reward == expected, (name, completion)
            assert task_reward("p", f"<answer>{right}9</answer>", **data) < 1.0


def test_job_data_carries_what_the_scorer_needs_through_the_wire():
    """msgpack, as jobs travel: the entry's tuples come back as lists; the score is the same."""
    import msgspec.msgpack

    for name, config in CLAIMED.items():
        for record in load_prompts(f"reasoning-gym:{name}", TaskSettings(size=8, seed=11, config=config)):
            carried = msgspec.msgpack.decode(msgspec.msgpack.encode(record))
            assert carried == record
            right = f"<answer>{record['entry']['answer']}</answer>"
            with enforcing(SCORERS_ALLOWED):
                assert task_reward("p", right, **carried) == 1.0, (name, record["entry"])


def test_the_scorer_is_built_once_per_process():
    record = load_prompts("reasoning-gym:basic_arithmetic", TaskSettings(size=2, config=SMALL_SUMS))[0]
    spec = msgspec.convert(record["task"], TaskSpec)
    with enforcing(SCORERS_ALLOWED):
        assert cached_task(spec) is cached_task(spec)


def test_the_scorer_never_reads_the_entry_a_job_carries(tmp_path):
    """reasoning-gym's number_sorting scorer evals its entry's answer (reasoning_gym/algorithmic/number_sorting.py:131):
    a job that carries an entry of its own gets it ignored; the entry scored against is task[index], rebuilt."""
    marker = tmp_path / "pwned"
    record = load_prompts("reasoning-gym:number_sorting", TaskSettings(size=2, seed=3))[1]
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch() or [1]"
    planted = {**record, "entry": {"question": "q", "answer": payload, "metadata": {}}}
    right = f"<answer>{record['entry']['answer']}</answer>"
    with enforcing(Allowlist(patterns=("reasoning_gym.number_sorting",))):
        assert task_reward("p", right, **planted) == 1.0  # scored against the real entry
        assert task_reward("p", "<answer>[1]</answer>", **planted) < 1.0
        for index in (-1, 2, "0", True, None):
            with pytest.raises(TaskError, match="index"):
                task_reward("p", right, **{**planted, "index": index})
    assert not marker.exists()


def test_a_task_whose_scorer_evaluates_answers_is_scored_only_where_the_operator_allows_it():
    """countdown parses the model's answer with sympy's parse_expr (reasoning_gym/games/countdown.py:221), which
    evals: the policy's text is not run unless the worker's allowlist (the job's) allows reasoning_gym.countdown."""
    from rollq.workers.builtin.task_reward import scorer_evaluates

    assert scorer_evaluates("countdown") and scorer_evaluates("string_insertion")
    assert not scorer_evaluates("chain_sum")
    record = load_prompts("reasoning-gym:countdown", TaskSettings(size=1))[0]
    for allowlist in (None, Allowlist(patterns=("rollq.*",)), SCORERS_ALLOWED.narrowed(["rollq.workers.builtin"])):
        with pytest.raises(TaskError, match=r"--allow reasoning_gym\.countdown"):
            if allowlist is None:
                task_reward("p", "<answer>1</answer>", **record)
            else:
                with enforcing(allowlist):
                    task_reward("p", "<answer>1</answer>", **record)
    with enforcing(Allowlist(patterns=("reasoning_gym.countdown",))):
        assert task_reward("p", "<answer>1</answer>", **record) < 1.0  # scored (a wrong answer)
    # rollq up allows its own run's task, and only that one
    cfg = train_config(dataset="reasoning-gym:countdown")
    assert worker_allowlist(cfg, UpConfig()) == ["reasoning_gym.countdown"]


def test_a_users_own_generator_and_scorer_plug_in_the_same_way():
    records = load_prompts("tests.task_generators:make", TaskSettings(size=30, seed=2, config={"top": 5}))
    assert len(records) == 30
    assert records[0]["messages"][-1]["content"].startswith("What number comes after ")
    assert {r["task"]["source"] for r in records} == {"tests.task_generators:make"}
    entry = records[0]["entry"]
    on_worker = Allowlist(patterns=("tests",))
    with enforcing(on_worker):
        assert task_reward("p", f"<answer>{entry['answer']}</answer>", **records[0]) == 1.0
        assert task_reward("p", "<answer>-1</answer>", **records[0]) == 0.0
        assert task_reward("p", entry["answer"], **records[0]) == 0.0  # the default extraction: <answer> tags
    # built and cached under the operator's list, it is still no way around a tenant's narrower one
    tenant = Allowlist(patterns=("tests",)).narrowed(["tests.reward_fns"])
    with enforcing(tenant), pytest.raises(ImportNotAllowed, match="not among the patterns this job may use"):
        task_reward("p", f"<answer>{entry['answer']}</answer>", **records[0])
    # its settings: the reward and held-out prompts are implied, as for reasoning-gym's
    cfg = train_config(dataset="tests.task_generators:make", task_config={"top": 9}, eval_task_size=5)
    assert cfg.workflow_kwargs["reward_fn"] == TASK_REWARD and cfg.eval_dataset == "tests.task_generators:make"
    assert worker_allowlist(cfg, UpConfig()) == ["tests.task_generators"]  # rollq up allows its module
    assert worker_allowlist(train_config(dataset="reasoning-gym:basic_arithmetic"), UpConfig()) == [
        "reasoning_gym.basic_arithmetic"
    ]


def test_a_job_naming_a_generator_outside_the_allowlist_imports_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "planted_task.py").write_text(
        textwrap.dedent(f"""
        open({str(marker)!r}, "w").close()
        def make(size, seed, **config):
            raise AssertionError("built")
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = {"task": {"source": "planted_task:make", "size": 1, "seed": 0, "config": {}}, "index": 0}
    try:
        with enforcing(Allowlist(patterns=("tests",))), pytest.raises(ImportNotAllowed, match="planted_task:make"):
            task_reward("p", "<answer>1</answer>", **data)
        # a tenant's job narrowed to its own patterns: the operator's list alone is not enough
        narrowed = Allowlist(patterns=("tests", "planted_task")).narrowed(["tests"])
        with enforcing(narrowed), pytest.raises(ImportNotAllowed, match="not among the patterns this job may use"):
            task_reward("p", "<answer>1</answer>", **data)
        # where no allowlist is active (a reward's child process, a reward worker), a job's path is not imported
        with pytest.raises(TaskError, match="no allowlist is active here"):
            task_reward("p", "<answer>1</answer>", **data)
        assert not marker.exists()
        # nor can a job's spec ask a worker to build a task of a trillion entries
        huge = {**data, "task": {"source": "reasoning-gym:chain_sum", "size": 10**12, "seed": 0, "config": {}}}
        with pytest.raises(TaskError, match="not a task spec"):
            task_reward("p", "<answer>1</answer>", **huge)
    finally:
        sys.modules.pop("planted_task", None)


def test_a_generated_dataset_brings_its_scorer_and_held_out_prompts():
    cfg = parse(["up", "--model", "smollm2", "dataset=reasoning-gym:chain_sum"], env={}).settings[1]
    assert cfg.workflow_kwargs == {"reward_fn": TASK_REWARD, "max_new_tokens": 8}  # smollm2's budget, the task's reward
    assert cfg.eval_dataset == "reasoning-gym:chain_sum" and cfg.steps == 80  # the rest of smollm2's task
    given = parse(["up", "dataset=reasoning-gym:chain_sum", "workflow_kwargs={max_new_tokens: 32}", "eval_dataset="])
    assert given.settings[1].workflow_kwargs == {"max_new_tokens": 32, "reward_fn": TASK_REWARD}
    assert given.settings[1].eval_dataset == ""  # given explicitly: no held-out evaluation
    own = parse(["up", "dataset=reasoning-gym:chain_sum", "workflow_kwargs={reward_fn: tests.reward_fns:exact_match}"])
    assert own.settings[1].workflow_kwargs == {"reward_fn": "tests.reward_fns:exact_match"}  # a reward given wins
    assert parse(["up"], env={}).settings[1].workflow_kwargs["reward_fn"] == "rollq.tasks.digits:digits_reward"


async def test_workers_score_with_the_task_and_refuse_a_jobs_generator_outside_the_allowlist(
    redis, redis_url, run_name, tmp_path, monkeypatch
):
    """A real worker (real Redis, a scripted engine server) runs the built-in loop on a generated task's prompts:
    the reward is the task's own score. A job whose data names a generator outside the worker's allowlist is
    dead-lettered, having imported nothing."""
    marker = tmp_path / "imported"
    (tmp_path / "planted_task.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make(size, seed): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = load_prompts("reasoning-gym:chain_sum", TaskSettings(size=1, config=CLAIMED["chain_sum"]))[0]
    own = load_prompts("tests.task_generators:make", TaskSettings(size=1))[0]
    planted = {**own, "task": {**own["task"], "source": "planted_task:make"}}
    right = f"<answer>{record['entry']['answer']}</answer>"
    kwargs = {"reward_fn": TASK_REWARD, "max_new_tokens": 16}
    producer = Producer(redis, run_name)
    try:
        async with (
            scripted_engine([f"I add them. {right}"]) as engine,
            EnginePool(PoolConfig(urls=[engine.url])) as pool,
            running_worker(redis_url, run_name, engine=pool, max_attempts=2),
        ):
            await producer.submit("rlvr", record, job_id="gym", workflow_kwargs=kwargs)
            await producer.submit("rlvr", own, job_id="own", workflow_kwargs=kwargs)
            await producer.submit("rlvr", planted, job_id="planted", workflow_kwargs=kwargs)
            expected = {"gym": 1, "own": 1, "planted": 1}
            trajs = {t.job_id: t async for t in producer.wait_for(expected, timeout_s=30)}
    finally:
        sys.modules.pop("planted_task", None)
    assert trajs["gym"].status == "ok" and trajs["gym"].sequences[0].reward == 1.0
    assert trajs["own"].status == "ok" and trajs["own"].sequences[0].reward == 0.0  # the wrong number: its scorer
    assert trajs["planted"].status == "error" and trajs["planted"].error.type == "ImportNotAllowed"
    assert "import path 'planted_task:make' is not allowed" in trajs["planted"].error.message
    assert not marker.exists()
    assert len(await redis.xrange(f"rollq:{{{run_name}}}:dead")) == 1


def rollq_up(run_dir, *settings: str) -> tuple[dict, list[dict], str]:
    """`rollq up` with the tiny model for 2 steps of 2 groups of 4 on `settings`: its summary, eval records, stderr."""
    import json
    import subprocess

    from tests.helpers import env_without_settings

    small = ["steps=2", "group_size=4", "groups_per_step=2", "task_size=40", "eval_task_size=6", "eval_every=0"]
    small.append("dynamic_sampling=false")  # the tiny model's groups mostly score alike: no second batch to filter
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "up", *small, *settings, f"run_dir={run_dir}"],
        cwd=REPO_ROOT,  # the workers import the tests' modules from here (no module_paths given)
        capture_output=True,
        text=True,
        timeout=300,
        env=env_without_settings(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return summary, evals, proc.stderr


@pytest.mark.slow
def test_rollq_up_trains_a_reasoning_gym_task_scored_by_its_own_scorer(tmp_path):
    """The CI smoke: two steps on reasoning-gym's sums, no failed sample (a scorer that raised would fail its sample:
    a failed reward is never a 0), and the held-out prompts evaluated before and after."""
    summary, evals, err = rollq_up(
        tmp_path / "run", "dataset=reasoning-gym:basic_arithmetic", "task_config={max_digits: 2, max_terms: 2}"
    )
    assert "training reasoning-gym:basic_arithmetic with the tiny model" in err
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 8 and not summary["dropped"], summary
    assert [(e["step"], e["samples"], e["failed"]) for e in evals] == [(0, 6, 0), (2, 6, 0)]


@pytest.mark.slow
@pytest.mark.scenario  # CI keeps its pieces (the allowlist unit test, the worker test) and the reasoning-gym smoke
def test_rollq_up_trains_a_users_own_generator_scored_by_its_own_scorer(tmp_path):
    """The user's pair: `rollq up` allows the generator's module on its workers by itself, and every reward is the
    scorer's (it scores every completion above 0)."""
    summary, evals, _ = rollq_up(
        tmp_path / "run", "dataset=tests.task_generators:make_any_text", "task_config={top: 999}"
    )
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 8 and not summary["dropped"], summary
    assert [(e["step"], e["samples"], e["failed"]) for e in evals] == [(0, 6, 0), (2, 6, 0)]
    assert all(e["reward_mean"] > 0 for e in evals) and summary["reward_first10"] > 0


def test_worked_examples_come_before_the_question_and_are_never_the_question_asked():
    cfg = train_config(
        dataset="reasoning-gym:basic_arithmetic",
        task_config={**SMALL_SUMS, "max_digits": 2},
        task_examples=2,
        task_system_prompt="direct",
        task_size=30,
        eval_task_size=10,
    )
    train, held_out = run_prompts(cfg)
    first_entries = [r["entry"] for r in train[:3]]
    for record in train + held_out:
        system, *examples, question = record["messages"]
        assert system == {"role": "system", "content": SYSTEM_PROMPTS["direct"]}
        assert [m["role"] for m in examples] == ["user", "assistant"] * 2
        assert question == {"role": "user", "content": record["entry"]["question"]}
        shown = [(q["content"], a["content"]) for q, a in zip(examples[::2], examples[1::2], strict=True)]
        assert record["entry"]["question"] not in [q for q, _ in shown]
        # the training prompts' first entries, answered in the form the reward reads
        answered = [(e["question"], f"<answer>{e['answer']}</answer>") for e in first_entries]
        assert all(pair in answered for pair in shown)
    assert train[0]["messages"][1]["content"] == train[1]["entry"]["question"]  # the first prompt skips itself


# The run that learns (docs/tasks.md, "A run that learns"): SmolLM2-135M on reasoning-gym's single-digit sums.
LEARNING_RUN = [
    "--model",
    "smollm2",
    "dataset=reasoning-gym:basic_arithmetic",
    "task_config={min_terms: 2, max_terms: 2, max_digits: 1, operators: ['+'], allow_negation: false, "
    "allow_parentheses: false}",
    "task_size=40",
    "eval_task_size=50",
    "task_system_prompt=",
    "task_examples=2",
    "workflow_kwargs={max_new_tokens: 10}",
    "steps=40",
    "lr=2e-5",
    "eval_every=10",
]


def standard_error_bound(mean: float, n: int) -> float:
    """An upper bound on the standard error of a mean of n rewards in [0, 1]: their variance is at most
    mean * (1 - mean) (Bhatia-Davis), equal to it for 0/1 rewards. eval.jsonl holds each evaluation's mean only."""
    return (mean * (1 - mean) / n) ** 0.5


@pytest.mark.slow
@pytest.mark.scenario
@pytest.mark.timeout(7200)  # ~30-60 min on 2 shared cores
def test_smollm2_learns_a_reasoning_gym_task_on_held_out_prompts(tmp_path):
    import json
    import subprocess

    from tests.helpers import env_without_settings

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "up", *LEARNING_RUN, f"run_dir={run_dir}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=7000,
        env=env_without_settings(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    assert (first["step"], last["step"]) == (0, 40) and first["samples"] == last["samples"] == 50
    assert first["failed"] == last["failed"] == 0
    se = (
        standard_error_bound(first["reward_mean"], 50) ** 2 + standard_error_bound(last["reward_mean"], 50) ** 2
    ) ** 0.5
    assert last["reward_mean"] - first["reward_mean"] > 2 * se, evals
