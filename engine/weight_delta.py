"""Weight deltas: what changed between two versions of a model's weights, tensor by tensor, in the dtype the engines
serve, and how an engine holding the base version rebuilds the new one bit for bit.

Encoding, chosen by measurement (docs/weight-sync.md): each changed tensor is the XOR of its base and new bytes,
compressed with zstd (level 1). At RL learning rates most bf16 weights keep every bit from one step to the next, so
the XOR is mostly zero bytes, which zstd packs to almost nothing; a changed weight usually differs only in its low
mantissa bits. On SmolLM2-135M in bf16, with an Adam-sized step (lr 5e-6) on every weight, XOR+zstd took 5.4 % of
the full bytes against 16.2 % for sparse (int32 position, value) pairs and 6.8 % for gap-coded positions + values
+ zstd, and encoded faster than the latter. A tensor with no changed bit is "unchanged" and carries no bytes.

An XOR applies exactly once, onto exactly the base: each tensor carries the xxh3-128 checksum of its new bytes, and
`apply` checks every tensor's result (the unchanged ones too) before anything is swapped in, so an engine whose
weights are not the base (a restart, a missed update, a corrupted load) is told so and gets a full update instead.

On disk a delta is a directory holding `delta.json` (the manifest) and `delta.bin` (the compressed tensors back to
back); over a process group the manifest goes in the request and the blob as one uint8 tensor."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
import torch
import xxhash
import zstandard

FORMAT = "rollq-weight-delta/1"
MANIFEST_FILE = "delta.json"
BLOB_FILE = "delta.bin"
ZSTD_LEVEL = 1  # level 3 packed SmolLM2's deltas 0.2 % smaller, 10 % slower: not worth it before every pause
MAX_MANIFEST_BYTES = 64 << 20

Encoding = Literal["xor-zstd", "unchanged"]


class TensorDelta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor of a delta."""

    name: str  # the parameter's name in the model's own files (as in its safetensors)
    dtype: str  # the served dtype, torch's name without "torch." ("bfloat16")
    shape: list[int]  # the tensor's shape
    encoding: Encoding  # "xor-zstd": zstd(base bytes XOR new bytes); "unchanged": no byte differs, nothing stored
    checksum: str  # xxh3-128 (hex) of the new tensor's bytes: checked after applying, before anything is swapped in
    offset: int = 0  # where its compressed bytes start in the blob
    length: int = 0  # how many compressed bytes it has there


class DeltaManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a delta holds and what it applies to."""

    format: str  # FORMAT: a reader refuses any other
    base_version: str  # the weight version the delta applies to: an engine holding another one needs a full update
    version: str  # the weight version the delta builds
    dtype: str  # the dtype of every tensor (the engines serve this dtype)
    tensors: list[TensorDelta]  # every parameter of the model, changed or not, in the order they were encoded
    full_bytes: int  # the new weights' bytes in `dtype`: what a full update would send
    blob_bytes: int  # the compressed bytes of all tensors: what this delta sends
    changed_elements: int  # weights with at least one changed bit
    total_elements: int  # all weights

    @property
    def share(self) -> float:
        """The delta's bytes as a share of a full update's."""
        return self.blob_bytes / self.full_bytes if self.full_bytes else 0.0

    @property
    def changed_share(self) -> float:
        """The share of weights with at least one changed bit."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


class WeightDelta(NamedTuple):
    manifest: DeltaManifest
    blob: bytes


class DeltaMismatch(ValueError):
    """The delta does not apply to these weights (another base, another model or dtype, a corrupt blob): nothing
    was changed, and the engine needs a full update."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer tensor of the same item size (no copy for a contiguous tensor)."""
    return t.detach().contiguous().view(-1).view(_INT_OF_SIZE[t.element_size()])


def _bytes(t: torch.Tensor) -> memoryview:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().data


def checksum(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes (its dtype and shape are checked apart)."""
    return xxhash.xxh3_128_hexdigest(_bytes(t))


def encode(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    base_version: str,
    version: str,
    level: int = ZSTD_LEVEL,
) -> WeightDelta:
    """The delta from `base` to `new`: CPU tensors of one dtype with the same names and shapes (the engines' dtype:
    cast before). Raises ValueError when they do not correspond."""
    if set(base) != set(new):
        raise ValueError(f"base and new weights differ in names: {sorted(set(base) ^ set(new))[:8]}")
    dtypes = {t.dtype for t in new.values()} | {t.dtype for t in base.values()}
    if len(dtypes) != 1:
        raise ValueError(f"a delta is taken in one dtype, got {sorted(map(dtype_name, dtypes))}")
    dtype = dtype_name(dtypes.pop())
    compressor = zstandard.ZstdCompressor(level=level)
    entries: list[TensorDelta] = []
    chunks: list[bytes] = []
    offset = full = changed = total = 0
    for name, new_t in new.items():
        base_t = base[name]
        if base_t.shape != new_t.shape:
            raise ValueError(f"{name}: shape {tuple(base_t.shape)} != {tuple(new_t.shape)}")
        xor = torch.bitwise_xor(_bits(base_t), _bits(new_t))
        n_changed = int(torch.count_nonzero(xor))
        full += new_t.numel() * new_t.element_size()
        total += new_t.numel()
        changed += n_changed
        shape, digest = list(new_t.shape), checksum(new_t)
        if n_changed == 0:
            entries.append(TensorDelta(name, dtype, shape, "unchanged", digest))
            continue
        packed = compressor.compress(_bytes(xor))
        entries.append(TensorDelta(name, dtype, shape, "xor-zstd", digest, offset=offset, length=len(packed)))
        chunks.append(packed)
        offset += len(packed)
    manifest = DeltaManifest(
        format=FORMAT,
        base_version=base_version,
        version=version,
        dtype=dtype,
        tensors=entries,
        full_bytes=full,
        blob_bytes=offset,
        changed_elements=changed,
        total_elements=total,
    )
    return WeightDelta(manifest, b"".join(chunks))


def check_manifest(manifest: DeltaManifest, blob_size: int) -> None:
    """A manifest that is whole and consistent with a blob of `blob_size` bytes (read from disk or a request: an
    engine trusts neither). Raises DeltaMismatch."""
    if manifest.format != FORMAT:
        raise DeltaMismatch(f"unknown delta format {manifest.format!r} (this engine reads {FORMAT!r})")
    if manifest.blob_bytes != blob_size:
        raise DeltaMismatch(f"the blob has {blob_size} bytes, the manifest says {manifest.blob_bytes}")
    names: set[str] = set()
    for t in manifest.tensors:
        if t.name in names:
            raise DeltaMismatch(f"{t.name} appears twice")
        names.add(t.name)
        if t.dtype != manifest.dtype or any(d < 0 for d in t.shape):
            raise DeltaMismatch(f"{t.name}: dtype {t.dtype} or shape {t.shape} is not valid here")
        if t.offset < 0 or t.length < 0 or t.offset + t.length > blob_size:
            raise DeltaMismatch(f"{t.name}: bytes {t.offset}..{t.offset + t.length} lie outside the blob")


def apply(current: Mapping[str, torch.Tensor], delta: WeightDelta) -> dict[str, torch.Tensor]:
    """The new tensors, rebuilt from `current` (the weights an engine holds, in the delta's dtype) without changing
    it: only the changed tensors are returned (new CPU tensors; copy them in to swap). Every tensor's result is
    checked against its checksum first. Raises DeltaMismatch, naming the first tensor that does not fit."""
    manifest, blob = delta
    check_manifest(manifest, len(blob))
    missing = sorted({t.name for t in manifest.tensors} ^ set(current))
    if missing:
        raise DeltaMismatch(f"the delta and these weights differ in names: {missing[:8]}")
    decompressor = zstandard.ZstdDecompressor()
    view = memoryview(blob)
    out: dict[str, torch.Tensor] = {}
    for t in manifest.tensors:
        base = current[t.name]
        if dtype_name(base.dtype) != t.dtype or list(base.shape) != t.shape:
            held = f"{dtype_name(base.dtype)} {list(base.shape)}"
            raise DeltaMismatch(f"{t.name}: these weights are {held}, the delta {t.dtype} {t.shape}")
        base = base.detach().to("cpu")
        if t.encoding == "unchanged":
            if checksum(base) != t.checksum:
                raise DeltaMismatch(f"{t.name}: these weights are not the delta's base {manifest.base_version}")
            continue
        size = base.numel() * base.element_size()
        try:  # bounded: a blob cannot expand past the tensor it claims to be
            xor = decompressor.decompress(view[t.offset : t.offset + t.length], max_output_size=size)
        except zstandard.ZstdError as exc:
            raise DeltaMismatch(f"{t.name}: corrupt delta bytes ({exc})") from exc
        if len(xor) != size:
            raise DeltaMismatch(f"{t.name}: the delta has {len(xor)} bytes for a tensor of {size}")
        bits = torch.frombuffer(bytearray(xor), dtype=_INT_OF_SIZE[base.element_size()])
        rebuilt = torch.bitwise_xor(_bits(base), bits).view(base.dtype).view(base.shape)
        if checksum(rebuilt) != t.checksum:
            raise DeltaMismatch(f"{t.name}: the result's checksum differs: these weights are not the delta's base")
        out[t.name] = rebuilt
    return out


def is_delta_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file()


def write(directory: str | os.PathLike[str], delta: WeightDelta) -> Path:
    """The delta as `directory` (delta.json + delta.bin), written beside it and renamed into place: a reader never
    sees half of one. An existing directory is replaced."""
    target = Path(directory)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        (tmp / BLOB_FILE).write_bytes(delta.blob)
        (tmp / MANIFEST_FILE).write_bytes(msgspec.json.encode(delta.manifest))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read(directory: str | os.PathLike[str]) -> WeightDelta:
    """A delta written by `write`. Raises DeltaMismatch when it is not a whole, consistent one."""
    path = Path(directory)
    manifest_path, blob_path = path / MANIFEST_FILE, path / BLOB_FILE
    try:
        if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            raise DeltaMismatch(f"{manifest_path} is larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = msgspec.json.decode(manifest_path.read_bytes(), type=DeltaManifest)
        blob = blob_path.read_bytes()
    except (OSError, msgspec.DecodeError) as exc:
        raise DeltaMismatch(f"{path} is not a readable weight delta: {exc}") from exc
    check_manifest(manifest, len(blob))
    return WeightDelta(manifest, blob)


__all__ = [
    "BLOB_FILE",
    "FORMAT",
    "MANIFEST_FILE",
    "DeltaManifest",
    "DeltaMismatch",
    "TensorDelta",
    "WeightDelta",
    "apply",
    "check_manifest",
    "checksum",
    "encode",
    "is_delta_dir",
    "read",
    "write",
]
