"""The images of a /generate request (SGLang's `image_data`), loaded under the engine's media policy.

SGLang's load_image takes a data URI, plain base64, a path or an http(s) URL (docs/sglang-protocol.md). A request
must not make the server read its own files or fetch arbitrary addresses, so here:
- data URIs and base64: always (the image travels in the request);
- paths (and `file://`): only under `media_root`, resolved (no `..` or symlink escapes), regular files;
- http(s) URLs: only to hosts in `url_hosts`, on ports 80 and 443 unless an entry names its port (`HOST:PORT`), no
  redirects, read to the end within `max_image_bytes` and `fetch_timeout_s`; a failed fetch answers generically (the
  detail goes to the engine's log), so the engine is no port scanner and no oracle of what a host serves.
Each is checked to be an image file (protocol.media: PNG, JPEG, WebP, GIF) of at most `max_image_bytes`, and a
request's images together against its limits (protocol.image_limits: how many, checked before any is read; their
bytes, counted as they are read; their pixels, from the headers, before any backend decodes them). No error echoes
a file's bytes."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import msgspec

from rollq.protocol.image_limits import (
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_TOTAL_PIXELS,
    ImageLimitError,
    ImageLimits,
    ImageTally,
)
from rollq.protocol.media import ImageError, ImageFile, image_from_string

log = logging.getLogger("rollq.engine")

WEB_PORTS = (80, 443)  # what a url_hosts entry without a port allows
REQUEST_LIMIT_NAMES = ("max_request_images", "max_request_image_bytes", "max_request_image_pixels")


class MediaPolicy(msgspec.Struct, kw_only=True, frozen=True):
    media_root: str | None = None  # image paths are read only from under this directory; None: no paths
    # hosts image URLs may name (exact, case-insensitive), on ports 80 and 443, or `HOST:PORT` for that port only;
    # empty: no URLs
    url_hosts: list[str] = []
    max_image_bytes: int = 16 << 20  # per image
    fetch_timeout_s: float = 10.0
    # per request (all its prompts): how many images, their bytes together, their pixels together (from headers)
    max_images: int = DEFAULT_MAX_IMAGES
    max_total_bytes: int = 32 << 20  # what a request's body can carry (max_body_bytes): paths and URLs no more
    max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS

    def __post_init__(self) -> None:
        for entry in self.url_hosts:
            allowed_host(entry)  # a bad entry fails at start, not at the first URL

    def limits(self) -> ImageLimits:
        return ImageLimits(
            max_images=self.max_images,
            max_bytes=self.max_total_bytes,
            max_pixels=self.max_total_pixels,
            names=REQUEST_LIMIT_NAMES,
        )


class MediaRefused(ValueError):
    """An image the policy refuses or that can't be had: the request's 400 (SGLang answers a bad image with one)."""


def allowed_host(entry: str) -> tuple[str, int | None]:
    """(host, port or None) of a url_hosts entry: `HOST`, `HOST:PORT`, `[v6]` or `[v6]:PORT`. Raises ValueError."""
    try:
        parts = urlsplit("//" + entry.strip())
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:
        host, port = "", None
    if not host or parts.path or parts.query or parts.username is not None:
        raise ValueError(f"image_url_hosts: {entry!r} is not HOST or HOST:PORT")
    return host, port


async def load_images(
    specs: list[str], policy: MediaPolicy, http: aiohttp.ClientSession | None, tally: ImageTally | None = None
) -> list[ImageFile]:
    """The request's images, in order, counted into `tally` (the whole request's: its images, their bytes as they
    are read, their pixels from the headers; a new one for these alone when None). Nothing is read once the tally
    is past a limit, and the rest of the loads are cancelled."""
    tally = tally or ImageTally(policy.limits(), "the request")
    try:
        tally.count(len(specs))
    except ImageLimitError as exc:
        raise MediaRefused(f"image_data: {exc}") from None
    tasks = [asyncio.ensure_future(load_image(s, policy, http, tally, f"image_data[{i}]")) for i, s in enumerate(specs)]
    try:
        images = list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    try:
        for image in images:
            tally.add_pixels(image)
    except ImageError as exc:  # a limit passed, or a header that does not read
        raise MediaRefused(f"image_data: {exc}") from None
    return images


async def load_image(
    spec: str,
    policy: MediaPolicy,
    http: aiohttp.ClientSession | None,
    tally: ImageTally | None = None,
    label: str = "image_data",
) -> ImageFile:
    tally = tally or ImageTally(policy.limits(), "the request")
    try:
        if spec.startswith(("http://", "https://")):
            raw = await _fetch(spec, policy, http, tally, label)
        elif spec.startswith("file://") or spec.startswith("/") or _looks_like_path(spec):
            raw = await _read_under_root(spec.removeprefix("file://"), policy, tally, label)
        else:
            try:
                image = image_from_string(spec)
            except ImageError as exc:
                raise MediaRefused(f"{label}: {exc}") from None
            tally.add_bytes(len(image))
            return _bounded(image, policy, label)
        return _bounded(ImageFile(raw), policy, label)
    except ImageError as exc:  # not an image (never its bytes: protocol.media), or the request's limit passed
        raise MediaRefused(f"{label}: {exc}") from None


def _looks_like_path(spec: str) -> bool:
    # base64 has no dots; a relative path to an image file ends in its extension
    return "." in spec[-6:] and spec.rsplit(".", 1)[-1].lower() in ("png", "jpg", "jpeg", "webp", "gif")


def _bounded(image: ImageFile, policy: MediaPolicy, label: str) -> ImageFile:
    if len(image) > policy.max_image_bytes:
        raise MediaRefused(f"{label}: an image of {len(image)} bytes, over max_image_bytes={policy.max_image_bytes}")
    return image


async def _read_under_root(path: str, policy: MediaPolicy, tally: ImageTally, label: str) -> bytes:
    if policy.media_root is None:
        raise MediaRefused(f"{label}: this engine reads no image paths (its media_root is unset)")
    root = Path(policy.media_root).resolve()
    target = await asyncio.to_thread(lambda: (root / path).resolve())  # absolute stays; `..`, symlinks resolved
    size = await asyncio.to_thread(_size_of_file, target) if target.is_relative_to(root) else None
    if size is None:
        # one answer for outside and missing: the reply must not tell which files exist
        raise MediaRefused(f"{label}: no such image under the engine's media_root")
    if size > policy.max_image_bytes:
        raise MediaRefused(f"{label}: over max_image_bytes={policy.max_image_bytes}")
    tally.add_bytes(size)  # counted before it is read
    raw = await asyncio.to_thread(_read_at_most, target, policy.max_image_bytes + 1)
    if len(raw) > size:  # it grew since: what was counted is what is taken
        raise MediaRefused(f"{label}: over max_image_bytes={policy.max_image_bytes}")
    return raw


def _size_of_file(target: Path) -> int | None:
    try:
        st = target.stat()
    except OSError:
        return None
    return st.st_size if os.path.isfile(target) else None


def _read_at_most(target: Path, n: int) -> bytes:
    with open(target, "rb") as f:
        return f.read(n)


def _url_allowed(url: str, policy: MediaPolicy) -> bool:
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    host = (parts.hostname or "").lower()
    for entry in policy.url_hosts:
        allowed, allowed_port = allowed_host(entry)
        if allowed == host and (port == allowed_port if allowed_port is not None else port in WEB_PORTS):
            return True
    return False


async def _fetch(
    url: str, policy: MediaPolicy, http: aiohttp.ClientSession | None, tally: ImageTally, label: str
) -> bytes:
    """The whole body of an allowed URL, up to max_image_bytes (refused beyond, not cut short). Errors are generic:
    what failed, and where, goes to the engine's log, not to the client (no port scan through it)."""
    if not _url_allowed(url, policy):
        hosts = "its image_url_hosts" if policy.url_hosts else "image_url_hosts (none)"
        raise MediaRefused(
            f"{label}: this engine fetches image URLs only from {hosts}, on ports 80 and 443 unless an entry "
            "names its port"
        )
    if http is None:
        raise MediaRefused(f"{label}: this engine has no HTTP client for image URLs")
    limit = policy.max_image_bytes
    try:
        async with http.get(
            url, allow_redirects=False, timeout=aiohttp.ClientTimeout(total=policy.fetch_timeout_s)
        ) as resp:
            if resp.status != 200:
                raise MediaRefused(f"{label}: the image URL answered HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > limit:
                raise MediaRefused(f"{label}: over max_image_bytes={limit}")
            body = bytearray()
            async for chunk in resp.content.iter_any():  # to the end: a read returns what has arrived so far
                tally.add_bytes(len(chunk))
                body += chunk
                if len(body) > limit:
                    raise MediaRefused(f"{label}: over max_image_bytes={limit}")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.warning("image URL %s could not be fetched: %s: %s", url[:200], type(exc).__name__, exc)
        raise MediaRefused(f"{label}: the image URL could not be fetched (the engine's log says why)") from None
    return bytes(body)


__all__ = ["MediaPolicy", "MediaRefused", "allowed_host", "load_image", "load_images"]
