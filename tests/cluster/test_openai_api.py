"""OpenAI API fields through the official `openai` client against a real cluster (two CPU
backends, SmolLM2; the session's shared cluster): parallel sampling, logprobs, penalties and
biases, explicit nulls, refused fields and `models.retrieve`."""

from __future__ import annotations

import openai
import pytest
import ray

from tests.cluster.conftest import MODEL, TIMEOUT_S, backends_idle, wait_for
from tests.cluster.test_openai_fields import REFUSED

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name a colour."}]


def served_stats(tandem, backend_id):
    return ray.get(tandem.refresh_backends()[backend_id].stats.remote(), timeout=TIMEOUT_S)


def test_models_retrieve(openai_client):
    assert openai_client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found" and "gpt-4o" in info.value.body["message"]


def test_n_greedy_identical_choices_and_the_prompt_prefilled_once(tandem, openai_client):
    wait_for(lambda: backends_idle(tandem), what="idle backends")
    prompt = "Parallel sampling shares one prompt: " + "a quick brown fox jumps over the lazy dog " * 6
    # The response names its backend only after it ran, so read both backends' stats.
    before = {b: served_stats(tandem, b) for b in tandem.refresh_backends()}
    response = openai_client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) == 1 and response.choices[0].text
    assert response.usage.completion_tokens == 18
    backend = response.model_extra["tandem"]["backend"]
    after, was = served_stats(tandem, backend), before[backend]
    num_prompt = response.usage.prompt_tokens
    hits = after.prefix_cache_hits - was.prefix_cache_hits
    prefilled = after.num_prompt_tokens_total - was.num_prompt_tokens_total
    assert hits >= 2 * 16 * ((num_prompt - 1) // 16)  # choices 1 and 2 hit every full block (block 16)
    assert prefilled == 3 * num_prompt - hits < 2 * num_prompt  # the rest was computed once


def test_n_seeded_choices_differ_and_stream_with_indexes(openai_client):
    kwargs = dict(model=MODEL, messages=QUESTION, n=3, max_tokens=8, temperature=1.0, seed=1234)
    full = openai_client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in full.choices]
    assert [c.index for c in full.choices] == [0, 1, 2] and len(set(texts)) == 3
    chunks = list(openai_client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **kwargs))
    streamed, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert streamed == texts and all(reasons)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completion_logprobs(openai_client, stream):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3)
    if stream:
        chunks = [c for c in openai_client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        token_logprobs = [x for lp in lps for x in lp.token_logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
    else:
        choice = openai_client.completions.create(**kwargs).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, token_logprobs, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert "".join(tokens) == text and len(tokens) == 6
    assert all(x <= 0 for x in token_logprobs)
    for token, logprob, top in zip(tokens, token_logprobs, tops):
        assert 3 <= len(top) <= 4 and top[token] == logprob == max(top.values())  # greedy: the top one
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_logprobs(openai_client, stream):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    if stream:
        chunks = [c for c in openai_client.chat.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    else:
        choice = openai_client.chat.completions.create(**kwargs).choices[0]
        text, content = choice.message.content, choice.logprobs.content
    assert "".join(t.token for t in content) == text and len(content) >= 1
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.logprob == t.top_logprobs[0].logprob <= 0 and bytes(t.bytes).decode() == t.token


def test_penalties_and_bias_change_the_output_as_defined(openai_client):
    base = dict(model=MODEL, prompt="red red red red red red red red", max_tokens=8, temperature=0,
                logprobs=1)
    plain = openai_client.completions.create(**base).choices[0]
    penalised = openai_client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **base).choices[0]
    assert len(set(penalised.logprobs.tokens)) > len(set(plain.logprobs.tokens))
    repeated = openai_client.completions.create(extra_body={"repetition_penalty": 2.0}, **base).choices[0]
    assert repeated.text != plain.text
    forced = openai_client.completions.create(**{**base, "max_tokens": 4}, logit_bias={"198": 100})
    assert forced.choices[0].text == "\n" * 4  # token 198 is "\n" in SmolLM2's vocabulary
    banned = openai_client.completions.create(**{**base, "max_tokens": 4}, logit_bias={"198": -100})
    assert "\n" not in banned.choices[0].text


def test_explicit_nulls_are_accepted(http):
    nulls = {k: None for k in ("temperature", "top_p", "n", "stop", "max_tokens", "seed", "presence_penalty",
                               "frequency_penalty", "logprobs", "user", "stream_options", "logit_bias",
                               "stream", "best_of", "suffix", "echo", "service_tier", "metadata", "store")}
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **nulls, "max_tokens": 2})
    assert r.status_code == 200, r.text
    chat_nulls = {**{k: v for k, v in nulls.items() if k not in ("best_of", "suffix", "echo")},
                  "max_completion_tokens": 2, "top_logprobs": None, "response_format": None,
                  "tools": None, "tool_choice": None, "parallel_tool_calls": None}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, **chat_nulls})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value", REFUSED + [("temprature", 0.5)], ids=[f for f, _ in REFUSED] + ["unknown"])
def test_unimplemented_field_is_a_400_naming_it(http, field, value):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, field: value})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and field in error["message"]


def test_best_of_is_refused_through_the_client(openai_client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        openai_client.completions.create(model=MODEL, prompt="Hi", n=1, best_of=2, max_tokens=2)
