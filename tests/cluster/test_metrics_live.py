"""Every selector a dashboard query uses selects samples in every scrape: at start, after load,
and idle; and the load moves every counter and histogram a panel plots.

Real Prometheus scrapes of the shared cluster (tests/cluster/conftest.py), on both addresses:
Ray's metrics export port (`--metrics-port`) and `/metrics` on the API port. Each page must
parse as Prometheus text (prometheus_client's parser; `promtool` is not installable here).
Each panel's selectors (tests/cluster/test_dashboards.py reads them from dashboards/*.json)
must match samples there carrying every label the query filters or groups on, for every
backend where the series is per backend.

Ray reports metrics to its agent every 10 s, so a scrape right after start or after load may
lag: those two wait for the series. The idle scrape does not wait: it comes after longer than
Ray's gauge TTL (20 s) with no request, which is exactly when gauges set only on events used to
vanish, so everything must already be there.

At start no request has been served, so every histogram is there only because Tandem's page
adds it at zero (Ray cannot export an empty histogram; cluster/metrics_route.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from tandem.actors.metrics import REGISTRY
from tests.cluster.conftest import MODEL, TIMEOUT_S
from tests.cluster.test_dashboards import DASHBOARDS, Selector, all_queries, selectors

pytestmark = pytest.mark.slow

IDLE_S = 25.0  # longer than Ray 2.60's gauge TTL (2 x its 10 s report interval)
WAIT_S = 60.0  # for Ray's next report, on a loaded 2-core machine
BACKEND_LABELLED = {series for spec in REGISTRY.values() if "backend" in spec.tag_keys
                    for series in spec.exported_series}
# Counters a panel plots that four plain requests on idle backends need not move: preemptions
# and failures need pressure or a crash, and a prefix hit a prompt seen before. A request's
# TTFT error lands in the late or the early histogram, whichever side of its projection the
# first token came, so a backend need not move both; refusals need a deadline. The host KV tier's
# counters need a backend with a tier (cuda or sim), which the shared cluster of cpu backends has not.
NOT_MOVED_BY_PLAIN_REQUESTS = {"ray_tandem_backend_preemptions_total", "ray_tandem_backend_prefix_cache_hits_total",
                               "ray_tandem_backend_prefix_cache_host_hits_total",
                               "ray_tandem_backend_kv_host_offload_bytes_total",
                               "ray_tandem_backend_kv_host_reload_bytes_total",
                               "ray_tandem_router_backend_failures_total", "ray_tandem_router_reroutes_total",
                               "ray_tandem_router_ttft_late_seconds_bucket", "ray_tandem_router_ttft_early_seconds_bucket",
                               "ray_tandem_router_deadline_refusals_total"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def dashboard_selectors() -> list[Selector]:
    unique = {str(s): s for path in DASHBOARDS for expr in all_queries(path) for s in selectors(expr)}
    return [unique[key] for key in sorted(unique)]


def scrape(url: str) -> list[Sample]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return [Sample(sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(response.text) for sample in family.samples]


def selected(samples: list[Sample], selector: Selector) -> list[Sample]:
    return [s for s in samples if s.name == selector.name and selector.matches(s.labels)]


def missing(samples: list[Sample], wanted: list[Selector], backend_ids: set[str]) -> list[str]:
    """Selectors that select nothing in a scrape, select samples without a label the query
    filters or groups on, or (on a per-backend series) miss a backend."""
    gaps = []
    for selector in wanted:
        found = selected(samples, selector)
        unlabelled = sorted({label for s in found for label in selector.used_labels if not s.labels.get(label)})
        per_backend = "backend" in selector.labels or selector.name in BACKEND_LABELLED
        absent = sorted(backend_ids - {s.labels.get("backend") for s in found}) if per_backend else []
        if not found:
            gaps.append(f"{selector} (no sample)")
        elif unlabelled:
            gaps.append(f"{selector} (samples without {unlabelled})")
        elif absent:
            gaps.append(f"{selector} (backends {absent})")
    return gaps


def moving_series(wanted: list[Selector]) -> list[Selector]:
    """The counters and histograms a panel plots that any served request moves."""
    return [s for s in wanted if s.name.endswith(("_total", "_bucket", "_count", "_sum"))
            and s.name not in NOT_MOVED_BY_PLAIN_REQUESTS]


def totals(samples: list[Sample], wanted: list[Selector]) -> dict[str, float]:
    """Each selector's samples summed, per backend where the query groups by backend."""
    sums: dict[str, float] = {}
    for selector in wanted:
        for sample in selected(samples, selector):
            key = f"{selector} backend={sample.labels['backend']}" if "backend" in selector.labels else str(selector)
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums


@pytest.fixture(scope="module")
def endpoints(tandem):
    return {"metrics port": tandem.metrics_url, "API port": tandem.url + "/metrics"}


def check_every_scrape(endpoints, wanted: list[Selector], backend_ids: set[str], wait: bool) -> None:
    for where, url in endpoints.items():
        gaps = missing(scrape(url), wanted, backend_ids)
        deadline = time.monotonic() + (WAIT_S if wait else 0.0)
        while gaps and time.monotonic() < deadline:
            time.sleep(1.0)
            gaps = missing(scrape(url), wanted, backend_ids)
        assert gaps == [], f"{where} scrape lacks {gaps}"


def check_moved(endpoints, wanted: list[Selector], before: dict[str, dict[str, float]]) -> None:
    """Every moving series' total (per backend where grouped so) is above its total in `before`,
    once Ray has reported the load."""
    for where, url in endpoints.items():
        def unmoved() -> list[str]:
            then, now = before[where], totals(scrape(url), wanted)
            return [f"{key}: {then.get(key)} -> {now.get(key)}" for key in sorted(now.keys() | then.keys())
                    if not now.get(key, 0.0) > then.get(key, 0.0)]

        still = unmoved()
        deadline = time.monotonic() + WAIT_S
        while still and time.monotonic() < deadline:
            time.sleep(1.0)
            still = unmoved()
        assert still == [], f"{where} scrape: the load did not move {still}"


def load_both_backends(http) -> list[str]:
    """Four concurrent requests (completions and chat): with equal rates and two slots per
    backend, the router spreads them over both. Returns the backends that served them."""
    from concurrent.futures import ThreadPoolExecutor

    def send(i: int) -> str:
        if i % 2:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Say {i}"}]}
        else:
            path, body = "/v1/completions", {"prompt": f"{i} plus {i} is"}
        response = http.post(path, json={"model": MODEL, "max_tokens": 8, "temperature": 0, **body})
        assert response.status_code == 200, response.text
        return response.headers["x-tandem-backend"]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(send, range(4)))


def test_every_dashboard_selector_at_start_after_load_and_idle(tandem, endpoints, http):
    wanted = dashboard_selectors()
    moving = moving_series(wanted)
    assert len(wanted) > 20 and len(moving) > 10, (wanted, moving)
    backend_ids = set(tandem.refresh_backends())
    assert len(backend_ids) == 2

    check_every_scrape(endpoints, wanted, backend_ids, wait=True)
    before = {where: totals(scrape(url), moving) for where, url in endpoints.items()}

    served_by = load_both_backends(http)
    assert set(served_by) == backend_ids
    check_every_scrape(endpoints, wanted, backend_ids, wait=True)
    check_moved(endpoints, moving, before)

    time.sleep(IDLE_S)
    check_every_scrape(endpoints, wanted, backend_ids, wait=False)


def test_metrics_on_the_api_port_are_open_like_health(tandem):
    """/metrics needs no key, even on an app that requires one for the API (as in vLLM)."""
    import httpx

    assert httpx.get(tandem.url + "/secure/v1/models", timeout=TIMEOUT_S).status_code == 401
    assert httpx.get(tandem.url + "/secure/metrics", timeout=TIMEOUT_S).status_code == 200
