"""Typed token arrays: the per-token columns of a sequence.

They are `array.array` subclasses with a fixed item type, so they index and iterate like lists, expose the buffer
protocol (``torch.frombuffer`` / ``numpy.frombuffer`` read them without a copy) and travel on the wire as packed
little-endian bytes inside a msgpack extension (see ``bench/queue_throughput.py`` for why: ~50x faster than lists of
numbers).
"""

from __future__ import annotations

import array
import functools
import struct
import sys
from typing import TYPE_CHECKING, Any, ClassVar, Self

_LITTLE_ENDIAN = sys.byteorder == "little"

if TYPE_CHECKING:
    _ArrayBase = array.array[Any]  # items are int (Int32Array, UInt8Array) or float (Float32Array)
else:
    _ArrayBase = array.array  # not subscriptable at runtime before Python 3.12


@functools.lru_cache(maxsize=1024)
def _packer(typecode: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{typecode}")


class _TypedArray(_ArrayBase):
    typecode_: ClassVar[str]
    ext_code: ClassVar[int]

    def __new__(cls, data: Any = ()) -> Self:
        return super().__new__(cls, cls.typecode_, data)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> Self:
        out = cls()
        out.frombytes(data)
        if not _LITTLE_ENDIAN:
            out.byteswap()
        return out

    def to_bytes(self) -> bytes:
        if _LITTLE_ENDIAN:
            return self.tobytes()
        swapped = type(self)(self)
        swapped.byteswap()
        return swapped.tobytes()

    @classmethod
    def coerce(cls, value: Any, field: str) -> Self:
        """Build from a list/tuple, another array, a numpy array or a 1-D (or [1, L]) torch tensor."""
        if isinstance(value, cls):
            return value
        if type(value) is list:  # the common case: one C call packs it, ~2.5x faster than array(list)
            try:
                raw = bytes(value) if cls.typecode_ == "B" else _packer(cls.typecode_, len(value)).pack(*value)
            except (struct.error, TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{field}: {exc}") from None
            return cls.from_bytes(raw)
        if isinstance(value, (list, tuple, range, array.array)):
            try:
                return cls(value)
            except (TypeError, OverflowError) as exc:
                raise ValueError(f"{field}: {exc}") from None
        if hasattr(value, "detach"):  # torch tensor: move to numpy without importing torch here
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16; float32 holds every bfloat16 exactly
                value = value.float()
            value = value.numpy()
        if hasattr(value, "ndim") and hasattr(value, "astype"):  # numpy array
            if value.ndim == 2 and value.shape[0] == 1:
                value = value[0]
            if value.ndim != 1:
                raise ValueError(f"{field}: expected a 1-D array, got shape {tuple(value.shape)}")
            if cls.bounds is not None and value.size and value.dtype.kind in "iu":  # astype would wrap around
                low, high = cls.bounds
                if int(value.min()) < low or int(value.max()) > high:
                    raise ValueError(f"{field}: values must lie in [{low}, {high}] ({cls.__name__})")
            return cls.from_bytes(value.astype(cls.numpy_dtype).tobytes())
        raise ValueError(f"{field}: expected a list or a 1-D array/tensor, got {type(value).__name__}")

    numpy_dtype: ClassVar[str]
    bounds: ClassVar[tuple[int, int] | None] = None  # the item type's range, for integer types

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"


class Int32Array(_TypedArray):
    """Token ids and policy versions (int32)."""

    typecode_ = "i"
    ext_code = 1
    numpy_dtype = "<i4"
    bounds = (-(2**31), 2**31 - 1)


class Float32Array(_TypedArray):
    """Per-token log-probabilities (float32)."""

    typecode_ = "f"
    ext_code = 2
    numpy_dtype = "<f4"


class UInt8Array(_TypedArray):
    """Loss mask: 1 = a token the model generated (trained on), 0 = prompt/tool/user token."""

    typecode_ = "B"
    ext_code = 3
    numpy_dtype = "u1"
    bounds = (0, 255)


ARRAY_TYPES: tuple[type[_TypedArray], ...] = (Int32Array, Float32Array, UInt8Array)
ARRAY_BY_EXT_CODE: dict[int, type[_TypedArray]] = {t.ext_code: t for t in ARRAY_TYPES}

assert array.array("i").itemsize == 4 and array.array("f").itemsize == 4, "rollq needs 4-byte C int and float"
