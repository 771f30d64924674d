"""The package's shape, as a reader and an installer see it: a public API with sorted
``__all__`` lists whose names resolve, no module-level import cycle inside the client or the
server, the library never importing the apps nor the lab tooling (``fedshard_lab``, the
repository's ``lab/``), and a wheel and an app bundle that carry only ``fedshard``."""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fedshard
import fedshard_lab

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedshard"
LAB = ROOT / "lab" / "fedshard_lab"  # its own distribution: lab/pyproject.toml


def _isort_key(name: str) -> tuple[int, str]:
    """isort's order (ruff RUF022): CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _packages() -> list[str]:
    names = []
    for top in (fedshard, fedshard_lab):
        names.append(top.__name__)
        for info in pkgutil.walk_packages(top.__path__, f"{top.__name__}."):
            if info.ispkg:
                names.append(info.name)
    return names


@pytest.mark.parametrize("name", _packages())
def test_every_package_exports_a_sorted_all_whose_names_resolve(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert list(exported) == sorted(exported, key=_isort_key), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not define"
    parent, _, child = name.rpartition(".")
    if parent:  # no re-exported name shadows the package (fedshard.client.train is a package)
        assert getattr(importlib.import_module(parent), child) is module, name


def test_the_top_level_api_names_the_strategy_and_the_client_entry_points() -> None:
    for name in ("SpectralSharding", "ShardingClientApp", "sharding_mod", "receive", "Shard",
                 "handle_query", "handle_train", "handle_evaluate", "keep_ratio_of"):
        assert name in fedshard.__all__, name
    assert fedshard.SpectralSharding.__module__ == "fedshard.server.strategy"
    assert fedshard.ShardingClientApp.__module__ == "fedshard.client.app"


def test_the_root_holds_at_most_eight_plain_modules() -> None:
    plain = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(plain) <= 8, plain


def _imports(path: Path) -> set[str]:
    """fedshard modules ``path`` imports at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedshard"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fedshard"))
    return out


def _source_root(package: str) -> Path:
    """The folder that holds ``package``'s top-level package (the lab's is under lab/)."""
    return ROOT / "lab" if package.split(".")[0] == "fedshard_lab" else ROOT


def _module_name(path: Path) -> str:
    base = ROOT / "lab" if path.is_relative_to(ROOT / "lab") else ROOT
    rel = path.relative_to(base).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _graph(package: str) -> dict[str, set[str]]:
    folder = _source_root(package) / package.replace(".", "/")
    files = {_module_name(p): p for p in folder.rglob("*.py")}
    modules = {m for m in files if not m.endswith("__init__")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        if path.name == "__init__.py":
            continue  # a package's re-exports are not a dependency between its modules
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` found by depth-first search, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", ["fedshard.client", "fedshard.server", "fedshard.app",
                                     "fedshard_lab.engine", "fedshard_lab.experiments"])
def test_no_import_cycle_between_the_modules_of(package: str) -> None:
    assert _cycle(_graph(package)) is None


@pytest.mark.parametrize("library", ["client", "server", "spectral", "sampling", "protocol",
                                     "models", "data"])
def test_the_library_never_imports_the_apps(library: str) -> None:
    for path in (PACKAGE / library).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                assert not name.startswith(("fedshard.app", "fedshard_lab",
                                            "client_app", "server_app")), (path, name)


def _imported_names(path: Path) -> list[str]:
    """Every module ``path`` imports, at module level or inside functions, and every
    ``importlib.import_module``/``-m`` string that names a module of the lab."""
    tree = ast.parse(path.read_text())
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith("fedshard_lab")):
            names.append(node.value)
    return names


def test_the_import_graph_never_leads_from_fedshard_to_the_lab() -> None:
    """No module of fedshard names fedshard_lab (an import, anywhere, or a module string)..."""
    found = [(str(p.relative_to(ROOT)), n) for p in PACKAGE.rglob("*.py")
             for n in _imported_names(p) if n.split(".")[0] == "fedshard_lab"]
    assert not found, found
    assert not (PACKAGE / "experiments").exists() and not (PACKAGE / "app" / "engine").exists()
    # ... and the lab does import fedshard (the direction the graph goes)
    assert any(n.split(".")[0] == "fedshard" for p in LAB.rglob("*.py")
               for n in _imported_names(p))


def test_importing_every_fedshard_module_loads_no_lab_module() -> None:
    """The import graph as Python walks it: every module of fedshard imported in a fresh
    interpreter, after which no fedshard_lab module is loaded."""
    code = ("import importlib, pkgutil, sys, fedshard\n"
            "for m in pkgutil.walk_packages(fedshard.__path__, 'fedshard.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'fedshard_lab'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_math_imports_neither_torch_nor_flower() -> None:
    for path in (PACKAGE / "sampling").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                assert name.split(".")[0] not in ("torch", "flwr"), (path, name)


def test_no_stack_frame_inspection_and_no_private_torch_api_in_the_library() -> None:
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text().replace("torch.__version__", "")
        assert "_getframe" not in text and "inspect.stack" not in text, path
        assert "torch._" not in text and "._optimizer_" not in text, path


def test_the_wheel_installs_only_the_fedshard_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["fedshard"]
    assert not list(PACKAGE.rglob("fedshard_lab"))
    # the lab is its own distribution, installed with pip install -e ./lab
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())
    assert lab["project"]["name"] == "fedshard-lab"
    assert lab["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["fedshard_lab"]
    assert "force-include" not in wheel  # client_app.py / server_app.py stay project files
    # what flwr run loads is still the project's thin apps
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "server_app:app", "clientapp": "client_app:app"}


def test_the_app_bundle_does_not_take_the_lab() -> None:
    """The FAB ``flwr run``/``flwr build`` make from fab-include: the library's code and the
    thin apps, none of the lab tooling."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["flwr"]["app"]["fab-include"]
    assert not any(p.startswith(("lab", "fedshard_lab", "**")) for p in include), include
    build = pytest.importorskip("flwr.cli.build")
    names = zipfile.ZipFile(io.BytesIO(build.build_fab_from_disk(ROOT))).namelist()
    assert "server_app.py" in names and "fedshard/server/strategy.py" in names
    assert not [n for n in names if n.startswith("lab/") or "fedshard_lab" in n]
