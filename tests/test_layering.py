"""One direction of imports, read from the source (lazy imports inside functions included).

engine and routing sit at the bottom and know nothing of each other or of the layers above;
actors may use both; cluster is the top. bench sits beside the product and nothing in it
imports bench. Every import of Tandem's own code goes through the `tandem` namespace, so an
installed Tandem adds no generic top-level names (`engine`, `cluster`, ...) to site-packages.
"""

import ast
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


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "tandem" else [node.module]
            found += [(node.lineno, name) for name in names]
    return found


def violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for lineno, module in imported_modules(path):
            parts = module.split(".")
            where = f"{path.relative_to(ROOT)}:{lineno} imports {module}"
            if parts[0] in OLD_TOP_LEVEL:
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


def test_tests_and_bench_use_the_namespace_too():
    bad = [f"{path.relative_to(ROOT)}:{lineno} imports {module}"
           for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
           for lineno, module in imported_modules(path) if module.split(".")[0] in set(LAYERS)]
    assert bad == []
