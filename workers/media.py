"""Images in a job's data, made ready for its workflow (protocol/media.py carries them).

- `data["images"]` (AReaL's dataset rows: what VisionRLVRWorkflow hands its processor): each ImageFile or
  `data:image/...;base64,` URI in it becomes a PIL image (other items are left as they are).
- Any other ImageFile in the data becomes a data URI string: the form OpenAI SDKs and SGLang take, so an agent can
  put it in an `image_url` part as it is.

Opening is bounded (rollq.engine.images.open_image)."""

from __future__ import annotations

from typing import Any

from rollq.engine.images import DEFAULT_MAX_PIXELS, MediaError, open_image
from rollq.protocol.media import DATA_URI_PREFIX, ImageFile


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
