"""BackendActor on CUDA as a plain object (no Ray): with asynchronous scheduling a step's tokens
come with the next step's message, and a channel add's answer still carries the first token;
the channel brings the rest, and the tokens are exactly those of each request alone. Skipped without
CUDA (runs on the GPU machine)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_channel_adds_on_cuda_bring_the_first_token_and_the_same_tokens_as_alone():
    from tandem.actors.backend import BackendActor
    from tandem.engine.sampling_params import SamplingParams
    from tests.actors.test_backend_actor import _channel_run, collect, run

    actor = BackendActor("cuda0", dict(model="tiny-llama-random", device="cuda", max_active=8, block_size=16),
                         threads=1)
    try:
        assert actor.core.ready.device.startswith("cuda")
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = {f"c{i}": list(range(40 + 3 * i, 70 + 3 * i)) for i in range(6)}
        solo = {req_id: [t for o in run(collect(actor, f"solo-{req_id}", ids, greedy)) for t in o.new_token_ids]
                for req_id, ids in prompts.items()}
        admitted, by_req = run(_channel_run(actor, "ch-cuda", [(r, ids, greedy) for r, ids in prompts.items()]))
        for a in admitted:
            assert a.outputs, f"{a.req_id}: no first token with the answer"
            assert [t for o in a.outputs + by_req[a.req_id] for t in o.new_token_ids] == solo[a.req_id]
    finally:
        run(actor.shutdown())
