"""Warm every backend up together right after start, so online calibration starts from the truth.

The router calibrates its rates from observed engine steps, and what it needs to learn is how
fast each backend runs *next to the others* and behind the serving path: a CPU backend shares
the host's cores with an accelerator backend's step loop, Ray and the HTTP ingress (on the H200
the CPU backend served at 65-75% of its isolated profile, and slower still beside a busy GPU).
Until it has seen steps, the router routes on the isolated profile, and a burst that arrives
first is placed on those rates.

So after start every backend decodes a full batch of short random prompts at the same time.
The slowest backend (by profiled seconds per token of one request at its full batch) decodes
`max_tokens` per request and a faster one proportionally more (at most 32x), so the fast one
stays busy while the slow one is measured. The requests go straight to the backend actors;
the router sees only their steps.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

MAX_SCALE = 32.0
TOKEN_ID_LOW, TOKEN_ID_HIGH = 32, 127  # printable ASCII in the byte tokenizer; common tokens elsewhere


def warmup_tokens(rates: dict[str, dict[str, Any]], max_actives: dict[str, int], max_tokens: int,
                  max_scale: float = MAX_SCALE) -> dict[str, int]:
    """Tokens per warm-up request for each backend: `max_tokens` for the slowest (by profiled
    seconds per token of one request at its full batch), proportionally more for faster ones,
    at most `max_scale` times; backends without a profile get `max_tokens`."""
    from tandem.routing.rates import RateProfile

    per_token_s = {b: m / RateProfile(**rates[b]).decode_rate(m) for b, m in max_actives.items() if b in rates}
    slowest = max(per_token_s.values(), default=0.0)
    return {b: round(max_tokens * min(max_scale, slowest / per_token_s[b])) if b in per_token_s else max_tokens
            for b in max_actives}


def warm_up_together(backends: dict[str, Any], infos: dict[str, Any], rates: dict[str, dict[str, Any]],
                     max_tokens: int, num_prompt_tokens: int = 64, seed: int = 0) -> float:
    """Run the warm-up on these backend actor handles (infos: their BackendInfo); returns seconds."""
    from tandem.actors.channel import run_to_end
    from tandem.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    tokens = warmup_tokens(rates, {b: infos[b].max_active for b in backends}, max_tokens)
    rng = random.Random(seed)
    requests = []
    for backend_id, handle in backends.items():
        info = infos[backend_id]
        num_tokens = max(1, min(tokens[backend_id], info.max_model_len - num_prompt_tokens - 1))
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(info.max_active):
            prompt = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(num_prompt_tokens)]
            requests.append((handle, f"warmup-{uuid.uuid4().hex}", prompt, params))
    run_to_end(requests)
    return time.perf_counter() - start
