"""Images in jobs' data: an encoded image file (PNG, JPEG, WebP or GIF) as one typed value of the wire.

On msgpack an image is an extension (IMAGE_EXT_CODE) holding the file's bytes, so it can sit anywhere in a job's data
(AReaL's `data["images"]`, a chat message's content part) and arrives as `ImageFile` in the worker, which opens it
(workers/media.py) under its pixel limits. A Python producer may put PIL images in the data: the codec stores them as
PNG. In JSON, where no extension exists, an image is a `data:image/...;base64,` URI string (OpenAI's form).

Data with images is large, so it travels by reference in the run's blob store (protocol.blobs): the n samples of a
prompt share one stored copy, which expires with the submission's retention. Pure functions: nothing here decodes
pixels."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

IMAGE_EXT_CODE = 16  # msgpack extension of an ImageFile (token arrays use 1-3)

# (magic bytes at offset 0, media type); WebP is RIFF....WEBP (checked in media_type_of)
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"))  # fmt: skip
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
DATA_URI_PREFIX = "data:image/"


class ImageError(ValueError):
    """Bytes or a string that are not an image rollq carries."""


def media_type_of(data: bytes | memoryview) -> str | None:
    """The media type of an encoded image file from its first bytes, or None when it is none of MEDIA_TYPES."""
    head = bytes(data[:12])
    for magic, media_type in _MAGIC:
        if head.startswith(magic):
            return media_type
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


class ImageFile(bytes):
    """An encoded image file (the bytes of a .png / .jpg / .webp / .gif), checked by its magic bytes."""

    media_type: str

    def __new__(cls, data: bytes | memoryview) -> ImageFile:
        media_type = media_type_of(data)
        if media_type is None:
            # Never the bytes themselves: the file may be one the sender may not read (an engine's media_root).
            raise ImageError(f"not an image file rollq carries ({', '.join(MEDIA_TYPES)})")
        out = super().__new__(cls, data)
        out.media_type = media_type
        return out

    def data_uri(self) -> str:
        """`data:<media type>;base64,...`: the form of OpenAI's image_url and SGLang's image_data."""
        return f"data:{self.media_type};base64,{base64.b64encode(self).decode()}"

    def base64(self) -> str:
        """Plain base64, without the data: prefix (AReaL's image2base64 form)."""
        return base64.b64encode(self).decode()

    def __repr__(self) -> str:
        return f"ImageFile({self.media_type}, {len(self)} bytes)"


def image_from_string(text: str) -> ImageFile:
    """An image given as text: a `data:image/...;base64,` URI or plain base64 of an image file (SGLang's and AReaL's
    forms). Never a path or a URL: reading those is the engine's to allow (its media root and URL allowlist)."""
    payload = text
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or not header.startswith(DATA_URI_PREFIX) or not header.endswith(";base64"):
            raise ImageError(f"an image data URI is data:image/<type>;base64,<data>; got {header[:40]!r}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image string must be a data:image/...;base64, URI or base64 of an image file") from None
    return ImageFile(raw)


def is_pil_image(obj: Any) -> bool:
    """Whether `obj` is a PIL image (checked by its class's module: protocol code never imports PIL)."""
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image" for c in type(obj).__mro__)


def pil_to_image_file(image: Any) -> ImageFile:
    """A PIL image as an ImageFile: PNG (lossless, so what the model sees is what the producer had)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return ImageFile(buf.getvalue())


__all__ = [
    "DATA_URI_PREFIX",
    "IMAGE_EXT_CODE",
    "MEDIA_TYPES",
    "ImageError",
    "ImageFile",
    "image_from_string",
    "is_pil_image",
    "media_type_of",
    "pil_to_image_file",
]
