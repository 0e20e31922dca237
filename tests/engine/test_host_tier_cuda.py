"""The host KV tier on a GPU: pinned host tensors that the copies reach through their device
address, in stream order and without a host synchronisation, and an asynchronous engine with
CUDA graphs that reloads evicted prefixes and gives the tokens it gives without the tier.
Skipped without CUDA."""

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache import KVTransfers
from tandem.engine.kv_host_cache import HostKVCache
from tandem.engine.llm_engine import LLMEngine
from tests.engine.test_host_tier_engine import NUM_PREFIXES, run, workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_copies_run_on_the_device_in_stream_order_without_a_sync():
    torch.manual_seed(0)
    reference = [torch.randn(2, 64, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    caches = [c.to("cuda") for c in reference]
    host = HostKVCache(caches, num_blocks=8)
    assert all(h.is_pinned() and h.device.type == "cpu" for h in host.host_caches)
    # Keep the stream busy so the copies queue behind work still running, as a step's do.
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        for _ in range(20):
            busy = busy @ busy / 64
        for c in caches:  # a step still writing block 3 when the copies are queued
            c[:, 3].add_(1)
        host.apply(KVTransfers(offloads=[(3, 5), (9, 0)], reloads=[(5, 40)]))
        host.apply(KVTransfers(offloads=[(40, 1)], reloads=[(0, 3)]))  # the next step's
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for ref, cache, h in zip(reference, caches, host.host_caches):
        written = ref.clone()
        written[:, 3] += 1
        assert torch.equal(h[:, 5], written[:, 3]) and torch.equal(h[:, 0], written[:, 9])
        assert torch.equal(h[:, 1], written[:, 3])
        assert torch.equal(cache[:, 40].cpu(), written[:, 3]) and torch.equal(cache[:, 3].cpu(), written[:, 9])


def test_an_async_graph_engine_reloads_and_matches_recompute():
    def engine(**overrides):
        return LLMEngine(EngineConfig(model="tiny-llama-random", device="cuda", dtype="float32", max_active=2,
                                      num_kv_blocks=13, block_size=16, **overrides))

    # Every evicted block kept (min hits 0): each prefix of the workload is used once before it goes.
    off, on = engine(), engine(kv_host_blocks=32, kv_host_offload_min_hits=0)
    assert on.async_scheduling and on.model_runner.graph_runner is not None
    tokens_off, _ = run(off, workload())
    tokens_on, usage_on = run(on, workload())
    assert tokens_on == tokens_off
    stats = on.get_stats()
    assert stats.kv_host_reloaded_blocks > 0 and stats.prefix_cache_host_hits > 0
    assert any(usage_on[f"r1-{i}"].host_cached_tokens for i in range(NUM_PREFIXES))
