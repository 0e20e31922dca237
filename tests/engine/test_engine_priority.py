"""Priority through a real (tiny, random) engine: with one slot, an urgent request added after
two batch requests runs right after the one already running, and the starvation bound is the
engine config's."""

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams


def first_token_order(engine: LLMEngine, order: list[str]) -> list[str]:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.req_id not in order and out.new_token_ids:
                order.append(out.req_id)
    return order


def test_an_urgent_request_goes_ahead_of_waiting_batch_work():
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", max_active=1, async_scheduling=False,
                                    max_priority_wait_s=60.0))
    assert engine.scheduler.config.max_priority_wait_s == 60.0
    batch = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, priority=1)
    engine.add_request("batch0", [5] * 8, batch)
    order = [out.req_id for out in engine.step() if out.new_token_ids]  # batch0 takes the only slot
    engine.add_request("batch1", [6] * 8, batch)
    engine.add_request("urgent", [7] * 8, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert first_token_order(engine, order) == ["batch0", "urgent", "batch1"]
