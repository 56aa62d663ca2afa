"""One import package: the wheel holds only `rollq`, every package folder is mapped into it, and `rollq.*` imports
work from a normal install and from the editable one, wherever Python starts (the repository root included, where
the top-level `rollq/` folder is found first)."""

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.slow

SERVICES = ("protocol", "producer", "workers", "engine", "trainer")
PROBE = (
    "import rollq, rollq.cli, rollq.protocol.messages, rollq.producer.producer, rollq.workers.worker, "
    "rollq.engine.pool, rollq.engine.server.app, rollq.trainer.config; "
    "print(rollq.protocol.messages.__file__); print(rollq.cli.__file__)"
)


def pyproject_packages() -> list[str]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO_ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    [built] = out.glob("rollq-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed the normal way (copied into a site folder, no editable hook)."""
    target = tmp_path_factory.mktemp("site")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return target


def test_every_package_folder_is_listed_in_pyproject():
    folders = {"rollq": REPO_ROOT / "rollq", **{f"rollq.{s}": REPO_ROOT / s for s in SERVICES}}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join([package, *parts]))
    assert found == set(pyproject_packages())


def test_the_wheel_holds_only_the_rollq_package_with_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"rollq", "rollq-0.1.0.dist-info"}
    for service in SERVICES:  # every module of every folder, under rollq/
        for module in (REPO_ROOT / service).rglob("*.py"):
            assert f"rollq/{service}/{module.relative_to(REPO_ROOT / service).as_posix()}" in names
    assert "rollq/cli.py" in names and "rollq/workers/builtin/rlvr.py" in names


@pytest.mark.parametrize("cwd", ["elsewhere", "repository root"])
def test_a_normal_install_imports_from_anywhere(installed, tmp_path, cwd):
    target = installed
    packages = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert packages == {"rollq", "bin"}  # bin: the `rollq` console script
    workdir = tmp_path if cwd == "elsewhere" else REPO_ROOT
    # -I -S: no PYTHONPATH, no cwd on sys.path and no site (so not the dev venv's editable-install hook, which would
    # rescue a broken mapping): the install, then the dependencies. The repository-root case puts the checkout first,
    # as `python -m` / `pytest` started there do.
    paths = [str(target), *(p for p in sys.path if p.endswith("site-packages"))]
    if cwd == "repository root":
        paths.insert(0, str(REPO_ROOT))
    code = f"import sys; sys.path[:0] = {paths!r}; {PROBE}"
    res = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=workdir, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    messages, cli = res.stdout.split()
    expected_root = target / "rollq" if cwd == "elsewhere" else REPO_ROOT
    assert Path(messages).is_relative_to(expected_root) and Path(cli).is_relative_to(expected_root)


@pytest.mark.parametrize("cwd", ["elsewhere", "repository root"])
def test_the_editable_install_imports_from_anywhere(tmp_path, cwd):
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path if cwd == "elsewhere" else REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    messages, _ = res.stdout.split()
    assert Path(messages) == REPO_ROOT / "protocol" / "messages.py"
    res = subprocess.run(
        [sys.executable, "-m", "rollq.engine", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and "--backend" in res.stdout


def test_the_bare_service_names_are_not_importable_from_an_install(installed, tmp_path):
    target = installed
    code = f"import sys; sys.path.insert(0, {str(target)!r}); import importlib.util as u; " + "; ".join(
        f"assert u.find_spec({s!r}) is None, {s!r}" for s in SERVICES
    )
    res = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
