"""Images in a job's data, made ready for its workflow (protocol/media.py carries them).

- `data["images"]` (AReaL's dataset rows: what VisionRLVRWorkflow hands its processor): each ImageFile or
  `data:image/...;base64,` URI in it becomes a PIL image (other items are left as they are).
- Any other ImageFile in the data becomes a data URI string: the form OpenAI SDKs and SGLang take, so an agent can
  put it in an `image_url` part as it is.

Opening is bounded: only MEDIA_TYPES' formats, and at most `max_pixels` pixels per image, checked from the header
before any pixel is decoded (a small file can declare a huge canvas)."""

from __future__ import annotations

import io
from typing import Any

from rollq.protocol.media import DATA_URI_PREFIX, ImageError, ImageFile, image_from_string

PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_PIXELS = 4096 * 4096


class MediaError(Exception):
    """An image in a job's data that can't be used (not an image, an unsupported format, over the pixel limit)."""


def open_image(image: ImageFile | str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """A PIL image (RGB) from an ImageFile or an image string, within `max_pixels`. Raises MediaError."""
    from PIL import Image, UnidentifiedImageError

    try:
        raw = image if isinstance(image, ImageFile) else image_from_string(image)
    except ImageError as exc:
        raise MediaError(str(exc)) from None
    try:
        opened = Image.open(io.BytesIO(raw), formats=PIL_FORMATS)
        width, height = opened.size
        if width * height > max_pixels:
            raise MediaError(f"an image of {width}x{height} pixels is over the worker's max_image_pixels={max_pixels}")
        return opened.convert("RGB")  # decodes the pixels (and fails on a truncated file)
    except Image.DecompressionBombError as exc:  # PIL's own bound (far above ours), raised while opening
        raise MediaError(f"an image is over the worker's max_image_pixels={max_pixels}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise MediaError(f"an image ({raw.media_type}, {len(raw)} bytes) does not decode: {exc}") from None


def prepare_images(data: Any, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """`data` with its images made ready for a workflow (module doc). Data without images comes back as it is."""
    if isinstance(data, dict) and isinstance(data.get("images"), list):
        data = {**data, "images": [open_image(x, max_pixels) if _is_image(x) else x for x in data["images"]]}
        return {k: (v if k == "images" else _as_uris(v)) for k, v in data.items()}
    return _as_uris(data)


def _is_image(value: Any) -> bool:
    return isinstance(value, ImageFile) or (isinstance(value, str) and value.startswith(DATA_URI_PREFIX))


def _as_uris(value: Any) -> Any:
    if isinstance(value, ImageFile):
        return value.data_uri()
    if isinstance(value, dict):
        return {k: _as_uris(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_uris(v) for v in value]
    return value


__all__ = ["DEFAULT_MAX_PIXELS", "MediaError", "open_image", "prepare_images"]
