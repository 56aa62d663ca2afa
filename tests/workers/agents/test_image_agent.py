"""An OpenAI-SDK agent that sends an image, end to end in a real worker: the job's image through Redis, the agent's
`image_url` part through the worker's recording proxy (on the tiny vision-language model) to a scripted engine
server, and back as a trajectory whose sequences hold the processor's image tokens and pixel values."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from rollq.engine.models import model_dir
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.tiny_vlm import load_processor
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol import Codec
from rollq.protocol.media import ImageFile
from rollq.protocol.messages import AgentOptions, VisionInputs
from tests.helpers import running_worker
from tests.scripted import scripted_engine

RED = Image.new("RGB", (56, 56), (220, 20, 20))


def png(image: Image.Image) -> ImageFile:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return ImageFile(buf.getvalue())


async def run_job(redis, redis_url, run, image, export: str = "individual"):
    async with scripted_engine(["It is red.", "Yes, it is red."], tokenizer="tiny-vl") as engine:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool:
            async with running_worker(redis_url, run, engine=pool, max_attempts=1, tokenizer="tiny-vl"):
                producer = Producer(redis, run)
                consumer = producer.consumer()
                await consumer.setup()
                job = JobRequest(
                    workflow="tests.agents:ImageAgent",
                    job_id="j",
                    data={"image": image},
                    agent=AgentOptions(export_style=export),
                )
                await producer.submit_many([job])
                [t] = [t async for t in producer.wait_for({"j": 1}, timeout_s=60, consumer=consumer)]
                return t


@pytest.mark.parametrize("export", ["individual", "concat"])
async def test_an_agents_image_is_in_its_trajectory(redis, redis_url, run_name, export):
    t = await run_job(redis, redis_url, run_name, png(RED), export)
    assert t.status == "ok", t.error
    processor = load_processor(model_dir("tiny-vl"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = processor(images=[RED], text=text, return_tensors="np")
    prompt = expected["input_ids"][0].tolist()
    assert prompt.count(processor.image_token_id) == 4  # the placeholder, expanded
    assert len(t.sequences) == (2 if export == "individual" else 1)  # a sequence per turn, or the one branch
    assert t.sequences[-1].reward == 1.0  # the agent's
    for seq in t.sequences:  # the second turn repeats the conversation: its sequence keeps the image
        assert list(seq.input_ids[: len(prompt)]) == prompt
        vision = Codec().decode(seq.vision.inline, VisionInputs)
        pixels = np.frombuffer(vision.pixel_values.to_bytes(), dtype=np.float32).reshape(vision.pixel_shape)
        assert np.array_equal(pixels, expected["pixel_values"]) and list(vision.image_grid_thw) == [1, 4, 4]
        types = list(vision.mm_token_type_ids)
        assert len(types) == len(seq.input_ids) and types[: len(prompt)] == expected["mm_token_type_ids"][0].tolist()
        assert sum(types) == 4


async def test_an_image_url_is_a_400_from_the_proxy(redis, redis_url, run_name):
    t = await run_job(redis, redis_url, run_name, "https://example.com/red.png")
    assert t.status == "error" and t.error.type == "BadRequestError", t.error
    assert "Error code: 400" in t.error.message and "the recording proxy fetches no URLs" in t.error.message
