"""Scenario files: JSON and YAML, the generator form, and errors that name the field."""

import json

import pytest
import yaml

from tandem.routing import ConfigError
from tandem.routing.scenario import load_scenario, parse_scenario

from routing_test_helpers import EXAMPLE, spec_scenario


def test_example_file_is_the_spec_setting():
    scenario = load_scenario(EXAMPLE)
    assert [b.spec.backend_id for b in scenario.backends] == ["mps0", "cpu0"]
    assert scenario.backends[1].spec.rates.prefill_tok_s == 73
    assert len(scenario.requests) == 8
    r7 = scenario.requests[6]
    assert (r7.req_id, r7.arrival_s, r7.num_prompt_tokens, r7.max_tokens, r7.num_output_tokens) == \
        ("r7", pytest.approx(0.3), 516, 128, 128)
    assert r7.num_cached_tokens == {"mps0": 496, "cpu0": 496}
    assert len(load_scenario(EXAMPLE, num_requests=48).requests) == 48


def test_json_and_yaml_give_the_same_scenario(tmp_path):
    data = spec_scenario(3)
    (tmp_path / "s.json").write_text(json.dumps(data))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    assert load_scenario(tmp_path / "s.json") == load_scenario(tmp_path / "s.yaml")


def test_explicit_requests_merge_with_generated_ones_by_arrival():
    data = spec_scenario(2)
    data["requests"] = [{"req_id": "late", "arrival_s": 0.01, "num_prompt_tokens": 10, "max_tokens": 4,
                         "num_output_tokens": 2, "num_cached_tokens": {"cpu0": 5}}]
    scenario = parse_scenario(data)
    assert [r.req_id for r in scenario.requests] == ["r1", "late", "r2"]
    assert scenario.requests[1].num_cached_tokens == {"cpu0": 5}


def bad(mutate) -> str:
    data = spec_scenario(2)
    mutate(data)
    with pytest.raises(ConfigError) as exc:
        parse_scenario(data)
    return str(exc.value)


def test_missing_field_is_named():
    message = bad(lambda d: d["backends"][0]["rates"].pop("decode_tok_s"))
    assert "backends.0.rates.decode_tok_s: required field is missing" in message


def test_negative_rate_is_named():
    message = bad(lambda d: d["backends"][1]["rates"].update(prefill_tok_s=-73))
    assert "backends.1.rates.prefill_tok_s: Input should be greater than 0 (got -73)" in message


def test_unknown_policy_is_named():
    message = bad(lambda d: d.update(policy="fastest"))
    assert "policy: Value error, unknown policy 'fastest'" in message


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["generate"].pop("max_tokens"), "generate.max_tokens: required field is missing"),
    (lambda d: d["generate"].update(num_output_tokens=200), "num_output_tokens (200) must be <= max_tokens (128)"),
    (lambda d: d["generate"].update(num_cached_tokens={"gpu9": 3}), "generate.num_cached_tokens: unknown backend 'gpu9'"),
    (lambda d: d["generate"].update(num_cached_tokens=600), "generate.num_cached_tokens.mps0: 600 exceeds"),
    (lambda d: d["backends"][0].update(max_active=0), "backends.0.max_active"),
    (lambda d: d["backends"][0].update(maxactive=4), "backends.0.maxactive: Extra inputs"),
    (lambda d: d["backends"][1].update(backend_id="mps0"), "backend_id values must be unique"),
    (lambda d: d.pop("generate"), "requests: give at least one request"),
    (lambda d: d.update(router={"new_token_ratio": {"init_ratio": 0.1, "min_ratio": 0.5}}), "router.new_token_ratio"),
    (lambda d: d.pop("backends"), "backends: required field is missing"),
])
def test_other_errors_are_named(mutate, expected):
    assert expected in bad(mutate)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read scenario"):
        load_scenario(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("backends: [")
    with pytest.raises(ConfigError, match="not valid yaml"):
        load_scenario(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="needs a generate: or tenants: section"):
        parse_scenario({**spec_scenario(1), "generate": None, "requests": [
            {"arrival_s": 0, "num_prompt_tokens": 5, "max_tokens": 1}]}, num_requests=3)
