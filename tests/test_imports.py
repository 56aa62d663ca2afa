"""The shape of the code: no import cycle among rollq's modules (imports inside functions count: a lazy import
still ties two modules together), and imports point one way between the services."""

import ast
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

# What each part may import of rollq (besides itself). Everyone may use the leaves of the root package: modules (and
# packages, with their modules) that import no service.
LEAVES = {
    "rollq.config",
    "rollq.module_paths",
    "rollq.redis_client",
    "rollq.shield",
    "rollq.http_server",
    "rollq.metrics_server",
    "rollq.tasks",
    "rollq.tracing",
    "rollq.trace_sink",
    "rollq.private_file",
    "rollq.up_record",
    "rollq.user_frame",
}
ALLOWED = {
    "rollq.protocol": set(),
    "rollq.producer": {"rollq.protocol"},
    "rollq.engine": {"rollq.protocol"},
    "rollq.workers": {"rollq.engine", "rollq.protocol"},
    "rollq.trainer": {"rollq.producer", "rollq.engine", "rollq.protocol"},
}
CLIENT_SIDE_OF_ENGINE = "rollq.engine.server"  # workers, the trainer and the engine client never import the servers


def setuptools_table() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_dirs() -> dict[str, Path]:
    """rollq's packages and their folders, from pyproject's package-dir mapping (the one source)."""
    return {pkg: REPO_ROOT / folder for pkg, folder in setuptools_table()["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module of the packages pyproject lists (the sub-packages of the root package included)."""
    packages = set(setuptools_table()["packages"])
    out = {}
    for pkg, folder in package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join([pkg, *parts]).removesuffix(".__init__")
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            if package in packages:  # not a folder inside a package that is no package itself
                out[name] = path
    return out


def is_leaf(module: str) -> bool:
    return any(module == leaf or module.startswith(leaf + ".") for leaf in LEAVES)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The rollq modules `name` imports anywhere in its file (a `from pkg import mod` counts as importing mod)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_module_and_lazy_imports(graph):
    assert {"rollq.cli", "rollq.protocol.messages", "rollq.workers.worker", "rollq.engine.server.app"} <= set(graph)
    assert "rollq.workers.chat_template" in graph["rollq.workers.context"]  # an import inside a method
    assert "rollq.engine.models" in graph["rollq.workers.model_names"]  # an import inside a function
    assert "rollq.tasks.addition" in graph["rollq.trainer.data"]  # a sub-package of the root package


def test_cycle_detection_finds_a_cycle_through_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_cycle(graph):
    assert cycles(graph) == []


def part_of(module: str) -> str:
    for part in ALLOWED:
        if module == part or module.startswith(part + "."):
            return part
    return module


def test_imports_point_one_way(graph):
    wrong = []
    for module, deps in graph.items():
        part = part_of(module)
        if part not in ALLOWED:
            continue  # the root package: the CLI may import every service, the leaves import none (checked below)
        for dep in deps:
            other = part_of(dep)
            entry_point = (
                module.endswith(".__main__") and dep == "rollq.cli"
            )  # `python -m rollq.engine` = `rollq engine`
            if other != part and other not in ALLOWED[part] and not is_leaf(dep) and not entry_point:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_the_leaf_modules_import_no_service_and_services_do_not_import_the_cli(graph):
    leaves = [m for m in graph if is_leaf(m)]
    assert set(LEAVES) <= set(leaves)
    for leaf in leaves:
        assert all(is_leaf(dep) for dep in graph[leaf]), leaf
    services_using_cli = {
        m for m, deps in graph.items() if "rollq.cli" in deps and part_of(m) in ALLOWED and not m.endswith("__main__")
    }
    assert services_using_cli == set()


def test_only_the_engine_servers_import_the_engine_servers(graph):
    wrong = [
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if d.startswith(CLIENT_SIDE_OF_ENGINE) and not m.startswith(CLIENT_SIDE_OF_ENGINE) and m not in ("rollq.cli",)
    ]
    assert wrong == []
