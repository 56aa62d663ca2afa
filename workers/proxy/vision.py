"""Images in the recording proxy's prompts: the model's processor turns each image placeholder the chat template
rendered into the image's tokens, and gives the pixel values a trajectory carries.

The processor is loaded the way the proxy's tokenizer was, from the same model directory
(rollq.engine.tiny_vlm.load_processor: AutoProcessor, or an image-only Qwen2-VL processor where torchvision is
missing), and only when a request first has images, so text agents never pay for it. A model without one (a text
model) answers every request with images with a 400: generating without the images would train on a prompt the
agent never sent.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec

from rollq.engine.images import DEFAULT_MAX_PIXELS, MediaError, open_image
from rollq.workers.proxy.chat import BadRequest


class PromptVision(msgspec.Struct, kw_only=True, frozen=True):
    """The images of one prompt, as the engine gets them and as its trajectory carries them.

    The processor's arrays are kept in the chunks it made them in (a continued prompt adds its new turns' chunk to its
    parent's), so the records of a conversation share them rather than each holding a copy of every earlier image."""

    images: list[str]  # data URIs in order, one per image in the prompt: the engine request's image_data
    pixel_chunks: tuple[Any, ...]  # the processor's pixel_values (numpy) of each call, in image order
    grid_chunks: tuple[Any, ...]  # its image_grid_thw of each call: one (t, h, w) row per image
    mm_token_type_ids: list[int]  # the processor's token types over the whole prompt (0: text, 1: image)

    @property
    def pixel_values(self) -> Any:
        return _joined(self.pixel_chunks)

    @property
    def image_grid_thw(self) -> Any:
        return _joined(self.grid_chunks)

    def trajectory_fields(self, length: int) -> dict[str, Any]:
        """The trajectory keys (AReaL's `multi_modal_input` and `mm_token_type_ids`, which the worker's outputs turn
        into the sequence's VisionInputs) of a `length`-token sequence that starts with this prompt: what follows the
        prompt is the model's text."""
        return {
            "multi_modal_input": [{"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}],
            "mm_token_type_ids": self.mm_token_type_ids + [0] * (length - len(self.mm_token_type_ids)),
        }


def _joined(chunks: tuple[Any, ...]) -> Any:
    if len(chunks) == 1:
        return chunks[0]
    import numpy as np

    return np.concatenate(chunks)


def continued(
    parent: PromptVision | None, parent_tokens: int, new: PromptVision | None, new_tokens: int
) -> PromptVision | None:
    """The vision of a prompt that is a recorded completion's `parent_tokens` tokens (its prompt with `parent`'s
    images, then its output) followed by `new_tokens` tokens of new turns holding `new`'s images: all the images of
    the conversation so far, in order."""
    if parent is None and new is None:
        return None
    head = parent.mm_token_type_ids if parent is not None else []
    types = head + [0] * (parent_tokens - len(head)) + (new.mm_token_type_ids if new is not None else [0] * new_tokens)
    parts = [v for v in (parent, new) if v is not None]
    return PromptVision(
        images=[uri for v in parts for uri in v.images],
        pixel_chunks=tuple(c for v in parts for c in v.pixel_chunks),
        grid_chunks=tuple(c for v in parts for c in v.grid_chunks),
        mm_token_type_ids=types,
    )


class ImageProcessor:
    """The model's processor for the proxy's prompts with images: loaded on first use, off the event loop."""

    def __init__(self, tokenizer: Any, max_pixels: int = DEFAULT_MAX_PIXELS, processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.max_pixels = max_pixels
        self._processor = processor
        self._refusal: str | None = None  # why the model takes no images, once a load failed (not retried)
        # Loads once, and serialises calls: a processor's tokenizer is not safe to call from threads at once.
        self._lock = threading.Lock()

    async def ready(self) -> None:
        """Load the processor (once); BadRequest when the model takes no images. Before rendering: a text model's
        chat template fails on content with image parts."""
        await asyncio.to_thread(self._locked_load)

    def _locked_load(self) -> None:
        with self._lock:
            self._load()

    async def expand(self, text: str, images: list[str]) -> tuple[list[int], PromptVision]:
        """`text` (rendered with one image placeholder per image) as token ids with each placeholder expanded into
        its image's tokens, and the images' vision. Raises BadRequest."""
        return await asyncio.to_thread(self._expand, text, images)

    def _expand(self, text: str, images: list[str]) -> tuple[list[int], PromptVision]:
        with self._lock:
            processor = self._load()
        try:
            pil = [open_image(uri, self.max_pixels) for uri in images]
        except MediaError as exc:
            raise BadRequest(f"an image part: {exc}", "messages") from None
        with self._lock:
            try:
                # The chat template wrote every special token (as the proxy's own encoding: no BOS of the
                # tokenizer's); numpy rather than torch: nothing here needs tensors.
                out = processor(images=pil, text=[text], return_tensors="np", add_special_tokens=False)
            except ValueError as exc:  # e.g. the text holds image placeholders of its own: counts differ
                raise BadRequest(f"the model's processor refused the prompt: {exc}", "messages") from None
        ids = [int(t) for t in out["input_ids"][0]]
        if "mm_token_type_ids" in out:
            types = [int(t) for t in out["mm_token_type_ids"][0]]
        else:  # a processor that does not return token types: its image tokens are the image's positions
            types = [int(t == processor.image_token_id) for t in ids]
        vision = PromptVision(
            images=list(images),
            pixel_chunks=(out["pixel_values"],),
            grid_chunks=(out["image_grid_thw"],),
            mm_token_type_ids=types,
        )
        return ids, vision

    def _load(self) -> Any:
        if self._processor is None and self._refusal is None:
            from rollq.engine.tiny_vlm import load_processor

            path = getattr(self.tokenizer, "name_or_path", "") or "the model"
            try:
                processor = load_processor(path)
            except Exception as exc:  # no preprocessor_config.json and the like: a text model
                self._refusal = f"{path} has no image processor ({type(exc).__name__})"
            else:
                if getattr(processor, "image_processor", None) is None:
                    self._refusal = f"{path}'s processor ({type(processor).__name__}) has no image processor"
                else:
                    self._processor = processor
        if self._refusal is not None:
            raise BadRequest(f"this model takes no images: {self._refusal}; send text only", "messages")
        return self._processor


__all__ = ["ImageProcessor", "PromptVision", "continued"]
