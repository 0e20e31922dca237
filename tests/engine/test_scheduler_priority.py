"""Admission by (priority, arrival) with the starvation bound, on exact orders (no torch, an
injected clock, no sleeps)."""

import pytest

from tandem.engine.errors import InvalidRequestError
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(max_active=1, wait_s=5.0):
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_active=max_active, max_num_batched_tokens=64, block_size=BS,
                                      num_blocks=64, max_priority_wait_s=wait_s), clock=clock)
    return sched, clock


def add(sched, clock, req_id, priority=0, max_tokens=2):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
    sched.add_request(Request(req_id, [5, 6, 7], params, arrival_time=clock.now))


def admitted(sched):
    """Run steps until nothing is left; the order in which requests were first scheduled."""
    order = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += [s.request.req_id for s in out.scheduled if s.request.req_id not in order]
        sched.update_from_output(out, {s.request.req_id: 9 for s in out.scheduled if s.completes_prefill})
    return order


def test_one_class_is_fcfs():
    sched, clock = make()
    for name in ("a", "b", "c"):
        add(sched, clock, name)
    assert admitted(sched) == ["a", "b", "c"]


def test_urgent_requests_go_ahead_of_waiting_batch_work_in_arrival_order():
    sched, clock = make()
    add(sched, clock, "batch1", priority=1)
    add(sched, clock, "batch2", priority=1)
    clock.now += 0.1
    add(sched, clock, "urgent1")
    add(sched, clock, "urgent2")
    assert sched.admission_order() and [r.req_id for r in sched.admission_order()] == [
        "urgent1", "urgent2", "batch1", "batch2"]
    assert admitted(sched) == ["urgent1", "urgent2", "batch1", "batch2"]


def test_classes_are_compared_by_value_including_negative_ones():
    sched, clock = make()
    for name, priority in (("p3", 3), ("p0", 0), ("pm1", -1), ("p1", 1)):
        add(sched, clock, name, priority)
    assert admitted(sched) == ["pm1", "p0", "p1", "p3"]


def test_priority_never_preempts_a_running_request():
    sched, clock = make(max_active=1)
    add(sched, clock, "batch", priority=1, max_tokens=3)
    out = sched.schedule()
    sched.update_from_output(out, {"batch": 9})
    add(sched, clock, "urgent")
    out = sched.schedule()  # batch decodes; urgent waits for its slot
    assert [s.request.req_id for s in out.scheduled] == ["batch"] and not out.preempted_req_ids
    assert [r.req_id for r in sched.waiting] == ["urgent"]


def test_batch_work_older_than_the_bound_goes_first_among_urgent_work():
    sched, clock = make(max_active=1, wait_s=5.0)
    add(sched, clock, "batch", priority=1)
    clock.now += 5.0  # exactly the bound: not yet aged
    add(sched, clock, "urgent1")
    assert [r.req_id for r in sched.admission_order()] == ["urgent1", "batch"]
    clock.now += 0.5  # batch has waited 5.5 s > 5 s
    add(sched, clock, "urgent2")
    assert [r.req_id for r in sched.admission_order()] == ["batch", "urgent1", "urgent2"]


def test_aged_and_urgent_requests_take_turns_then_the_rest_by_class():
    sched, clock = make(max_active=1, wait_s=5.0)
    for name in ("b1", "b2", "b3"):
        add(sched, clock, name, priority=1)
    clock.now += 6.0  # b1..b3 have aged
    add(sched, clock, "u1")
    add(sched, clock, "fresh_batch", priority=1)
    add(sched, clock, "u2")
    # One aged, one urgent, in turn; then the aged left; then fresh work by class.
    assert [r.req_id for r in sched.admission_order()] == ["b1", "u1", "b2", "u2", "b3", "fresh_batch"]


def test_an_aged_urgent_request_goes_first_and_aged_batch_work_still_takes_turns():
    sched, clock = make(max_active=1, wait_s=5.0)
    add(sched, clock, "old_urgent", priority=0)
    add(sched, clock, "old_batch", priority=1)
    clock.now += 6.0
    add(sched, clock, "u1")
    add(sched, clock, "u2")
    assert [r.req_id for r in sched.admission_order()] == ["old_urgent", "old_batch", "u1", "u2"]


def test_an_urgent_request_waits_behind_as_many_aged_requests_as_urgent_ones():
    sched, clock = make(max_active=1, wait_s=1.0)
    for i in range(10):  # a backlog of batch work that has all aged
        add(sched, clock, f"b{i}", priority=1)
    clock.now += 2.0
    add(sched, clock, "u")
    assert admitted(sched)[:3] == ["b0", "u", "b1"]


def test_a_starving_batch_request_runs_within_the_bound_under_a_stream_of_urgent_work():
    sched, clock = make(max_active=1, wait_s=2.0)
    add(sched, clock, "batch", priority=1)
    order = []
    for i in range(6):  # one urgent arrival per second, each running 1 s (two steps of 0.5 s)
        add(sched, clock, f"u{i}")
        for _ in range(2):
            out = sched.schedule()
            order += [s.request.req_id for s in out.scheduled if s.request.req_id not in order]
            sched.update_from_output(out, {s.request.req_id: 9 for s in out.scheduled if s.completes_prefill})
            clock.now += 0.5
    # batch has waited more than 2 s when u2 finishes (at t+3 s), and goes before u3.
    assert order[:4] == ["u0", "u1", "u2", "batch"]


def test_preempted_requests_stay_ahead_of_every_class():
    sched, clock = make()
    add(sched, clock, "batch", priority=1)
    add(sched, clock, "urgent", priority=0)
    sched.waiting[0].status = sched.waiting[0].status.PREEMPTED  # as _preempt leaves it, at the front
    assert [r.req_id for r in sched.admission_order()] == ["batch", "urgent"]


def test_priority_must_be_an_int():
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        SamplingParams(priority=0.5).validate()
