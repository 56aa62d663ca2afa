"""What the images of one job (or one engine request) may cost, checked before any pixel is decoded.

One image is bounded elsewhere (its bytes, its pixels); a request is bounded here: how many images, their bytes and
their pixels together. A PNG of one colour is tens of KB on the wire and 64 MiB decoded, so a small request of many
images is a memory bomb unless the pixels are counted from the headers first.

`image_size` reads an image's width and height from its header the way Pillow does (the canvas Pillow would
allocate), without Pillow: the ingress runs without it, and the header is all that is needed. Pure functions."""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Iterator
from typing import Any

import msgspec

from rollq.protocol.media import DATA_URI_PREFIX, ImageError, ImageFile, media_type_of

MiB = 1 << 20
# Per job / per request, by default. 64 images: a multi-image prompt (a few pages, a short clip's frames) with room;
# 64 M pixels: 4 images at the per-image maximum (4096 x 4096), or 64 at 1024 x 1024, about 192 MiB as decoded RGB
# (what one job's decode may hold in a worker); bytes: what one job can carry at all (MAX_JOB_BYTES).
DEFAULT_MAX_IMAGES = 64
DEFAULT_MAX_IMAGE_BYTES = 16 * MiB
DEFAULT_MAX_TOTAL_PIXELS = 64 * MiB


class ImageLimitError(ImageError):
    """A job's or a request's images pass one of its limits (the message names the setting)."""


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The most images, encoded bytes and pixels one job (or request) may carry; `names` are the settings that set
    them, for the messages."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_TOTAL_PIXELS
    names: tuple[str, str, str] = ("max_job_images", "max_job_image_bytes", "max_job_image_pixels")


class ImageTally:
    """Counts images against `limits` as they come: `count` before anything is read, `add_bytes` as bytes arrive,
    `add_pixels` from each header. Each raises ImageLimitError once a limit is passed; `what` names the request."""

    __slots__ = ("limits", "what", "images", "bytes", "pixels")

    def __init__(self, limits: ImageLimits, what: str = "the job") -> None:
        self.limits, self.what = limits, what
        self.images = self.bytes = self.pixels = 0

    def count(self, n: int) -> None:
        self.images += n
        if self.images > self.limits.max_images:
            raise ImageLimitError(
                f"{self.what} has {self.images} images, over {self.limits.names[0]}={self.limits.max_images}"
            )

    def add_bytes(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.limits.max_bytes:
            raise ImageLimitError(
                f"{self.what}'s images take over {self.bytes:,} bytes, over {self.limits.names[1]}="
                f"{self.limits.max_bytes:,}"
            )

    def add_pixels(self, image: bytes) -> None:
        width, height = image_size(image)
        self.pixels += width * height
        if self.pixels > self.limits.max_pixels:
            raise ImageLimitError(
                f"{self.what}'s images have over {self.pixels:,} pixels (read from their headers), over "
                f"{self.limits.names[2]}={self.limits.max_pixels:,}"
            )


def images_in(data: Any) -> Iterator[ImageFile | str]:
    """Every image in a job's data, at any depth: ImageFile values and `data:image/` URI strings (what the workers
    treat as images; other strings are text to them)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.startswith(DATA_URI_PREFIX):
                yield item
        elif isinstance(item, ImageFile):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def check_images(images: list[ImageFile | str], limits: ImageLimits, what: str = "the job") -> None:
    """Refuses (ImageLimitError, or ImageError for a string that is no image) images past `limits`: their count
    first, then their encoded bytes (a data URI's from its length, before decoding it), then their pixels."""
    tally = ImageTally(limits, what)
    tally.count(len(images))
    tally.add_bytes(sum(len(x) if isinstance(x, bytes) else _decoded_length(x) for x in images))
    for image in images:
        tally.add_pixels(image if isinstance(image, bytes) else _uri_bytes(image))


def _decoded_length(uri: str) -> int:
    """The bytes a base64 data URI decodes to (padding aside), without decoding it."""
    payload = len(uri) - (uri.find(",") + 1)
    return payload * 3 // 4


def _uri_bytes(uri: str) -> bytes:
    _, sep, payload = uri.partition(",")
    try:
        return base64.b64decode(payload, validate=True) if sep else b""
    except (binascii.Error, ValueError):
        raise ImageError("an image data URI is data:image/<type>;base64,<data>") from None


def image_size(data: bytes | memoryview) -> tuple[int, int]:
    """(width, height) of an encoded PNG, JPEG, WebP or GIF, from its header (as Pillow reads it). Raises ImageError
    for a file rollq does not carry or whose header does not read."""
    kind = media_type_of(data)
    view = memoryview(data)
    try:
        if kind == "image/png":
            if bytes(view[12:16]) != b"IHDR":
                raise ImageError("a PNG file without its IHDR header")
            return struct.unpack_from(">II", view, 16)
        if kind == "image/gif":
            return _gif_size(view)
        if kind == "image/webp":
            return _webp_size(view)
        if kind == "image/jpeg":
            return _jpeg_size(view)
    except struct.error:
        raise ImageError(f"an image ({kind}) whose header is cut short") from None
    raise ImageError("not an image file rollq carries (PNG, JPEG, WebP, GIF)")


def _gif_size(view: memoryview) -> tuple[int, int]:
    # The logical screen, grown to the first frame's extent when that frame reaches past it (as Pillow does).
    width, height, flags = struct.unpack_from("<HHB", view, 6)
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while at < len(view):
        block = view[at]
        if block == 0x2C:  # an image descriptor: left, top, width, height
            left, top, w, h = struct.unpack_from("<HHHH", view, at + 1)
            return max(width, left + w), max(height, top + h)
        if block != 0x21:  # the trailer, or anything else: no frame
            break
        at += 2  # an extension: its label, then sub-blocks up to an empty one
        while at < len(view) and view[at]:
            at += view[at] + 1
        at += 1
    return width, height


def _webp_size(view: memoryview) -> tuple[int, int]:
    chunk = bytes(view[12:16])
    if chunk == b"VP8 " and bytes(view[23:26]) == b"\x9d\x01\x2a":
        w, h = struct.unpack_from("<HH", view, 26)
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8X":
        w = int.from_bytes(view[24:27], "little") + 1
        h = int.from_bytes(view[27:30], "little") + 1
        if len(view) < 30:
            raise struct.error
        return w, h
    if chunk == b"VP8L" and view[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", view, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    raise ImageError("a WebP file whose header does not read")


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(view: memoryview) -> tuple[int, int]:
    # Markers up to the first scan; the last frame header before it sets the size (as Pillow reads them).
    size: tuple[int, int] | None = None
    at = 2
    while at + 1 < len(view):
        if view[at] != 0xFF:
            raise ImageError("a JPEG file whose markers do not read")
        marker = view[at + 1]
        if marker == 0xFF:  # fill
            at += 1
            continue
        if marker == 0xDA or marker == 0xD9:  # start of scan, end of image
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length
            at += 2
            continue
        (length,) = struct.unpack_from(">H", view, at + 2)
        if marker in _SOF:
            height, width = struct.unpack_from(">HH", view, at + 5)
            size = (width, height)
        at += 2 + length
    if size is None:
        raise ImageError("a JPEG file without a frame header")
    return size


__all__ = [
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_TOTAL_PIXELS",
    "ImageLimitError",
    "ImageLimits",
    "ImageTally",
    "check_images",
    "image_size",
    "images_in",
]
