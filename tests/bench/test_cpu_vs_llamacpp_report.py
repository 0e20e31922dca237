"""The CPU-vs-llama.cpp report: paired decode ratios per round, and the table that shows them."""

from bench.cpu_vs_llamacpp import medians, paired_ratios, render


def _round(r: int, ours: float, theirs_paired: float, theirs: float) -> dict:
    cell = {"prefill_tok_s": 100.0, "decode_tok_s": ours, "concurrent_tok_s": 50.0}
    return {"round": r, "tandem": {"int4-ggml-graph": cell},
            "llama.cpp": {"Q4_1": {"prefill_tok_s": 90.0, "decode_tok_s": theirs, "concurrent_tok_s": 25.0}},
            "paired": {"int4-ggml-graph": {"kind": "Q4_1", "tandem_decode_tok_s": ours,
                                           "llama_decode_tok_s": theirs_paired, "ratio": ours / theirs_paired}}}


def test_paired_ratios_are_per_round_and_shown_beside_the_medians():
    rounds = [_round(0, 100.0, 80.0, 120.0), _round(1, 90.0, 100.0, 90.0), _round(2, 110.0, 100.0, 100.0)]
    paired = paired_ratios(rounds)["int4-ggml-graph"]
    assert paired["ratios"] == [1.25, 0.9, 1.1] and paired["median"] == 1.1
    assert (paired["min"], paired["max"]) == (0.9, 1.25)
    table = render({"median": medians(rounds), "paired": paired_ratios(rounds)})
    row = next(line for line in table.splitlines() if line.startswith("| tandem int4-ggml-graph"))
    assert "1.00x (Q4_1)" in row  # medians apart: 100 / 100
    assert "1.10x (0.90-1.25, 3 rounds)" in row and "2.00x" in row


def test_a_report_without_pairs_still_renders():
    rounds = [_round(0, 100.0, 80.0, 100.0)]
    for r in rounds:
        del r["paired"]
    assert "| tandem int4-ggml-graph |" in render({"median": medians(rounds), "paired": paired_ratios(rounds)})
