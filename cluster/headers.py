"""The x-tandem-* headers: their names, and the ones every answer to a routed request carries.

A client learns which backend served its request, and the TTFT the router projected where it
placed it, from headers as well as from each body's `tandem` field, so a streamed response
says both before its first chunk. A request's id is in a header on every answer, errors
included: it is what the server's log files the request under. A request's TTFT deadline may
come in a header instead of the body's `ttft_deadline_ms` (the body wins; docs/routing.md,
"Deadlines"). Every answer says in the standard `Server-Timing` header how long the server held
the request before answering (`tandem`), so a client can tell the server's part of a latency from
its own and the network's; an admitted request's answer also splits that time into the stages of
its admission (cluster/dispatch.py `admission_stages`: `route`, `to_backend`, `to_core`,
`to_engine`, `prefill`, `back`, or `admit` where the engine queued it), which is where a lone
request's time to first token goes.
"""

from __future__ import annotations

from tandem.cluster.dispatch import RoutedRequest

BACKEND_HEADER = "x-tandem-backend"
DEADLINE_HEADER = "x-tandem-ttft-deadline-ms"
PROJECTED_TTFT_HEADER = "x-tandem-projected-ttft-ms"
REQUEST_ID_HEADER = "x-tandem-request-id"  # Serve sets its own x-request-id
SERVER_TIMING_HEADER = "server-timing"


def server_timing(received_s: float, now_s: float, stages: dict[str, float] | None = None) -> dict[str, str]:
    """`Server-Timing: <stage>;dur=MS, ..., tandem;dur=MS`: each stage's milliseconds, then the
    whole from the ingress receiving the request to `now_s`."""
    metrics = [f"{name};dur={seconds * 1000:.2f}" for name, seconds in (stages or {}).items()]
    metrics.append(f"tandem;dur={max(0.0, now_s - received_s) * 1000:.2f}")
    return {SERVER_TIMING_HEADER: ", ".join(metrics)}


def routed_headers(stream: RoutedRequest) -> dict[str, str]:
    """The request's id and, once it is placed, its backend and projected TTFT; once it is
    admitted, its admission's stages (up to its admission, where a streamed answer starts)."""
    headers = {REQUEST_ID_HEADER: stream.req_id}
    if stream.backend_id:
        headers[BACKEND_HEADER] = stream.backend_id
        headers[PROJECTED_TTFT_HEADER] = f"{stream.decision.projected_ttft_s * 1000:.1f}"
    stages = stream.admission_stages()
    if stages:
        headers.update(server_timing(stream.arrival_time, stream.admitted_time, stages))
    return headers
