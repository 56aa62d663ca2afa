"""Settings handed to a child process through an inherited pipe: how `rollq up` gives its engines and workers their
keys and the Redis URL (with its password) without a command line (`ps`, /proc/<pid>/cmdline: readable by every
local user, even for a non-dumpable process), an environment, or a file on disk.

The parent writes the settings (a config document: shared keys and one section per service, JSON being YAML) into a
pipe and closes its end; the child inherits the read end at the same descriptor number and reads it as its config
file, `--config /dev/fd/N`, once, at start, before anything else of it runs. Nothing is left behind: the pipe is
empty once read and is gone when the child's descriptor closes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

# Written whole before the child starts, so it must fit the pipe's buffer (4 KiB is POSIX's atomic minimum; Linux
# buffers 64 KiB): a few keys and a URL.
MAX_BYTES = 4096


class HandedConfig:
    """One child's settings in a pipe: start the child with `argv()` among its arguments and `fd` in its pass_fds,
    then `close()` (the parent's copy of the read end)."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        data = json.dumps(document).encode()
        if len(data) > MAX_BYTES:
            raise ValueError(f"settings handed to a child must fit {MAX_BYTES} bytes, these are {len(data)}")
        read, write = os.pipe()
        try:
            os.write(write, data)  # an empty pipe takes MAX_BYTES at once: never blocks
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)  # the child reads to the end of the pipe
        self.fd = read

    def argv(self) -> list[str]:
        return ["--config", f"/dev/fd/{self.fd}"]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> HandedConfig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MAX_BYTES", "HandedConfig"]
