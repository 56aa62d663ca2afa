"""Training a vision-language model (the tiny Qwen2-VL): the trainer recomputes the engine's logprobs of a sample
with its images (same pixels, same multimodal rope) and a step moves the language model, not the frozen vision
tower. A sequence with images never trains as text alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image

from rollq.engine.models import model_dir
from rollq.engine.server.backend import GenState
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.engine.tiny_vlm import load_processor
from rollq.engine.types import SamplingParams
from rollq.protocol import Codec
from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
from rollq.protocol.blobs import digest_of
from rollq.protocol.media import pil_to_image_file
from rollq.protocol.messages import Sequence, Trajectory, VisionInputs, VisionRef
from rollq.trainer.batch import Group, build_batch
from rollq.trainer.config import TrainConfig
from rollq.trainer.policy import Policy

pytestmark = pytest.mark.slow


def question(processor, colour) -> tuple[str, Image.Image]:
    content = [{"type": "image"}, {"type": "text", "text": "Which colour?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return text, Image.new("RGB", (56, 56), colour)


async def engine_sample(colour, new: int = 6) -> tuple[list[int], list[int], list[float], VisionInputs]:
    """A sample of the reference engine (sampled at temperature 1): prompt ids, output ids, their logprobs, and the
    VisionInputs a workflow would return for it (the processor's)."""
    processor = load_processor(model_dir("tiny-vl"))
    text, image = question(processor, colour)
    inputs = processor(images=[image], text=text, return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    backend = ReferenceBackend(ReferenceConfig(model="tiny-vl", max_running=2, seed=int(sum(colour))))
    await backend.start()
    try:
        state = GenState("s", prompt, SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True), True)
        file = pil_to_image_file(image)
        state.input_ids, state.vision = await asyncio.to_thread(backend.prepare_images, prompt, [file])
        state.images = [file]
        await backend.run(state)
    finally:
        await backend.close()
    vision = VisionInputs(
        pixel_values=Float32Array.coerce(inputs["pixel_values"].reshape(-1).numpy(), "pixel_values"),
        pixel_shape=list(inputs["pixel_values"].shape),
        image_grid_thw=Int32Array.coerce(inputs["image_grid_thw"].reshape(-1).int().numpy(), "image_grid_thw"),
        mm_token_type_ids=UInt8Array(inputs["mm_token_type_ids"][0].tolist() + [0] * len(state.output_ids)),
    )
    return prompt, state.output_ids, state.output_logprobs, vision


def sequence(prompt, output, logprobs, vision: VisionInputs, reward: float) -> Sequence:
    payload = Codec().encode(vision)
    return Sequence(
        input_ids=prompt + output,
        loss_mask=[0] * len(prompt) + [1] * len(output),
        logprobs=[0.0] * len(prompt) + list(logprobs),
        versions=[-1] * len(prompt) + [0] * len(output),
        reward=reward,
        vision=VisionRef(digest=digest_of(payload), size=len(payload), inline=payload),
    )


def group(job_id: str, seqs: list[Sequence]) -> Group:
    samples = [
        Trajectory(job_id=job_id, sample_index=i, n=len(seqs), status="ok", sequences=[s]) for i, s in enumerate(seqs)
    ]
    codec = Codec()  # as the trainer gets them: off the wire
    return Group(job_id=job_id, samples=[codec.decode_trajectory(codec.encode(t)) for t in samples])


async def test_the_trainer_recomputes_the_engines_logprobs_with_the_images():
    red = await engine_sample((200, 0, 0))
    blue = await engine_sample((0, 0, 200), new=9)  # another length: the batch pads the shorter row
    policy = Policy(TrainConfig(model="tiny-vl", lr=1e-2))
    assert policy.takes_images
    batch = build_batch([group("g", [sequence(*red, 1.0), sequence(*blue, 0.0)])], policy.pad_id)
    assert len(batch.vision) == 2
    rows = policy._rows(batch)
    with torch.no_grad():
        logprobs = policy._logprobs_of(rows, [0, 1], batch.input_ids.shape[1])
    for row, (prompt, output, engine_lps, _) in enumerate((red, blue)):
        start = len(prompt) - 1  # token t is predicted at position t - 1
        mine = logprobs[row, start : start + len(output)]
        assert torch.allclose(mine, torch.tensor(engine_lps), atol=1e-4), (row, mine, engine_lps)
    # without the images the same ids give other logprobs: the images are in the forward, not decoration
    with torch.no_grad():
        blind = policy.token_logprobs(batch.input_ids[:1], batch.attention_mask[:1])
    assert not torch.allclose(blind[0, len(red[0]) - 1 : len(red[0]) - 1 + len(red[1])], logprobs[0, : len(red[1])])

    visual = policy.model.model.visual.named_parameters
    tower = {n: p.detach().clone() for n, p in visual() if not n.startswith("merger.")}
    merger = {n: p.detach().clone() for n, p in visual() if n.startswith("merger.")}
    head = policy.model.lm_head.weight.detach().clone()
    stats = policy.train_step(batch)
    assert stats.grad_norm > 0 and abs(stats.importance_mean - 1) < 1e-3  # on-policy: the engine's own logprobs
    assert all(torch.equal(p, tower[n]) for n, p in visual() if n in tower)  # frozen
    assert any(not torch.equal(p, merger[n]) for n, p in visual() if n in merger)  # the projector trains
    assert not torch.equal(policy.model.lm_head.weight, head)


def test_a_sequence_with_images_is_invalid_for_a_text_model():
    payload = b"not read"
    seq = Sequence(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, versions=[-1, 0, 0])
    seq.vision = VisionRef(digest=digest_of(payload), size=len(payload), inline=payload)
    g = Group(job_id="g", samples=[Trajectory(job_id="g", sample_index=0, n=1, status="ok", sequences=[seq])])
    assert g.invalid(1000) == "it has images, and the trainer's model takes none"
    seq.vision = VisionRef(digest=digest_of(payload), size=len(payload))
    assert g.invalid(1000, takes_images=True) == "its images were not read from the blob store"


def test_image_tokens_the_images_do_not_fill_are_invalid():
    """A generated image pad would read as a picture's slot in the trainer's forward (transformers finds slots by
    id): such a sequence is dropped, not a failed step. The engines never sample one (both leave them out)."""
    seq = Sequence(input_ids=[1, 522, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, versions=[-1, 0, 0])
    g = Group(job_id="g", samples=[Trajectory(job_id="g", sample_index=0, n=1, status="ok", sequences=[seq])])
    assert g.invalid(1000, takes_images=True, image_token_id=522) == "1 image tokens where its images fill 0"
    assert g.invalid(1000, takes_images=True, image_token_id=523) is None
