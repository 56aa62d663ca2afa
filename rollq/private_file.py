"""Files only their owner may read (RUN_DIR/up.json with the Redis password, RUN_DIR/dead-letters.jsonl with jobs'
data), replaced whole."""

from __future__ import annotations

import os
from pathlib import Path

MODE = 0o600


def write_private(path: Path, data: bytes) -> None:
    """Write `path` atomically with mode 0600: a new file beside it, opened with O_EXCL (never one someone else made,
    never wider for an instant; the umask can only narrow it), renamed over the old one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


__all__ = ["MODE", "write_private"]
