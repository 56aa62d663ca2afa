"""AReaL's own RolloutWorkflows, from the real areal 1.0.4 wheel, in a rollq worker: (b) the user's copy with only
its `from areal...` import lines changed to rollq.workers.api, and (a) the file unchanged with areal importable
(a `rollq worker` subprocess with areal's cached site on its path). Each is named in the job directly, its kwargs
as JSON: `gconfig` a mapping, `tokenizer` a model name, `reward_fn` an import path (tests/../construct.py)."""

from __future__ import annotations

import uuid

import pytest

from rollq.protocol import Codec
from rollq.protocol.messages import VisionInputs
from tests.areal_real import VISION_KWARGS, colour_question, run_converted, user_package
from tests.scripted import tiny_tokenizer

REWARD = "tests.reward_fns:answer_in_completion"
RLVR_KWARGS = {"reward_fn": REWARD, "gconfig": {"max_new_tokens": 32}, "tokenizer": "tiny"}
MULTI_TURN_KWARGS = {**RLVR_KWARGS, "max_turns": 3, "turn_discount": 0.9}
MULTI_TURN_V2 = "areal.experimental.workflow.multi_turn_v2:MultiTurnWorkflow"


def trained_text(seq) -> str:
    ids = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


def converted(tmp_path, monkeypatch, files: dict[str, str]) -> str:
    package = user_package(tmp_path, f"user_{uuid.uuid4().hex[:8]}", files)
    monkeypatch.syspath_prepend(str(tmp_path))
    return package


def check_rlvr(trajs, reply: str, reward: float) -> None:
    [t] = trajs
    assert t.status == "ok", t.error
    [seq] = t.sequences
    assert trained_text(seq) == reply
    assert seq.reward == reward
    assert len(seq.input_ids) == len(seq.loss_mask) == len(seq.logprobs) == len(seq.versions)


def check_multi_turn(trajs) -> None:
    """Wrong, then right: one growing sequence with both replies trained, the reward discounted once."""
    [t] = trajs
    assert t.status == "ok", t.error
    [seq] = t.sequences
    assert seq.reward == pytest.approx(0.9)
    trained = trained_text(seq)
    assert "The answer is 4." in trained and "The answer is 5." in trained, trained


async def test_rlvr_with_only_its_imports_changed(redis, redis_url, run_name, tmp_path, monkeypatch):
    package = converted(tmp_path, monkeypatch, {"rlvr": "areal/workflow/rlvr.py"})
    trajs = await run_converted(
        redis, redis_url, run_name, ["The answer is 5."], f"{package}.rlvr:RLVRWorkflow", workflow_kwargs=RLVR_KWARGS
    )
    check_rlvr(trajs, "The answer is 5.", 1.0)


async def test_multi_turn_with_only_its_imports_changed(redis, redis_url, run_name, tmp_path, monkeypatch):
    package = converted(tmp_path, monkeypatch, {"multi_turn": "areal/workflow/multi_turn.py"})
    trajs = await run_converted(
        redis,
        redis_url,
        run_name,
        ["The answer is 4.", "The answer is 5."],
        f"{package}.multi_turn:MultiTurnWorkflow",
        workflow_kwargs=MULTI_TURN_KWARGS,
    )
    check_multi_turn(trajs)


async def test_a_job_may_not_name_a_tokenizer_path(redis, redis_url, run_name, tmp_path, monkeypatch):
    """Kwargs come from whoever may submit: a tokenizer is a model name, never a path the job picks."""
    package = converted(tmp_path, monkeypatch, {"rlvr": "areal/workflow/rlvr.py"})
    kwargs = {**RLVR_KWARGS, "tokenizer": str(tmp_path)}
    [t] = await run_converted(redis, redis_url, run_name, ["x"], f"{package}.rlvr:RLVRWorkflow", workflow_kwargs=kwargs)
    assert t.status == "error" and t.error.type == "WorkflowLoadError", t.error
    assert "models_root" in t.error.message


async def test_a_reward_path_outside_the_allowlist_is_refused(redis, redis_url, run_name, tmp_path, monkeypatch):
    """AReaL's RLVRWorkflow would import a string reward_fn itself: the worker resolves it first, allowlisted."""
    package = converted(tmp_path, monkeypatch, {"rlvr": "areal/workflow/rlvr.py"})
    kwargs = {**RLVR_KWARGS, "reward_fn": "os:system"}
    [t] = await run_converted(redis, redis_url, run_name, ["x"], f"{package}.rlvr:RLVRWorkflow", workflow_kwargs=kwargs)
    assert t.status == "error" and t.error.type == "ImportNotAllowed", t.error


EVAL_PROBE = '''
from areal import workflow_context
from areal.api import RolloutWorkflow
from areal.utils import stats_tracker


class EvalProbe(RolloutWorkflow):
    """Rewards 1.0 when AReaL's own workflow_context says this is an eval episode (and its stats scope agrees)."""

    async def arun_episode(self, engine, data):
        scope = workflow_context.stat_scope()
        stats_tracker.get(scope).scalar(probe=1.0)
        hit = workflow_context.get().is_eval and scope == "eval-rollout"
        return {"input_ids": [1, 2], "loss_mask": [0, 1], "logprobs": [0.0, -1.0], "reward": float(hit)}
'''


@pytest.mark.slow
async def test_the_files_unchanged_with_areal_importable(redis, redis_url, run_name, spawn_worker, tmp_path):
    """Mode (a): one `rollq worker` subprocess with the real areal on its path (areal's import takes seconds)
    runs rlvr.py and multi_turn.py as the wheel ships them, and a file of AReaL's imports that reads AReaL's own
    workflow_context: the worker sets it, so eval jobs count as eval there too."""
    from rollq.producer.producer import JobRequest
    from tests.areal_real import QUESTION, areal_site, submit_all
    from tests.scripted import scripted_engine

    site = areal_site()
    package = tmp_path / f"probe_{uuid.uuid4().hex[:8]}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(EVAL_PROBE)
    probe = f"{package.name}.probe:EvalProbe"
    jobs = [
        JobRequest(
            job_id="rlvr", workflow="areal.workflow.rlvr:RLVRWorkflow", workflow_kwargs=RLVR_KWARGS, data=QUESTION
        ),
        JobRequest(
            job_id="multi",
            workflow="areal.workflow.multi_turn:MultiTurnWorkflow",
            workflow_kwargs=MULTI_TURN_KWARGS,
            data=QUESTION,
        ),
        JobRequest(job_id="v2", workflow=MULTI_TURN_V2, workflow_kwargs=MULTI_TURN_KWARGS, data=QUESTION),
        JobRequest(job_id="eval", workflow=probe, data=QUESTION, is_eval=True),
        JobRequest(job_id="train", workflow=probe, data=QUESTION),
        JobRequest(
            job_id="vision",
            workflow="areal.workflow.vision_rlvr:VisionRLVRWorkflow",
            workflow_kwargs={**VISION_KWARGS, "reward_fn": REWARD},
            data={**colour_question((200, 0, 0)), "answer": "4"},
        ),
    ]
    # the tiny vision-language model's tokenizer: the tiny model's ids and its four vision tokens besides
    async with scripted_engine(["The answer is 4.", "The answer is 5."], tokenizer="tiny-vl") as engine:
        worker = spawn_worker(
            redis_url,
            run_name,
            *("--engine", engine.url, "--allow", "areal", "--allow", package.name, "--tokenizer", "tiny"),
            *("--max-attempts", "1"),
            env={"PYTHONPATH": f"{site}:{tmp_path}"},
        )
        try:
            got = await submit_all(redis, run_name, jobs)
        except TimeoutError:
            raise AssertionError(f"no results; the worker's log:\n{worker.output()[-4000:]}") from None
    check_rlvr(got["rlvr"], "The answer is 4.", 0.0)  # the script's first reply is wrong
    check_multi_turn(got["multi"])
    # AReaL 1.0.4's own ArealOpenAI runs against rollq's engine (its ModelResponse reads output_tokens_without_stop,
    # tokenizer) up to AReaL's own bug: its export_interactions() requires a style that multi_turn_v2 never passes.
    [v2] = got["v2"]
    assert v2.status == "error" and "export_interactions() missing 1 required positional argument: 'style'" in (
        v2.error.message
    ), v2.error
    [eval_run], [train_run] = got["eval"], got["train"]
    assert eval_run.status == "ok" and train_run.status == "ok", (eval_run.error, train_run.error)
    assert (eval_run.sequences[0].reward, train_run.sequences[0].reward) == (1.0, 0.0)
    # vision_rlvr.py as the wheel ships it (AReaL's own ModelRequest, image2base64 and processor call): its image
    # reached the engine and the trajectory carries its pixel values
    [vision] = got["vision"]
    assert vision.status == "ok" and vision.sequences[0].reward == 1.0, vision.error
    pixels = Codec().decode(vision.sequences[0].vision.inline, VisionInputs)
    assert list(pixels.image_grid_thw) == [1, 4, 4] and sum(pixels.mm_token_type_ids) == 4
