"""Scenario builders shared by the simulator, oracle, scenario and CLI tests."""

import random
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "route-sim-examples" / "spec-m2.yaml"


def spec_scenario(num_requests: int = 8, **router) -> dict:
    return {
        "backends": [
            {"backend_id": "mps0", "device_kind": "mps", "max_active": 4,
             "rates": {"prefill_tok_s": 2551, "decode_tok_s": 293}},
            {"backend_id": "cpu0", "device_kind": "cpu", "max_active": 4,
             "rates": {"prefill_tok_s": 73, "decode_tok_s": 45}},
        ],
        "generate": {"num_requests": num_requests, "interval_s": 0.05, "num_prompt_tokens": 516,
                     "num_cached_tokens": 496, "max_tokens": 128},
        "router": router,
    }


def random_scenario(seed: int) -> dict:
    rng = random.Random(seed)
    requests, t = [], 0.0
    for _ in range(rng.randint(5, 12)):
        t += rng.choice([0.0, 0.01, 0.05, 0.3])
        prompt, max_tokens = rng.randint(20, 800), rng.choice([8, 32, 128])
        requests.append({"arrival_s": t, "num_prompt_tokens": prompt, "max_tokens": max_tokens,
                         "num_output_tokens": rng.randint(1, max_tokens),
                         "num_cached_tokens": {"g": rng.randint(0, prompt), "c": rng.randint(0, prompt)}})
    return {
        "backends": [
            {"backend_id": "g", "device_kind": "cuda", "max_active": rng.choice([1, 2, 4]),
             "rates": {"prefill_tok_s": 2551, "decode_tok_s": 293,
                       "decode_tok_s_by_batch": rng.choice([None, {1: 293, 4: 700}])}},
            {"backend_id": "c", "device_kind": "cpu", "max_active": rng.choice([1, 4]),
             "rates": {"prefill_tok_s": 73, "decode_tok_s": 45}},
        ],
        "requests": requests,
    }
