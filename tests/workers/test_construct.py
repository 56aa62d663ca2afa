"""A job's JSON kwargs -> a workflow's constructor arguments, by its type hints (rollq.workers.construct)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from rollq.engine.types import GenerationHyperparameters
from rollq.workers.construct import KwargConverter, ModelNames
from rollq.workers.resolver import Allowlist, ImportNotAllowed, WorkflowLoadError, enforcing
from tests import reward_fns


class AReaLShaped:
    """The constructor of AReaL's RLVRWorkflow, as its file writes it."""

    def __init__(
        self,
        reward_fn: Callable[..., Any] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: PreTrainedTokenizerFast | str,
        enable_thinking: bool = False,
        note: str = "",
    ) -> None:
        self.reward_fn, self.gconfig, self.tokenizer, self.note = reward_fn, gconfig, tokenizer, note


class Untyped:
    def __init__(self, tokenizer, processor=None, other="x", reward_fn=None) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer, self.other, self.reward_fn = tokenizer, other, reward_fn


def test_json_kwargs_become_the_objects_the_hints_ask_for(tiny_dir):
    kwargs = {"reward_fn": "tests.reward_fns:exact_match", "gconfig": {"max_new_tokens": 8}, "tokenizer": "tiny"}
    with enforcing(Allowlist(patterns=("tests",))):
        out = KwargConverter().convert(AReaLShaped, {**kwargs, "note": "tests.reward_fns:exact_match"})
    assert out["reward_fn"] is reward_fns.exact_match
    assert out["gconfig"] == GenerationHyperparameters(max_new_tokens=8)
    assert out["tokenizer"].eos_token_id is not None and out["tokenizer"].pad_token_id is not None
    assert out["note"] == "tests.reward_fns:exact_match"  # a str parameter keeps its string
    again = KwargConverter().convert(Untyped, {"tokenizer": "tiny", "other": "tiny", "reward_fn": kwargs["reward_fn"]})
    assert hasattr(again["tokenizer"], "apply_chat_template") and again["other"] == "tiny"
    assert again["reward_fn"] is reward_fns.exact_match  # unannotated, by AReaL's `_fn` naming


def test_a_callable_path_goes_through_the_allowlist():
    with enforcing(Allowlist(patterns=("tests",))), pytest.raises(ImportNotAllowed):
        KwargConverter().convert(AReaLShaped, {"reward_fn": "os:system"})


def test_a_mapping_the_class_refuses_names_the_parameter():
    with pytest.raises(WorkflowLoadError, match="'gconfig'.*max_new_tokenz"):
        KwargConverter().convert(AReaLShaped, {"gconfig": {"max_new_tokenz": 8}})


def test_tokenizers_are_model_names_never_paths_a_job_picks(tmp_path, tiny_dir):
    converter = KwargConverter(ModelNames(worker_tokenizer="tiny"))
    for bad in (str(tmp_path), "/etc", "../x"):
        with pytest.raises(WorkflowLoadError, match="models_root"):
            converter.convert(AReaLShaped, {"tokenizer": bad})
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    rooted = KwargConverter(ModelNames(models_root=str(models)))
    for bad in ("../outside", str(tmp_path / "outside"), ".", "missing"):
        with pytest.raises(WorkflowLoadError, match="models_root|no such model folder"):
            rooted.convert(AReaLShaped, {"tokenizer": bad})
    assert rooted.model_path("mine", "tokenizer") == (models / "mine").resolve()
    # the worker's own tokenizer (an operator's choice) is always allowed
    assert KwargConverter(ModelNames(worker_tokenizer=str(tiny_dir))).model_path(str(tiny_dir), "t") == tiny_dir


def test_rollq_workflows_keep_their_paths_as_strings():
    """rollq's built-ins resolve reward paths themselves, allowlisted; a remote reward may exist only on the reward
    workers, so it must arrive as the path."""
    from rollq.workers.builtin.rlvr import RLVRWorkflow

    out = KwargConverter().convert(RLVRWorkflow, {"reward_fn": "only_on_reward_workers:score"})
    assert out == {"reward_fn": "only_on_reward_workers:score"}
