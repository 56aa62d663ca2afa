"""Images in a job's data, made ready for its workflow (protocol/media.py carries them).

- `data["images"]` (AReaL's dataset rows: what VisionRLVRWorkflow hands its processor): each ImageFile or
  `data:image/...;base64,` URI in it becomes a PIL image (other items are left as they are).
- Any other ImageFile in the data becomes a data URI string: the form OpenAI SDKs and SGLang take, so an agent can
  put it in an `image_url` part as it is.
- A command agent (`raw=True`) gets every image as a data URI string, `data["images"]` too: its data is written as
  JSON, and the agent sends the images on to the proxy as they came.

What a job's images may cost is checked first, from their headers (protocol/image_limits.py: count, bytes, pixels),
before any is decoded; each one's pixels are bounded too (rollq.engine.images.open_header). A job's images are
decoded once on a worker and shared by its samples running there (JobImages)."""

from __future__ import annotations

import asyncio
from typing import Any

from rollq.engine.images import DEFAULT_MAX_PIXELS, MediaError, decode_image, open_header, open_image
from rollq.protocol.image_limits import ImageLimits, check_images
from rollq.protocol.media import DATA_URI_PREFIX, ImageError, ImageFile


def prepare_images(
    data: Any, max_pixels: int = DEFAULT_MAX_PIXELS, limits: ImageLimits | None = None, *, raw: bool = False
) -> Any:
    """`data` with its images made ready for a workflow (module doc). Data without images comes back as it is."""
    found: list[ImageFile | str] = []
    converted = _walk(data, found)
    if not found:
        return converted
    check_job_images(found, limits or ImageLimits(), max_pixels)
    return with_images(data, None if raw else decode_images(data, max_pixels, limits))


def check_job_images(images: list[ImageFile | str], limits: ImageLimits, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Refuses (MediaError, naming the limit) a job whose images (`images_in` its data) pass `limits`, from their
    headers alone."""
    try:
        check_images(images, limits)
    except ImageError as exc:
        raise MediaError(str(exc)) from None


def decode_images(data: Any, max_pixels: int = DEFAULT_MAX_PIXELS, limits: ImageLimits | None = None) -> list[Any]:
    """The decoded (PIL, RGB) images of `data["images"]`, in order (None for an item that is no image). Every header
    is read, and the pixels they declare checked together against `limits`, before any is decoded."""
    items = data.get("images") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return []
    opened = [open_header(x, max_pixels) if _is_image(x) else None for x in items]
    pixels = sum(x.size[0] * x.size[1] for x in opened if x is not None)
    if limits is not None and pixels > limits.max_pixels:  # as Pillow reads the headers (check_job_images: ours)
        raise MediaError(f"the job's images have {pixels:,} pixels, over {limits.names[2]}={limits.max_pixels:,}")
    return [None if x is None else decode_image(x) for x in opened]


def with_images(data: Any, decoded: list[Any] | None) -> Any:
    """`data` with `data["images"]` replaced by `decoded` where an item was an image (None: every image as a data
    URI string, for a command agent) and every other ImageFile as a data URI. A new container at each level, so a
    sample changing its data changes no other sample's (the PIL images are shared: read them, don't draw on them)."""
    if isinstance(data, dict) and isinstance(data.get("images"), list):
        images = data["images"]
        if decoded is None:
            data = {**data, "images": [_as_uris(x) for x in images]}
        else:
            got = dict(enumerate(decoded))  # decode_images' list: one per item, or [] when none is an image
            data = {**data, "images": [x if got.get(i) is None else got[i] for i, x in enumerate(images)]}
        return {k: (v if k == "images" else _as_uris(v)) for k, v in data.items()}
    return _as_uris(data)


class JobImages:
    """Decodes each job's images once on this worker, shared by its samples running here at once: `acquire` with
    the job's data (keyed by its blob digest, `Job.data_ref`), `release` when the sample is done. A key is dropped
    when no sample holds it; data without a key (inline, small) is decoded per sample."""

    def __init__(self, max_pixels: int, limits: ImageLimits) -> None:
        self.max_pixels = max_pixels
        self.limits = limits
        self._shared: dict[str, tuple[asyncio.Future[list[Any]], list[int]]] = {}  # key -> (decode, [holders])

    def __len__(self) -> int:
        return len(self._shared)

    async def acquire(self, key: str | None, data: Any, *, raw: bool = False) -> tuple[Any, str | None]:
        """(`data` ready for its workflow (prepare_images), the key now held or None). A held key is released with
        release(key) when the sample is done; on an error nothing is held."""
        found: list[ImageFile | str] = []
        converted = _walk(data, found)  # the common case, no image: one pass over the data, as before
        if not found:
            return converted, None
        check_job_images(found, self.limits, self.max_pixels)
        if raw or not _has_images(data):
            return converted, None
        if key is None:
            return with_images(data, await asyncio.to_thread(decode_images, data, self.max_pixels, self.limits)), None
        entry = self._shared.get(key)
        if entry is None:
            task = asyncio.ensure_future(asyncio.to_thread(decode_images, data, self.max_pixels, self.limits))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its holders see the error
            entry = self._shared[key] = (task, [0])
        entry[1][0] += 1
        try:
            decoded = await asyncio.shield(entry[0])
        except BaseException:
            self.release(key)
            raise
        return with_images(data, decoded), key

    def release(self, key: str) -> None:
        entry = self._shared.get(key)
        if entry is not None:
            entry[1][0] -= 1
            if entry[1][0] <= 0:
                del self._shared[key]


def _has_images(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("images"), list) and any(map(_is_image, data["images"]))


def _is_image(value: Any) -> bool:
    return isinstance(value, ImageFile) or (isinstance(value, str) and value.startswith(DATA_URI_PREFIX))


def _walk(value: Any, found: list[ImageFile | str]) -> Any:
    """`value` with every ImageFile as a data URI (new containers), collecting its images (images_in's) in `found`."""
    if isinstance(value, str):
        if value.startswith(DATA_URI_PREFIX):
            found.append(value)
        return value
    if isinstance(value, dict):
        return {k: _walk(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, found) for v in value]
    if isinstance(value, ImageFile):
        found.append(value)
        return value.data_uri()
    return value


def _as_uris(value: Any) -> Any:
    if isinstance(value, ImageFile):
        return value.data_uri()
    if isinstance(value, dict):
        return {k: _as_uris(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_uris(v) for v in value]
    return value


__all__ = [
    "DEFAULT_MAX_PIXELS",
    "JobImages",
    "MediaError",
    "check_job_images",
    "decode_images",
    "open_image",
    "prepare_images",
    "with_images",
]
