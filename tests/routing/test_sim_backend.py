"""One simulated backend, on tiny hand-computed timelines."""

import math

import pytest

from tandem.routing import RateProfile
from tandem.routing.sim_backend import SimBackend, SimJob, first_step_at_or_after


def job(index: int, arrival: float, prefill: int, outputs: int) -> SimJob:
    return SimJob(index, f"r{index}", arrival, num_prompt_tokens=prefill + 10,
                  num_prefill_tokens=prefill, num_output_tokens_target=outputs)


class Recorder:
    def __init__(self):
        self.events, self.steps = [], []

    def on_events(self, backend_id, events):
        self.events.append([(e.req_id, e.kind, e.value) for e in events])

    def on_step(self, backend_id, num_prefill_tokens, num_decode_tokens, batch_size, elapsed_s):
        self.steps.append((num_prefill_tokens, num_decode_tokens, batch_size, round(elapsed_s, 9)))


def test_prefill_first_then_shared_decode():
    # prefill 100 tok/s, aggregate decode 10 tok/s, 2 slots.
    backend = SimBackend("b", RateProfile(100, 10), max_active=2)
    a, b = job(0, 0.0, 50, 3), job(1, 0.1, 20, 2)
    backend.enqueue(a)
    backend.enqueue(b)
    backend.run_to_completion()
    assert a.first_token_s == pytest.approx(0.5)  # 50 / 100
    assert b.first_token_s == pytest.approx(0.7)  # admitted at 0.5, 20 / 100
    assert b.finish_s == pytest.approx(0.9)  # one decode step of 2 / 10 s
    assert a.finish_s == pytest.approx(1.0)  # then one step of 1 / 10 s alone


def test_queue_waits_for_a_free_slot():
    backend = SimBackend("b", RateProfile(1000, 10), max_active=1)
    a, b = job(0, 0.0, 0, 3), job(1, 0.0, 0, 2)
    for j in (a, b):
        backend.enqueue(j)
    backend.run_to_completion()
    assert (a.first_token_s, a.finish_s) == (0.0, pytest.approx(0.2))
    assert (b.first_token_s, b.finish_s) == (pytest.approx(0.2), pytest.approx(0.3))


def test_arrival_mid_run_is_admitted_at_the_next_boundary():
    backend = SimBackend("b", RateProfile(1e9, 10), max_active=2)  # steps of 0.1 s alone
    a, b = job(0, 0.0, 0, 10), job(1, 0.25, 0, 1)
    backend.enqueue(a)
    backend.advance_to(0.25)
    backend.enqueue(b)
    backend.run_to_completion()
    assert b.first_token_s == b.finish_s == pytest.approx(0.3)  # first boundary >= 0.25
    # a: token 1 from its (empty) prefill at 0, +1 per 0.1 s step: 4 tokens at 0.3, 10 at 0.9.
    assert a.finish_s == pytest.approx(0.9)


def test_progress_events_inside_a_run_and_reports():
    recorder = Recorder()
    backend = SimBackend("b", RateProfile(100, 10), max_active=4, reporter=recorder)
    a = job(0, 0.0, 10, 5)
    backend.enqueue(a)
    backend.advance_to(0.35)  # prefill 0.1 s, then a run of 4 steps of 0.1 s
    assert [(e.req_id, e.kind, e.value) for e in backend.progress_events_at(0.35)] == [("r0", "generated", 3)]
    backend.run_to_completion()
    assert recorder.events == [
        [("r0", "admitted", 0)],
        [("r0", "prefill", 20), ("r0", "generated", 1)],
        [("r0", "generated", 5), ("r0", "finished", 0)],
    ]
    assert recorder.steps == [(10, 0, 1, 0.1), (0, 4, 1, 0.4)]


def test_first_step_at_or_after_is_exact():
    assert first_step_at_or_after(1.0, 0.5, 0.2) == 1
    for t in (0.05, 0.1, 0.7, 1.3, 2.2):
        k = first_step_at_or_after(0.0, 0.1, t)
        assert k * 0.1 >= t and (k == 1 or (k - 1) * 0.1 < t)


def test_idle_backend_has_no_boundary():
    assert SimBackend("b", RateProfile(1, 1), 1).next_boundary() == math.inf
