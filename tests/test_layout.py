"""The package layout is the architecture: imports only go down the layers, and the core has no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# lower number = lower layer; a module may import its own layer or lower ones only
LAYERS = [
    ("mosaic_proto", 0),
    ("mosaicd.settings", 1), ("mosaicd.logs", 1), ("mosaicd.outputs", 1), ("mosaicd.extras", 1),
    ("mosaicd.rundir", 1), ("mosaicd.progress", 1),
    ("mosaicd.learning.partition", 2),
    ("mosaicd.learning.data", 3),
    ("mosaicd.learning.tasks", 4),
    ("mosaicd.learning.evaluation", 5), ("mosaicd.learning", 5),
    ("mosaicd.daemon", 6),
    ("mosaicd.experiments", 7),
    ("mosaicd.cli", 8), ("mosaicd.__main__", 8), ("mosaicd", 8),
]
CORE_FORBIDDEN = {"asyncio", "aiohttp", "socket", "torch", "mosaicd", "http", "urllib", "threading", "subprocess"}


def layer(module: str) -> int:
    """The layer of the longest prefix that names `module`."""
    return next(rank for prefix, rank in sorted(LAYERS, key=lambda p: -len(p[0]))
                if module == prefix or module.startswith(prefix + "."))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[str]:
    """Every module `path` imports (absolute names), at any depth of the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            found.append(target)
    return found


FILES = sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_imports_go_down_the_layers(path: Path) -> None:
    me = module_name(path)
    mine = layer(me)
    for target in imports(path):
        if not target.startswith(("mosaic_proto", "mosaicd")):
            if me.startswith("mosaic_proto"):
                assert target.split(".")[0] not in CORE_FORBIDDEN, f"{me} imports {target}: the core has no I/O"
            continue
        if target == "mosaicd" and me.startswith("mosaicd."):
            pytest.fail(f"{me} imports the top package mosaicd (import the module it needs instead)")
        assert layer(target) <= mine, f"{me} (layer {mine}) imports {target} (layer {layer(target)}): upward"


def test_data_does_not_import_tasks() -> None:
    for path in (SRC / "mosaicd" / "learning" / "data").glob("*.py"):
        assert not any(t.startswith("mosaicd.learning.tasks") for t in imports(path)), path


MODULES = {module_name(p): p for p in FILES}


def _resolved(target: str) -> str | None:
    """The module of ours an import names (`from pkg import mod` names pkg.mod where that is a module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        found.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack += node.orelse
            continue
        stack += ast.iter_child_nodes(node)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports at run time, at any depth of the file (function-level imports
    too); a `from package import module` counts as importing that module."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
            else:
                continue
            edges |= {m for m in map(_resolved, targets) if m and m != name and m.startswith("mosaic")}
        graph[name] = edges
    return graph


def test_no_import_cycles() -> None:
    """Routes import domain objects, never the reverse; no module reaches itself through its imports."""
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_no_private_name_is_imported_from_another_module() -> None:
    found = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mosaic")):
                found += [f"{module_name(path)}: {a.name} from {node.module}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


def test_no_class_is_over_200_lines() -> None:
    big = [f"{module_name(p)}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for p in FILES
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)
           and n.end_lineno - n.lineno + 1 > 200]
    assert not big, big


def test_the_roles_share_only_http_the_neutral_modules_and_the_core() -> None:
    """daemon/node/ and daemon/barrier/ import nothing of each other (at run time or for annotations), nor the
    module that puts them together (daemon/embedded.py): a node reaches the barrier it hosts as a
    `daemon.hosting.HostedBarrier`."""
    roles = {"mosaicd.daemon.node": "mosaicd.daemon.barrier", "mosaicd.daemon.barrier": "mosaicd.daemon.node"}
    found = []
    for path in FILES:
        me = module_name(path)
        for mine, other in roles.items():
            if me == mine or me.startswith(mine + "."):
                found += [f"{me} imports {t}" for t in imports(path)
                          if t == other or t.startswith((other + ".", "mosaicd.daemon.embedded"))]
    assert not found, found
