"""Whole engines with a host KV tier: on the cpu a workload whose shared prefixes the device cache
evicts, then repeats, reloads them and gives the same greedy tokens as without the tier; the sim
device reports the same hits; the host cache's copies move exactly the planned blocks."""

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache import KVTransfers
from tandem.engine.kv_host_cache import HostKVCache
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sim_runner import SimModelRunner, TokenSpace

PREFIX_LEN = 64  # 4 blocks of 16
NUM_PREFIXES = 4


def workload():
    """Distinct long prefixes, each asked twice with different suffixes: the second round comes
    after the other prefixes have gone through a cache too small to keep them all."""
    prefixes = [[(37 * p + 11 * i) % 240 + 3 for i in range(PREFIX_LEN)] for p in range(NUM_PREFIXES)]
    first = [prefix + [245 + p, 250] for p, prefix in enumerate(prefixes)]
    second = [prefix + [251 + p, 252, 253] for p, prefix in enumerate(prefixes)]
    return first, second


def run(engine, rounds, max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, usage = {}, {}
    for r, prompts in enumerate(rounds):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{r}-{i}", prompt, params)
        while engine.has_unfinished_requests():  # one round at a time: the first round's blocks are freed
            for out in engine.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
                if out.finished:
                    usage[out.req_id] = out.usage
    return tokens, usage


def cpu_engine(**overrides):
    # 12 usable blocks: two running requests (5 blocks each) and little else, so the 16 prefix
    # blocks of the first round cannot all stay.
    # The tier keeps every evicted block (min hits 0): each prefix of the workload is used once before it goes.
    overrides.setdefault("kv_host_offload_min_hits", 0)
    return LLMEngine(EngineConfig(model="tiny-llama-random", device="cpu", max_active=2, num_kv_blocks=13,
                                  block_size=16, **overrides))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reloads_give_the_same_greedy_tokens_as_recomputing(async_scheduling):
    rounds = workload()
    off = cpu_engine(async_scheduling=async_scheduling)
    on = cpu_engine(async_scheduling=async_scheduling, kv_host_blocks=32)
    tokens_off, usage_off = run(off, rounds)
    tokens_on, usage_on = run(on, rounds)
    assert tokens_on == tokens_off
    stats_on, stats_off = on.get_stats(), off.get_stats()
    assert stats_on.kv_host_reloaded_blocks > 0 and stats_on.kv_host_offloaded_blocks > 0
    assert stats_on.prefix_cache_host_hits > 0 and stats_on.num_host_total_blocks == 32
    assert 0 < stats_on.num_host_used_blocks <= 32
    assert stats_on.prefix_cache_hits > stats_off.prefix_cache_hits
    assert stats_off.kv_host_reloaded_blocks == stats_off.num_host_total_blocks == 0
    # The second round's prompts came back from the host tier, and say so in their usage.
    assert sum(u.host_cached_tokens for u in usage_on.values()) == stats_on.prefix_cache_host_hits
    assert all(usage_on[f"r1-{i}"].cached_tokens == PREFIX_LEN for i in range(NUM_PREFIXES))
    assert any(usage_on[f"r1-{i}"].host_cached_tokens == PREFIX_LEN for i in range(NUM_PREFIXES))
    assert all(u.host_cached_tokens == 0 for u in usage_off.values())


def test_cache_changes_report_the_host_tier():
    engine = cpu_engine(kv_host_blocks=32)
    first, _ = workload()
    run(engine, [first])
    changes = engine.drain_cache_changes()
    host_held = set(engine.kv_cache_manager.host_tier.hashes())
    device_held = set(engine.kv_cache_manager.block_pool.cached_blocks)
    assert {h for h, state in changes.items() if state == 2} == host_held - device_held
    assert {h for h, state in changes.items() if state == 1} == device_held
    assert host_held - device_held


def test_the_sim_device_reloads_and_reports_host_hits():
    config = EngineConfig(model="tiny-llama-random", device="sim", max_active=2, num_kv_blocks=13, block_size=16,
                          kv_host_blocks=32, kv_host_offload_min_hits=0)
    engine = LLMEngine(config, step_time=lambda p, d, c: 0.0, reload_time=lambda n: 0.0)
    _, usage = run(engine, workload())
    stats = engine.get_stats()
    assert stats.kv_host_reloaded_blocks > 0 and stats.prefix_cache_host_hits > 0
    assert sum(u.host_cached_tokens for u in usage.values()) == stats.prefix_cache_host_hits
    # Without a reload rate a sim engine runs without the tier.
    plain = LLMEngine(config, step_time=lambda p, d, c: 0.0)
    assert plain.kv_cache_manager.host_tier is None


def test_a_sim_step_lasts_its_reloads_longer():
    runner = SimModelRunner(lambda p, d, c: 0.0, TokenSpace(1000, frozenset()), reload_time=lambda n: n / 1000,
                            block_size=16)
    runner.device_free_at = 1e9  # busy far into the future: the copies queue behind it
    runner.apply_kv_transfers(KVTransfers(offloads=[(1, 0)], reloads=[(0, 2), (1, 3)]))
    assert runner.device_free_at == pytest.approx(1e9 + 32 / 1000)


def test_host_tier_size_from_memory_and_validation():
    config = EngineConfig(model="tiny-llama-random", kv_host_memory_gb=1.0)
    assert config.resolved_kv_host_blocks(1 << 20) == 1024
    assert EngineConfig(kv_host_blocks=7, kv_host_memory_gb=1.0).resolved_kv_host_blocks(1 << 20) == 7
    assert EngineConfig().resolved_kv_host_blocks(1 << 20) == 0
    with pytest.raises(ValueError, match="kv_host_blocks"):
        EngineConfig(kv_host_blocks=-1)
    with pytest.raises(ValueError, match="kv_host_memory_gb"):
        EngineConfig(kv_host_memory_gb=-0.5)


def test_host_cache_copies_offloads_then_reloads_in_place():
    torch.manual_seed(0)
    device = [torch.randn(2, 6, 4, 2, 8) for _ in range(2)]
    caches = [c.clone() for c in device]
    host = HostKVCache(caches, num_blocks=3)
    assert host.host_caches[0].shape == (2, 3, 4, 2, 8)
    # Block 1 goes out to slot 2 and comes back into block 4 in the same step; block 4's own
    # content goes out to slot 0 first.
    host.apply(KVTransfers(offloads=[(1, 2), (4, 0)], reloads=[(2, 4)]))
    for before, after, h in zip(device, caches, host.host_caches):
        assert torch.equal(h[:, 2], before[:, 1]) and torch.equal(h[:, 0], before[:, 4])
        assert torch.equal(after[:, 4], before[:, 1])
        assert torch.equal(after[:, [0, 1, 2, 3, 5]], before[:, [0, 1, 2, 3, 5]])
    assert host.device_caches[0] is caches[0]  # the device tensors were written, not replaced


def test_a_host_tier_the_host_cannot_give_leaves_the_engine_without_one(monkeypatch, caplog):
    import tandem.engine.model_runner as model_runner

    def refused(*args, **kwargs):
        raise RuntimeError("pinned memory refused")

    monkeypatch.setattr(model_runner, "HostKVCache", refused)
    engine = cpu_engine(kv_host_blocks=32)
    assert engine.model_runner.num_host_blocks == 0 and engine.kv_cache_manager.host_tier is None
    assert "no host KV tier" in caplog.text and "pinned memory refused" in caplog.text
    tokens, _ = run(engine, workload())
    assert tokens == run(cpu_engine(), workload())[0]


def test_the_profiler_measures_the_reload_rate_of_an_engine_with_a_host_tier():
    from tandem.engine.profiler import _reload_rate

    assert _reload_rate(cpu_engine()) is None
    rate = _reload_rate(cpu_engine(kv_host_blocks=32))
    assert rate is not None and rate > 0


def test_gated_only_a_prefix_that_was_hit_is_kept_in_the_host_tier():
    """With min hits 1, round one's prefixes are each used once, so none is offloaded when evicted; a prefix hit
    once (asked twice in round one) is, and its later request reloads it."""
    first, second = workload()
    engine = cpu_engine(kv_host_blocks=32, kv_host_offload_min_hits=1)
    run(engine, [first])
    assert engine.get_stats().kv_host_offloaded_blocks == 0
    hit_twice = [first[0], first[0][:-1] + [249, 250]] + first[1:]
    engine = cpu_engine(kv_host_blocks=32, kv_host_offload_min_hits=1)
    run(engine, [hit_twice, [second[0]]])
    stats = engine.get_stats()
    assert 0 < stats.kv_host_offloaded_blocks <= PREFIX_LEN // 16 and stats.kv_host_reloaded_blocks > 0


def test_a_pinned_tier_is_rounded_down_to_what_the_pinned_allocator_gives_exactly():
    """PyTorch's pinned allocator rounds an allocation up to a power of two, so a pinned layer
    tensor is sized to the largest power of two of bytes within what was asked: it pins what it
    uses and never more than asked."""
    from tandem.engine.kv_host_cache import pinned_num_blocks

    assert pinned_num_blocks(1024, 8192) == 1024  # a power of two already: all of it
    assert pinned_num_blocks(1000, 8192) == 512
    for asked, block_bytes in [(1000, 6144), (123_457, 12_288), (7, 3), (1, 8192)]:
        n = pinned_num_blocks(asked, block_bytes)
        power = 1 << ((n * block_bytes - 1).bit_length()) if n else 0  # what the allocator pins for n blocks
        assert n <= asked and power <= asked * block_bytes  # never more than asked
        assert (n + 1) * block_bytes > 1 << ((asked * block_bytes).bit_length() - 1)  # and the most that fits
    # a quarter of 125 GiB over qwen2.5-0.5b's 24 layers (8 KiB a block a layer): 1 GiB a layer, not 2 pinned
    asked = int(125 / 4 * (1 << 30)) // (24 * 8192)
    assert pinned_num_blocks(asked, 8192) * 8192 == 1 << 30
