"""The start-up warm-up's token counts: the slowest backend gets the base, faster ones more."""

from tandem.cluster.warmup import warmup_tokens


def test_warmup_keeps_faster_backends_busy_as_long_as_the_slowest():
    rates = {"cpu0": {"prefill_tok_s": 600, "decode_tok_s": 27, "decode_tok_s_by_batch": {1: 27, 4: 76}},
             "cuda0": {"prefill_tok_s": 38000, "decode_tok_s": 834, "decode_tok_s_by_batch": {1: 834, 4: 3155}},
             "mps0": {"prefill_tok_s": 2551, "decode_tok_s": 293}}
    # per token of one request at full batch: cpu0 4/76 = 52.6 ms, mps0 4/293 = 13.7 ms -> 3.84x
    assert warmup_tokens(rates, {"cpu0": 4, "mps0": 4}, 48) == {"cpu0": 48, "mps0": round(48 * (4 / 76) / (4 / 293))}
    # cuda0 at batch 4 is 41x faster per request: capped at 32x; an unprofiled backend gets the base
    assert warmup_tokens(rates, {"cpu0": 4, "cuda0": 4, "x": 2}, 48) == {"cpu0": 48, "cuda0": 48 * 32, "x": 48}
    assert warmup_tokens(rates, {"cpu0": 4, "cpu1": 4}, 10) == {"cpu0": 10, "cpu1": 10}
