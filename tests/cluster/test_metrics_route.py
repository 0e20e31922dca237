"""Tandem's Prometheus page: Ray's export plus empty histograms until their first observation,
served on --metrics-port by a small server in front of Ray's port (here a fake Ray page)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.actors.metrics import BACKEND_METRICS, HISTOGRAM, LATENCY_BUCKETS_S, ROUTER_METRICS
from tandem.cluster.metrics_route import MetricsServer, fill_empty_histograms

RAY_PAGE = """# HELP ray_tandem_backend_up 1 while the backend actor is serving.
# TYPE ray_tandem_backend_up gauge
ray_tandem_backend_up{WorkerId="a",backend="cpu0"} 1.0
ray_tandem_backend_up{WorkerId="b",backend="cpu1"} 1.0
# HELP ray_tandem_router_pending_requests Requests the router's ledger holds per backend.
# TYPE ray_tandem_router_pending_requests gauge
ray_tandem_router_pending_requests{WorkerId="c",backend="cpu0"} 0.0
# HELP ray_tandem_backend_ttft_seconds Time to first token.
# TYPE ray_tandem_backend_ttft_seconds histogram
ray_tandem_backend_ttft_seconds_bucket{WorkerId="a",backend="cpu0",le="+Inf"} 2.0
ray_tandem_backend_ttft_seconds_count{WorkerId="a",backend="cpu0"} 2.0
ray_tandem_backend_ttft_seconds_sum{WorkerId="a",backend="cpu0"} 0.5
"""


def families(page: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(page)}


def test_histograms_get_zeros_for_every_backend_without_a_series():
    page = families(fill_empty_histograms(RAY_PAGE))
    ttft = page["ray_tandem_backend_ttft_seconds"]
    own = [s for s in ttft if s.labels["backend"] == "cpu0"]
    assert [(s.name, s.value) for s in own] == [  # Ray's own samples, untouched
        ("ray_tandem_backend_ttft_seconds_bucket", 2.0), ("ray_tandem_backend_ttft_seconds_count", 2.0),
        ("ray_tandem_backend_ttft_seconds_sum", 0.5)]
    # A backend Ray has not observed yet gets zeros inside the same family (the live failure:
    # one backend served the warm-up, the other's series were missing until its first request).
    others = [s for s in ttft if s.labels["backend"] == "cpu1"]
    assert len(others) == len(LATENCY_BUCKETS_S) + 3 and all(s.value == 0 for s in others)
    e2e = page["ray_tandem_backend_e2e_seconds"]
    assert {s.labels["backend"] for s in e2e} == {"cpu0", "cpu1"} and all(s.value == 0 for s in e2e)
    assert {s.labels["le"] for s in e2e if s.name.endswith("_bucket")} == {
        *(str(float(b)) for b in LATENCY_BUCKETS_S), "+Inf"}
    ratio = page["ray_tandem_router_completion_ratio"]
    assert {s.labels["backend"] for s in ratio} == {"cpu0"}  # the router names only cpu0
    histograms = {s.exported_name for s in (*BACKEND_METRICS, *ROUTER_METRICS) if s.kind == HISTOGRAM}
    assert histograms <= set(page)


def test_the_ingress_stage_histogram_gets_zeros_for_every_stage_without_a_series():
    from tandem.actors.metrics import ADMISSION_STAGES, STAGE_BUCKETS_S

    ingress = ('# TYPE ray_tandem_http_requests_total counter\n'
               'ray_tandem_http_requests_total{endpoint="/v1/completions",status="200"} 0.0\n')
    stages = families(fill_empty_histograms(ingress))["ray_tandem_http_stage_seconds"]
    assert {s.labels["stage"] for s in stages} == set(ADMISSION_STAGES) and all(s.value == 0 for s in stages)
    assert len(stages) == len(ADMISSION_STAGES) * (len(STAGE_BUCKETS_S) + 3)
    observed = ingress + ('# TYPE ray_tandem_http_stage_seconds histogram\n'
                          'ray_tandem_http_stage_seconds_bucket{stage="route",le="+Inf"} 3.0\n'
                          'ray_tandem_http_stage_seconds_count{stage="route"} 3.0\n'
                          'ray_tandem_http_stage_seconds_sum{stage="route"} 0.01\n')
    stages = families(fill_empty_histograms(observed))["ray_tandem_http_stage_seconds"]
    assert [s.value for s in stages if s.labels["stage"] == "route"] == [3.0, 3.0, 0.01]  # Ray's, untouched
    assert {s.labels["stage"] for s in stages if s.value == 0} == set(ADMISSION_STAGES) - {"route"}


def test_a_page_without_tandem_backends_is_unchanged():
    assert fill_empty_histograms("# TYPE ray_node_cpu gauge\nray_node_cpu 1.0\n") == (
        "# TYPE ray_node_cpu gauge\nray_node_cpu 1.0\n")


def test_the_metrics_port_serves_the_filled_page():
    class FakeRay(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = RAY_PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ray = ThreadingHTTPServer(("127.0.0.1", 0), FakeRay)
    threading.Thread(target=ray.serve_forever, daemon=True).start()
    server = MetricsServer(0, ray.server_address[1])
    try:
        response = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        assert response.text == fill_empty_histograms(RAY_PAGE)
        assert httpx.get(f"http://127.0.0.1:{server.port}/other", timeout=10).status_code == 404
    finally:
        server.close()
        ray.shutdown()
        ray.server_close()
