"""msgpack on the wire; JSON for people and other languages. Never pickle."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rollq.protocol.arrays import ARRAY_BY_EXT_CODE, ARRAY_TYPES
from rollq.protocol.media import IMAGE_EXT_CODE, ImageFile, is_pil_image, pil_to_image_file
from rollq.protocol.messages import DeadLetter, Job, Trajectory

T = TypeVar("T")


class CodecError(ValueError):
    """A payload that does not decode into the expected message."""


def _msgpack_enc_hook(obj: Any) -> Any:
    if isinstance(obj, ARRAY_TYPES):
        return msgspec.msgpack.Ext(obj.ext_code, obj.to_bytes())
    if isinstance(obj, ImageFile):
        return msgspec.msgpack.Ext(IMAGE_EXT_CODE, bytes(obj))
    if is_pil_image(obj):  # a producer's PIL image: travels as a PNG file
        return msgspec.msgpack.Ext(IMAGE_EXT_CODE, bytes(pil_to_image_file(obj)))
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == IMAGE_EXT_CODE:
        return ImageFile(data)  # an ImageError (ValueError) for bytes that are no image: the payload does not decode
    cls = ARRAY_BY_EXT_CODE.get(code)
    if cls is None:
        raise ValueError(f"unknown msgpack extension code {code}")
    return cls.from_bytes(data)


def _json_enc_hook(obj: Any) -> Any:
    if isinstance(obj, ARRAY_TYPES):
        return obj.tolist()
    if isinstance(obj, ImageFile):
        return obj.data_uri()
    if is_pil_image(obj):
        return pil_to_image_file(obj).data_uri()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def json_schema_hook(typ: type) -> dict[str, Any]:
    """The `schema_hook` of msgspec.json.schema / schema_components for the messages as JSON: a token array is a list
    of numbers (as `encode_json` writes it and `decode_json` reads it), integers within its item type's range."""
    if isinstance(typ, type) and issubclass(typ, ARRAY_TYPES):
        if typ.bounds is None:
            return {"type": "array", "items": {"type": "number"}}
        low, high = typ.bounds
        return {"type": "array", "items": {"type": "integer", "minimum": low, "maximum": high}}
    raise NotImplementedError(f"no JSON schema for {typ!r}")


def _dec_hook(typ: type, obj: Any) -> Any:
    # Token arrays may also arrive as plain lists (JSON, or msgpack from another language).
    if typ in ARRAY_TYPES:
        if isinstance(obj, typ):  # already built by _ext_hook
            return obj
        if isinstance(obj, list):
            return typ(obj)
    raise NotImplementedError(f"cannot decode {typ.__name__} from {type(obj).__name__}")


class Codec:
    """Encoders/decoders for the wire messages. Create once per process and reuse (msgspec caches per instance)."""

    def __init__(self) -> None:
        self._mp_enc = msgspec.msgpack.Encoder(enc_hook=_msgpack_enc_hook)
        self._json_enc = msgspec.json.Encoder(enc_hook=_json_enc_hook)
        self._mp_dec: dict[type, msgspec.msgpack.Decoder[Any]] = {}
        self._json_dec: dict[type, msgspec.json.Decoder[Any]] = {}

    def encode(self, msg: Any) -> bytes:
        return self._mp_enc.encode(msg)

    def encode_json(self, msg: Any) -> bytes:
        return self._json_enc.encode(msg)

    def decode(self, payload: bytes, typ: type[T]) -> T:
        """Decode msgpack, or JSON when the payload is a JSON object (producers in other languages may send JSON)."""
        try:
            if payload[:1] == b"{":
                return self._json_decoder(typ).decode(payload)
            return self._msgpack_decoder(typ).decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, NotImplementedError, RecursionError) as exc:
            raise CodecError(f"cannot decode {typ.__name__}: {exc}") from None

    def decode_json(self, payload: bytes | str, typ: type[T]) -> T:
        try:
            return self._json_decoder(typ).decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, NotImplementedError, RecursionError) as exc:
            raise CodecError(f"cannot decode {typ.__name__}: {exc}") from None

    def to_builtins(self, msg: Any) -> Any:
        """Plain dicts/lists (token arrays as lists), e.g. for writing JSON lines."""
        return msgspec.to_builtins(msg, enc_hook=_json_enc_hook)

    def _msgpack_decoder(self, typ: type[T]) -> msgspec.msgpack.Decoder[T]:
        dec = self._mp_dec.get(typ)
        if dec is None:
            dec = self._mp_dec[typ] = msgspec.msgpack.Decoder(typ, ext_hook=_ext_hook, dec_hook=_dec_hook)
        return dec

    def _json_decoder(self, typ: type[T]) -> msgspec.json.Decoder[T]:
        dec = self._json_dec.get(typ)
        if dec is None:
            dec = self._json_dec[typ] = msgspec.json.Decoder(typ, dec_hook=_dec_hook)
        return dec

    def decode_data(self, payload: bytes) -> Any:
        """A job's data as stored in the blob store (msgpack of any value; token arrays as extensions)."""
        try:
            return msgspec.msgpack.decode(payload, ext_hook=_ext_hook)
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:
            raise CodecError(f"cannot decode job data: {exc}") from None

    def decode_job(self, payload: bytes) -> Job:
        return self.decode(payload, Job)

    def decode_trajectory(self, payload: bytes) -> Trajectory:
        return self.decode(payload, Trajectory)

    def decode_dead_letter(self, payload: bytes) -> DeadLetter:
        return self.decode(payload, DeadLetter)
