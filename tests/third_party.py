"""Third-party packages as their registries ship them, for the tests that check rollq against the real thing.

Wheels are fetched once (`pip download --no-deps`, pinned) into $ROLLQ_CACHE/wheels and reused by every later run;
a package whose pins clash with the project's environment gets its own cached site folder (`pip install --no-deps
--target`) that only the processes of its tests put on their path, or a virtualenv of its own (`venv`: a package
run by its own interpreter, as rollq's environment drivers are). Nothing from these packages is copied into the
repository. The xdist processes take turns under a file lock, so one fetches and the others find its copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from rollq.engine.tiny_model import cache_root

PIP_TIMEOUT_S = 600  # a cold fetch of a large wheel (ray: 72 MB)


def wheels_dir() -> Path:
    return cache_root() / "wheels"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pip(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    if res.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}")


def _wheel_prefix(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    if not version:
        raise ValueError(f"pin the version: {requirement!r} (name==version)")
    return f"{name.replace('-', '_').lower()}-{version}-"


def fetch_wheel(requirement: str) -> Path:
    """The wheel of `name==version`, from the cache or fetched into it."""
    prefix = _wheel_prefix(requirement)
    target = wheels_dir()

    def cached() -> Path | None:
        hits = [p for p in target.glob("*.whl") if p.name.lower().startswith(prefix)]
        return hits[0] if hits else None

    with _locked("wheels"):
        hit = cached()
        if hit is None:
            target.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target) as tmp:
                _pip("download", "-q", "--no-deps", "--only-binary", ":all:", "-d", tmp, requirement)
                for wheel in Path(tmp).glob("*.whl"):
                    wheel.rename(target / wheel.name)
            hit = cached()
        if hit is None:
            raise RuntimeError(f"pip download {requirement} gave no wheel named {prefix}*")
        return hit


def unpacked(requirement: str) -> Path:
    """The files of `name==version`'s wheel, unpacked once into the cache (read them, don't change them)."""
    wheel = fetch_wheel(requirement)
    target = cache_root() / "unpacked" / wheel.stem
    with _locked("unpacked"):
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                zipfile.ZipFile(wheel).extractall(tmp)
                Path(tmp).rename(target)
                Path(tmp).mkdir()  # for TemporaryDirectory's clean-up
    return target


def site(name: str, requirements: list[str]) -> Path:
    """A folder with exactly `requirements` installed (`--no-deps`, each pinned): put it first on a process's path
    to run a package whose own pins clash with the project's environment. Cached per set of requirements."""
    for requirement in requirements:
        _wheel_prefix(requirement)  # each one pinned
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:12]
    target = cache_root() / "sites" / f"{name}-{key}"
    with _locked("sites"):
        if not target.is_dir():
            wheels = [str(fetch_wheel(r)) for r in requirements]
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                _pip("install", "-q", "--no-deps", "--no-compile", "--target", tmp, *wheels)
                Path(tmp).rename(target)
                Path(tmp).mkdir()
    return target


VENV_DONE = ".rollq-complete"  # written last: a virtualenv without it was interrupted while being built


def venv(name: str, requirements: Path) -> Path:
    """The python of a virtualenv holding exactly the pinned `requirements` file (the full closure, `pip freeze`d:
    installed `--no-deps`), built once per content of the file under $ROLLQ_CACHE/venvs. Its wheels come from the
    wheels cache, fetched into it (`pip download`) the first time a file needs one it lacks."""
    text = requirements.read_text()
    pins = [line.split("#")[0].strip() for line in text.splitlines()]
    for pin in filter(None, pins):
        _wheel_prefix(pin)  # each one pinned
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    target = cache_root() / "venvs" / f"{name}-{key}"
    python = target / "bin" / "python"
    with _locked("venvs"):
        if (target / VENV_DONE).is_file():
            return python
        shutil.rmtree(target, ignore_errors=True)  # an interrupted build
        target.parent.mkdir(parents=True, exist_ok=True)
        # Not relocatable (its scripts name their interpreter by path): built where it stays.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=120)
        wheels = wheels_dir()
        wheels.mkdir(parents=True, exist_ok=True)
        # Compiled (.pyc) as pip installs by default: its programs start once per episode, often as agent_user, which
        # cannot write the cache, and compiling openenv's imports (gradio) anew cost seconds of CPU each time.
        install = ["--python", str(python), "install", "-q", "--no-deps", "--no-index"]
        install += ["--find-links", str(wheels), "-r", str(requirements)]
        try:
            _pip(*install)
        except RuntimeError:  # some wheel is not cached yet: fetch the missing ones, then install offline again
            fetch = ["download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(wheels)]
            with _locked("wheels"):
                _pip(*fetch, "-r", str(requirements))
            _pip(*install)
        (target / VENV_DONE).write_text(text)
    return python
