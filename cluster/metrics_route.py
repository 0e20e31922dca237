"""`/metrics` on the API port, where vLLM and SGLang serve it and where tools such as aiperf look.

Every Tandem actor records through Ray's metrics API, and Ray's metrics agent exports them,
with Ray's own series, on each node's metrics export port (`tandem serve --metrics-port`). This
route fetches that page over loopback from the node the ingress runs on and returns it as is,
so the two addresses always carry the same series; there is one exporter, not two that could
disagree.

The route is open, like `/health` and like vLLM's `/metrics`: the metrics port itself answers
without a key, so requiring one here would protect nothing, and Prometheus scrape configs rarely
carry API keys.
"""

from __future__ import annotations

import asyncio
import functools

import httpx
from starlette.responses import PlainTextResponse, Response

SCRAPE_TIMEOUT_S = 10.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # what Ray's exporter writes


async def metrics_response() -> Response:
    """This node's Prometheus page, or 503 naming what failed."""
    try:
        port = await asyncio.to_thread(local_metrics_port)
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
            page = await client.get(f"http://127.0.0.1:{port}/metrics")
        page.raise_for_status()
    except (httpx.HTTPError, LookupError) as exc:
        return PlainTextResponse(f"metrics unavailable: {type(exc).__name__}: {exc}\n", status_code=503)
    return Response(page.content, media_type=page.headers.get("content-type", PROMETHEUS_TEXT))


def local_metrics_port() -> int:
    import ray

    return _metrics_port_of(ray.get_runtime_context().get_node_id())


@functools.lru_cache(maxsize=4)
def _metrics_port_of(node_id: str) -> int:
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("MetricsExportPort"):
            return int(node["MetricsExportPort"])
    raise LookupError(f"Ray reports no metrics export port for node {node_id}")
