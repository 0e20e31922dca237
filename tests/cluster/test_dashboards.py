"""Every query in dashboards/ uses only series Tandem exports (actors/metrics.py), and the
Prometheus scrape config points at the default metrics port."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tandem.cluster.config import TandemConfig
from tandem.actors.metrics import REGISTRY, exported_series

DASHBOARDS = sorted((Path(__file__).parents[2] / "dashboards").glob("*.json"))
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "offset", "bool", "inf", "nan"}


def series_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*(\([^)]*\))?", " ", expr)  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = match.group(), expr[match.end():].lstrip()
        if word in PROMQL_WORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


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


def test_every_backend_and_router_metric_is_on_a_dashboard():
    used = set().union(*(series_in(e) for p in DASHBOARDS for e in all_queries(p)))
    missing = [s.name for s in REGISTRY.values() if not set(s.exported_series) & used]
    assert missing == []


def test_prometheus_scrapes_the_default_metrics_port():
    config = yaml.safe_load((DASHBOARDS[0].parent / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"127.0.0.1:{TandemConfig().metrics_port}" in targets
