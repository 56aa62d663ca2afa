"""AReaL's request and response shapes in the engine layer: a request of AReaL's shape (its dataclass fields, none
of rollq's routing fields) is accepted, and responses answer AReaL's properties. The real areal objects go through
a real worker in tests/workers/areal_real/."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from rollq.engine.types import GenerationHyperparameters, ModelRequest, ModelResponse, as_model_request
from tests.scripted import tiny_tokenizer


@dataclasses.dataclass
class OtherGconfig:  # another library's settings class of the same field names
    max_new_tokens: int = 16
    greedy: bool = True
    n_samples: int = 1
    unknown_here: str = "ignored"


@dataclasses.dataclass
class RequestOfAReaLShape:
    rid: str = "r1"
    input_ids: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3])
    gconfig: Any = dataclasses.field(default_factory=OtherGconfig)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None
    image_data: list[str] | None = dataclasses.field(default_factory=list)
    processor: Any = None
    vision_msg_vllm: list | None = None


def test_a_request_of_areals_shape_becomes_rollqs():
    req = as_model_request(RequestOfAReaLShape(metadata={"k": 1}))
    assert isinstance(req, ModelRequest)
    assert (req.rid, req.input_ids, req.affinity, req.priority, req.metadata) == ("r1", [1, 2, 3], "", None, {"k": 1})
    assert req.gconfig == GenerationHyperparameters(max_new_tokens=16, greedy=True)
    assert (req.sampling.max_new_tokens, req.sampling.temperature) == (16, 0.0)
    ours = ModelRequest(input_ids=[1])
    assert as_model_request(ours) is ours


def test_images_and_the_processor_are_carried():
    processor = object()
    req = as_model_request(RequestOfAReaLShape(image_data=["data:image/png;base64,AAAA"], processor=processor))
    assert req.image_data == ["data:image/png;base64,AAAA"] and req.processor is processor
    assert as_model_request(RequestOfAReaLShape()).image_data is None  # AReaL's default: an empty list
    with pytest.raises(TypeError, match="image_data must be a list of strings"):
        as_model_request(RequestOfAReaLShape(image_data=[b"\x89PNG"]))
    with pytest.raises(TypeError, match="needs input_ids"):
        as_model_request(object())


def test_copy_is_independent():
    req = ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=4), metadata={"a": 1})
    dup = req.copy()
    dup.input_ids.append(3)
    dup.metadata["b"] = 2
    assert req.input_ids == [1, 2] and req.metadata == {"a": 1} and dup.gconfig == req.gconfig


def test_responses_answer_areals_properties():
    tok = tiny_tokenizer()
    eos = tok.eos_token_id

    def resp(output: list[int], reason: str = "stop") -> ModelResponse:
        return ModelResponse(
            input_tokens=[1],
            output_tokens=output,
            output_logprobs=[0.0] * len(output),
            output_versions=[0] * len(output),
            stop_reason=reason,  # type: ignore[arg-type]
            tokenizer=tok,
        )

    assert resp([5, 6, eos]).end_with_stop and resp([5, 6, eos]).output_tokens_without_stop == [5, 6]
    assert resp([5, 6], "length").output_tokens_without_stop == [5, 6]
    with pytest.raises(ValueError, match="not eos or pad"):
        _ = resp([5, 6]).output_tokens_without_stop
    with pytest.raises(ValueError, match="tokenizer is None"):
        _ = ModelResponse(
            input_tokens=[], output_tokens=[1], output_logprobs=[0.0], output_versions=[0], stop_reason="stop"
        ).end_with_stop
    fresh = resp([5])
    assert math.isinf(fresh.ttft) and fresh.itl == [] and fresh.routed_experts is None and fresh.input_images == []


def test_generation_settings_as_openai_arguments():
    g = GenerationHyperparameters(max_new_tokens=64, temperature=0.5, top_k=5, stop=["\n"])
    completions = g.to_openai_completions_args_dict()
    assert completions["max_completion_tokens"] == 64 and completions["n"] == 1 and completions["temperature"] == 0.5
    assert "top_k" not in completions and "max_tokens" not in completions and completions["stop"] == ["\n"]
    assert g.to_openai_responses_args_dict()["max_output_tokens"] == 64
    assert g.to_openai_agents_model_settings_dict(exclude_args=["n_samples"])["max_tokens"] == 64
    assert "n" not in g.to_openai_agents_model_settings_dict(exclude_args=["n_samples"])
    with pytest.raises(ValueError, match="Unsupported API format"):
        g.to_openai_args_dict(api_format="chat")
