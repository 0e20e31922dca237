"""`tandem bench structured-output` end to end on the tiny model: both engine rows decode the same
tokens per request, the summary compares them, and the mask part walks its document."""

import json

import pytest

pytest.importorskip("xgrammar")


def test_structured_output_bench_writes_its_rows(tmp_path):
    from tandem.cluster.cli import main

    out = tmp_path / "so.json"
    main(["bench", "structured-output", "--model", "tiny-llama-random", "--batch", "2", "--max-tokens", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["batch"], r["constrained"]) for r in result["engine"]] == [(2, False), (2, True)]
    assert result["engine"][0]["mask_ms_per_step"] == 0 and result["engine"][1]["mask_ms_per_step"] > 0
    assert [s["batch"] for s in result["summary"]] == [2]
    assert {r["library"] for r in result["mask"]} == {"xgrammar"} and all(r["steps"] > 10 for r in result["mask"])
