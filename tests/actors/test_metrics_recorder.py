"""The recorder keeps every counter and gauge exported: counters declared at 0 for each label set
it can name, gauges re-set to their last value on each refresh (tested with fake Ray metric
objects; tests/cluster/test_metrics_live.py checks the real export)."""

from __future__ import annotations

import pytest

from tandem.actors import metrics
from tandem.actors.metrics import BACKEND_METRICS, INGRESS_METRICS, ROUTER_METRICS, Recorder


class FakeMetric:
    def __init__(self, spec):
        self.spec, self.calls = spec, []

    def _record(self, value, tags):
        self.calls.append(("record", value, tags))

    def inc(self, value, tags):
        self.calls.append(("inc", value, tags))

    def set(self, value, tags):
        self.calls.append(("set", value, tags))

    def observe(self, value, tags):
        self.calls.append(("observe", value, tags))


@pytest.fixture
def fakes(monkeypatch):
    made = {}

    def make(spec):
        made[spec.name] = FakeMetric(spec)
        return made[spec.name]

    monkeypatch.setattr(metrics, "_make_metric", make)
    # As outside Ray, whatever ran before in this process: no refresh thread, nothing buffered.
    monkeypatch.setattr(metrics, "_ray_running", lambda: False)
    return made


def test_a_backend_declares_every_counter_and_gauge_at_start(fakes):
    recorder = Recorder(BACKEND_METRICS, {"backend": "cpu0"})
    recorder.refresh()
    assert fakes["tandem_backend_preemptions"].calls == [("record", 0, {"backend": "cpu0"})]
    assert sorted(c[2]["finish_reason"] for c in fakes["tandem_backend_requests_finished"].calls) == [
        "abort", "length", "stop"]
    assert fakes["tandem_backend_running_requests"].calls == [("set", 0.0, {"backend": "cpu0"})]
    assert "tandem_backend_ttft_seconds" not in fakes  # Ray cannot export an empty histogram


def test_gauges_are_re_set_to_their_last_value(fakes):
    recorder = Recorder(INGRESS_METRICS)
    recorder.set("tandem_http_pending_requests", 3)
    recorder.refresh()
    recorder.refresh()
    sets = [c for c in fakes["tandem_http_pending_requests"].calls if c[0] == "set"]
    assert sets[0] == ("set", 3.0, {}) and sets[-2:] == [("set", 3.0, {}), ("set", 3.0, {})]
    declared = sorted(c[2]["endpoint"] for c in fakes["tandem_http_requests"].calls)
    assert declared == ["/v1/chat/completions", "/v1/completions"]


def test_a_router_declares_a_backend_once_it_is_named(fakes):
    recorder = Recorder(ROUTER_METRICS)
    recorder.declare({"backend": "cuda0", "policy": "cost"})
    assert fakes["tandem_router_decisions"].calls == [("record", 0, {"backend": "cuda0", "policy": "cost"})]
    assert fakes["tandem_router_reroutes"].calls == [("record", 0, {"backend": "cuda0"})]
    recorder.set("tandem_router_pending_seconds", 1.5, tags={"backend": "cpu0"})  # learns cpu0
    assert ("record", 0, {"backend": "cpu0"}) in fakes["tandem_router_backend_failures"].calls
    recorder.refresh()  # declared gauges go out with the next refresh
    assert ("set", 0.0, {"backend": "cpu0"}) in fakes["tandem_router_pending_requests"].calls
    assert ("set", 1.5, {"backend": "cpu0"}) in fakes["tandem_router_pending_seconds"].calls[-2:]
    recorder.declare({"backend": "cuda0", "policy": "cost"})  # already known: nothing again
    assert len(fakes["tandem_router_reroutes"].calls) == 2


def test_increments_of_zero_are_skipped(fakes):
    recorder = Recorder(BACKEND_METRICS, {"backend": "cpu0"})
    recorder.inc("tandem_backend_steps", 0)
    recorder.inc("tandem_backend_steps", 2)
    assert [c for c in fakes["tandem_backend_steps"].calls if c[0] == "inc"] == [("inc", 2, {"backend": "cpu0"})]


def test_inside_ray_counters_and_gauges_wait_for_the_flush(fakes):
    def calls(name, kind):
        return [c for c in getattr(fakes.get(name), "calls", []) if c[0] == kind]

    recorder = Recorder(ROUTER_METRICS, buffered=True)
    for _ in range(3):
        recorder.inc("tandem_router_decisions", tags={"backend": "cuda0", "policy": "cost"})
    recorder.set("tandem_router_pending_seconds", 1.0, tags={"backend": "cuda0"})
    recorder.set("tandem_router_pending_seconds", 2.5, tags={"backend": "cuda0"})
    assert not calls("tandem_router_decisions", "inc")
    assert not calls("tandem_router_pending_seconds", "set")
    recorder.flush()
    assert calls("tandem_router_decisions", "inc") == [("inc", 3.0, {"backend": "cuda0", "policy": "cost"})]
    assert calls("tandem_router_pending_seconds", "set") == [("set", 2.5, {"backend": "cuda0"})]
    recorder.flush()  # nothing new: nothing recorded again
    assert len(calls("tandem_router_decisions", "inc")) == 1


def test_inside_ray_histogram_observations_wait_for_the_flush_and_all_arrive(fakes):
    recorder = Recorder(ROUTER_METRICS, buffered=True)
    name = "tandem_router_estimated_completion_seconds"
    for value in (0.1, 0.2, 0.3):
        recorder.observe(name, value, tags={"backend": "cuda0"})
    assert not [c for c in getattr(fakes.get(name), "calls", []) if c[0] == "observe"]
    recorder.flush()
    assert [c for c in fakes[name].calls if c[0] == "observe"] == [
        ("observe", v, {"backend": "cuda0"}) for v in (0.1, 0.2, 0.3)]
