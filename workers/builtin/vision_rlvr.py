"""VisionRLVRWorkflow: one picture-and-text prompt, one generation, one verifiable reward (rollq's own form of
AReaL's VisionRLVRWorkflow, which runs unchanged too: tests/workers/areal_real/test_vision.py).

The data: `messages` (a chat whose content parts include `{"type": "image"}` where each picture goes, or a prompt
already templated), `images` (PIL images, as the worker hands a job's images over) and whatever the reward reads.
The model's processor renders the chat and sizes each image's tokens; the request carries the images to the engine
(SGLang's image_data); the trajectory carries the processor's pixel values, so the trainer sees what the engine
saw."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rollq.engine.types import InferenceEngine
from rollq.protocol.media import pil_to_image_file
from rollq.workers.builtin.episode import GenerationConfig, TokenSequence
from rollq.workers.chat_template import LazyTokenizer, stop_token_ids
from rollq.workers.rewards.call import RewardedWorkflow


def _load_processor(name: str) -> Any:
    from rollq.engine.tiny_vlm import load_processor
    from rollq.workers.model_names import job_model_dir

    return load_processor(job_model_dir(name, "processor"))


class VisionRLVRWorkflow(RewardedWorkflow):
    def __init__(
        self,
        reward_fn: str | Callable[..., Any],
        processor: str = "tiny-vl",
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        **reward_options: Any,
    ) -> None:
        super().__init__(reward_fn, **reward_options)  # reward_mode, reward_timeout, ...: see RewardedWorkflow
        self.processor = LazyTokenizer(processor, _load_processor, "processor")  # the model's processor, loaded once
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        processor = await self.processor.get()
        images = list(data.get("images") or [])
        messages = data["messages"]
        text = (
            messages
            if isinstance(messages, str)
            else processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
        inputs = await asyncio.to_thread(processor, images=images or None, text=text, return_tensors="pt")
        prompt = inputs["input_ids"][0].tolist()
        request = self.generation.request(prompt, data, stop_token_ids=stop_token_ids(processor.tokenizer))
        request.image_data = [pil_to_image_file(image).base64() for image in images] or None
        resp = await engine.agenerate(request)
        seq = TokenSequence()
        seq.add_context(prompt)
        seq.add_generated(resp)
        facts = {k: v for k, v in data.items() if k != "images"}  # a reward in another process gets no pictures
        reward = await self.score(
            processor.tokenizer.decode(prompt),
            processor.tokenizer.decode(resp.output_tokens, skip_special_tokens=True),
            prompt,
            list(resp.output_tokens),
            facts,
        )
        out = seq.trajectory(reward)
        if images:
            out["multi_modal_input"] = [
                {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
            ]
            out["mm_token_type_ids"] = inputs["mm_token_type_ids"][0].tolist() + [0] * len(resp.output_tokens)
        return out


__all__ = ["VisionRLVRWorkflow"]
