"""A request's images made into a vision-language model's inputs (the reference backend's Qwen2-VL family): pixel
values and patch grids from the model's own image processor, and the prompt's image placeholders sized to them.

As SGLang does for Qwen2-VL (docs/sglang-protocol.md, Images), a prompt marks each image with a run of the image
token between <|vision_start|> and <|vision_end|>: one token (the chat template's form; expanded here to the image's
size) or already as many as the image takes (the HF processor's form, what AReaL's VisionRLVRWorkflow sends). The
images fill the runs in order; a count that does not match is the request's error."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollq.engine.images import MediaError, decode_image, open_header
from rollq.protocol.media import ImageFile

if TYPE_CHECKING:  # the server imports this module for its error; only the reference backend needs torch
    import torch


class ImageRequestError(ValueError):
    """The images and the prompt's placeholders don't fit together (the request's 400)."""


class PreparedImages:
    """What the model's forward takes beside the ids: `pixel_values` [patches, dim], `image_grid_thw` [images, 3],
    and `types` per prompt token (1: an image token)."""

    __slots__ = ("pixel_values", "image_grid_thw", "types")

    def __init__(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, types: list[int]) -> None:
        self.pixel_values = pixel_values
        self.image_grid_thw = image_grid_thw
        self.types = types

    def token_types(self, length: int) -> list[int]:
        """Types for the prompt and `length - len(prompt)` generated tokens (text)."""
        return self.types + [0] * (length - len(self.types))


class ImageInputs:
    """Prepares requests' images for one model: its processor (rollq.engine.tiny_vlm.load_processor) and config."""

    def __init__(self, processor: Any, image_token_id: int, max_pixels: int) -> None:
        self.image_processor = processor.image_processor
        self.merge = int(getattr(self.image_processor, "merge_size", 1) or 1)
        self.image_token_id = image_token_id
        self.max_pixels = max_pixels

    def prepare(self, input_ids: list[int], images: list[ImageFile]) -> tuple[list[int], PreparedImages]:
        """(the prompt with each image's placeholder sized to it, the images as model inputs)."""
        runs = self._runs(input_ids)
        if len(runs) != len(images):  # before any image is decoded: a mismatch costs the request nothing
            raise ImageRequestError(
                f"image_data has {len(images)} image(s) but the prompt has {len(runs)} image placeholder(s) "
                f"(runs of token {self.image_token_id})"
            )
        try:
            headers = [open_header(image, self.max_pixels) for image in images]  # every size known first
            opened = [decode_image(header) for header in headers]
        except MediaError as exc:
            raise ImageRequestError(f"image_data: {exc}") from None
        out = self.image_processor(images=opened, return_tensors="pt")
        grid = out["image_grid_thw"]
        sizes = [int(n) for n in (grid.prod(-1) // (self.merge**2)).tolist()]
        ids = self._sized(input_ids, runs, sizes)
        types = [int(t == self.image_token_id) for t in ids]
        return ids, PreparedImages(out["pixel_values"], grid, types)

    def check_no_placeholders(self, ids: list[int]) -> None:
        """A prompt without images must hold no image token (the model would look for a picture there)."""
        if self.image_token_id in ids:
            raise ImageRequestError(
                f"the prompt has image placeholders (token {self.image_token_id}) but the request has no image_data"
            )

    def _runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of image tokens in `ids`."""
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] == self.image_token_id:
                j = i
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        return runs

    def _sized(self, ids: list[int], runs: list[tuple[int, int]], sizes: list[int]) -> list[int]:
        out: list[int] = []
        last = 0
        for (start, length), size in zip(runs, sizes, strict=True):
            if length not in (1, size):
                raise ImageRequestError(
                    f"an image placeholder of {length} tokens at position {start}: its image takes {size} "
                    "(give one token, or exactly as many)"
                )
            out += ids[last:start] + [self.image_token_id] * size
            last = start + length
        return out + ids[last:]


__all__ = ["ImageInputs", "ImageRequestError", "PreparedImages"]
