"""The package layout is the architecture: imports only go down the layers, and the core has no I/O."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# lower number = lower layer; a module may import its own layer or lower ones only
LAYERS = [
    ("mosaic_proto", 0),
    ("mosaicd.settings", 1), ("mosaicd.logs", 1), ("mosaicd.outputs", 1), ("mosaicd.extras", 1),
    ("mosaicd.files", 1), ("mosaicd.rundir", 1), ("mosaicd.progress", 1),
    ("mosaicd.trackers", 1), ("mosaicd.protocol", 1),
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
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _resolved(target: str) -> str | None:
    """The module of ours an import names (`from pkg import mod` names pkg.mod where that is a module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at any depth of the file (function-level imports and those under
    `if TYPE_CHECKING:` too: an annotation that needs a module that needs this one is a circle all the same); a
    `from package import module` counts as importing that module."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
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


ROLES = ("mosaicd.daemon.node", "mosaicd.daemon.barrier")


def test_the_roles_share_only_http_and_the_core() -> None:
    """A member and the barrier talk through typed messages (`mosaic_proto`) over `daemon/http`; a process that hosts
    both (a peer list's rank 0, an own training loop) puts them together above both packages."""
    graph = import_graph()
    crossing = [f"{me} imports {target}" for me, targets in graph.items() for target in sorted(targets)
                for mine, other in (ROLES, ROLES[::-1]) if me.startswith(mine) and target.startswith(other)]
    assert not crossing, crossing


def test_no_class_is_over_300_lines() -> None:
    """A smoke alarm, not a target: a class is as large as what belongs together (the rule is that nothing outside
    a class's module writes its fields, below)."""
    big = [f"{module_name(p)}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for p in FILES
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)
           and n.end_lineno - n.lineno + 1 > 300]
    assert not big, big


# -- who writes a class's fields -------------------------------------------------------------------------------------
def class_fields() -> dict[str, dict[str, set[str]]]:
    """module -> class -> the attributes the class gives itself (`self.x = ...` in its methods, fields in its body)."""
    found: dict[str, dict[str, set[str]]] = {}
    for name, tree in TREES.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            fields = {t.id for t, _ in map(_assignment, cls.body) if isinstance(t, ast.Name)}
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    fields.add(node.attr)
            found.setdefault(name, {})[cls.name] = fields
    return found


def _assignment(node: ast.AST) -> tuple[ast.AST | None, ast.AST | None]:
    """`x = C(...)` -> (x, the call); `x: C = ...` -> (x, C); anything else -> (None, None)."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        return node.targets[0], node.value
    if isinstance(node, ast.AnnAssign):
        return node.target, node.annotation
    return None, None


def _class_named(expr: ast.AST | None) -> str | None:
    """`C(...)`, `C`, `C | None`, `"C"`: the class name an annotation or a constructor call names."""
    if isinstance(expr, ast.Call):
        expr = expr.func
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id[:1].isupper():
            return expr.value.id  # C.from_json(...)
    if isinstance(expr, ast.BinOp):
        return _class_named(expr.left) or _class_named(expr.right)
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value.split("|")[0].strip() or None
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else None


def member_types() -> dict[str, dict[str, str]]:
    """class -> {attribute: the class of ours it holds}, from `self.x = C(...)` or `self.x: C` in its methods."""
    found: dict[str, dict[str, str]] = {}
    for tree in TREES.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            members = found.setdefault(cls.name, {})
            for node in ast.walk(cls):
                target, value = _assignment(node)
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self" and (c := _class_named(value)) and c[:1].isupper():
                    members.setdefault(target.attr, c)
    return found


def foreign_writes(path: Path, classes: dict[str, dict[str, set[str]]], held: dict[str, dict[str, str]]) -> list[str]:
    """Attribute writes in `path` to an object of a class of ours defined in another module: the object's class is
    known from a parameter's annotation, a local made by calling the class, or `self.x` made so in `__init__`."""
    me = module_name(path)
    ours = {cls: (mod, fields) for mod, per in classes.items() for cls, fields in per.items() if mod != me}
    mine = set(classes.get(me, {}))
    tree = TREES[me]
    bad = []

    def typed(scope: ast.AST, extra: dict[str, str]) -> dict[str, str]:
        kinds = dict(extra)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in [*scope.args.args, *scope.args.kwonlyargs, *scope.args.posonlyargs]:
                if (c := _class_named(arg.annotation)) in ours and c not in mine:
                    kinds[arg.arg] = c
        for target, value in map(_assignment, ast.walk(scope)):
            if target is not None and (c := _class_named(value)) in ours and c not in mine:
                key = ast.unparse(target)
                kinds[key] = c
        return kinds

    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] or []:
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        members = typed(init, {}) if init else {}
        for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)):
            own = {"self": cls.name, **{k: v for k, v in members.items() if k.startswith("self.")}}
            made = {ast.unparse(t) for t, v in map(_assignment, ast.walk(fn))  # `state = cls(...)`: its own object
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("cls", cls.name)}
            bad += _writes(fn, typed(fn, own), ours, held, me, made)
    for fn in (f for f in tree.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)):
        bad += _writes(fn, typed(fn, {}), ours, held, me)
    return bad


def _writes(fn: ast.AST, kinds: dict[str, str], ours: dict[str, tuple[str, set[str]]],
            held: dict[str, dict[str, str]], me: str, made: set[str] = frozenset()) -> list[str]:
    def resolve(expr: ast.AST) -> str | None:
        if (known := kinds.get(ast.unparse(expr))) is not None:
            return known
        if isinstance(expr, ast.Attribute) and (outer := resolve(expr.value)) is not None:
            return held.get(outer, {}).get(expr.attr)
        return None

    bad = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del) \
                and isinstance(node.value, ast.Attribute) and (cls := resolve(node.value.value)) in ours \
                and node.value.attr in ours[cls][1]:  # x.field[key] = ...: the field's contents are the class's too
            bad.append(f"{me}:{node.lineno} writes into {ast.unparse(node.value)} ({ours[cls][0]}.{cls} owns it)")
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            owner = ast.unparse(node.value)
            cls = resolve(node.value)
            if cls in ours and node.attr in ours[cls][1]:
                bad.append(f"{me}:{node.lineno} writes {owner}.{node.attr} ({ours[cls][0]}.{cls} owns it)")
            elif node.attr.startswith("_") and not node.attr.startswith("__") and owner not in ("self", "cls", *made):
                bad.append(f"{me}:{node.lineno} writes {owner}.{node.attr}, a private field of another object")
    return bad


# aiohttp's request caches its body in `_read_bytes`: `read_body` fills it (so the handler's `request.read()` gets
# the body already hashed) and `release_body` empties it. A third party's field, written on purpose.
THIRD_PARTY_WRITES = {"mosaicd.daemon.http.body": {"request._read_bytes"}}


def test_a_class_owns_its_fields() -> None:
    """Nothing outside a class's module writes its fields, and no function edits another object's private fields:
    a class that needs another to change asks it (a method), as h11's `Connection` asks its `ConnectionState`."""
    classes, held = class_fields(), member_types()
    bad = [w for p in FILES for w in foreign_writes(p, classes, held)
           if not any(f" writes {allowed}," in w for allowed in THIRD_PARTY_WRITES.get(module_name(p), ()))]
    assert not bad, "\n".join(bad)


FIGURE = re.compile(r"\b20\d\d-\d\d-\d\d\b|~?\b\d+(\.\d+)? ?(us|µs|ms)\b|\b\d+(\.\d+)? -> \d")


def prose(source: str) -> list[tuple[int, str]]:
    """A module's comments and docstrings, with their first line numbers."""
    texts = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    return texts + [(n.lineno, n.value.value) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Expr)
                    and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]


def test_docstrings_and_comments_say_why_not_what_was_measured() -> None:
    """A figure measured on a given day (a date, a time in us or ms, a before -> after) goes to bench/README.md,
    beside the script that measures it; the code says why, and names the script."""
    found = [f"{path.relative_to(SRC)}:{line}: {FIGURE.search(text).group(0)!r} in {text.strip()[:80]!r}"
             for path in FILES for line, text in prose(path.read_text()) if FIGURE.search(text)]
    assert not found, "figures in the code (move them to bench/README.md):\n" + "\n".join(found)


SECRET_READERS = {"mosaicd.daemon.http.auth"}  # `load_secret`, the one reader of a secret file
# where a role starts: the secret is resolved here once (`Secret.of`, `Secret.new`), then handed down
SECRET_RESOLVERS = {
    "mosaicd.daemon.barrier.run", "mosaicd.daemon.node.peer", "mosaicd.daemon.embedded",
    "mosaicd.experiments.run_secret", "mosaicd.daemon.node.async_run"}


def test_a_secret_file_has_one_reader_and_each_entry_point_resolves_it_once() -> None:
    """Only auth.py reads a secret file (`load_secret`); the entry points resolve the run's secret into one value
    (`Secret.of`, `Secret.new`) that the rest is handed; no module keeps secrets in a registry of its own."""
    readers, resolvers, registries = [], [], []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) \
                    else ""
                if called == "load_secret" and name not in SECRET_READERS:
                    readers.append(name)
                if called in ("of", "new") and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                        and func.value.id == "Secret" and name not in SECRET_RESOLVERS:
                    resolvers.append(name)
                if called in ("read_bytes", "read_text", "open") and "secret" in ast.unparse(node).lower() \
                        and name not in SECRET_READERS:
                    readers.append(f"{name}: {ast.unparse(node)[:80]}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Dict | ast.Set) and any(
                    isinstance(t, ast.Name) and "SECRET" in t.id.upper() for t in node.targets):
                registries.append(f"{name}: {ast.unparse(node)[:80]}")
    assert not readers, f"a secret file read outside auth.load_secret: {readers}"
    assert not resolvers, f"a secret resolved outside the entry points: {resolvers}"
    assert not registries, f"a module-level store of secrets: {registries}"


def test_a_fragment_message_has_one_cbor_reader() -> None:
    """wire.py reads a message with its one reader (`_Reader`): no second parser beside it (cbor2's decoder, regular
    expressions over the bytes), so that a change to the format is made in one place."""
    source = (SRC / "mosaic_proto" / "wire.py").read_text()
    tree = ast.parse(source)
    readers = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Reader")]
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert readers == ["_Reader"], readers
    assert not {"cbor2.loads", "cbor2.load", "cbor2.CBORDecoder"} & calls and "re" not in imported


# -- the state machines: fed through their methods, phases checked only by their tables ----------------------------
def _is_state(expr: ast.AST, names: set[str]) -> bool:
    """`x.state` (a role's `BarrierState` or `NodeState`: `Barrier.state`, `Host.state`, `Peer.state`) or a name
    known to hold one."""
    return isinstance(expr, ast.Attribute) and expr.attr == "state" or isinstance(expr, ast.Name) and expr.id in names


def _reaches_state(target: ast.AST, names: set[str]) -> bool:
    """Whether writing `target` writes into a state: `state.f`, `x.state.f`, `state.f[k]`, `state.f[k].g`..."""
    node = target.value if isinstance(target, ast.Attribute | ast.Subscript) else None
    while node is not None:
        if _is_state(node, names):
            return True
        node = node.value if isinstance(node, ast.Attribute | ast.Subscript) else None
    return False


def _state_names(scope: ast.AST) -> set[str]:
    """The names in `scope` that hold a state: annotated `BarrierState`/`NodeState`, made by one (`BarrierState(...)`,
    `BarrierState.from_json(...)`) or taken from one (`state = self.state`, `host, state = ..., host.state`)."""
    names: set[str] = set()
    if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        names |= {a.arg for a in [*scope.args.args, *scope.args.kwonlyargs, *scope.args.posonlyargs]
                  if _class_named(a.annotation) in ("BarrierState", "NodeState")}
    for node in ast.walk(scope):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts, strict=False))
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr):
            pairs.append((node.target, node.value if node.value is not None else node.annotation))
        for target, value in pairs:
            if isinstance(target, ast.Name) and (_is_state(value, names)
                                                 or _class_named(value) in ("BarrierState", "NodeState")):
                names.add(target.id)
    return names


def state_writes(source: str, module: str) -> list[str]:
    """Writes to a state machine's fields from outside its module: `x.state.f = `, `state.f += `, `state.f[k] = `,
    `del state.f`, `setattr(state, ...)`. The daemon feeds a state through its methods (`Barrier.decide`) and reads
    it; what it decided is the state's own to write."""
    tree, bad = ast.parse(source), []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]:
        names = _state_names(scope)
        for node in ast.walk(scope):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                                   else [target])]
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr",
                                                                                                     "delattr"):
                if node.args and (_is_state(node.args[0], names) or _reaches_state(node.args[0], names)):
                    bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            bad += [f"{module}:{node.lineno}: {ast.unparse(t)} written" for t in targets if _reaches_state(t, names)]
    return sorted(set(bad))


# enum -> (the module, the class) that holds the phase and its table: the one place its phase is compared
PHASE_TABLES = {"BarrierPhase": ("mosaic_proto.barrier", "BarrierPhases"),
                "NodePhase": ("mosaic_proto.node", "NodePhases")}
PHASE_FIELDS = {"phase", "run_phase"}


def phase_checks(source: str, module: str) -> list[str]:
    """Comparisons against a phase outside the class that holds it and its table: `x.phase is P.RUNNING`,
    `state.phase.value == "finished"`, `phase in (BarrierPhase.A, BarrierPhase.B)`, `BarrierPhase(name) is ...`.
    Each is a rule of the table kept by hand elsewhere: ask the table's class instead (`state.phases.failed`)."""
    tree = ast.parse(source)
    aliases = set(PHASE_TABLES)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            aliases |= {a.asname or a.name for a in node.names if a.name in PHASE_TABLES}
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = (zip(target.elts, node.value.elts, strict=False)
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(target, node.value)])
                aliases |= {t.id for t, v in elts if isinstance(t, ast.Name) and isinstance(v, ast.Name)
                            and v.id in aliases}
    tables = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
              and any((module, n.name) == table for table in PHASE_TABLES.values())]
    inside = {id(sub) for cls in tables for sub in ast.walk(cls)}

    def phase_in(expr: ast.AST) -> bool:
        return any(isinstance(sub, ast.Attribute) and (sub.attr in PHASE_FIELDS or isinstance(sub.value, ast.Name)
                                                       and sub.value.id in aliases)
                   or isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in aliases
                   for sub in ast.walk(expr))

    return [f"{module}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and id(node) not in inside
            and any(phase_in(operand) for operand in [node.left, *node.comparators])]


def test_the_daemon_writes_no_field_of_a_state_machine() -> None:
    """`BarrierState` (and `NodeState`) are written only by their own methods: the daemon asks and runs decisions."""
    bad = [w for p in FILES if module_name(p).startswith("mosaicd") for w in state_writes(p.read_text(),
                                                                                        module_name(p))]
    assert not bad, "\n".join(bad)


def test_no_phase_is_checked_outside_its_table() -> None:
    bad = [c for p in FILES for c in phase_checks(p.read_text(), module_name(p))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("snippet", [
    "def f(barrier):\n    barrier.state.round = 3",
    "def f(host):\n    host.state.members[0].missed += 1",
    "def f(host):\n    state = host.state\n    state.failure = 'x'",
    "def f(state: BarrierState):\n    state.live.append(1)\n    state.pending['a:1'] = 0.0",
    "def f(self):\n    host, state = self.host, self.host.state\n    del state.released[0]",
    "def f(self):\n    setattr(self.state, 'round', 0)",
    "state = BarrierState.from_json(saved, 0.0)\nstate.round = 2",
])
def test_the_state_write_check_catches_a_write(snippet: str) -> None:
    assert state_writes(snippet, "mosaicd.daemon.example")


def test_the_state_write_check_lets_a_state_be_read_fed_and_replaced() -> None:
    ok = ("def f(self, host: Host):\n    self.state = BarrierState.from_json(saved, 0.0)\n    x = host.state.round\n"
          "    host.decide(lambda s, now: s.join('a:1', now))\n    self.state.check(0, 1)\n    self.round = 2\n")
    assert state_writes(ok, "mosaicd.daemon.example") == []


@pytest.mark.parametrize("snippet", [
    "if state.phase is BarrierPhase.FAILED: pass",
    "P = BarrierPhase\nok = barrier.state.phase is not P.RUNNING",
    "from mosaic_proto import BarrierPhase as Ph\nok = s.phase in (Ph.REBINDING, Ph.FAILED)",
    "ok = barrier.state.phase.value == 'finished'",
    "ok = state.run_phase != 'running'",
    "ok = BarrierPhase(data['phase']) == BarrierPhase.RUNNING",
    "class BarrierState:\n    def f(self):\n        return self.phase is BarrierPhase.RUNNING",
])
def test_the_phase_check_catches_a_phase_compared_outside_its_table(snippet: str) -> None:
    assert phase_checks(snippet, "mosaic_proto.barrier")


def test_the_phase_check_lets_the_table_class_compare_and_others_ask() -> None:
    table = "class BarrierPhases:\n    def failed(self):\n        return self._phase is BarrierPhase.FAILED\n"
    asking = "ok = state.phases.failed and state.round == 3 and phase_of(x).value\nname = state.phase.value\n"
    assert phase_checks(table + asking, "mosaic_proto.barrier") == []
    assert phase_checks(table, "mosaicd.daemon.barrier.example")  # the table's class only in its own module


# -- files are rewritten only through files.py (replacing / write_whole: whole, or the one before) -----------------

WRITE_MODE = re.compile(r"[rwxabtU+]*[wx+][rwxabtU+]*")  # an open() mode that writes other than at the end
WRITERS = {  # (owner, function) -> the argument a writer writes to; owner "": any (a figure's savefig)
    ("", "savefig"): 0, ("np", "save"): 0, ("np", "savez"): 0, ("np", "savez_compressed"): 0, ("torch", "save"): 1,
    ("json", "dump"): 1, ("pickle", "dump"): 1, ("shutil", "copyfile"): 1, ("shutil", "copyfileobj"): 1,
    ("shutil", "copy"): 1, ("shutil", "copy2"): 1,
}
# Writes that are not rewrites of a finished file, by (module, function): each says why it may stay.
WRITES_ALLOWED = {
    # checkpoint slots are rewritten in place on purpose, their blocks reused (files.py's docstring says so)
    ("mosaicd.daemon.node.checkpoint", "save"): "in place on purpose",
    # a secret is a new file (O_EXCL, mode 600), never one rewritten
    ("mosaicd.daemon.http.auth", "write_new_secret"): "a new file only",
    # the barrier's lock file: created empty, its content never written
    ("mosaicd.rundir.lock", "hold_barrier"): "a lock",
    # a process's log, streamed while it runs (appended on resume, else started afresh)
    ("mosaicd.experiments.processes", "spawn"): "a log",
    ("mosaicd.experiments.processes", "spawn_warm"): "a log",
    ("mosaicd.experiments.warm", "_child"): "a log",
    ("mosaicd.experiments.sweep_jobs", "start"): "a log (a job's stderr)",
    # a download unpacked into a temporary folder that replaces the data folder whole (os.replace)
    ("mosaicd.learning.data.fetch", "safe_extract_tar"): "a staging folder",
    ("mosaicd.learning.data.fetch", "safe_extract_zip"): "a staging folder",
    ("mosaicd.learning.data.fetch", "_download"): "a staging folder",
}


def whole_file_writes(source: str, module: str) -> list[tuple[str, str]]:
    """(enclosing function, 'module:line: call') for each call that writes a file other than through files.py:
    write_text/write_bytes, open() in a mode that writes other than by appending, os.open creating a file, or a
    writer (savefig, np.save, json/pickle.dump, shutil.copy*) whose destination is not a `with replacing(...) as f`."""
    tree = ast.parse(source)
    through_files = {item.optional_vars.id for node in ast.walk(tree) if isinstance(node, ast.With | ast.AsyncWith)
                     for item in node.items if isinstance(item.optional_vars, ast.Name)
                     and isinstance(item.context_expr, ast.Call)
                     and ast.unparse(item.context_expr.func).split(".")[-1] == "replacing"}
    where: dict[int, str] = {}
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
        for sub in ast.walk(fn):
            where[id(sub)] = fn.name  # the innermost function wins: ast.walk visits outer ones first

    def writes(call: ast.Call) -> bool:
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        owner = ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else ""
        if name in ("write_text", "write_bytes"):
            return True
        if name in ("open", "fdopen") and owner != "os":
            modes = [a for a in [*call.args[:2], *(k.value for k in call.keywords if k.arg == "mode")]
                     for c in ast.walk(a) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                     and WRITE_MODE.fullmatch(c.value)]
            return bool(modes)
        if name == "open" and owner == "os":
            return any(isinstance(c, ast.Attribute) and c.attr in ("O_CREAT", "O_TRUNC")
                       for a in call.args[1:2] for c in ast.walk(a))
        at = WRITERS.get((owner, name), WRITERS.get(("", name)))
        if at is not None:
            dest = call.args[at] if len(call.args) > at else None
            return not (isinstance(dest, ast.Name) and dest.id in through_files)
        return False

    return [(where.get(id(node), ""), f"{module}:{node.lineno}: {ast.unparse(node)[:100]}")
            for node in ast.walk(tree) if isinstance(node, ast.Call) and writes(node)]


def test_files_are_rewritten_only_through_files_py() -> None:
    """A crash, a reader or a full disk finds a file whole (the one before or the one after), never torn: every
    rewrite goes through files.replacing / write_whole; appends (rows, logs) are not rewrites."""
    found = [(module_name(p), fn, text) for p in FILES if module_name(p).startswith("mosaicd")
             and module_name(p) != "mosaicd.files" for fn, text in whole_file_writes(p.read_text(), module_name(p))]
    bad = [text for module, fn, text in found if (module, fn) not in WRITES_ALLOWED]
    assert not bad, "\n".join(bad)
    used = {(module, fn) for module, fn, _ in found}
    assert not set(WRITES_ALLOWED) - used, f"allowed but no longer there: {set(WRITES_ALLOWED) - used}"


@pytest.mark.parametrize("snippet", [
    "def f(p):\n    p.write_text('a')",
    "def f(p):\n    (p / 'x.json').write_bytes(b'a')",
    "def f(p):\n    with open(p, 'w', newline='') as f:\n        f.write('a')",
    "def f(p):\n    with p.open('wb') as f:\n        f.write(b'a')",
    "def f(p, append):\n    log = open(p, 'ab' if append else 'wb')",
    "def f(p):\n    json.dump({}, open(p, mode='w+'))",
    "def f(p, a):\n    np.save(p, a)",
    "def f(fig, p):\n    fig.savefig(p, dpi=110)",
    "def f(p):\n    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)",
    "def f(p, model):\n    with open(p, 'ab') as g:\n        torch.save(model, g)",
])
def test_the_rewrite_check_catches_a_write_beside_files_py(snippet: str) -> None:
    assert whole_file_writes(snippet, "mosaicd.example")


def test_the_rewrite_check_lets_appends_reads_and_files_py_through() -> None:
    ok = ("def f(p, a, fig, rows):\n    write_whole(p, 'text')\n    with replacing(p, durable=True) as out:\n"
          "        np.save(out, a)\n    with files.replacing(p) as g:\n        fig.savefig(g, format='png')\n"
          "    with open(p, 'a', newline='') as log:\n        log.write(rows)\n    text = open(p).read()\n"
          "    with p.open('rb') as f:\n        f.read()\n    fd = os.open(p, os.O_RDONLY)\n")
    assert whole_file_writes(ok, "mosaicd.example") == []


# Prefixes that name no layer of their own on the architecture page: each shares the rank of one the page names.
LAYERS_NOT_ON_THE_PAGE = {"mosaicd.learning": "mosaicd.learning.evaluation", "mosaicd.__main__": "mosaicd.cli",
                          "mosaicd": "mosaicd.cli"}


def page_layers(text: str) -> list[list[str]]:
    """The layers the architecture page's sentence names, lowest first, each a list of module prefixes:
    `a` < `b.{c,d}` < `e` (f < g) reads [[a], [b.c, b.d], [e.f], [e.g]]."""
    sentence = re.search(r"Imports only go down these layers[^:]*:\s*(.+?)\. The two roles", text, re.S)
    assert sentence, "docs/architecture.md: the sentence on the import layers is gone"
    words = " ".join(sentence.group(1).split())
    layers: list[list[str]] = []
    for part in re.finditer(r"`([\w.]+)(?:\.\{([\w,]+)\})?`(?: \(([^)]*)\))?", words):
        base, group, inner = part.groups()
        if inner:
            layers += [[f"{base}.{sub.strip()}"] for sub in inner.split("<")]
        else:
            layers.append([f"{base}.{sub}" for sub in group.split(",")] if group else [base])
    return layers


def test_the_architecture_page_names_the_layers_this_file_checks() -> None:
    page = page_layers((SRC.parent / "docs" / "architecture.md").read_text())
    ranks = dict(LAYERS)
    named = [m for layer in page for m in layer]
    expected = set(ranks) - set(LAYERS_NOT_ON_THE_PAGE)
    assert len(named) == len(set(named)) and set(named) == expected, f"named on one side only: {set(named) ^ expected}"
    assert all(ranks[a] == ranks[layer[0]] for layer in page for a in layer), "one layer on the page, several here"
    assert [ranks[layer[0]] for layer in page] == sorted({ranks[layer[0]] for layer in page}), "another order here"
    assert all(ranks[m] == ranks[like] for m, like in LAYERS_NOT_ON_THE_PAGE.items())


def test_the_layer_sentence_reader_reads_groups_and_sublayers() -> None:
    text = ("Imports only go down these layers (checked):\n`a` < `b.{c,d}` < `e` (f < g) < `h`. The two roles")
    assert page_layers(text) == [["a"], ["b.c", "b.d"], ["e.f"], ["e.g"], ["h"]]


def test_the_message_decoder_reads_only_a_message_s_shape() -> None:
    """wire.py reads exactly what `encode` writes (issue 57): under 500 lines, no count of items kept by hand (no
    `self.x -= ...`) and no function that calls itself (a general CBOR reader descends into any nesting; a message
    has one fixed shape)."""
    source = (SRC / "mosaic_proto" / "wire.py").read_text()
    assert len(source.splitlines()) < 500
    tree = ast.parse(source)
    counted = [ast.unparse(n) for n in ast.walk(tree)
               if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Sub) and isinstance(n.target, ast.Attribute)]
    assert not counted, counted
    recursive = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                 and any(isinstance(c, ast.Call) and ast.unparse(c.func) in (f.name, f"self.{f.name}")
                         for c in ast.walk(f))]
    assert not recursive, recursive


def test_settings_configure_and_build_nothing() -> None:
    """`mosaicd.settings` holds the values and their checks, one concern per module, each under 400 lines; the
    protocol objects a run builds from them (each node's aggregator, compressor, attack, the attacking ranks, the
    profiles) are `mosaicd.protocol`'s, so settings import none of their classes."""
    built = {"Aggregator", "Attack", "Compressor", "NodeProfile", "byzantine_ranks"}
    for path in sorted((SRC / "mosaicd" / "settings").glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) < 400, f"{module_name(path)}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mosaic_proto"):
                names = built & {a.name for a in node.names}
                assert not names, f"{module_name(path)} imports {names}: build them in mosaicd.protocol"


# -- the barrier's runner: one input path, timers and the journal only in `apply` (issue 57) --------------------------
BARRIER_DAEMON = "mosaicd.daemon.barrier"
STATE_READERS = {"check", "notice", "unheard", "to_json"}  # BarrierState's methods that change nothing


def barrier_state_inputs() -> set[str]:
    """BarrierState's public methods that feed it an input (every one but the readers, properties and constructors)."""
    cls = next(n for n in ast.walk(TREES["mosaic_proto.barrier"]) if isinstance(n, ast.ClassDef)
               and n.name == "BarrierState")
    return {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
            and not f.decorator_list and f.name not in STATE_READERS}


def _names_the_state(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("state", "s") or isinstance(expr, ast.Attribute) \
        and expr.attr == "state"


def state_inputs_outside_decide(source: str, module: str, inputs: set[str]) -> list[str]:
    """Calls that feed the barrier's state (`state.arrive(...)`, `self.state.answered(...)`) anywhere but in the
    function handed to `decide` (`x.decide(lambda state, now: state.arrive(...))`): the one input path."""
    tree = ast.parse(source)
    fed = {id(sub) for call in ast.walk(tree) if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
           and call.func.attr == "decide" for arg in call.args if isinstance(arg, ast.Lambda) for sub in ast.walk(arg)}
    return [f"{module}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in inputs
            and _names_the_state(n.func.value) and id(n) not in fed]


def test_the_barriers_runner_has_one_input_path() -> None:
    """Only `decide` feeds `BarrierState` in daemon/barrier (no second path that calls the state, then `apply`)."""
    inputs = barrier_state_inputs()
    assert {"arrive", "tick", "stop", "leave_held", "answered", "end", "count", "claim_layout"} <= inputs
    bad = [c for name, path in MODULES.items() if name.startswith(BARRIER_DAEMON)
           for c in state_inputs_outside_decide(path.read_text(), name, inputs)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("snippet", [
    "def f(self):\n    self.state.arrive(0, 1, self.now())",
    "def f(self):\n    release = self.state.tick(now)\n    self.apply(release)",
    "def f(host):\n    state = host.state\n    state.answered(3)",
    "def f(self):\n    self.decide(lambda state, now: None)\n    self.state.leave(1, 0.0)",
])
def test_the_input_path_check_catches_a_second_path(snippet: str) -> None:
    assert state_inputs_outside_decide(snippet, "mosaicd.daemon.barrier.example", barrier_state_inputs())


def test_the_input_path_check_lets_decide_feed_and_anyone_read() -> None:
    ok = ("def f(self, host):\n    host.decide(lambda s, now: s.join('a:1', now))\n    self.state.check(0, 1)\n"
          "    self.decide(lambda state, now: state.stop(1, 'x', now))\n    x = self.state.notice(r)\n"
          "    self.registrar.register('a:1')\n")
    assert state_inputs_outside_decide(ok, "mosaicd.daemon.barrier.example", barrier_state_inputs()) == []


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def innermost_callers(tree: ast.AST, names: set[str]) -> set[tuple[str, str]]:
    """(function, name called) for every call of one of `names`, by the innermost function that makes it."""
    owner: dict[int, str] = {}
    for fn in sorted(_functions(tree), key=lambda f: len(list(ast.walk(f))), reverse=True):
        for sub in ast.walk(fn):
            owner[id(sub)] = fn.name  # the smaller (inner) functions come later and overwrite
    return {(owner.get(id(n), "<module>"), n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id)
            for n in ast.walk(tree) if isinstance(n, ast.Call) and (
                isinstance(n.func, ast.Attribute) and n.func.attr in names
                or isinstance(n.func, ast.Name) and n.func.id in names)}


# asyncio.sleep in daemon/barrier that decides nothing: the node count read every moment while nodes register (the
# state settles it), the --register-deadline of the registration's long polls, the process lingering after the end
SLEEPS_THAT_DECIDE_NOTHING = {("mosaicd.daemon.barrier.registration", "count_nodes"),
                              ("mosaicd.daemon.barrier.run", "serve_barrier")}


def test_no_timer_of_the_barrier_outside_apply() -> None:
    """The barrier's timers are armed in one place, step 2 of `DecisionRunner.apply` (`_arm_timers`), at the times the
    state says: no call_at/call_later anywhere else in daemon/barrier, and no sleep that then feeds the state."""
    runner = TREES["mosaicd.daemon.barrier.runner"]
    timers = {(name, fn) for name, tree in TREES.items() if name.startswith(BARRIER_DAEMON)
              for fn, _ in innermost_callers(tree, {"call_at", "call_later"})}
    assert timers == {("mosaicd.daemon.barrier.runner", "at")}, timers  # `_Timer.at`, the runner's timers
    armed = {fn for fn, _ in innermost_callers(runner, {"at"})}
    assert armed <= {"_arm_timers", "interrupt"}, armed  # interrupt: disarmed, never armed
    assert {fn for fn, _ in innermost_callers(runner, {"_arm_timers"})} == {"apply"}
    sleeps = {(name, fn) for name, tree in TREES.items() if name.startswith(BARRIER_DAEMON)
              for fn, called in innermost_callers(tree, {"sleep"})}
    assert sleeps <= SLEEPS_THAT_DECIDE_NOTHING, sleeps - SLEEPS_THAT_DECIDE_NOTHING


def test_the_barriers_journal_is_written_only_by_the_runner() -> None:
    """`journal.save` is called in one place, `DecisionRunner.save_journal`, itself called only by `apply` (where the
    decision says it is `journaled`): no list of journaled decisions, no write elsewhere."""
    journal_saves = {(name, f.name) for name, tree in TREES.items() if name.startswith("mosaicd")
                     for f in _functions(tree) for c in ast.walk(f) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Attribute) and c.func.attr == "save"
                     and isinstance(c.func.value, ast.Name) and c.func.value.id in ("barrier_journal", "journal")}
    assert journal_saves == {("mosaicd.daemon.barrier.runner", "save_journal")}, journal_saves
    runner = TREES["mosaicd.daemon.barrier.runner"]
    assert {fn for fn, _ in innermost_callers(runner, {"save_journal"})} == {"apply"}
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "journaled" for n in ast.walk(runner))


# -- the node's core, like the barrier's (issue 57): inputs apart from outcomes, one fire per call, decisions as values
def _node_module() -> ast.Module:
    return ast.parse((SRC / "mosaic_proto" / "node.py").read_text())


def _enum_values(tree: ast.Module, name: str) -> set[str]:
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.value.value for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}


def test_no_outcome_is_an_input_of_the_node() -> None:
    """What comes in (`NodeInput`) and what the state decides of it (`NodeOutcome`) are apart: an input enum that also
    names decisions (READMITTED, LEFT_OUT...) lets a caller fire what only the state may decide."""
    tree = _node_module()
    inputs, outcomes = _enum_values(tree, "NodeInput"), _enum_values(tree, "NodeOutcome")
    assert inputs and outcomes
    shared = (inputs & outcomes) - {"dropped", "finished"}  # the barrier's words for what came in, not decisions
    assert not shared, f"an outcome in NodeInput: {sorted(shared)}"
    decided = {"readmitted", "new_run", "aggregated", "left_out", "failed", "refused", "ignored"}
    assert not inputs & decided, inputs & decided


def fires_per_call(source: str, cls_name: str) -> dict[str, int]:
    """method -> how many `*.fire(...)` calls its body holds; a fire in a loop counts twice (it can fire again)."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    counts = {}
    for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        count = 0
        for node in ast.walk(method):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "fire", "_fire"):
                count += 1
            if isinstance(node, ast.For | ast.While) and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in ("fire", "_fire")
                    for c in ast.walk(node)):
                count += 1
        counts[method.name] = count
    return counts


def test_each_call_on_the_node_state_fires_once() -> None:
    """One call, one input, one transition: no public method of `NodeState` fires twice (an in-between phase that
    nobody can observe), and the ones that move the phase fire exactly once, at one place."""
    counts = fires_per_call((SRC / "mosaic_proto" / "node.py").read_text(), "NodeState")
    assert all(n <= 1 for n in counts.values()), counts
    moving = {"registered", "start", "rejoining", "leaving", "left", "outgoing", "sent", "released", "dropped",
              "finishing", "finished"}
    assert {m for m, n in counts.items() if n == 1} >= moving, counts
    assert {m for m, n in counts.items() if n and m.startswith("_")} == set(), counts


def test_the_fire_check_counts_a_second_fire() -> None:
    twice = ("class NodeState:\n    def released(self):\n        self.phases.fire(1, 2)\n"
             "        self.phases.fire(3, 4)\n    def each(self):\n        for x in y:\n            self._fire(x)\n")
    assert fires_per_call(twice, "NodeState") == {"released": 2, "each": 2}


# what the node's daemon must not ask of its state: it runs the state's decisions, it does not make them
NODE_POLICY_READS = {"allows", "expect", "fire", "phases", "gone", "left_out", "takes_fragments"}


def node_policy_reads(source: str, module: str) -> list[str]:
    """Reads of a node state's phase rules outside `mosaic_proto` (`state.allows(...)`, `state.gone`,
    `advance.left_out`, `state.phases`), and `NodeOutcome` compared outside the runner (`Peer`)."""
    tree, bad = ast.parse(source), []
    runner = {id(sub) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name == "Peer"
              for sub in ast.walk(cls)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in NODE_POLICY_READS:
            bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare) and id(node) not in runner and "NodeOutcome" in ast.unparse(node):
            bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_the_node_daemon_asks_its_state_no_phase_rule() -> None:
    """`daemon/node` (and the `mosaicd.Peer` around it) feeds `NodeState` and runs what it returns (`Sending`,
    `Advance`, a `NodeOutcome`); whether a drop counts, a leave is told, a round may be sent is the state's answer,
    never a check of its phase here."""
    paths = [*sorted((SRC / "mosaicd" / "daemon" / "node").glob("*.py")), SRC / "mosaicd" / "daemon" / "embedded.py"]
    bad = [b for p in paths for b in node_policy_reads(p.read_text(), module_name(p))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("snippet", [
    "def f(self):\n    if self.state.allows(NodeInput.DROPPED):\n        self.state.dropped()",
    "def f(state):\n    if state.gone or state.rank < 0:\n        return",
    "def f(advance):\n    if advance.left_out:\n        raise PeerDropped('x')",
    "def f(outcome):\n    return outcome is NodeOutcome.LEFT_OUT",
])
def test_the_node_policy_check_catches_a_decision_taken_in_the_daemon(snippet: str) -> None:
    assert node_policy_reads(snippet, "mosaicd.daemon.node.example")


def test_the_node_policy_check_lets_the_runner_apply_outcomes() -> None:
    ok = ("class Peer:\n    def _applied(self, advance):\n        if advance.outcome is NodeOutcome.LEFT_OUT:\n"
          "            raise PeerDropped('x')\n        return self.state.round\n")
    assert node_policy_reads(ok, "mosaicd.daemon.node.peer") == []


def test_the_node_state_is_handed_the_clock() -> None:
    """As `BarrierState` is: every call that times a phase takes `now`; node.py reads no clock of its own."""
    tree = _node_module()
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | imported
    assert not {"time", "monotonic", "perf_counter"} & modules, modules
    state = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "NodeState")
    timed = {m.name: [a.arg for a in m.args.args + m.args.kwonlyargs] for m in state.body
             if isinstance(m, ast.FunctionDef) and m.name in ("registered", "outgoing", "send_budget", "sent",
                                                              "released")}
    assert all("now" in args for args in timed.values()) and len(timed) == 5, timed


# -- the asynchronous node's core (issue 60): the node's shape, for a node with no rounds
def test_the_async_node_state_fires_once_per_call_and_is_handed_the_clock() -> None:
    """`AsyncNodeState` is built as `NodeState` is: every call that moves or keeps its phase fires exactly once, no
    private helper fires, every input takes `now`, and async_node.py (and the event simulation) read no clock."""
    source = (SRC / "mosaic_proto" / "async_node.py").read_text()
    counts = fires_per_call(source, "AsyncNodeState")
    inputs = {"trained", "receive", "next_send", "paired", "averaged"}
    assert {m for m, n in counts.items() if n == 1} == inputs and all(n <= 1 for n in counts.values()), counts
    tree = ast.parse(source)
    state = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AsyncNodeState")
    takes = {m.name: [a.arg for a in m.args.args] for m in state.body if isinstance(m, ast.FunctionDef)}
    assert all("now" in takes[m] for m in inputs), takes
    for module in ("async_node.py", "async_network.py"):
        names = {a.name for n in ast.walk(ast.parse((SRC / "mosaic_proto" / module).read_text()))
                 if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
        assert not {"time", "monotonic", "perf_counter"} & names, (module, names)


# -- the registration's deadline is the barrier state's (issue 57): registration.py waits, and decides nothing by it
REGISTRATION = "mosaicd.daemon.barrier.registration"
ENDS_THE_RUN = {"_fail", "fail_registration", "fail", "end_failed", "decide"}


def waits_that_decide(tree: ast.Module) -> set[str]:
    """The functions of `tree` that sleep or wait_for and also end the run or feed the state (`ENDS_THE_RUN`): a
    wait that decides the run's fate when it gives up, which is the state's to decide from the clock (`tick`)."""
    waiting = {fn for fn, _ in innermost_callers(tree, {"sleep", "wait_for"})}
    deciding = {fn for fn, _ in innermost_callers(tree, ENDS_THE_RUN)}
    return waiting & deciding


def test_the_registrations_deadline_is_the_states_and_its_waits_decide_nothing() -> None:
    """The registration failing at --register-deadline (and a resumed run's members not coming back in time) is
    decided by `BarrierState.tick` at `registration_deadline`, which one of the runner's timers feeds (step 2 of
    `apply`); registration.py only waits on what the runner publishes: its one wait (`waited`, a long poll's own
    limit) ends nothing, and it sleeps only to read the node count (`count_nodes`), which ends nothing either."""
    tree = TREES[REGISTRATION]
    assert not waits_that_decide(tree), waits_that_decide(tree)
    assert {fn for fn, _ in innermost_callers(tree, {"wait_for"})} == {"waited"}
    assert {fn for fn, _ in innermost_callers(tree, {"sleep"})} == {"count_nodes"}
    assert not any(f.name == "_deadline" for f in _functions(tree))
    runner = next(f for f in _functions(TREES["mosaicd.daemon.barrier.runner"]) if f.name == "_arm_timers")
    assert "state.registration_deadline" in ast.unparse(runner)
    state = next(n for n in ast.walk(TREES["mosaic_proto.barrier"]) if isinstance(n, ast.ClassDef)
                 and n.name == "BarrierState")
    tick = next(f for f in state.body if isinstance(f, ast.FunctionDef) and f.name == "tick")
    assert "registration_deadline" in ast.unparse(tick)


@pytest.mark.parametrize("snippet", [
    "async def _deadline(self):\n    await asyncio.sleep(9)\n    self._fail('passed', 503)",
    "async def poll(self):\n    try:\n        await asyncio.wait_for(e.wait(), 9)\n    except TimeoutError:\n"
    "        self.host.fail_registration('gone')",
])
def test_the_deciding_wait_check_catches_a_wait_that_ends_the_run(snippet: str) -> None:
    assert waits_that_decide(ast.parse(snippet))
