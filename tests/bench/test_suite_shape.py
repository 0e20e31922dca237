"""The benchmark suite stays one a user can read: no larger than the engine it measures, and every
bench command the docs cite still names a `tandem bench` mode, module or file that exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from bench.cli import add_arguments

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODE = re.compile(r"tandem bench ([a-z][a-z0-9-]*)")
MODULE = re.compile(r"python3?\s+-m\s+bench\.([a-z_]+)")
FILE = re.compile(r"(?<![\w/.:-])(bench/[\w/]+\.(?:py|sh))")


def lines_of(files: list[Path]) -> int:
    return sum(f.read_text().count("\n") for f in files)


def modes() -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def cited(pattern: re.Pattern) -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), match) for doc in DOCS for match in pattern.findall(doc.read_text())]


def test_bench_is_no_larger_than_the_engine():
    bench = lines_of(sorted((ROOT / "bench").glob("*.py")))
    engine = lines_of(sorted((ROOT / "engine").glob("*.py")) + sorted((ROOT / "engine").glob("*/*.py")))
    assert bench <= engine, f"bench/ has {bench} lines of Python, engine/ {engine}: share or delete before adding"


def test_every_cited_bench_command_names_what_exists():
    known = modes()
    assert {"seed", "sweep", "tenants", "soak", "fidelity", "report", "fast-path"} <= known
    missing = [f"{doc}: tandem bench {mode}" for doc, mode in cited(MODE) if mode not in known]
    missing += [f"{doc}: python -m bench.{name}" for doc, name in cited(MODULE)
                if not (ROOT / "bench" / f"{name}.py").is_file()]
    missing += [f"{doc}: {path}" for doc, path in cited(FILE) if not (ROOT / path).is_file()]
    assert not missing, "docs cite benches that do not exist:\n" + "\n".join(missing)
    assert cited(MODE), "the pattern found no command at all"
