"""Every series a dashboard query uses is in every scrape: at start, after load, and idle.

Real Prometheus scrapes of the shared cluster (tests/cluster/conftest.py), on both addresses:
Ray's metrics export port (`--metrics-port`) and `/metrics` on the API port. Each page must
parse as Prometheus text (prometheus_client's parser; `promtool` is not installable here).

Ray reports metrics to its agent every 10 s, so a scrape right after start or after load may
lag: those two wait for the series. The idle scrape does not wait: it comes after longer than
Ray's gauge TTL (20 s) with no request, which is exactly when gauges set only on events used to
vanish, so everything must already be there.

At start no request has been served, so every histogram is there only because Tandem's page
adds it at zero (Ray cannot export an empty histogram; cluster/metrics_route.py).
"""

from __future__ import annotations

import time

import pytest

from tandem.actors.metrics import REGISTRY
from tests.cluster.conftest import MODEL, TIMEOUT_S
from tests.cluster.test_dashboards import DASHBOARDS, all_queries, series_in

pytestmark = pytest.mark.slow

IDLE_S = 25.0  # longer than Ray 2.60's gauge TTL (2 x its 10 s report interval)
WAIT_S = 60.0  # for Ray's next report, on a loaded 2-core machine
BACKEND_LABELLED = {series for spec in REGISTRY.values() if "backend" in spec.tag_keys
                    for series in spec.exported_series}


def dashboard_series() -> set[str]:
    return set().union(*(series_in(expr) for path in DASHBOARDS for expr in all_queries(path)))


def scrape(url: str) -> dict[str, set[str]]:
    """Series name -> the backend label values it carries ('' where it has none)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).add(sample.labels.get("backend", ""))
    return found


def missing(found: dict[str, set[str]], wanted: set[str], backend_ids: set[str]) -> list[str]:
    """Wanted series absent from a scrape, or present without one of the backends."""
    gaps = []
    for name in sorted(wanted):
        if name not in found:
            gaps.append(name)
        elif name in BACKEND_LABELLED and not backend_ids <= found[name]:
            gaps.append(f"{name} (backends {sorted(backend_ids - found[name])})")
    return gaps


@pytest.fixture(scope="module")
def endpoints(tandem):
    return {"metrics port": tandem.metrics_url, "API port": tandem.url + "/metrics"}


def check_every_scrape(endpoints, wanted: set[str], backend_ids: set[str], wait: bool) -> None:
    for where, url in endpoints.items():
        gaps = missing(scrape(url), wanted, backend_ids)
        deadline = time.monotonic() + (WAIT_S if wait else 0.0)
        while gaps and time.monotonic() < deadline:
            time.sleep(1.0)
            gaps = missing(scrape(url), wanted, backend_ids)
        assert gaps == [], f"{where} scrape lacks {gaps}"


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


def test_every_dashboard_series_at_start_after_load_and_idle(tandem, endpoints, http):
    wanted = dashboard_series()
    backend_ids = set(tandem.refresh_backends())
    assert len(backend_ids) == 2

    check_every_scrape(endpoints, wanted, backend_ids, wait=True)

    served_by = load_both_backends(http)
    assert set(served_by) == backend_ids
    check_every_scrape(endpoints, wanted, backend_ids, wait=True)

    time.sleep(IDLE_S)
    check_every_scrape(endpoints, wanted, backend_ids, wait=False)


def test_metrics_on_the_api_port_are_open_like_health(tandem):
    """/metrics needs no key, even on an app that requires one for the API (as in vLLM)."""
    import httpx

    assert httpx.get(tandem.url + "/secure/v1/models", timeout=TIMEOUT_S).status_code == 401
    assert httpx.get(tandem.url + "/secure/metrics", timeout=TIMEOUT_S).status_code == 200
