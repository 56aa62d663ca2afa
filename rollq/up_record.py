"""The file `rollq up` leaves in its run directory, RUN_DIR/up.json: the run's name (a later `rollq up --run-dir
RUN_DIR` resumes that run) and, while `up` runs, the URL of its Redis with the password of the private one (`rollq
status --run-dir RUN_DIR` reads it). Created with mode 0600, never readable by another user even for an instant: the
password is nowhere else on disk, the console or the logs. Once `up` has exited the URL is taken out (its private Redis
is gone with it).

`describe_run_dir` says what a run directory holds, for the messages that have nothing live to show.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from rollq.private_file import MODE, write_private

FILE = "up.json"


class UpRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What RUN_DIR/up.json holds."""

    run: str  # the run's name: its Redis keys' namespace
    redis_url: str | None = None  # while `up` runs: its Redis (the password in it); None once it has exited
    pid: int = 0  # the `rollq up` process that wrote it


def write_record(run_dir: Path, record: UpRecord) -> Path:
    """Write RUN_DIR/up.json atomically: a new file opened with mode 0600 (O_EXCL: never one someone else made, never
    wider for an instant; the umask can only narrow it), renamed over the old one."""
    path = Path(run_dir) / FILE
    write_private(path, msgspec.json.encode(record) + b"\n")
    return path


def read_record(run_dir: Path) -> UpRecord | None:
    """RUN_DIR/up.json, or None when there is none. ValueError naming the file when it is not one `up` wrote."""
    path = Path(run_dir) / FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=UpRecord)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a record of `rollq up` ({exc})") from None


def describe_run_dir(run_dir: Path) -> str:
    """What a run directory holds, one phrase per thing: steps in metrics.jsonl, the last checkpoint, dead letters,
    plot, logs (for a message about a run that no longer runs)."""
    run_dir = Path(run_dir)
    parts = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        steps = sum(1 for line in metrics.read_bytes().splitlines() if line.strip())
        parts.append(f"metrics.jsonl ({steps} step{'s' if steps != 1 else ''})")
    if (run_dir / "eval.jsonl").exists():
        parts.append("eval.jsonl")
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    if checkpoints:
        parts.append(f"checkpoints/ (latest {checkpoints[-1]})")
    dead = run_dir / "dead-letters.jsonl"
    if dead.exists():
        letters = sum(1 for line in dead.read_bytes().splitlines() if line.strip())
        parts.append(f"dead-letters.jsonl ({letters} failed job{'s' if letters != 1 else ''} with their tracebacks)")
    if (run_dir / "plot.png").exists():
        parts.append("plot.png")
    logs = sorted(p.name for p in (run_dir / "logs").glob("*.log"))
    if logs:
        parts.append(f"logs/ ({', '.join(logs)})")
    return ", ".join(parts) if parts else "nothing yet"


__all__ = ["FILE", "MODE", "UpRecord", "describe_run_dir", "read_record", "write_record"]
