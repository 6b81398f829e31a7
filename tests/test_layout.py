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
    ("mosaicd.rundir", 1),
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
