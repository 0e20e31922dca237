"""bench/route_sim_grid: a small grid end to end through routing's simulator (JSON, table, plot),
and the per-cell verdict on hand-made summaries."""

import json

from bench.route_sim_grid import verdict
from tandem.cluster.cli import main


def arm(p50_ms, p95_ms, tok_s, hit=0.9):
    return {"ttft_p50_s": p50_ms / 1000, "ttft_p95_s": p95_ms / 1000, "output_tok_s": tok_s, "cache_hit_rate": hit,
            "e2e_p95_s": 0.1}


def test_a_small_grid_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "grid"
    assert main(["bench", "route-sim-grid", "--out", str(out), "--tenants", "4", "--prefix-tokens", "1024", "--arrival-rates", "10,40",
                 "--seeds", "0", "--num-requests", "40"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(c["tenants"], c["rate_per_s"], c["seed"]) for c in report["cells"]] == [(4, 10.0, 0), (4, 40.0, 0)]
    assert all(list(c["arms"]) == ["cost", "prefix-affinity", "least-requests", "round-robin", "random"] for c in report["cells"])
    assert all(sum(a["num_requests_by_backend"].values()) == 40 for c in report["cells"] for a in c["arms"].values())
    assert report["meta"]["spec"]["scenario"] == "docs/route-sim-examples/tenants-2gpu.yaml"
    markdown = out.with_suffix(".md").read_text()
    assert "simulator cells" in markdown and "![TTFT p95](grid.png)" in markdown
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_verdict_allows_rounding_only():
    arms = {"cost": arm(2.00, 3.04, 999.5), "round-robin": arm(2.00, 3.00, 1000), "prefix-affinity": arm(2.1, 5, 1000)}
    assert verdict(arms) == {"met": True, "lost": []}
    arms["cost"] = arm(2.00, 3.06, 998, hit=0.8)
    lost = {loss["metric"]: loss["best_arm"] for loss in verdict(arms)["lost"]}
    assert lost == {"ttft_p95_s": "round-robin", "output_tok_s": "round-robin", "cache_hit_rate": "prefix-affinity"}
