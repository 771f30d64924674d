"""The package's shape, as a reader and an installer see it: a public API with sorted
``__all__`` lists whose names resolve, no module-level import cycle inside the client or the
server, the library never importing the apps, and a wheel that installs only ``fedshard``."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import fedshard

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedshard"


def _isort_key(name: str) -> tuple[int, str]:
    """isort's order (ruff RUF022): CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _packages() -> list[str]:
    names = ["fedshard"]
    for info in pkgutil.walk_packages(fedshard.__path__, "fedshard."):
        if info.ispkg:
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _packages())
def test_every_package_exports_a_sorted_all_whose_names_resolve(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if name == "fedshard.experiments" and exported is None:
        pytest.skip("a command-line tool, not an import API")
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


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _graph(package: str) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (ROOT / package.replace(".", "/")).rglob("*.py")}
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


@pytest.mark.parametrize("package", ["fedshard.client", "fedshard.server", "fedshard.app"])
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
                assert not name.startswith(("fedshard.app", "fedshard.experiments",
                                            "client_app", "server_app")), (path, name)


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
    assert "force-include" not in wheel  # client_app.py / server_app.py stay project files
    # what flwr run loads is still the project's thin apps
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "server_app:app", "clientapp": "client_app:app"}
