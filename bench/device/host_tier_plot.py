"""Plot host_tier_h200.sh's summaries: TTFT p50 and p90 (bars, mean of runs, the runs' sd as
error bars) and hit rate per run name and cell. Usage: python bench/device/host_tier_plot.py DIR OUT.png
(DIR holds NAME.json summaries, as docs/benchmarks/host-tier-h100/ does)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(directory: str, out: str) -> None:
    rows = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.stem.startswith("before-"):
            continue
        for cell in json.loads(path.read_text())["cells"]:
            for arm, m in cell["arms"].items():
                rows.append((f"{path.stem}\n{cell['cell'].split('-')[-1]}", m))
    fig, (ttft, hits) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1.4]})
    xs = range(len(rows))
    for offset, key, label in ((-0.2, "ttft_p50_s", "TTFT p50"), (0.2, "ttft_p90_s", "TTFT p90")):
        ttft.bar([x + offset for x in xs], [m[key]["mean"] for _, m in rows], 0.4, label=label,
                 yerr=[m[key]["sd"] for _, m in rows], capsize=3)
    ttft.set_yscale("log")
    ttft.set_ylabel("seconds (log)")
    ttft.set_xticks(list(xs), [name for name, _ in rows], fontsize=7)
    ttft.legend()
    ttft.set_title("TTFT, one H100 engine, 64 tenants x 4k-token prefixes (r = req/s)")
    hits.barh([name.replace("\n", " ") for name, _ in rows], [m["hit_rate"]["mean"] for _, m in rows])
    hits.set_xlim(0, 1)
    hits.set_title("prefix hit rate")
    hits.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
