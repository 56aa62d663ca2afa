"""The full versions a weight agent keeps beside its engine, and how the next one is made: a full weights directory
is copied in; a delta is applied to the newest one (its base) and the result written as a full directory.

Layout of `local_root`: one directory per version, `v{VERSION}/` (the safetensors files under the base's own names,
with its index when sharded, and every other file of the base: config.json, the tokenizer's), written beside it as
`.v{VERSION}.{random}.tmp/` and renamed into place, so the engine never sees half of one; and `agent-state.json`,
the versions kept, newest last, replaced atomically after each rename.

A restarted agent continues from the newest version its state names (when its directory is still there) rather than
asking for a full update: every delta checks every tensor's checksum against its base before anything is written, so
a base that is not the delta's (files changed under it, a version the trainer did not mean) is refused with 409,
never built upon. A kill mid-prepare leaves a `.tmp` directory (deleted at the next start) and the state unchanged.

Copies, not hardlinks: the trainer's volume and the agent's are different filesystems in every deployment rollq
writes (a hardlink fails there), and a hardlinked file would keep the trainer's owner and mode.

Everything here is blocking file work: the server runs it in a thread, one prepare at a time."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from rollq.engine import weight_delta
from rollq.engine.server.weights import safetensors_files
from rollq.engine.server.weights_root import WeightsPathRefused, file_in, resolve_under

STATE_FILE = "agent-state.json"
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # becomes a directory name: nothing else
OUTSIDE = "model_path is not a weights path under this agent's weights_root"
_COPY_CHUNK = 16 << 20


class Refused(Exception):
    """A prepare the agent will not do: `status` 400 (a malformed request) or 409 (the delta does not apply to what
    the agent holds: the trainer gives this engine a full version)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Kept(msgspec.Struct, frozen=True):
    version: str
    directory: str  # its name in local_root
    # xxh3-128 of the delta manifest that built it ('' = a full version copied in): a prepare asked again is answered
    # from it only for that same delta (a restarted trainer may send another delta to the same version number)
    built_from: str = ""


class State(msgspec.Struct):
    versions: list[Kept] = []  # newest last


class Prepared(msgspec.Struct, frozen=True):
    version: str
    load_path: str  # the full directory the engine loads at the swap
    bytes_read: int  # bytes read from the trainer's volume (the delta, or the full version copied)
    message: str


def _directory_name(version: str) -> str:
    return f"v{version}"


class LocalVersions:
    """The versions in `local_root` and the one prepares build on (`base`: the newest)."""

    def __init__(self, weights_root: str | os.PathLike[str], local_root: str | os.PathLike[str], keep: int = 2) -> None:
        self.weights_root = Path(weights_root).resolve()
        self.local_root = Path(local_root).resolve()
        if self.local_root.is_relative_to(self.weights_root) or self.weights_root.is_relative_to(self.local_root):
            # pruning deletes old versions in local_root: it may never reach the trainer's files
            raise ValueError(f"local_root {self.local_root} and weights_root {self.weights_root} must not overlap")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self.local_root.mkdir(parents=True, exist_ok=True)
        self.state = self._recover()

    # -- what it holds -----------------------------------------------------------------------------------------------

    @property
    def base(self) -> Kept | None:
        return self.state.versions[-1] if self.state.versions else None

    @property
    def version(self) -> str:
        """The version prepares build on ('' = none: only a full version is accepted)."""
        base = self.base
        return base.version if base else ""

    def path_of(self, kept: Kept) -> Path:
        return self.local_root / kept.directory

    def _recover(self) -> State:
        """The recorded state, keeping the versions whose directories are still there; leftovers of a prepare that
        was killed are deleted."""
        for leftover in self.local_root.glob(".*.tmp"):  # a version's directory or the state file
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        try:
            state = msgspec.json.decode((self.local_root / STATE_FILE).read_bytes(), type=State)
        except (OSError, msgspec.DecodeError):  # none or unreadable: start over (a full version comes next)
            state = State()
        kept = [k for k in state.versions if _VERSION.match(k.version) and k.directory == _directory_name(k.version)]
        kept = [k for k in kept if (self.local_root / k.directory).is_dir()]
        named = {k.directory for k in kept}
        for orphan in self.local_root.glob("v*"):  # renamed into place, then killed before the state named it
            if orphan.is_dir() and orphan.name not in named:
                shutil.rmtree(orphan, ignore_errors=True)
        return State(kept)

    def _make_room(self) -> None:
        """Before a version is built: only the newest `keep - 1` versions stay (the base at least), so the agent
        never holds more than `keep` full versions, 2 at least (by default 2: the one served and the one being
        prepared)."""
        stay = max(self.keep - 1, 1)
        if len(self.state.versions) <= stay:
            return
        dropped, versions = self.state.versions[:-stay], self.state.versions[-stay:]
        _write_atomically(self.local_root / STATE_FILE, msgspec.json.encode(State(versions)))
        self.state = State(versions)
        for old in dropped:
            shutil.rmtree(self.path_of(old), ignore_errors=True)

    def _record(self, kept: Kept) -> None:
        """`kept` is the newest version: recorded durably, then the versions past `keep` deleted."""
        versions = [k for k in self.state.versions if k.version != kept.version] + [kept]
        dropped, versions = versions[: -self.keep], versions[-self.keep :]
        _write_atomically(self.local_root / STATE_FILE, msgspec.json.encode(State(versions)))
        self.state = State(versions)
        for old in dropped:
            shutil.rmtree(self.path_of(old), ignore_errors=True)

    # -- prepares ----------------------------------------------------------------------------------------------------

    def prepare(self, model_path: str, weight_version: str) -> Prepared:
        """Make `model_path` (a delta dir or a full weights dir under weights_root) the newest full version in
        local_root. Raises Refused (400: malformed; 409: the delta does not apply to the base held)."""
        if not isinstance(weight_version, str) or not _VERSION.match(weight_version):
            raise Refused(400, "weight_version must be 1-64 letters, digits, '.', '_' or '-' (not first)")
        if not isinstance(model_path, str) or not model_path:
            raise Refused(400, "model_path is required")
        try:
            path = resolve_under(str(self.weights_root), model_path)
        except WeightsPathRefused:
            raise Refused(400, OUTSIDE) from None
        if not path.is_dir():
            raise Refused(400, "model_path must be a delta directory or a full weights directory")
        if weight_delta.is_delta_dir(path):
            return self._apply_delta(path, weight_version)
        return self._copy_full(path, weight_version)

    def _copy_full(self, source: Path, version: str) -> Prepared:
        try:
            safetensors_files(source)  # a weights directory: its safetensors (and shards) inside it
        except (OSError, ValueError) as exc:  # WeightsPathRefused is a ValueError
            raise Refused(400, f"model_path is neither a delta nor a weights directory: {exc}") from None
        try:
            files = _plain_files(source)
        except WeightsPathRefused as exc:
            raise Refused(400, str(exc)) from None
        self._make_room()
        with self._building(version) as tmp:
            read = 0
            for name, src in files:
                read += _copy_file(src, tmp / name)
        kept = Kept(version, _directory_name(version))
        self._record(kept)
        return Prepared(version, str(self.path_of(kept)), read, f"full version {version} copied")

    def _apply_delta(self, directory: Path, version: str) -> Prepared:
        try:
            delta = weight_delta.read(directory)
        except weight_delta.DeltaMismatch as exc:
            raise Refused(409, f"the delta is not readable: {exc}") from None
        manifest = delta.manifest
        if manifest.version != version:
            raise Refused(400, f"weight_version {version!r} is not the delta's version {manifest.version!r}")
        manifest_bytes = (directory / weight_delta.MANIFEST_FILE).read_bytes()
        read = len(manifest_bytes) + manifest.blob_bytes
        digest = xxhash.xxh3_128_hexdigest(manifest_bytes)
        base = self.base
        if base is not None and base.version == version:
            if base.built_from == digest:  # asked again (a retry): built already
                return Prepared(version, str(self.path_of(base)), 0, f"version {version} is prepared already")
            raise Refused(409, f"this agent holds a version {version} built otherwise than by this delta")
        if base is None or base.version != manifest.base_version:
            held = f"version {base.version}" if base else "no version"
            raise Refused(409, f"this agent holds {held}, not the delta's base {manifest.base_version}")
        base_dir = self.path_of(base)
        try:
            shards = safetensors_files(base_dir)
        except (OSError, ValueError) as exc:
            raise Refused(409, f"the base version {base.version} is not readable here: {exc}") from None
        self._make_room()
        with _SafetensorsWeights(shards) as current:
            try:
                changed = weight_delta.apply(current, delta)  # every tensor checked before anything is written
            except weight_delta.DeltaMismatch as exc:
                why = f"the delta does not apply to version {base.version}, the base here: {exc}"
                raise Refused(409, why) from None
            with self._building(version) as tmp:
                for shard in shards:
                    tensors = {name: changed.get(name, current[name]) for name in current.names_in(shard)}
                    save_file(tensors, str(tmp / shard.name), metadata=current.metadata(shard))
                    _fsync(tmp / shard.name)
                shard_names = {s.name for s in shards}
                for name, src in _plain_files(base_dir):
                    if name not in shard_names:  # config.json, the index, the tokenizer's files
                        _copy_file(src, tmp / name)
        kept = Kept(version, _directory_name(version), built_from=digest)
        self._record(kept)
        changed_share = f"{manifest.changed_share:.1%}"
        message = f"version {version} built from {base.version} ({len(changed)} tensors changed, {changed_share})"
        return Prepared(version, str(self.path_of(kept)), read, message)

    def _building(self, version: str) -> _Building:
        return _Building(self.local_root, _directory_name(version))


class _Building:
    """A version's directory under construction: written as a `.tmp` beside its place, renamed there when the block
    ends without an error (an existing one is replaced), deleted otherwise."""

    def __init__(self, root: Path, name: str) -> None:
        self.target = root / name
        self.tmp = root / f".{name}.{uuid.uuid4().hex[:8]}.tmp"

    def __enter__(self) -> Path:
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            _fsync(self.tmp)
            if self.target.exists():
                shutil.rmtree(self.target)
            os.replace(self.tmp, self.target)
            _fsync(self.target.parent)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


class _SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of a version's safetensors files by name, each read when asked (never all at once: apply reads
    them one by one, and the rebuilt ones are what memory holds)."""

    def __init__(self, files: list[Path]) -> None:
        self._files = files
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}

    def __enter__(self) -> _SafetensorsWeights:
        for file in self._files:
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle
            for name in handle.keys():
                if name in self._where:
                    raise weight_delta.DeltaMismatch(f"{name} is in two files of the base version")
                self._where[name] = file
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def names_in(self, file: Path) -> list[str]:
        return [name for name, where in self._where.items() if where == file]

    def metadata(self, file: Path) -> dict[str, str]:
        return self._handles[file].metadata() or {"format": "pt"}  # type: ignore[attr-defined]


def _plain_files(directory: Path) -> list[tuple[str, Path]]:
    """The regular files of a weights directory (not its subdirectories), each by a name that stays inside it."""
    out = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        path = file_in(directory, entry.name)  # a symlink out of the directory is refused
        if path.is_file():
            out.append((entry.name, path))
    return out


def _copy_file(source: Path, target: Path) -> int:
    copied = 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(_COPY_CHUNK):
            dst.write(chunk)
            copied += len(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    return copied


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["STATE_FILE", "Kept", "LocalVersions", "Prepared", "Refused"]
