"""AReaL's own VisionRLVRWorkflow (areal/workflow/vision_rlvr.py from the real areal 1.0.4 wheel), mode (b): the
user's copies of it and of rlvr.py (its base class) with only their `from areal...` lines changed. A job's PIL image
travels through Redis, the workflow's processor expands its image tokens, its request carries the image to a real
engine server (scripted, on the tiny vision-language model's tokenizer), and the trajectory carries the processor's
pixel values, inline or, when large, by reference in the run's blob store."""

from __future__ import annotations

import uuid

import pytest
import torch

from rollq.engine.models import model_dir
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.tiny_vlm import load_processor
from rollq.producer.producer import JobRequest
from rollq.protocol import Codec
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import VisionInputs
from tests.areal_real import VISION_KWARGS, colour_question, submit_all, user_package
from tests.helpers import running_worker
from tests.scripted import scripted_engine


@pytest.fixture
def vision_rlvr(tmp_path, monkeypatch) -> str:
    package = f"user_{uuid.uuid4().hex[:8]}"
    user_package(
        tmp_path,
        package,
        {"rlvr": "areal/workflow/rlvr.py", "vision_rlvr": "areal/workflow/vision_rlvr.py"},
        {"areal.workflow.rlvr": f"{package}.rlvr"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{package}.vision_rlvr:VisionRLVRWorkflow"


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "by-reference"])
async def test_vision_rlvr_with_only_its_imports_changed(redis, redis_url, run_name, vision_rlvr, inline):
    data = colour_question((220, 20, 20))
    limit = {} if inline else {"vision_inline_bytes": 0}
    async with scripted_engine(["It is red."], tokenizer="tiny-vl") as engine:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool:
            async with running_worker(
                redis_url, run_name, engine=pool, max_attempts=1, allow=["tests", vision_rlvr.split(".")[0]], **limit
            ):
                got = await submit_all(
                    redis,
                    run_name,
                    [JobRequest(workflow=vision_rlvr, data=data, workflow_kwargs=VISION_KWARGS, job_id="v")],
                )
    [t] = got["v"]
    assert t.status == "ok", t.error
    assert t.schema == 4  # a trainer that knows no images refuses it rather than train its text alone
    [seq] = t.sequences
    assert seq.reward == 1.0
    processor = load_processor(model_dir("tiny-vl"))
    expected = processor(images=data["images"], text=data["messages"], return_tensors="pt")
    prompt = expected["input_ids"][0].tolist()
    assert list(seq.input_ids[: len(prompt)]) == prompt and prompt.count(processor.image_token_id) == 4
    ref = seq.vision
    assert ref is not None and (ref.inline is not None) == inline
    payload = ref.inline if inline else await redis.get(RunKeys(run_name).blob(ref.digest))
    if not inline:
        assert 0 < await redis.ttl(RunKeys(run_name).blob(ref.digest))  # expires with the run's retention
    vision = Codec().decode(payload, VisionInputs)
    assert vision.pixel_shape == list(expected["pixel_values"].shape) and list(vision.image_grid_thw) == [1, 4, 4]
    pixels = torch.frombuffer(bytearray(vision.pixel_values.to_bytes()), dtype=torch.float32)
    assert torch.equal(pixels.view(*vision.pixel_shape), expected["pixel_values"])  # what the model saw, exactly
    types = list(vision.mm_token_type_ids)
    assert len(types) == len(seq.input_ids) and types[: len(prompt)] == expected["mm_token_type_ids"][0].tolist()
    assert sum(types) == 4 and not any(types[len(prompt) :])
