"""The images of a /generate request (SGLang's `image_data`), loaded under the engine's media policy.

SGLang's load_image takes a data URI, plain base64, a path or an http(s) URL (docs/sglang-protocol.md). A request
must not make the server read its own files or fetch arbitrary addresses, so here:
- data URIs and base64: always (the image travels in the request);
- paths (and `file://`): only under `media_root`, resolved (no `..` or symlink escapes), regular files;
- http(s) URLs: only to hosts in `url_hosts`, no redirects, bounded in size and time.
Each is checked to be an image file (protocol.media: PNG, JPEG, WebP, GIF) of at most `max_image_bytes`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import msgspec

from rollq.protocol.media import ImageError, ImageFile, image_from_string


class MediaPolicy(msgspec.Struct, kw_only=True, frozen=True):
    media_root: str | None = None  # image paths are read only from under this directory; None: no paths
    url_hosts: list[str] = []  # hosts image URLs may name (exact, case-insensitive); empty: no URLs
    max_image_bytes: int = 16 << 20  # per image
    fetch_timeout_s: float = 10.0


class MediaRefused(ValueError):
    """An image the policy refuses or that can't be had: the request's 400 (SGLang answers a bad image with one)."""


async def load_images(specs: list[str], policy: MediaPolicy, http: aiohttp.ClientSession | None) -> list[ImageFile]:
    """The request's images, in order."""
    return list(await asyncio.gather(*(load_image(s, policy, http) for s in specs)))


async def load_image(spec: str, policy: MediaPolicy, http: aiohttp.ClientSession | None) -> ImageFile:
    if spec.startswith(("http://", "https://")):
        raw = await _fetch(spec, policy, http)
    elif spec.startswith("file://") or spec.startswith("/") or _looks_like_path(spec):
        raw = await asyncio.to_thread(_read_under_root, spec.removeprefix("file://"), policy)
    else:
        try:
            image = image_from_string(spec)
        except ImageError as exc:
            raise MediaRefused(f"image_data: {exc}") from None
        return _bounded(image, policy)
    try:
        return _bounded(ImageFile(raw), policy)
    except ImageError as exc:
        raise MediaRefused(f"image_data {_short(spec)}: {exc}") from None


def _looks_like_path(spec: str) -> bool:
    # base64 has no dots; a relative path to an image file ends in its extension
    return "." in spec[-6:] and spec.rsplit(".", 1)[-1].lower() in ("png", "jpg", "jpeg", "webp", "gif")


def _bounded(image: ImageFile, policy: MediaPolicy) -> ImageFile:
    if len(image) > policy.max_image_bytes:
        raise MediaRefused(f"image_data: an image of {len(image)} bytes, over max_image_bytes={policy.max_image_bytes}")
    return image


def _read_under_root(path: str, policy: MediaPolicy) -> bytes:
    if policy.media_root is None:
        raise MediaRefused(f"image_data {_short(path)}: this engine reads no image paths (its media_root is unset)")
    root = Path(policy.media_root).resolve()
    target = (root / path).resolve()  # an absolute path stays itself; `..` and symlinks are resolved away
    if not target.is_relative_to(root) or not target.is_file():
        # one answer for outside and missing: the reply must not tell which files exist
        raise MediaRefused(f"image_data {_short(path)}: no such image under the engine's media_root")
    if target.stat().st_size > policy.max_image_bytes:
        raise MediaRefused(f"image_data {_short(path)}: over max_image_bytes={policy.max_image_bytes}")
    return target.read_bytes()


async def _fetch(url: str, policy: MediaPolicy, http: aiohttp.ClientSession | None) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in {h.lower() for h in policy.url_hosts}:
        raise MediaRefused(
            f"image_data {_short(url)}: this engine fetches image URLs only from its image_url_hosts "
            f"({', '.join(policy.url_hosts) or 'none'})"
        )
    if http is None:
        raise MediaRefused("image_data: this engine has no HTTP client for image URLs")
    try:
        async with http.get(
            url, allow_redirects=False, timeout=aiohttp.ClientTimeout(total=policy.fetch_timeout_s)
        ) as resp:
            if resp.status != 200:
                raise MediaRefused(f"image_data {_short(url)}: HTTP {resp.status}")
            body = await resp.content.read(policy.max_image_bytes + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise MediaRefused(f"image_data {_short(url)}: {type(exc).__name__}: {exc}") from None
    if len(body) > policy.max_image_bytes:
        raise MediaRefused(f"image_data {_short(url)}: over max_image_bytes={policy.max_image_bytes}")
    return body


def _short(spec: str) -> str:
    return repr(spec if len(spec) <= 80 else spec[:77] + "...")


__all__ = ["MediaPolicy", "MediaRefused", "load_image", "load_images"]
