"""The batched sampler against a straightforward per-row reference: penalties (repetition,
frequency, presence) over the device-side token history, logit bias, logprobs, and top-k /
top-p / min-p. Milliseconds on the CPU; the same checks run on cuda where there is one."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch

from tandem.engine.sampler import Sampler, SamplingRow, _filter
from tandem.engine.sampling_params import SamplingParams

VOCAB = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs CUDA"))]


def reference_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[int]):
    """One row, token by token, as OpenAI and vLLM define the penalties."""
    x = logits.double().clone()
    counts = Counter(outputs)
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(outputs):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    for t, b in params.logit_bias.items():
        x[t] += b
    if not params.is_greedy:
        x /= params.temperature
    return x


def make_rows(device, specs, prompts):
    return [SamplingRow(SamplingParams(**spec), None if "seed" not in spec else
                        torch.Generator(device=device).manual_seed(spec["seed"]), prompt_token_ids=prompt)
            for spec, prompt in zip(specs, prompts)]


SPECS = [
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
    dict(temperature=0.0),  # plain greedy row inside a processed batch
    dict(temperature=0.0, presence_penalty=-1.5, logit_bias={3: 5.0, 9: -100.0}),
    dict(temperature=0.7, seed=11, frequency_penalty=2.0, repetition_penalty=0.8, logprobs=3),
    dict(temperature=1.3, seed=12, logit_bias={1: 2.5}, logprobs=0),
]


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_and_bias_match_the_reference_over_many_steps(device):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in SPECS]
    rows = make_rows(device, SPECS, prompts)
    sampler, outputs = Sampler(), [[] for _ in SPECS]
    for _ in range(12):
        # Peaked logits so greedy rows repeat themselves and the penalties matter.
        logits = (torch.randn(len(rows), VOCAB, generator=gen) * 3).to(device)
        processed = sampler.processed_logits(logits, rows)
        for i, row in enumerate(rows):
            want = reference_logits(logits[i].cpu(), row.params, prompts[i], outputs[i])
            torch.testing.assert_close(processed[i].cpu().double(), want, rtol=1e-5, atol=1e-4)
        out = sampler.sample(logits, rows)
        sampled = out.sampled_token_ids.tolist()
        for i, row in enumerate(rows):
            if row.greedy:
                assert sampled[i] == int(processed[i].argmax())
            outputs[i].append(sampled[i])
        lp = out.logprobs
        assert lp.rows == [4, 5] and lp.num_top == [3, 0]
        for j, i in enumerate(lp.rows):
            want = torch.log_softmax(processed[i].cpu().double(), -1)
            assert abs(lp.sampled[j].item() - want[sampled[i]].item()) < 1e-4
        want_top = torch.log_softmax(processed[4].cpu().double(), -1).topk(3)
        torch.testing.assert_close(lp.top_logprobs[0].cpu().double(), want_top.values, rtol=1e-5, atol=1e-4)
        assert lp.top_ids[0].tolist() == want_top.indices.tolist() and lp.top_ids.shape == (2, 3)
    assert outputs[0] != [outputs[0][0]] * len(outputs[0])  # the repetition penalty moved it off its argmax


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_penalty_changes_tokens_as_defined(device):
    """Flat logits with one favourite: greedy picks it forever, a presence penalty larger than
    its lead makes the next pick something else, a frequency penalty after as many repeats."""
    logits = torch.zeros(1, VOCAB, device=device)
    logits[0, 5] = 1.0
    for spec, expected in [(dict(), [5, 5, 5]), (dict(presence_penalty=1.5), [5, 0, 1]),
                           (dict(frequency_penalty=0.6), [5, 5, 0])]:
        sampler, rows = Sampler(), make_rows(device, [dict(temperature=0.0, **spec)], [[]])
        assert [sampler(logits, rows)[0] for _ in range(3)] == expected


@pytest.mark.parametrize("device", DEVICES)
def test_bias_of_minus_100_bans_and_plus_100_forces(device):
    logits = torch.randn(2, VOCAB, device=device)
    top = logits.argmax(-1).tolist()
    rows = make_rows(device, [dict(temperature=1.0, seed=1, logit_bias={7: 100.0}),
                              dict(temperature=0.0, logit_bias={top[1]: -100.0})], [[], []])
    sampler = Sampler()
    for _ in range(5):
        tokens = sampler(logits, rows)
        assert tokens[0] == 7 and tokens[1] != top[1]


def test_history_slots_are_reused_once_rows_are_gone():
    sampler, logits = Sampler(), torch.randn(3, VOCAB)
    for _ in range(20):
        rows = make_rows("cpu", [dict(temperature=0.0, presence_penalty=1.0)] * 3, [[1], [2], [3]])
        sampler(logits, rows)
        del rows
        gc.collect()
    assert sampler._counts.shape[0] == 8  # never grew past its first size
    assert sorted(sampler._free_slots) == list(range(8))


def test_history_grows_past_its_first_size():
    sampler, logits = Sampler(), torch.zeros(20, VOCAB)
    logits[:, 4] = 1.0
    rows = make_rows("cpu", [dict(temperature=0.0, presence_penalty=2.0)] * 20, [[]] * 20)
    assert sampler(logits, rows) == [4] * 20
    assert sampler(logits, rows) == [0] * 20
    assert sampler._counts.shape[0] == 32


def reference_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row: top-k, then top-p over what is left (the smallest set reaching p), then min-p."""
    x = logits.double().clone()
    if 0 < params.top_k < x.numel():
        x[x < x.topk(params.top_k).values[-1]] = float("-inf")
    probs = torch.softmax(x, -1)
    if params.top_p < 1.0:
        sorted_probs, ids = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.clone()
        probs[ids[drop]] = 0.0
        probs /= probs.sum()
    if params.min_p:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("specs", [
    [dict(top_k=5), dict(top_k=1), dict(), dict(top_k=63)],
    [dict(top_p=0.5), dict(top_p=0.9, top_k=10), dict(), dict(top_p=0.05)],
    [dict(min_p=0.2), dict(min_p=0.05, top_k=20), dict(top_p=0.7, min_p=0.1), dict()],
], ids=["top_k", "top_p", "min_p"])
def test_filters_match_the_reference(device, specs):
    logits = torch.randn(len(specs), VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    rows = make_rows(device, [dict(temperature=1.0, **s) for s in specs], [[]] * len(specs))
    probs = _filter(logits.to(device), rows)
    probs = probs / probs.sum(-1, keepdim=True)
    for i, row in enumerate(rows):
        torch.testing.assert_close(probs[i].cpu().double(), reference_filter(logits[i], row.params),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_distribution_and_seeds_repeat(device):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]], device=device))
    sampler = Sampler()
    counts = Counter(sampler(logits.expand(4000, 4).contiguous(),
                             make_rows(device, [dict(temperature=1.0)] * 4000, [[]] * 4000)))
    assert set(counts) == {0, 1, 2} and abs(counts[0] / 4000 - 0.5) < 0.05 and abs(counts[2] / 4000 - 0.2) < 0.05
    first = [sampler(logits, make_rows(device, [dict(temperature=1.0, seed=5)], [[]]))[0] for _ in range(3)]
    row = make_rows(device, [dict(temperature=1.0, seed=5)], [[]])
    batch = make_rows(device, [dict(temperature=1.0)] * 3, [[]] * 3)
    again = sampler(logits.expand(4, 4).contiguous(), batch[:1] + row + batch[1:])[1]
    assert len(set(first)) == 1 and again == first[0]


def test_all_greedy_plain_batch_stays_on_the_fast_path():
    logits = torch.randn(4, VOCAB)
    out = Sampler().sample(logits, make_rows("cpu", [dict(temperature=0.0)] * 4, [[]] * 4))
    assert out.logprobs is None and out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_bias_past_the_sampling_vocabulary_is_ignored():
    """Random presets sample only ids their tokenizer can decode; a bias beyond those is a no-op."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0
    rows = make_rows("cpu", [dict(temperature=0.0, logit_bias={60: 100.0, 3: 5.0}, logprobs=1)], [[]])
    out = Sampler(sampling_vocab_size=50).sample(logits, rows)
    assert out.sampled_token_ids.tolist() == [3] and out.logprobs.top_ids.tolist() == [[3]]
