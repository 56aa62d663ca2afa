"""`rollq up --workflow mod:Cls` allows the workers exactly that workflow: an allowlist pattern is over dotted names,
so the colon spelling, appended as it was written, matched nothing and every sample was dead-lettered."""

from __future__ import annotations

import msgspec
import pytest

from rollq.trainer.config import TrainConfig
from rollq.up import UpConfig, worker_allowlist
from rollq.workers.resolver import Allowlist, ImportNotAllowed, resolve
from tests.reward_fns import exact_match
from tests.workflows import Echo


@pytest.mark.parametrize("workflow", ["tests.workflows:Echo", "tests.workflows.Echo"])
def test_the_trainers_workflow_is_what_the_workers_may_import(workflow):
    allowlist = Allowlist(patterns=tuple(worker_allowlist(TrainConfig(workflow=workflow), UpConfig())))
    assert resolve(workflow, allowlist=allowlist) is Echo
    with pytest.raises(ImportNotAllowed):  # that workflow, not its whole module
        resolve("tests.workflows:Boom", allowlist=allowlist)


def test_a_built_in_loops_short_name_adds_no_pattern():
    assert worker_allowlist(TrainConfig(workflow="rlvr"), UpConfig(allow=["mine"])) == ["mine"]


@pytest.mark.parametrize("setting", ["workflow_kwargs", "eval_workflow_kwargs"])
def test_the_reward_fn_of_the_trainers_own_kwargs_is_allowed_like_its_workflow(setting):
    cfg = TrainConfig(**{setting: {"reward_fn": "tests.reward_fns:exact_match"}})
    allowlist = Allowlist(patterns=tuple(worker_allowlist(cfg, UpConfig(allow=["mine"]))))
    assert resolve("tests.reward_fns:exact_match", allowlist=allowlist) is exact_match
    with pytest.raises(ImportNotAllowed):  # that function, not its whole module
        resolve("tests.reward_fns:raises", allowlist=allowlist)


def test_a_built_in_reward_adds_no_pattern():
    cfg = TrainConfig(workflow_kwargs={"reward_fn": "rollq.tasks.addition:addition_reward"})
    assert worker_allowlist(cfg, UpConfig(allow=["mine"])) == ["mine"]


@pytest.mark.parametrize(
    "settings",
    [
        {"workflow": "my_agent:*"},
        {"workflow_kwargs": {"reward_fn": "*.*"}},
        {"eval_workflow_kwargs": {"reward_fn": "os:*"}},
    ],
)
def test_a_pattern_given_as_the_workflow_or_reward_is_refused_not_allowed(settings):
    """`rollq up` allows the one object the trainer names: a wildcard there would open a module (or everything)."""
    cfg = msgspec.convert({"run": "r", **settings}, TrainConfig)
    with pytest.raises(ValueError, match="is not an import path"):
        worker_allowlist(cfg, UpConfig())


def test_an_environment_the_trainer_names_is_allowed_as_written():
    cfg = TrainConfig(workflow="verifiers:my-env")
    allow = worker_allowlist(cfg, UpConfig(allow=["mine"]))
    assert allow == ["mine", "verifiers:my-env"]
    Allowlist(patterns=tuple(allow)).check_environment("verifiers", "my-env")
    with pytest.raises(ImportNotAllowed):  # that environment, no other
        Allowlist(patterns=tuple(allow)).check_environment("verifiers", "my-env2")
    with pytest.raises(ValueError, match="is not a verifiers environment id"):
        worker_allowlist(TrainConfig(workflow="verifiers:*"), UpConfig())


def test_the_variables_the_trainers_own_kwargs_pass_are_allowed_by_name():
    kwargs = {"env": {"HF_HUB_OFFLINE": "1", "BAD NAME": "x", "A*": "y"}, "sampling": {"max_tokens": 8}}
    allow = worker_allowlist(TrainConfig(workflow="verifiers:my-env", workflow_kwargs=kwargs), UpConfig())
    assert allow == ["verifiers:my-env", "env:HF_HUB_OFFLINE"]  # a name, never a pattern a job could widen
    Allowlist(patterns=tuple(allow)).check_env("HF_HUB_OFFLINE")
    with pytest.raises(ImportNotAllowed):
        Allowlist(patterns=tuple(allow)).check_env("HF_TOKEN")
