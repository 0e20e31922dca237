"""The sampler on hand-made logits: greedy rows, seeded rows and banned tokens in one batch."""

import torch

from tandem.engine.sampler import Sampler, SamplingRow, _argmax
from tandem.engine.sampling_params import SamplingParams


def seeded_row(seed, **kw):
    return SamplingRow(SamplingParams(temperature=1.0, seed=seed, **kw), torch.Generator().manual_seed(seed))


def test_mixed_batch_returns_ints_and_each_row_as_if_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingRow(SamplingParams(temperature=0.0), None)
    tokens = Sampler()(logits, [greedy, seeded_row(1, top_k=5), seeded_row(2, top_p=0.5)])
    assert all(type(t) is int for t in tokens)
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == Sampler()(logits[1:2], [seeded_row(1, top_k=5)])[0]
    assert tokens[2] == Sampler()(logits[2:3], [seeded_row(2, top_p=0.5)])[0]
    assert tokens[1] in logits[1].topk(5).indices.tolist()


def test_banned_tokens_are_never_picked():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 10.0
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, banned_token_ids=(3,)), seeded_row(4)]
    rows[1].banned_token_ids = (3,)
    tokens = Sampler()(logits, rows)
    assert 3 not in tokens and tokens[0] == 0


def test_cpu_argmax_picks_what_torch_picks():
    # ties (the first maximum), NaN (taken before any number), a row slice of a wider vocab
    logits = torch.randn(4, 1000)
    logits[1, 5] = logits[1, 7] = 50.0
    logits[2, 9] = logits[2, 3] = float("nan")
    logits[3, 998] = 60.0
    for view in (logits, logits[:, :900], logits[1:3]):
        got = _argmax(view)
        assert got.dtype == torch.int64
        assert torch.equal(got, view.argmax(dim=-1))
