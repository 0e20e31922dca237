"""Write Tandem's Grafana dashboards (backends.json, routing.json) from the panel lists below.

Run `python dashboards/generate.py` after changing a panel; the JSON files are committed so
Grafana users need nothing but the files. Every query uses only series from
actors/metrics.py (tests/cluster/test_dashboards.py checks), with the `ray_` prefix that
Ray's metrics export adds. Gauges are summed over Ray's per-worker label sets, by backend.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RATE = "[1m]"


def quantiles(metric: str, by: str = "backend") -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{RATE})))", f"p{int(q * 100)} {{{{{by}}}}}")
            for q in (0.5, 0.95)]


BACKENDS = [
    ("Running requests", "short", [("sum by (backend) (ray_tandem_backend_running_requests)", "{{backend}}")]),
    ("Waiting requests", "short", [("sum by (backend) (ray_tandem_backend_waiting_requests)", "{{backend}}")]),
    ("KV cache usage", "percentunit", [("max by (backend) (ray_tandem_backend_kv_cache_usage)", "{{backend}}")]),
    ("Prefix-cache hit rate (tokens)", "percentunit", [(
        f"sum by (backend) (rate(ray_tandem_backend_prefix_cache_hits_total{RATE})) / "
        f"sum by (backend) (rate(ray_tandem_backend_prefix_cache_queries_total{RATE}))", "{{backend}}")]),
    ("Prompt tokens/s (computed)", "short", [(
        f"sum by (backend) (rate(ray_tandem_backend_prompt_tokens_total{RATE}))", "{{backend}}")]),
    ("Generation tokens/s", "short", [(
        f"sum by (backend) (rate(ray_tandem_backend_generation_tokens_total{RATE}))", "{{backend}}")]),
    ("Time to first token", "s", quantiles("ray_tandem_backend_ttft_seconds")),
    ("End-to-end latency", "s", quantiles("ray_tandem_backend_e2e_seconds")),
    ("Queue time", "s", quantiles("ray_tandem_backend_queue_time_seconds")),
    ("Engine step time", "s", quantiles("ray_tandem_backend_step_time_seconds")),
    ("Mean engine step time (exact)", "s", [(
        f"sum by (backend) (rate(ray_tandem_backend_step_seconds_total{RATE})) / "
        f"sum by (backend) (rate(ray_tandem_backend_steps_total{RATE}))", "{{backend}}")]),
    ("Engine steps/s", "short", [(f"sum by (backend) (rate(ray_tandem_backend_steps_total{RATE}))", "{{backend}}")]),
    ("Requests finished/s by reason", "short", [(
        f"sum by (backend, finish_reason) (rate(ray_tandem_backend_requests_finished_total{RATE}))",
        "{{backend}} {{finish_reason}}")]),
    ("Preemptions/s", "short", [(f"sum by (backend) (rate(ray_tandem_backend_preemptions_total{RATE}))", "{{backend}}")]),
    ("Backend up", "short", [("max by (backend) (ray_tandem_backend_up)", "{{backend}}")]),
    ("Free KV blocks", "short", [("sum by (backend) (ray_tandem_backend_kv_cache_free_blocks)", "{{backend}}")]),
    ("Host KV tier: copies", "Bps", [
        (f"sum by (backend) (rate(ray_tandem_backend_kv_host_reload_bytes_total{RATE}))", "reload {{backend}}"),
        (f"sum by (backend) (rate(ray_tandem_backend_kv_host_offload_bytes_total{RATE}))", "offload {{backend}}")]),
    ("Host KV tier: hits and occupancy", "short", [
        (f"sum by (backend) (rate(ray_tandem_backend_prefix_cache_host_hits_total{RATE})) / "
         f"sum by (backend) (rate(ray_tandem_backend_prefix_cache_queries_total{RATE}))", "host hit rate {{backend}}"),
        (f"(sum by (backend) (rate(ray_tandem_backend_prefix_cache_hits_total{RATE})) - "
         f"sum by (backend) (rate(ray_tandem_backend_prefix_cache_host_hits_total{RATE}))) / "
         f"sum by (backend) (rate(ray_tandem_backend_prefix_cache_queries_total{RATE}))", "device hit rate {{backend}}"),
        ("max by (backend) (ray_tandem_backend_kv_host_usage)", "occupancy {{backend}}")]),
]

ROUTING = [
    ("Decisions/s by backend and policy", "short", [(
        f"sum by (backend, policy) (rate(ray_tandem_router_decisions_total{RATE}))", "{{backend}} ({{policy}})")]),
    ("Share of decisions (5m)", "percentunit", [(
        "sum by (backend) (increase(ray_tandem_router_decisions_total[5m])) / "
        "ignoring(backend) group_left sum(increase(ray_tandem_router_decisions_total[5m]))", "{{backend}}")]),
    ("Score at the last decision (estimated cost)", "s", [(
        "max by (backend) (ray_tandem_router_estimated_cost_seconds)", "{{backend}}")]),
    ("Pending work (estimated seconds)", "s", [("max by (backend) (ray_tandem_router_pending_seconds)", "{{backend}}")]),
    ("Pending requests in the router's ledger", "short", [(
        "max by (backend) (ray_tandem_router_pending_requests)", "{{backend}}")]),
    ("Estimated vs realised completion (p50)", "s", [
        (f"histogram_quantile(0.5, sum by (backend, le) (rate(ray_tandem_router_estimated_completion_seconds_bucket{RATE})))",
         "estimated {{backend}}"),
        (f"histogram_quantile(0.5, sum by (backend, le) (rate(ray_tandem_router_realised_completion_seconds_bucket{RATE})))",
         "realised {{backend}}")]),
    ("Realised / estimated completion", "short", quantiles("ray_tandem_router_completion_ratio")),
    ("Observed minus projected TTFT", "s", [
        (f"histogram_quantile({q}, sum by (backend, le) (rate(ray_tandem_router_ttft_late_seconds_bucket{RATE})))",
         f"late p{int(q * 100)} {{{{backend}}}}") for q in (0.5, 0.95)] + [
        (f"-histogram_quantile({q}, sum by (backend, le) (rate(ray_tandem_router_ttft_early_seconds_bucket{RATE})))",
         f"early p{int(q * 100)} {{{{backend}}}}") for q in (0.5, 0.95)]),
    ("Deadline refusals (5m)", "short", [
        ("sum by (backend) (increase(ray_tandem_router_deadline_refusals_total[5m]))", "best was {{backend}}")]),
    ("Backends alive", "short", [("max(ray_tandem_router_backends_alive)", "alive")]),
    ("Backend failures and re-routes (5m)", "short", [
        ("sum by (backend) (increase(ray_tandem_router_backend_failures_total[5m]))", "failures {{backend}}"),
        ("sum by (backend) (increase(ray_tandem_router_reroutes_total[5m]))", "re-routed to {{backend}}")]),
    ("Prefix-cache blocks the router mirrors", "short", [
        ("max by (backend) (ray_tandem_router_mirrored_cached_blocks)", "device {{backend}}"),
        ("max by (backend) (ray_tandem_router_mirrored_host_blocks)", "host tier {{backend}}")]),
    ("HTTP requests/s by status", "short", [(
        f"sum by (endpoint, status) (rate(ray_tandem_http_requests_total{RATE}))", "{{endpoint}} {{status}}")]),
    ("HTTP requests in flight", "short", [("sum(ray_tandem_http_pending_requests)", "pending")]),
    ("Arrival to admission, by stage", "s", quantiles("ray_tandem_http_stage_seconds", by="stage")),
    ("Arrival to admission, mean by stage (exact)", "s", [(
        f"sum by (stage) (rate(ray_tandem_http_stage_time_seconds_total{RATE})) / "
        f"sum by (stage) (rate(ray_tandem_http_stage_seconds_count{RATE}))", "{{stage}}")]),
]


def panel(index: int, title: str, unit: str, queries: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(queries)],
    }


def dashboard(uid: str, title: str, panels: list) -> dict:
    return {
        "uid": uid,
        "title": title,
        "tags": ["tandem"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "panels": [panel(i, *p) for i, p in enumerate(panels)],
    }


def main() -> None:
    for name, uid, title, panels in (("backends", "tandem-backends", "Tandem: backends", BACKENDS),
                                     ("routing", "tandem-routing", "Tandem: routing", ROUTING)):
        (HERE / f"{name}.json").write_text(json.dumps(dashboard(uid, title, panels), indent=2) + "\n")


if __name__ == "__main__":
    main()
