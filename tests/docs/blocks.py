"""The fenced blocks of a docs page and the marker above each (the docs-test convention, CONTRIBUTING.md).

The line right above a block's opening fence is one HTML comment that says what the docs test does with it:

    <!-- docs: run -->              run as written (bash/console/sh: in bash; python: with the venv's python)
    <!-- docs: file NAME -->        its content is written to NAME in the page's scratch folder
    <!-- docs: scenario -->         run only by the scenario-marked docs test (too long for CI)
    <!-- docs: skip REASON -->      not runnable here, and why

Parsing only: what runs where is tests/docs/test_docs.py.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs:(?P<body>.*?)-->\s*$")
KINDS = ("run", "file", "scenario", "skip")
SHELLS = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Block:
    page: str  # the page's path, relative to the repository root
    line: int  # the opening fence's line (1-based)
    lang: str  # the info string's first word ("" for none)
    text: str  # the content, its fence's indentation removed
    kind: str  # run, file, scenario or skip
    arg: str  # file: the name; skip: the reason

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


class MarkerError(ValueError):
    """A block without a marker, a marker that is not one of the four, or one that is not above a block."""


def parse_marker(body: str) -> tuple[str, str]:
    """`run` -> ("run", ""); `file NAME` -> ("file", NAME); `skip REASON` -> ("skip", REASON); anything else (a
    skip without a reason, a file without a name, an unknown word): MarkerError."""
    kind, _, arg = body.strip().partition(" ")
    arg = arg.strip()
    if kind not in KINDS:
        raise MarkerError(f"unknown docs marker {body.strip()!r} (one of: run, file NAME, scenario, skip REASON)")
    if kind in ("run", "scenario") and arg:
        raise MarkerError(f"docs marker {kind!r} takes nothing after it, got {arg!r}")
    if kind == "file" and (not arg or " " in arg or arg.startswith("/") or ".." in Path(arg).parts):
        raise MarkerError(f"docs marker 'file' needs one relative file name, got {arg!r}")
    if kind == "skip" and not arg:
        raise MarkerError("docs marker 'skip' needs a reason: <!-- docs: skip REASON -->")
    return kind, arg


def page_blocks(page: str, text: str) -> tuple[list[Block], list[str]]:
    """The page's blocks with their markers, and every problem found (a block without a marker, a bad marker, a
    marker not right above a block, an unclosed fence)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    used_markers: set[int] = set()
    inside: set[int] = set()  # lines within blocks: a marker shown in a block is text, not a marker
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            problems.append(f"{page}:{i + 1}: a fence that is never closed")
            break
        inside.update(range(i, end + 1))
        body = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end])
        lang = (m["info"].split() or [""])[0]
        above = MARKER.match(lines[i - 1]) if i > 0 else None
        if above is None:
            problems.append(f"{page}:{i + 1}: a ```{lang} block without a <!-- docs: ... --> marker on the line above")
        else:
            used_markers.add(i - 1)
            try:
                kind, arg = parse_marker(above["body"])
            except MarkerError as e:
                problems.append(f"{page}:{i}: {e}")
            else:
                blocks.append(Block(page, i + 1, lang, textwrap.dedent(body) + "\n", kind, arg))
        i = end + 1
    for n, line in enumerate(lines):
        if MARKER.match(line) and n not in used_markers and n not in inside:
            problems.append(f"{page}:{n + 1}: a docs marker that is not right above a fenced block")
    return blocks, problems


def has_markers(text: str) -> bool:
    return any(MARKER.match(line) for line in text.splitlines())


__all__ = ["KINDS", "SHELLS", "Block", "MarkerError", "has_markers", "page_blocks", "parse_marker"]
