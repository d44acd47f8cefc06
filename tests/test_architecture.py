"""The house rules of src/repro (docs/architecture.md): every module sits in one layer
package, a layer imports only the layers below it, and no module imports itself back
through others. Every import statement counts -- at module level, inside a function, under
``if TYPE_CHECKING:`` -- because each is a way a change down below can break code above, and
each circle makes "what does this module need" unanswerable.

The graph is read from the source (``ast``), so these tests need nothing imported."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# What each layer may import (itself included). The top-level modules: repro (the package:
# its version and the old import paths; any layer may read them) and repro.__main__ and
# repro.cli (the command line, on top).
ALLOWED = {
    "base": {"base"},
    "defense": {"base", "defense"},
    "records": {"base", "defense", "records"},
    "components": {"base", "components"},
    "engine": {"base", "defense", "records", "components", "engine"},
    "tools": {"base", "defense", "records", "components", "engine", "tools"},
    "cli": {"base", "defense", "records", "components", "engine", "tools", "cli"},
}
for _allowed in ALLOWED.values():
    _allowed.add("package")  # repro itself: its version and the old paths, importing nothing
ALLOWED["package"] = set()
TOP_LEVEL = {"repro": "package", "repro.__main__": "cli", "repro.cli": "cli"}


def modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted name -> file of every module of the repro package under ``src``."""
    found = {}
    for path in sorted((src / "repro").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the repro modules it imports, from every import statement in its file.
    ``from package import name`` counts as importing ``package.name`` when that is a module
    (else the package); a relative import is resolved against the module's package."""
    known = modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
            else:
                continue
            for target in targets:
                while target and target not in known:  # an attribute of a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def layer(module: str) -> str | None:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    inside = len(parts) > 1 and parts[1] in ALLOWED and parts[1] not in ("cli", "package")
    return parts[1] if inside else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_sits_in_a_layer() -> None:
    homeless = [m for m in modules() if layer(m) is None]
    assert not homeless, (
        f"{homeless}: put each module in one layer package of src/repro "
        f"({', '.join(sorted(set(ALLOWED) - {'cli', 'package'}))}; docs/architecture.md)"
    )


def test_no_layer_imports_a_layer_above_it() -> None:
    graph = import_graph()
    wrong = sorted(
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in graph.items()
        for t in targets
        if layer(m) is not None and layer(t) not in ALLOWED[layer(m)]
    )
    assert not wrong, "\n".join(["imports against the layers (docs/architecture.md):", *wrong])


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (every import statement counts):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_checks_see_a_cycle_and_a_layer_break(tmp_path: Path) -> None:
    """The graph reader and the cycle finder on a made-up package: a function-level import
    and one under TYPE_CHECKING close a circle; a base module importing the engine breaks
    the layers. (Tests that pass on clean code prove nothing unless they can fail.)"""
    package = tmp_path / "repro"
    for sub in ("", "base", "engine"):
        (package / sub).mkdir(exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    (package / "base" / "files.py").write_text("def f():\n    from repro.engine.loop import run\n")
    (package / "engine" / "loop.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from repro.base import files\n"
    )
    graph = import_graph(tmp_path)
    assert graph["repro.base.files"] == {"repro.engine.loop"}
    assert graph["repro.engine.loop"] == {"repro.base.files"}
    assert cycles(graph) == [["repro.base.files", "repro.engine.loop"]]
    assert "engine" not in ALLOWED[layer("repro.base.files")]


OLD_PATHS = [  # a sample of each layer; repro/__init__.py's table has them all
    ("repro.models", "repro.components.models"),
    ("repro.data.augment", "repro.components.data.augment"),
    ("repro.loggers", "repro.records.loggers"),
    ("repro.callbacks", "repro.engine.callbacks"),
    ("repro.determinism", "repro.defense.determinism"),
    ("repro.errors", "repro.base.errors"),
    ("repro.testing", "repro.tools.testing"),
]


@pytest.mark.parametrize(("old", "new"), OLD_PATHS)
def test_old_import_paths_are_the_moved_modules(old: str, new: str) -> None:
    """``_target_`` strings in conf/ (part of every config hash, so of every old checkpoint)
    and forks' imports name the modules where they were before the layers: each old path
    is the very module object at its new home, so a patch through either name holds."""
    assert importlib.import_module(old) is importlib.import_module(new)


def test_every_old_path_names_a_module_that_exists() -> None:
    import repro

    missing = [f"{old} -> {new}" for old, new in repro.MOVED.items() if new not in modules()]
    assert not missing, missing
    assert "repro.engine.dist" in repro.MOVED.values()
