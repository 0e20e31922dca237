"""One direction of imports, read from the source (lazy imports inside functions included).

engine and routing sit at the bottom and know nothing of each other or of the layers above;
actors may use both; cluster is the top. bench sits beside the product and nothing in it
imports bench. Every import of Tandem's own code goes through the `tandem` namespace, so an
installed Tandem adds no generic top-level names (`engine`, `cluster`, ...) to site-packages.

An import by name counts like an import statement: `importlib.import_module("x.y")` and
`__import__("x.y")` with a literal, and, in a file that imports by a computed name (a table of
subcommand modules, say), every dotted string in it that names one of this repository's modules.

No two of the repository's modules import each other, directly or round a longer circle; every
import counts there too (inside functions and under `if TYPE_CHECKING:`), since a lazy import is
where a circle usually hides.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "routing", "actors", "cluster")
ALLOWED = {
    "engine": {"engine"},
    "routing": {"routing"},
    "actors": {"actors", "engine", "routing"},
    "cluster": {"cluster", "actors", "engine", "routing"},
}
OLD_TOP_LEVEL = {*LAYERS, "bench"}
# (file, module) -> why this one import across the rules is allowed. Each entry must still be
# needed (test_every_exception_is_still_needed), so a fixed import cannot leave one behind.
EXCEPTIONS = {
    ("cluster/cli.py", "bench.cli"):
        "`tandem bench` loads the benchmark suite by name, only when that subcommand is chosen, and "
        "only from a source checkout (bench/ is not in the wheel; without it the command says so). "
        "It runs in-process so that bench's arguments are part of `tandem`'s parser.",
}
IMPORT_FUNCTIONS = {"import_module", "__import__"}
CYCLE_FOLDERS = (*LAYERS, "tandem", "bench", "tests")


# -- reading imports -----------------------------------------------------------------------------
def module_name(path: Path) -> str:
    """The name a file is imported by: engine/x.py -> tandem.engine.x, bench/x.py -> bench.x."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["tandem", *parts] if parts[0] in LAYERS else parts)


def module_path(name: str) -> Path | None:
    """The file of one of this repository's modules (by its tandem name or a bare top-level one)."""
    parts = name.split(".")
    if parts[0] == "tandem":
        parts = parts[1:] or ["tandem"]
        if parts[0] not in LAYERS and parts != ["tandem"]:
            return None
    if not all(p.isidentifier() for p in parts):
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _import_call(node: ast.AST) -> ast.Call | None:
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return node if name in IMPORT_FUNCTIONS else None


def import_statements(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names taken from it) for every import in a file, at any depth; an import by
    name has no names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str, list[str]]] = []
    computed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the file's own package
                package = module_name(path).split(".")
                package = package if path.name == "__init__.py" else package[:-1]
                module = ".".join(package[:len(package) - node.level + 1] + ([module] if module else []))
            found.append((node.lineno, module, [alias.name for alias in node.names]))
        elif call := _import_call(node):
            target = call.args[0]
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                found.append((node.lineno, target.value, []))
            else:
                computed = True
    if computed:
        found += [(node.lineno, node.value, []) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value
                  and module_path(node.value) is not None]
    return found


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for lineno, module, names in import_statements(path):
        if module == "tandem" and names:
            found += [(lineno, f"tandem.{name}") for name in names]
        elif module:
            found.append((lineno, module))
    return found


# -- layers --------------------------------------------------------------------------------------
def violations(layer: str, exceptions: dict = EXCEPTIONS) -> list[str]:
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        where_file = path.relative_to(ROOT).as_posix()
        for lineno, module in imported_modules(path):
            parts = module.split(".")
            where = f"{where_file}:{lineno} imports {module}"
            if (where_file, module) in exceptions:
                continue
            if parts[0] == "bench":
                bad.append(f"{where} (the product never imports bench, which sits beside it)")
            elif parts[0] in OLD_TOP_LEVEL:
                bad.append(f"{where} (not through the tandem namespace)")
            elif parts[0] == "tandem" and len(parts) > 1 and parts[1] not in ALLOWED[layer]:
                bad.append(f"{where} (layer {layer} may import only {sorted(ALLOWED[layer])})")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_the_layers_below(layer):
    assert violations(layer) == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    fake = tmp_path / "actors"
    fake.mkdir()
    (fake / "x.py").write_text("def f():\n    from tandem.cluster import app\n    import engine.config\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("actors") == [
        "actors/x.py:2 imports tandem.cluster (layer actors may import only ['actors', 'engine', 'routing'])",
        "actors/x.py:3 imports engine.config (not through the tandem namespace)",
    ]


def test_the_checker_sees_imports_by_name(tmp_path, monkeypatch):
    for name in ("cluster/__init__.py", "cluster/app.py", "bench/__init__.py", "bench/cli.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "x.py").write_text(
        "import importlib\n"
        "importlib.import_module('bench.cli')\n"
        "__import__('tandem.cluster.app')\n"
        "importlib.import_module('json')\n")
    (tmp_path / "actors" / "y.py").write_text(
        "from importlib import import_module\n"
        "TABLE = {'b': 'bench.cli', 'text': 'not.a.module', 'c': 'tandem.cluster.app'}\n"
        "def load(key):\n"
        "    return import_module(TABLE[key])\n")
    (tmp_path / "actors" / "z.py").write_text("HELP = 'see bench.cli'  # a string, but no import by name here\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("actors") == [
        "actors/x.py:2 imports bench.cli (the product never imports bench, which sits beside it)",
        "actors/x.py:3 imports tandem.cluster.app (layer actors may import only ['actors', 'engine', 'routing'])",
        "actors/y.py:2 imports bench.cli (the product never imports bench, which sits beside it)",
        "actors/y.py:2 imports tandem.cluster.app (layer actors may import only ['actors', 'engine', 'routing'])",
    ]


def test_the_cli_loading_bench_by_name_is_seen_and_allowed_only_by_its_exception():
    seen = [line for line in violations("cluster", exceptions={}) if "bench" in line]
    assert seen, "cluster/cli.py loads bench.cli by name: the checker must see it"
    for line in seen:
        assert re.fullmatch(r"cluster/cli\.py:\d+ imports bench\.cli \(the product never imports bench, "
                            r"which sits beside it\)", line), line


def test_every_exception_is_still_needed():
    for (file, module), reason in EXCEPTIONS.items():
        assert reason
        assert module in {m for _, m in imported_modules(ROOT / file)}, f"{file} no longer imports {module}"


def test_tandem_bench_still_runs_bench_from_the_checkout():
    from tandem.cluster.cli import build_parser

    argv = ["bench", "report", "out", "--report", "seed.md"]
    args = build_parser(argv).parse_args(argv)
    assert (args._module, args.bench_command, args.out, args.report) == ("bench.cli", "report", "out", "seed.md")


def test_tests_and_bench_use_the_namespace_too():
    bad = [f"{path.relative_to(ROOT)}:{lineno} imports {module}"
           for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
           for lineno, module in imported_modules(path) if module.split(".")[0] in set(LAYERS)]
    assert bad == []


# -- circles -------------------------------------------------------------------------------------
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module of this repository it imports: the line of the first such import}."""
    files = {module_name(path): path for folder in CYCLE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, {})
        for lineno, module, names in import_statements(path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, lineno)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan's algorithm), each as a list
    of modules that starts and ends with the same one, smallest name first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            if group:
                groups.append(group | {v})

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(_circle_in(graph, group) for group in groups)


def _circle_in(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest circle through the group's first module (breadth-first within the group)."""
    start = min(group)
    came_from = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in group and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start}")


def describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_no_import_cycles():
    graph = import_graph()
    assert "tandem.engine.model.loader" in graph and "bench.cli" in graph  # the graph sees the whole tree
    assert [describe(graph, c) for c in import_cycles(graph)] == []


def test_the_cycle_finder_names_a_cycle(tmp_path, monkeypatch):
    (tmp_path / "engine" / "model").mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "model" / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("from tandem.engine.b import x\n")
    (tmp_path / "engine" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from tandem.engine import c\n")
    (tmp_path / "engine" / "c.py").write_text("def f():\n    import tandem.engine.a\n")
    (tmp_path / "engine" / "model" / "p.py").write_text("def f():\n    from tandem.engine.model import q\n")
    (tmp_path / "engine" / "model" / "q.py").write_text("from tandem.engine.model.p import f\n")
    (tmp_path / "engine" / "model" / "r.py").write_text("from tandem.engine.model import p, q\n")  # no circle
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert [describe(graph, c) for c in import_cycles(graph)] == [
        "tandem.engine.a (line 1) -> tandem.engine.b (line 3) -> tandem.engine.c (line 2) -> tandem.engine.a",
        "tandem.engine.model.p (line 2) -> tandem.engine.model.q (line 1) -> tandem.engine.model.p",
    ]
