"""Every query in dashboards/ uses only series Tandem exports (actors/metrics.py), filters and
groups only on labels those series carry, and the Prometheus scrape config points at the
default metrics port. test_metrics_live.py runs the same selectors against a live scrape.

`selectors` reads a PromQL expression's metric selectors: each metric name, its label matchers
(`{backend="cpu0"}`) and the labels an aggregation around it groups on (`sum by (backend, le)
(...)`, or `sum (...) by (...)`), enough to check a panel against a scrape without a PromQL
evaluator.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tandem.cluster.config import TandemConfig
from tandem.actors.metrics import HISTOGRAM, REGISTRY, exported_series

DASHBOARDS = sorted((Path(__file__).parents[2] / "dashboards").glob("*.json"))
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "offset", "bool", "inf", "nan", "atan2"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_TOKEN = re.compile(r"""\s*(?:
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<matchers>\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[(),])
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>])
)""", re.VERBOSE)
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...] = ()  # (label, op, value): =, !=, =~, !~
    labels: frozenset[str] = frozenset()  # labels an enclosing aggregation groups on

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether a sample with these labels is one this selector selects."""
        for label, op, value in self.matchers:
            got = labels.get(label, "")
            ok = got == value if op in ("=", "!=") else re.fullmatch(value, got) is not None
            if ok != (op in ("=", "=~")):
                return False
        return True

    @property
    def used_labels(self) -> set[str]:
        return set(self.labels) | {label for label, _, _ in self.matchers}

    def __str__(self) -> str:
        matchers = ",".join(f'{label}{op}"{value}"' for label, op, value in self.matchers)
        by = f" by ({', '.join(sorted(self.labels))})" if self.labels else ""
        return f"{self.name}{{{matchers}}}{by}" if matchers else f"{self.name}{by}"


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while expr[pos:].strip():
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:]!r} in {expr!r}")
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        pos = match.end()
    return tokens


def _parse_matchers(text: str) -> tuple[tuple[str, str, str], ...]:
    body, found, pos = text[1:-1].strip(), [], 0
    while pos < len(body):
        match = _MATCHER.match(body, pos)
        if match is None:
            raise ValueError(f"cannot read the label matchers {text!r}")
        found.append(match.groups())
        pos = match.end()
    return tuple(found)


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression, in order (see the module docstring)."""
    tokens = _tokens(expr)
    frames: list[int] = []  # open parentheses, innermost last, as ids into `grouping`
    grouping: dict[int, set[str]] = {}  # parenthesis id -> labels its aggregation groups on
    found: list[tuple[str, tuple, list[int]]] = []  # (name, matchers, enclosing parentheses)
    pending: set[str] | None = None  # a `by (...)` list waiting for its aggregation's "("
    last_closed: int | None = None
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        prev = tokens[i - 1] if i else ("", "")
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "ident" and text in LABEL_LISTS:
            labels: set[str] = set()
            if nxt == ("punct", "("):  # the label list (group_left may have none)
                i += 2
                while tokens[i] != ("punct", ")"):
                    labels |= {tokens[i][1]} if tokens[i][0] == "ident" else set()
                    i += 1
            if text == "by" and prev == ("punct", ")") and last_closed is not None:
                grouping[last_closed] = labels  # `sum (...) by (labels)`
            elif text == "by":
                pending = labels  # `sum by (labels) (...)`
        elif kind == "punct" and text == "(":
            frames.append(len(grouping))
            grouping[len(grouping)] = pending or set()
            pending = None
        elif kind == "punct" and text == ")":
            last_closed = frames.pop()
        elif kind == "ident" and text not in PROMQL_WORDS and nxt not in (("punct", "("), ("ident", "by"),
                                                                         ("ident", "without")):
            matchers = _parse_matchers(nxt[1]) if nxt[0] == "matchers" else ()
            found.append((text, matchers, list(frames)))
        i += 1
    return [Selector(name, matchers, frozenset().union(*(grouping[f] for f in frames)))
            for name, matchers, frames in found]


def series_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression."""
    return {selector.name for selector in selectors(expr)}


def series_labels() -> dict[str, set[str]]:
    """Exported series -> the labels its samples carry (Tandem's tags; `le` on a bucket)."""
    return {series: set(spec.tag_keys) | ({"le"} if spec.kind == HISTOGRAM and series.endswith("_bucket") else set())
            for spec in REGISTRY.values() for series in spec.exported_series}


def all_queries(path: Path) -> list[str]:
    dashboard = json.loads(path.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_there_are_backend_and_routing_dashboards():
    assert {p.stem for p in DASHBOARDS} == {"backends", "routing"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_uses_exported_series_only(path):
    known = exported_series()
    queries = all_queries(path)
    assert queries
    for expr in queries:
        names = series_in(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= known, f"{expr!r} uses {sorted(names - known)}, which Tandem does not export"


def test_series_parser_ignores_labels_and_functions():
    expr = 'histogram_quantile(0.5, sum by (backend, le) (rate(ray_x_bucket{backend="cpu0"}[1m]))) / ignoring(backend) group_left sum(y)'
    assert series_in(expr) == {"ray_x_bucket", "y"}


def test_selectors_carry_matchers_and_grouping_labels():
    expr = ('histogram_quantile(0.95, sum by (backend, le) (rate(x_bucket{backend="cpu0", stage=~"pre.*"}[1m]))) '
            '/ ignoring(backend) group_left sum(y{a!="b"}) + max(z) by (policy) offset 5m')
    assert [str(s) for s in selectors(expr)] == [
        'x_bucket{backend="cpu0",stage=~"pre.*"} by (backend, le)', 'y{a!="b"}', "z by (policy)"]
    x = selectors(expr)[0]
    assert x.matches({"backend": "cpu0", "stage": "prefill"}) and not x.matches({"backend": "cpu1", "stage": "prefill"})
    assert not x.matches({"backend": "cpu0", "stage": "route"}) and x.used_labels == {"backend", "stage", "le"}
    assert [str(s) for s in selectors("sum by (backend) (a) / sum by (stage) (rate(b[1m]))")] == [
        "a by (backend)", "b by (stage)"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_filters_and_groups_on_labels_its_series_carry(path):
    carried = series_labels()
    for expr in all_queries(path):
        for selector in selectors(expr):
            unknown = selector.used_labels - carried[selector.name]
            assert not unknown, f"{expr!r}: {selector} uses labels {sorted(unknown)} that {selector.name} lacks"


def test_every_backend_and_router_metric_is_on_a_dashboard():
    used = set().union(*(series_in(e) for p in DASHBOARDS for e in all_queries(p)))
    missing = [s.name for s in REGISTRY.values() if not set(s.exported_series) & used]
    assert missing == []


def test_prometheus_scrapes_the_default_metrics_port():
    config = yaml.safe_load((DASHBOARDS[0].parent / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"127.0.0.1:{TandemConfig().metrics_port}" in targets
