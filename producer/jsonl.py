"""JSON Lines input: one JSON object per line, blank lines skipped, a bad line named by file and number."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


class JsonlError(ValueError):
    pass


def json_objects(lines: Iterable[str], name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            # without its line ending: a line cut short is reported at its last column, not at column 1 after the
            # newline (a file's lines keep theirs; splitlines() drops them)
            data = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as exc:
            raise JsonlError(f"{name}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(data, dict):
            raise JsonlError(f"{name}:{lineno}: expected a JSON object, got {type(data).__name__}")
        yield lineno, data


__all__ = ["JsonlError", "json_objects"]
