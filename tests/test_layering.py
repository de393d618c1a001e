"""Imports point downward through the floors below, and no module imports itself back through a cycle.

A module belongs to the longest unit that prefixes its name; each unit may import only itself and the units
it lists. `ds4.errors` is a leaf of error classes that backends and models may raise (ops raise
ValueError/TypeError); `ds4.formats` is pure file work below the engine; the server and the benchmark suites
sit on top, and only their entry points in scripts/ import them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("ops", "backends", "models", "ds4", "scripts")
_ENGINE_BELOW = ("ops", "backends", "models", "models.args", "ds4.errors", "ds4.formats", "ds4.tiny")
FLOORS: dict[str, tuple[str, ...]] = {   # unit -> the units below it that it may import, bottom to top
    "ops": (),
    "ds4.errors": (),
    "models.args": ("ds4.errors",),
    "backends": ("ops", "ds4.errors"),
    "models": ("ops", "backends", "models.args", "ds4.errors"),
    "ds4.formats": ("ops", "models.args", "ds4.errors"),
    "ds4.tiny": ("ops", "backends", "models", "models.args", "ds4.errors", "ds4.formats"),
    "ds4": _ENGINE_BELOW,
    "ds4.research": (*_ENGINE_BELOW, "ds4"),
    "ds4.bench": (*_ENGINE_BELOW, "ds4", "ds4.research"),
    "ds4.server": (*_ENGINE_BELOW, "ds4"),
    "scripts": (*_ENGINE_BELOW, "ds4", "ds4.research", "ds4.bench", "ds4.server"),
}
ENTRY_POINTS = {"ds4.server": {"scripts.serve"}, "ds4.bench": {"scripts.bench"}}


def unit(module: str) -> str:
    """The floor `module` belongs to: the longest unit that prefixes its name."""
    return max((u for u in FLOORS if module == u or module.startswith(u + ".")), key=len)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at module level) for every project import in `path`."""
    tree, found = ast.parse(path.read_text()), []
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level:   # relative: resolve against the package
            base = module_name(path).split(".")
            base = base[:len(base) - node.level + (path.name == "__init__.py")]
            package = ".".join(base + ([node.module] if node.module else []))
            names = [package] if node.module else [f"{package}.{a.name}" for a in node.names]
        else:
            continue
        found += [(n, id(node) in top) for n in names if n.split(".")[0] in TOP_LEVEL]
    return found


def project_files() -> list[Path]:
    return [p for top in TOP_LEVEL for p in sorted((ROOT / top).rglob("*.py"))]


def test_imports_point_downward():
    upward = []
    for path in project_files():
        source = unit(module_name(path))
        for name, _ in imports(path):
            target = unit(name)
            if target != source and target not in FLOORS[source]:
                upward.append(f"{path.relative_to(ROOT)} ({source}) imports {name} ({target})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_only_entry_points_import_the_top():
    """The server and the bench suites are imported by nothing but their own modules and their scripts."""
    wrong = []
    for path in project_files():
        module = module_name(path)
        for name, _ in imports(path):
            top = unit(name)
            if top in ENTRY_POINTS and unit(module) != top and module not in ENTRY_POINTS[top]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {module_name(p): {n for n, top in imports(p) if top} for p in project_files()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            n = n if n in graph else n.rsplit(".", 1)[0]   # `from pkg import name` of a non-module name
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n in graph and not state.get(n):
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [m])


def test_the_layering_check_can_fail(tmp_path, monkeypatch):
    """An ops module importing the engine and a formats module importing the engine are both reported."""
    for top in TOP_LEVEL:
        (tmp_path / top).mkdir()
    (tmp_path / "ops" / "bad.py").write_text("from ds4.errors import UsageError\n")
    (tmp_path / "ds4" / "formats").mkdir()
    (tmp_path / "ds4" / "formats" / "bad.py").write_text("from ds4.session import Session\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    try:
        test_imports_point_downward()
    except AssertionError as e:
        assert "ops/bad.py (ops) imports ds4.errors" in str(e)
        assert "ds4/formats/bad.py (ds4.formats) imports ds4.session (ds4)" in str(e)
    else:
        raise AssertionError("the upward imports were not reported")
