"""Where an engine may read weights from disk: under its `weights_root`, nowhere else.

`/update_weights_from_disk` takes a path from whoever can call the engine. Without a root an engine would load (or
report on) any file it can read, and its error messages would tell the caller what exists on its filesystem. So:
the path is resolved (symlinks followed, `..` collapsed; `~` is a plain name, never expanded) and must lie under the
resolved root; every path that does not (outside, missing, unreadable) gets the same message. With no root configured
no disk load is allowed at all (defaults closed).

Both backends share this check (the server applies it before `Backend.load_weights`); the files a weights directory
names (an index's shards, `model.safetensors`) must also stay inside that directory (`file_in`)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

OUTSIDE = "model_path is not a weights path under this engine's weights_root"
NO_ROOT = (
    "this engine loads no weights from disk: start it with --weights-root DIR (weights_root, "
    "ROLLQ_ENGINE_WEIGHTS_ROOT) to load weights from under DIR"
)


class WeightsPathRefused(ValueError):
    """A weights path the engine will not read. The message never depends on what exists outside the root."""


def resolve_under(root: str | None, model_path: str) -> Path:
    """`model_path` resolved, when it exists under the resolved `root`; else WeightsPathRefused (OUTSIDE for every
    outside or missing path alike, NO_ROOT when there is no root)."""
    if not root:
        raise WeightsPathRefused(NO_ROOT)
    if not model_path:
        raise WeightsPathRefused(OUTSIDE)
    base = Path(root).resolve()
    try:
        path = Path(model_path).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, unreadable, a symlink loop, a NUL byte
        raise WeightsPathRefused(OUTSIDE) from None
    if not path.is_relative_to(base):
        raise WeightsPathRefused(OUTSIDE)
    return path


def file_in(directory: Path, name: str, what: str = "a file") -> Path:
    """`directory / name` for a plain relative name that stays inside `directory` once resolved (an index's shard
    names come from the file, not from the operator: absolute names, `..` and symlinks out are refused)."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name or "\x00" in name:
        raise WeightsPathRefused(f"{what} named {name!r} is not a plain file name inside its weights directory")
    path = directory / pure
    if not path.resolve().is_relative_to(directory.resolve()):
        raise WeightsPathRefused(f"{what} named {name!r} resolves outside its weights directory")
    return path


__all__ = ["NO_ROOT", "OUTSIDE", "WeightsPathRefused", "file_in", "resolve_under"]
