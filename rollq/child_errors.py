"""The ERROR lines of supervised children's logs, for the console of the process that supervises them (`rollq up`).

An engine whose steps fail, or a worker that dead-letters jobs, says so in its own log (runs/RUN/logs/NAME.log), where
nobody looks while the run's progress lines look fine (issue 42). `ChildErrors` follows those logs and hands back
console lines: each distinct error once, when it first comes (its first line, and the exception a traceback ends
with), then a count when the same error has come 10, 100, 1000... times, and a summary per child at the end. Errors
are the same when their text is, digits aside (entry ids, ports, counts), so a flood of one error is a few lines.

Records are the `rollq` processes' logging format (`TIME LEVEL LOGGER: message`, then any traceback lines); a record
is complete at the next record's line or, the last one, when a poll finds nothing new in its log.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

HEADER = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) (\S+): (.*)$")
LOUD_LEVELS = frozenset({"ERROR", "CRITICAL"})
DIGITS = re.compile(r"\d+")
MAX_CHARS = 400  # of a console line's quote of the error
READ_BYTES = 4 << 20  # read of one log per poll: a flooded log is caught up with over several


class _Record:
    """An ERROR record being read: its header's logger and message, and its last continuation line."""

    __slots__ = ("logger", "message", "last")

    def __init__(self, logger: str, message: str) -> None:
        self.logger = logger
        self.message = message
        self.last = ""  # a traceback's last line: the exception

    def text(self) -> str:
        if self.last and self.last not in self.message:
            return f"{self.message}: {self.last}"
        return self.message


class _Follow:
    """Where one log has been read to."""

    __slots__ = ("offset", "partial", "record")

    def __init__(self) -> None:
        self.offset = 0
        self.partial = ""  # an unterminated last line, completed by the next read
        self.record: _Record | None = None


class _Seen:
    """One distinct error of one child."""

    __slots__ = ("text", "count")

    def __init__(self, text: str) -> None:
        self.text = text
        self.count = 1


class ChildErrors:
    """Console lines for the ERROR records of children's logs (see the module docstring). `max_distinct`: distinct
    errors shown per child; past it the rest are counted in the summary only."""

    def __init__(self, *, max_distinct: int = 20) -> None:
        self.max_distinct = max_distinct
        self._follows: dict[str, _Follow] = {}
        self._seen: dict[str, dict[str, _Seen]] = {}  # child -> normalized text -> its first text and count
        self._totals: dict[str, int] = {}
        self._logs: dict[str, Path] = {}

    def poll(self, logs: Mapping[str, Path]) -> list[str]:
        """Read what each child's log gained since the last poll; the console lines it calls for."""
        lines: list[str] = []
        for name, path in logs.items():
            self._logs[name] = path
            follow = self._follows.setdefault(name, _Follow())
            for record in self._read(path, follow):
                lines += self._note(name, record)
        return lines

    def summary(self) -> list[str]:
        """One line per child that logged errors: how many, how many distinct, and its log."""
        return [
            f"{name} logged {total} ERROR line{'s' if total > 1 else ''} ({len(self._seen[name])} distinct): "
            f"{self._logs[name]}"
            for name, total in self._totals.items()
        ]

    def _read(self, path: Path, follow: _Follow) -> list[_Record]:
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                if f.tell() < follow.offset:  # the log was replaced: read the new one from its start
                    follow.offset, follow.partial, follow.record = 0, "", None
                f.seek(follow.offset)
                data = f.read(READ_BYTES)
        except OSError:
            return []
        follow.offset += len(data)
        done: list[_Record] = []
        if not data:  # nothing new: the record read last is complete
            if follow.record is not None:
                done.append(follow.record)
                follow.record = None
            return done
        *complete, follow.partial = (follow.partial + data.decode(errors="replace")).split("\n")
        for line in complete:
            header = HEADER.match(line)
            if header is None:
                if follow.record is not None and line.strip():
                    follow.record.last = line.strip()
                continue
            if follow.record is not None:
                done.append(follow.record)
            level, logger, message = header.groups()
            follow.record = _Record(logger, message.strip()) if level in LOUD_LEVELS else None
        return done

    def _note(self, name: str, record: _Record) -> list[str]:
        text = record.text()
        key = f"{record.logger}: {DIGITS.sub('N', text)}"
        seen = self._seen.setdefault(name, {})
        self._totals[name] = self._totals.get(name, 0) + 1
        known = seen.get(key)
        if known is not None:
            known.count += 1
            if _is_power_of_ten(known.count):
                return [f'{name}: "{_quote(known.text, 120)}" came {known.count} times so far']
            return []
        if len(seen) == self.max_distinct:
            seen[key] = _Seen(text)
            return [f"{name}: more than {self.max_distinct} distinct ERROR lines; the rest are in {self._logs[name]}"]
        seen[key] = _Seen(text)
        if len(seen) > self.max_distinct:
            return []
        return [f"{name}: {_quote(text, MAX_CHARS)} ({record.logger}; {self._logs[name]})"]


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _quote(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."


__all__ = ["ChildErrors"]
