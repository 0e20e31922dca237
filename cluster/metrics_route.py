"""Tandem's Prometheus page: `--metrics-port`, and `/metrics` on the API port.

Every Tandem actor records through Ray's metrics API, and Ray's metrics agent exports them,
with Ray's own series, on each node's metrics export port; the Ray dashboard's Prometheus
discovers that port, so its view is Ray's as usual. Tandem's page is that page plus one thing
Ray cannot do: a histogram that has had no observation yet is absent from Ray's export (the
recorder keeps counters and gauges present, see actors/metrics.py), so a latency panel would
read "no data" until the first request. `fill_empty_histograms` adds each such Tandem
histogram at zero, per backend that the page already names (the ingress's: per value known up
front, such as each admission stage), until Ray exports the real one.

Two addresses serve the page. `--metrics-port` is a small HTTP server in the process that
started Tandem (`MetricsServer`), in front of Ray's export port, which then moves to a free
port of its own; the API port answers `/metrics` too (`metrics_response`), where vLLM's and
SGLang's users and tools such as aiperf look. Both read the local node's Ray export each time,
so they never disagree. Both are open, like `/health` and like vLLM's `/metrics`: a scrape
carries no secrets, and Prometheus scrape configs rarely carry API keys.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from starlette.responses import PlainTextResponse, Response

SCRAPE_TIMEOUT_S = 10.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # what Ray's exporter writes
_BACKEND_LABEL = re.compile(r'[{,]backend="([^"]*)"')


# -- the page ------------------------------------------------------------------------------
def fill_empty_histograms(page: str) -> str:
    """Ray's page plus, for each Tandem histogram, a zero series for every backend the page
    names (on the same component's metrics: the backends' or the router's) that has none yet.
    A family Ray exports for some backends gets the others' zeros next to its own samples (a
    Prometheus family must stay contiguous); a family it does not export yet is added whole."""
    from tandem.actors.metrics import BACKEND_METRICS, HISTOGRAM, INGRESS_METRICS, ROUTER_METRICS

    lines = page.splitlines()
    appended = []
    wanted = [(spec, "backend", _backend_ids(page, prefix))
              for prefix, specs in (("ray_tandem_backend_", BACKEND_METRICS), ("ray_tandem_router_", ROUTER_METRICS))
              for spec in specs]
    if "\nray_tandem_http_" in "\n" + page:  # an ingress runs here (its counters are declared at start)
        wanted += [(spec, key, list(values)) for spec in INGRESS_METRICS for key, values in spec.known_values]
    for spec, key, values in wanted:
        if spec.kind != HISTOGRAM or not values:
            continue
        family = [i for i, line in enumerate(lines) if _series_name(line) in spec.exported_series]
        if not family:
            appended.append(_zero_histogram(spec, key, values, header=True))
            continue
        label = re.compile(rf'[{{,]{key}="([^"]*)"')
        have = {v for i in family for v in label.findall(lines[i])}
        lacking = [v for v in values if v not in have]
        if lacking:
            lines[family[-1]] += "\n" + _zero_histogram(spec, key, lacking, header=False).rstrip("\n")
    if not appended and "\n".join(lines) == page.rstrip("\n"):
        return page
    body = "\n".join(lines)
    return body + ("\n" if body else "") + "".join(appended)


def _series_name(line: str) -> str:
    """A sample's series name; for a `# TYPE` line, its family's first series (a family Ray
    declared without samples is left alone rather than declared twice)."""
    if line.startswith("# TYPE "):
        name, kind = (line.split() + ["", ""])[2:4]
        return f"{name}_bucket" if kind == "histogram" else name
    return "" if line.startswith("#") else line.split("{", 1)[0].split(" ", 1)[0]


def _backend_ids(page: str, prefix: str) -> list[str]:
    found = set()
    for line in page.splitlines():
        if line.startswith(prefix):
            found.update(_BACKEND_LABEL.findall(line))
    return sorted(found)


def _zero_histogram(spec, key: str, values: list[str], header: bool) -> str:
    """`spec`'s histogram at zero, one series per value of its label `key`."""
    name = spec.exported_name
    lines = [f"# HELP {name} {spec.description}", f"# TYPE {name} histogram"] if header else []
    for value in values:
        for bound in (*(repr(float(b)) for b in spec.boundaries), "+Inf"):
            lines.append(f'{name}_bucket{{{key}="{value}",le="{bound}"}} 0.0')
        lines.append(f'{name}_count{{{key}="{value}"}} 0.0')
        lines.append(f'{name}_sum{{{key}="{value}"}} 0.0')
    return "\n".join(lines) + "\n"


def fetch_page(ray_port: int) -> str:
    response = httpx.get(f"http://127.0.0.1:{ray_port}/metrics", timeout=SCRAPE_TIMEOUT_S)
    response.raise_for_status()
    return fill_empty_histograms(response.text)


# -- /metrics on the API port --------------------------------------------------------------
async def metrics_response() -> Response:
    """This node's page, or 503 naming what failed."""
    try:
        port = await asyncio.to_thread(local_metrics_port)
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
            page = await client.get(f"http://127.0.0.1:{port}/metrics")
        page.raise_for_status()
    except (httpx.HTTPError, LookupError) as exc:
        return PlainTextResponse(f"metrics unavailable: {type(exc).__name__}: {exc}\n", status_code=503)
    return Response(fill_empty_histograms(page.text), media_type=PROMETHEUS_TEXT)


def local_metrics_port() -> int:
    """Ray's metrics export port on the node this process runs on."""
    import ray

    return _metrics_port_of(ray.get_runtime_context().get_node_id())


@functools.lru_cache(maxsize=4)
def _metrics_port_of(node_id: str) -> int:
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("MetricsExportPort"):
            return int(node["MetricsExportPort"])
    raise LookupError(f"Ray reports no metrics export port for node {node_id}")


# -- --metrics-port --------------------------------------------------------------------------
class MetricsServer:
    """Serves the page on `port` (loopback) from Ray's export on `ray_port`, in a thread."""

    def __init__(self, port: int, ray_port: int) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(ray_port))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="tandem-metrics-port", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(ray_port: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self._reply(404, "not found; Prometheus metrics are at /metrics\n", "text/plain; charset=utf-8")
                return
            try:
                page = fetch_page(ray_port)
            except httpx.HTTPError as exc:
                self._reply(503, f"metrics unavailable: {type(exc).__name__}: {exc}\n", "text/plain; charset=utf-8")
                return
            self._reply(200, page, PROMETHEUS_TEXT)

        def _reply(self, status: int, text: str, content_type: str) -> None:
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
            pass  # one line per scrape would be the access log Tandem keeps off

    return Handler
