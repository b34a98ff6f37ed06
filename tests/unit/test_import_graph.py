"""No import circle between files of the package: every `import` of a shardtune module, at module level, inside a
function (a lazy import is still a dependency) or under `if TYPE_CHECKING:` (a file that names another's type in
its signatures depends on it: two files that need each other's types are one concern split in two), read from the
source with `ast`. A circle is a strongly connected component of more than one module. The packages are layered
(LAYERS): each imports only its own modules and those of the packages below it."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "shardtune"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The shardtune modules `name` imports (`from pkg import mod` counts as mod when mod is a module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package[:len(package) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in child.names:
                    if f"{base}.{a.name}" in modules:
                        found.add(f"{base}.{a.name}")
                    elif base in modules:
                        found.add(base)
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_type_checking_imports_are_read(tmp_path: Path) -> None:
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py"}
    modules["pkg.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
                                "def f():\n    from . import c\n")
    assert imported("pkg.a", modules["pkg.a"], modules) == {"pkg.b", "pkg.c"}


def test_the_package_has_no_import_circle() -> None:
    modules = module_names()
    assert "shardtune.engine.unit" in modules and "shardtune.plan.planner" in modules
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "shardtune.plan.search" in graph["shardtune.plan.planner"]  # lazy and top-level imports both read
    found = circles(graph)
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


# The packages from the ground floor up. A module may import its own package and those below it, never one above.
# "" is the ground floor: shardtune's top-level modules (errors, disk, hub, accelerator, memory, ...).
LAYERS = ["", "simulated", "config", "data", "model", "engine", "checkpoint", "trainer", "plan", "launcher"]


def layer_of(name: str, modules: dict[str, Path]) -> int:
    parts = name.split(".")
    package = parts[1] if len(parts) > 2 or (len(parts) == 2 and modules[name].name == "__init__.py") else ""
    return LAYERS.index(package)


def test_every_package_imports_only_downward() -> None:
    modules = module_names()
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS) - {""}  # a new package gets its place in LAYERS
    upward = sorted(f"{name} -> {dep}" for name, path in modules.items() for dep in imported(name, path, modules)
                    if layer_of(dep, modules) > layer_of(name, modules))
    assert upward == []


def test_an_upward_import_is_found() -> None:
    modules = module_names()
    assert layer_of("shardtune.accelerator", modules) < layer_of("shardtune.launcher.cli", modules)
    assert layer_of("shardtune.trainer", modules) == LAYERS.index("trainer")
