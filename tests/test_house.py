"""The house rules of issue 28, read off the source with ``ast``: no import circle among the product's
modules (counting imports inside functions too: a lazy import only hides a circle), no private name
imported from another module, no product file over 400 lines and no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the source folders and the package names they are installed as (pyproject.toml)
PACKAGES = {"treespec": "treespec", "plugins": "treespec.plugins", "cli": "treespec.cli"}


def _modules() -> dict[str, Path]:
    """Every product module by its installed name."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every import statement of the module, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {  # ``if TYPE_CHECKING:`` blocks: annotations, never run (``if not TYPE_CHECKING:`` does run)
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [alias.name for alias in node.names]))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, names: list[str]) -> list[str]:
    """The product modules an import runs: the module (a package's ``__init__`` runs too when its
    submodules are imported from it), and the submodules imported by name from a package. Not seen:
    what a module imports by name at run time (``importlib``, a package's lazy ``__getattr__``)."""
    hits = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return [module, *hits] if module in MODULES else hits


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for name, path in MODULES.items():
        graph.add_node(name)
        for module, names in _imports(name, path):
            for hit in _resolve(module, names):
                if hit != name and not name.startswith(f"{hit}."):  # a package's own __init__ is not a circle
                    graph.add_edge(name, hit)
    return graph


def test_the_graph_sees_the_product():
    """The check reads real edges (a graph with none would pass the next test vacuously)."""
    graph = _graph()
    assert len(MODULES) > 100
    assert graph.has_edge("treespec.native_matmul", "treespec.weight_blocks")
    assert graph.has_edge("treespec.gguf_blocks", "treespec.native_matmul")
    assert graph.has_edge("treespec.plugins.eagle", "treespec.weight_blocks")


def test_every_import_form_is_an_edge(tmp_path):
    """Plain, aliased, from-, relative and function-level imports are read; ``if TYPE_CHECKING:`` ones are
    not, ``if not TYPE_CHECKING:`` ones are."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import treespec.gguf\n"
        "import treespec.kv as kv\n"
        "from treespec import weight_blocks\n"
        "from .tree import DraftTree\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from treespec.decoder import Decoder\n"
        "if not TYPE_CHECKING:\n    import treespec.errors\n"
        "def f():\n    from treespec.plugins import eagle\n"
    )
    reached = {hit for module, names in _imports("treespec.probe", source) for hit in _resolve(module, names)}
    assert {"treespec.gguf", "treespec.kv", "treespec.weight_blocks", "treespec.tree"} <= reached
    assert {"treespec.errors", "treespec.plugins.eagle", "treespec.plugins"} <= reached
    assert "treespec.decoder" not in reached


def test_no_import_circle():
    """Including imports inside functions: ``decoder`` ↔ ``batch`` once hid as a lazy import."""
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import circles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_no_private_name_is_imported_across_modules():
    crossing = [
        f"{name} imports {n} from {module}"
        for name, path in MODULES.items()
        for module, names in _imports(name, path)
        for n in names
        if n.startswith("_") and not n.startswith("__") and module.split(".")[0] == "treespec"
    ]
    assert not crossing, crossing


@pytest.mark.parametrize("name", sorted(MODULES))
def test_file_and_function_sizes(name):
    source = MODULES[name].read_text()
    assert len(source.splitlines()) < 400, f"{name}: {len(source.splitlines())} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"{name}: " + ", ".join(long)
