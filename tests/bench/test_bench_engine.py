"""Smoke test of the engine benchmark: it runs end to end on a tiny model and writes its JSON.

No timing asserts (speed belongs in the benchmark's own output); only the shape of the report,
and that the workload is the one the benchmark promises (shared prefix, distinct tails).
"""

from __future__ import annotations

import json

from bench.engine import build_prompts, percentile
from tandem.cluster.cli import main


def test_prompts_share_exactly_the_prefix():
    encode = lambda text: list(text.encode())  # noqa: E731 - a byte tokenizer is enough here
    prompts = build_prompts(encode, num_requests=3, prompt_tokens=40, prefix_tokens=32, run_index=1)
    assert [len(p) for p in prompts] == [40, 40, 40]
    assert prompts[0][:32] == prompts[1][:32] == prompts[2][:32]
    assert len({tuple(p[32:]) for p in prompts}) == 3
    assert build_prompts(encode, 3, 40, 32, run_index=2)[0][:32] != prompts[0][:32]


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == 9.5


def test_bench_engine_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "engine", "--model", "tiny-llama-random", "--num-requests", "2", "--prompt-tokens", "40",
          "--prefix-tokens", "32", "--max-tokens", "4", "--threads", "1", "--no-progress",
          "--out", str(out)])
    result = json.loads(out.read_text())
    assert {"command", "date", "machine", "config", "results", "engine_vs_hf_tokens"} <= result.keys()
    assert {"cpu_model", "cpu_count", "torch", "torch_threads"} <= result["machine"].keys()
    assert result["config"]["num_requests"] == 2 and result["config"]["max_active"] == 2
    rows = {row["system"]: row for row in result["results"]}
    assert set(rows) == {"engine (cold)", "engine (warm-prefix)", "HF transformers"}
    for row in rows.values():
        assert {"output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s", "tok_s_vs_hf",
                "ttft_p50_vs_hf", "runs"} <= row.keys()
        assert row["runs"][0]["num_output_tokens"] == 2 * 4
    warm_run = rows["engine (warm-prefix)"]["runs"][0]["extra"]
    assert warm_run["prefix_cache_hit_tokens"] == 2 * 32
    assert {"other_cpu_cores", "waited_for_idle_s"} <= warm_run.keys()
    # Greedy decoding of the same fp32 weights: the engine reproduces HF's tokens.
    assert result["engine_vs_hf_tokens"] == {"requests_identical": 2, "requests_compared": 2}
    assert "| engine (cold) |" in capsys.readouterr().out
