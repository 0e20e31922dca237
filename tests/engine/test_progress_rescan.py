"""After an eviction, waiting requests whose prefix hit shrank are re-reported to the router,
a bounded slice per progress drain, and the ones whose hit did not change are not: past
saturation the queue is long and evictions come every step, so re-reporting the whole queue
on every drain stalled the step loop."""

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine import reporting
from tandem.engine.sampling_params import SamplingParams

PREFIX = [7 + i % 200 for i in range(48)]  # 3 blocks of 16


def test_an_eviction_re_reports_only_the_waiting_requests_it_changed_a_slice_per_drain(monkeypatch):
    monkeypatch.setattr(reporting, "RESCAN_BLOCKS_PER_DRAIN", 64)  # a small slice, for a small queue
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", device="cpu", max_active=1, num_kv_blocks=9,
                                    block_size=16))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", PREFIX + [3, 4], params)
    while engine.has_unfinished_requests():
        engine.step()
    # The evictor runs first (max_active 1) and needs every block; behind it wait requests that
    # hit the cached prefix and requests that hit nothing.
    engine.add_request("evictor", [211 + i % 17 for i in range(120)], params)
    per_drain = 64 // (50 // 16 + 1)  # each request of 50 tokens counts 4 lookups
    sharing = [f"shares-{i}" for i in range(per_drain + 10)]
    for i, req_id in enumerate(sharing):
        engine.add_request(req_id, PREFIX + [5, i % 200 + 3], params)
    for i in range(20):
        engine.add_request(f"cold-{i}", [230 - (i + j) % 50 for j in range(30)], params)
    before = {p.req_id: p.num_cached_tokens for p in engine.drain_progress()}
    assert all(before[r] == 48 for r in sharing) and before["cold-0"] == 0

    engine.step()  # the evictor's prefill takes the prefix's blocks
    assert engine.kv_cache_manager.num_cached_tokens(PREFIX + [5, 3]) == 0
    first = [p for p in engine.drain_progress() if p.status == "waiting"]
    second = [p for p in engine.drain_progress() if p.status == "waiting"]
    assert len(first) == per_drain  # a bounded slice per drain
    re_reported = first + second
    assert sorted(p.req_id for p in re_reported) == sorted(sharing)  # the cold ones did not change
    assert all(p.num_cached_tokens == 0 for p in re_reported)
    assert not [p for p in engine.drain_progress() if p.status == "waiting"]  # nothing more until the next eviction
