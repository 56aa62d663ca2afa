"""msgpack for arq, both ways: what remote rewards write to Redis and read back is plain data, never a pickle.

arq pickles jobs and results unless told otherwise, so whoever can write `arq:job:*` or `arq:result:*` would run code
in the process that reads them (a reward worker, a rollout worker). Every arq pool and worker in rollq is built with
`job_serializer=encode, job_deserializer=decode` (tests/security/test_arq_pickle.py scans the code for one without).

`encode` takes plain data only: None, bool, int, float, str, bytes, lists, tuples (they arrive as lists, as after any
msgpack hop), dicts with str or int keys, and rollq's token arrays (msgpack extensions, as in the job streams: a job's
data may hold them). Anything else (a dataclass, an enum, a numpy scalar, a set) raises NotPlainData naming where it
is, rather than changing silently on the way. An exception in a result (arq's own failures: a timeout, an abort,
retries used up, a refused payload) travels as `{"exception": type name, "message": ...}`; `describe_failure` turns
that back into a line. `decode` refuses whatever is not a msgpack map (RefusedPayload), without loading it,
saying so when it looks like a pickle."""

from __future__ import annotations

from typing import Any

import msgspec

from rollq.protocol.arrays import ARRAY_BY_EXT_CODE, ARRAY_TYPES

PICKLE_START = b"\x80"  # pickle's PROTO opcode, how every pickle of protocol 2 and later begins
MAX_DEPTH = 64  # nesting a reward call may use; also what stops the walk on a list that contains itself
PLAIN = "None, bool, int, float, str, bytes, list, tuple, dict with str/int keys or a rollq token array"
_SCALARS = frozenset({type(None), bool, int, float, str, bytes, *ARRAY_TYPES})  # what needs no walking
_KEYS = frozenset({str, int})
_NAMES = {"a": "args", "k": "kwargs", "r": "result"}  # arq's record keys, as an error names them


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, ARRAY_TYPES):
        return msgspec.msgpack.Ext(obj.ext_code, obj.to_bytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")  # check_plain refused it first


def _ext_hook(code: int, data: memoryview) -> Any:
    cls = ARRAY_BY_EXT_CODE.get(code)
    if cls is None:
        raise ValueError(f"unknown msgpack extension code {code}")
    return cls.from_bytes(data)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


class NotPlainData(TypeError):
    """A value for an arq job or result that msgpack would not carry unchanged."""


class RefusedPayload(ValueError):
    """What arq read from Redis is not a msgpack map (a planted pickle, garbage): refused, nothing loaded."""


def check_plain(value: Any, where: str) -> None:
    """Raise NotPlainData unless `value` is plain data (PLAIN), naming the first offending place."""
    stack = [(value, where, 0)]
    while stack:
        item, at, depth = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if depth >= MAX_DEPTH:
            raise NotPlainData(f"{at}: nested deeper than {MAX_DEPTH} levels")
        if kind is list or kind is tuple:
            if set(map(type, item)) <= _SCALARS:  # token id lists and the like: one pass in C
                continue
            stack.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(item) if type(x) not in _SCALARS)
        elif kind is dict:
            for key, x in item.items():
                if type(key) not in _KEYS:
                    raise NotPlainData(f"{at}: key {key!r:.80} is {_type_name(key)}; msgpack keys here are str or int")
                if type(x) not in _SCALARS:
                    stack.append((x, f"{at}[{key!r:.80}]", depth + 1))
        else:
            raise NotPlainData(f"{at} is {_type_name(item)}, not plain data ({PLAIN})")


def exception_record(exc: BaseException) -> dict[str, str]:
    """An exception as plain data: its type name and message, with its cause's (arq wraps the interesting one)."""
    message = str(exc)
    cause = exc.__cause__
    if cause is not None:
        message = f"{message}: {type(cause).__name__}: {cause}" if message else f"{type(cause).__name__}: {cause}"
    return {"exception": type(exc).__name__, "message": message}


def describe_failure(result: Any) -> str:
    """One line for the result of a failed arq job: an exception record, or arq's own text."""
    if isinstance(result, dict) and "exception" in result:
        message = result.get("message") or ""
        return f"{result['exception']}: {message}" if message else str(result["exception"])
    return f"{result!r:.300}"


def encode(data: dict[str, Any]) -> bytes:
    """arq's job_serializer: a job or result record as msgpack; NotPlainData for anything but plain data."""
    result = data.get("r")
    if isinstance(result, BaseException):
        data = {**data, "r": exception_record(result)}
    for key, value in data.items():
        check_plain(value, _NAMES.get(key, key))
    try:
        return _ENCODER.encode(data)
    except (TypeError, ValueError, OverflowError) as exc:  # ints beyond 64 bits
        raise NotPlainData(str(exc)) from None


def decode(payload: bytes) -> dict[str, Any]:
    """arq's job_deserializer: a msgpack map, or RefusedPayload (never unpickled, whatever it is)."""
    try:
        data = _DECODER.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: an extension that isn't a token array
        why = "it starts like a pickle" if payload[:1] == PICKLE_START else str(exc)
        raise RefusedPayload(f"payload is not msgpack ({why}): refused") from None
    except RecursionError:
        raise RefusedPayload("payload is msgpack nested too deeply to decode: refused") from None
    if not isinstance(data, dict):
        raise RefusedPayload(f"payload is msgpack but a {type(data).__name__}, not an arq record (a map): refused")
    return data


def refusal(exc: BaseException) -> RefusedPayload | None:
    """The RefusedPayload behind one of arq's (De)SerializationErrors, if that is what it wraps."""
    cause = exc.__cause__
    return cause if isinstance(cause, RefusedPayload) else None


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


__all__ = [
    "NotPlainData",
    "RefusedPayload",
    "check_plain",
    "decode",
    "describe_failure",
    "encode",
    "exception_record",
    "refusal",
]
