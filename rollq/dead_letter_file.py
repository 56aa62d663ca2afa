"""A run's dead letters written to a file: `rollq up` does it on the way out, before its private Redis (which held
them, each with its error and traceback) goes. One JSON object a line, oldest first: the entry id, the error (type,
message, traceback, worker, attempt) and the job (its data among it, hence mode 0600)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from rollq.private_file import write_private
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.redis_client import run_partitions

FILE = "dead-letters.jsonl"
PAGE = 500  # entries read per XRANGE


async def write_dead_letters(redis: aioredis.Redis, run: str, path: Path, *, after: bool = False) -> int:
    """Write every dead letter of `run` (all partitions) to `path` (mode 0600), if there is any; returns how many.
    `after`: the file's letters so far are kept ahead of them (a resumed run in a fresh Redis: the earlier life's
    letters are in the file only); else it is replaced (a Redis that kept the run holds them all). A letter that does
    not decode is written with its error and the entry's raw payload size."""
    keys = RunKeys(run)
    codec = Codec()
    lines: list[bytes] = []
    for part in range(await run_partitions(redis, keys.partitions)):
        stream = keys.at(part).dead
        start = "-"
        while True:
            entries = await redis.xrange(stream, min=start, count=PAGE)
            for eid, fields in entries:
                payload = fields.get(PAYLOAD_FIELD, b"")
                try:
                    record = msgspec.to_builtins(codec.decode_dead_letter(payload))
                except CodecError as exc:
                    record = {"entry_id": eid.decode(), "undecodable": str(exc), "bytes": len(payload)}
                lines.append(msgspec.json.encode(record) + b"\n")
            if len(entries) < PAGE:
                break
            start = "(" + entries[-1][0].decode()  # exclusive: after the last one read
    if not lines:
        return 0
    kept = path.read_bytes() if after and path.exists() else b""
    write_private(path, kept + b"".join(lines))
    return len(lines)


__all__ = ["FILE", "write_dead_letters"]
