"""The x-tandem-* headers: their names, and the ones every answer to a routed request carries.

A client learns which backend served its request, and the TTFT the router projected where it
placed it, from headers as well as from each body's `tandem` field, so a streamed response
says both before its first chunk. A request's id is in a header on every answer, errors
included: it is what the server's log files the request under. A request's TTFT deadline may
come in a header instead of the body's `ttft_deadline_ms` (the body wins; docs/routing.md,
"Deadlines"). A failed request's answer says how long the server held it, in the standard
`Server-Timing` header, so a client can tell the server's part of a refusal's latency from its own
and the network's.
"""

from __future__ import annotations

from tandem.cluster.dispatch import RoutedRequest

BACKEND_HEADER = "x-tandem-backend"
DEADLINE_HEADER = "x-tandem-ttft-deadline-ms"
PROJECTED_TTFT_HEADER = "x-tandem-projected-ttft-ms"
REQUEST_ID_HEADER = "x-tandem-request-id"  # Serve sets its own x-request-id
SERVER_TIMING_HEADER = "server-timing"


def server_timing(received_s: float, now_s: float) -> dict[str, str]:
    """`Server-Timing: tandem;dur=MS`: from the ingress receiving the request to its answer."""
    return {SERVER_TIMING_HEADER: f"tandem;dur={max(0.0, now_s - received_s) * 1000:.2f}"}


def routed_headers(stream: RoutedRequest) -> dict[str, str]:
    """The request's id and, once it is placed, its backend and projected TTFT."""
    headers = {REQUEST_ID_HEADER: stream.req_id}
    if stream.backend_id:
        headers[BACKEND_HEADER] = stream.backend_id
        headers[PROJECTED_TTFT_HEADER] = f"{stream.decision.projected_ttft_s * 1000:.1f}"
    return headers
