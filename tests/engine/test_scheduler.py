"""Scheduler behaviour on exact block ids: batching, chunked prefill, prefix hits,
preemption by recompute, abort, and that no block ever leaks (no torch)."""

import random

from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig

BS = 4
EOS = 0


def make_scheduler(num_blocks=32, max_active=4, budget=64):
    return Scheduler(SchedulerConfig(max_active=max_active, max_num_batched_tokens=budget,
                                     block_size=BS, num_blocks=num_blocks))


def add(sched, req_id, prompt, max_tokens=4, **kw):
    req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), (EOS,))
    sched.add_request(req)
    return req


def step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request.req_id: token for s in out.scheduled if s.completes_prefill}
    sched.update_from_output(out, sampled)
    return out


def assert_no_leak(sched):
    pool = sched.kv_cache_manager.block_pool
    assert not sched.kv_cache_manager.req_to_blocks
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert sorted(pool.free_queue.block_ids()) == list(range(1, len(pool.blocks)))


def test_fcfs_batch_respects_max_active_and_finishes_at_max_tokens():
    sched = make_scheduler(max_active=2)
    for i in range(3):
        add(sched, f"r{i}", [10 + i] * 5, max_tokens=2)
    out = step(sched)
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("r0", 5), ("r1", 5)]
    assert sched.kv_cache_manager.get_block_ids("r0") == [1, 2]
    assert sched.kv_cache_manager.get_block_ids("r1") == [3, 4]
    out = step(sched)  # decodes; both reach max_tokens=2
    assert [s.num_scheduled_tokens for s in out.scheduled] == [1, 1]
    assert [r.req_id for r in sched.running] == []
    out = step(sched)
    assert [s.request.req_id for s in out.scheduled] == ["r2"]
    while sched.has_unfinished_requests():
        step(sched)
    assert_no_leak(sched)


def test_chunked_prefill_and_decode_first():
    sched = make_scheduler(budget=6)
    a = add(sched, "a", list(range(1, 4)), max_tokens=3)
    step(sched)  # a: prefill 3 tokens, samples first token
    b = add(sched, "b", list(range(20, 30)), max_tokens=2)
    out = step(sched)
    # a's decode is scheduled before b's prefill, which is chunked to the remaining budget.
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]
    assert b.num_computed_tokens == 5 and b.num_output_tokens == 0
    out = step(sched)
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]
    assert a.is_finished and b.num_output_tokens == 1
    while sched.has_unfinished_requests():
        step(sched)
    assert_no_leak(sched)


def test_prefix_hit_while_first_request_still_running():
    sched = make_scheduler()
    prefix = list(range(1, 9))
    add(sched, "a", prefix + [100], max_tokens=4)
    step(sched)
    b = add(sched, "b", prefix + [200], max_tokens=4)
    step(sched)
    assert b.num_cached_tokens == 8
    assert sched.kv_cache_manager.get_block_ids("b")[:2] == sched.kv_cache_manager.get_block_ids("a")[:2]
    assert sched.kv_cache_manager.prefix_cache_hits == 8


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make_scheduler(num_blocks=5, budget=64)  # 4 usable blocks
    a = add(sched, "a", [1] * 4, max_tokens=8)
    b = add(sched, "b", [2] * 4, max_tokens=8)
    step(sched)  # a: [1], b: [2]
    assert sched.kv_cache_manager.get_block_ids("a") == [1]
    assert sched.kv_cache_manager.get_block_ids("b") == [2]
    for _ in range(4):
        step(sched)  # each grows into a second block, then a needs a third
    step(sched)
    assert b.num_preemptions == 1 and b.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    assert a.num_preemptions == 0
    while sched.has_unfinished_requests():
        step(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert_no_leak(sched)


def test_abort_waiting_and_running():
    sched = make_scheduler(max_active=1)
    add(sched, "a", [1] * 6, max_tokens=10)
    add(sched, "b", [2] * 6, max_tokens=10)
    step(sched)
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED).status.finish_reason == "abort"
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is not None
    assert sched.finish_request("missing", RequestStatus.FINISHED_ABORTED) is None
    assert not sched.has_unfinished_requests()
    assert_no_leak(sched)


def test_eos_stops_unless_ignored_and_min_tokens():
    sched = make_scheduler()
    a = add(sched, "a", [1, 2, 3], max_tokens=5)
    b = add(sched, "b", [1, 2, 3], max_tokens=5, ignore_eos=True)
    c = add(sched, "c", [1, 2, 3], max_tokens=5, min_tokens=2)
    step(sched, token=EOS)
    assert a.status is RequestStatus.FINISHED_STOPPED and a.num_output_tokens == 1
    assert not b.is_finished and not c.is_finished
    step(sched, token=EOS)
    assert c.status is RequestStatus.FINISHED_STOPPED and c.num_output_tokens == 2
    while sched.has_unfinished_requests():
        step(sched, token=EOS)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 5


def test_random_mix_never_leaks_blocks():
    rng = random.Random(0)
    for trial in range(20):
        sched = make_scheduler(num_blocks=rng.randint(6, 20), max_active=rng.randint(1, 4),
                               budget=rng.randint(4, 32))
        shared = [rng.randint(1, 50) for _ in range(8)]
        for i in range(rng.randint(1, 8)):
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
            add(sched, f"t{trial}-{i}", prompt, max_tokens=rng.randint(1, 6))
        for _ in range(200):
            if not sched.has_unfinished_requests():
                break
            if rng.random() < 0.1 and sched.requests:
                sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
            step(sched, token=rng.choice([EOS, 5, 6, 7]))
        assert not sched.has_unfinished_requests()
        assert_no_leak(sched)


def snapshot(sched, out):
    kv = sched.kv_cache_manager
    return (sorted((r, list(ids)) for r, ids in kv.req_to_block_ids.items()),
            kv.block_pool.free_queue.block_ids(),
            sorted((h, b.block_id) for h, b in kv.block_pool.cached_blocks.items()),
            [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled])


def test_allocate_fast_path_matches_the_full_allocation(monkeypatch):
    """The no-new-block shortcut in allocate_slots changes nothing observable: the same random
    workloads give the same block tables, free queue order and prefix index at every step."""
    def run(fast):
        rng = random.Random(1)
        sched = make_scheduler(num_blocks=14, max_active=4, budget=12)
        if not fast:
            monkeypatch.setattr(sched.kv_cache_manager, "_fits_without_change", lambda *a: False)
        shared = [rng.randint(1, 50) for _ in range(9)]
        for i in range(10):
            prompt = (shared if i % 2 else []) + [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
            add(sched, f"r{i}", prompt, max_tokens=rng.randint(1, 12))
        states = []
        while sched.has_unfinished_requests():
            out = step(sched, token=rng.choice([5, 6, 7]))
            states.append(snapshot(sched, out))
        assert_no_leak(sched)
        return states, sched.num_preemptions

    fast, num_preemptions = run(fast=True)
    assert (fast, num_preemptions) == run(fast=False)
    assert sum(1 for state in fast if state[2]) > 10  # blocks were published along the way
    assert num_preemptions > 0  # and the pool ran short
