"""Opening an image file for a model, bounded: only the formats rollq carries (protocol.media.MEDIA_TYPES), and at
most `max_pixels` pixels, checked from the header before any pixel is decoded (a small file can declare a huge
canvas). Shared by the workers (a job's images) and the engines (a request's image_data); and a vision model's own
placeholder tokens, which neither the engine nor the trainer lets it sample."""

from __future__ import annotations

import io
from typing import Any

from rollq.protocol.media import ImageError, ImageFile, image_from_string

PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_PIXELS = 4096 * 4096


class MediaError(Exception):
    """An image in a job's data that can't be used (not an image, an unsupported format, over the pixel limit)."""


def open_image(image: ImageFile | str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """A PIL image (RGB) from an ImageFile or an image string, within `max_pixels`. Raises MediaError."""
    return decode_image(open_header(image, max_pixels))


def open_header(image: ImageFile | str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """A PIL image opened from its header only (no pixel decoded yet: `.size` is known), within `max_pixels`; its
    pixels come with decode_image. Raises MediaError."""
    from PIL import Image, UnidentifiedImageError

    try:
        raw = image if isinstance(image, ImageFile) else image_from_string(image)
    except ImageError as exc:
        raise MediaError(str(exc)) from None
    try:
        opened = Image.open(io.BytesIO(raw), formats=PIL_FORMATS)
    except Image.DecompressionBombError as exc:  # PIL's own bound (far above ours), raised while opening
        raise MediaError(f"an image is over the worker's max_image_pixels={max_pixels}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise MediaError(f"an image ({raw.media_type}, {len(raw)} bytes) does not decode: {exc}") from None
    width, height = opened.size
    if width * height > max_pixels:
        raise MediaError(f"an image of {width}x{height} pixels is over the worker's max_image_pixels={max_pixels}")
    return opened


def decode_image(opened: Any) -> Any:
    """The pixels of an image open_header opened, as RGB. Raises MediaError (a truncated or damaged file)."""
    from PIL import Image

    try:
        return opened.convert("RGB")  # decodes the pixels (and fails on a truncated file)
    except Image.DecompressionBombError as exc:
        raise MediaError(f"an image is over PIL's pixel bound: {exc}") from None
    except (OSError, ValueError) as exc:
        raise MediaError(
            f"an image ({opened.format}, {opened.size[0]}x{opened.size[1]}) does not decode: {exc}"
        ) from None


def vision_token_ids(config: Any) -> list[int]:
    """A vision-language model's own placeholder tokens (vision start and end, image and video pads). Neither the
    reference engine's sampling nor the trainer's logprobs include them: a generated image pad would read as a
    picture's slot in the next forward (transformers finds the slots by id), which no picture fills."""
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return sorted({int(v) for n in names if (v := getattr(config, n, None)) is not None})


__all__ = [
    "DEFAULT_MAX_PIXELS",
    "PIL_FORMATS",
    "MediaError",
    "decode_image",
    "open_header",
    "open_image",
    "vision_token_ids",
]
