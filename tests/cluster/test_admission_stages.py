"""`admission_stages`: a request's arrival-to-admission time split per stage, from the times the
dispatch notes and the first outputs' engine timestamps (`RequestOutput`s, as the backend sends them)."""

import pytest

from tandem.engine.outputs import RequestOutput, Usage
from tandem.cluster.dispatch import admission_stages


def first_output(first_scheduled: float | None, first_token: float | None) -> RequestOutput:
    return RequestOutput("r", [7], "a", False, None, Usage(16, 1, 0), 100.0, first_scheduled, first_token, None)


def test_with_first_outputs_the_admission_splits_into_engine_and_transport():
    stages = admission_stages(100.0, 100.003, 100.020, [first_output(100.005, 100.015)])
    assert stages == pytest.approx({"route": 0.003, "to_engine": 0.002, "prefill": 0.010, "back": 0.005})
    assert sum(stages.values()) == pytest.approx(0.020)  # the stages add up to arrival -> admitted


def test_a_queued_request_has_one_admit_stage():
    assert admission_stages(100.0, 100.004, 100.050, []) == pytest.approx({"route": 0.004, "admit": 0.046})
    # outputs without engine timestamps say nothing about the engine's share
    assert admission_stages(100.0, 100.004, 100.050, [first_output(None, None)]) == pytest.approx(
        {"route": 0.004, "admit": 0.046})


def test_clock_differences_between_processes_never_give_negative_stages():
    stages = admission_stages(100.0, 100.003, 100.020, [first_output(100.002, 100.021)])
    assert min(stages.values()) == 0.0 and stages["to_engine"] == 0.0 and stages["back"] == 0.0


def test_the_backends_stamps_split_the_adds_trip_into_its_hops():
    stages = admission_stages(100.0, 100.003, 100.030, [first_output(100.012, 100.022)], received=100.005,
                              queued=100.009)
    assert stages == pytest.approx({"route": 0.003, "to_backend": 0.002, "to_core": 0.004, "to_engine": 0.003,
                                    "prefill": 0.010, "back": 0.008})
    assert sum(stages.values()) == pytest.approx(0.030)
    queued = admission_stages(100.0, 100.003, 100.050, [], received=100.005, queued=100.009)
    assert queued == pytest.approx({"route": 0.003, "to_backend": 0.002, "to_core": 0.004, "admit": 0.041})


def test_every_stage_is_one_the_metrics_declare_up_front():
    from tandem.actors.metrics import ADMISSION_STAGES

    seen = set()
    for received, queued in ((None, None), (100.005, 100.009)):
        for outputs in ([], [first_output(100.012, 100.022)]):
            for opened in (None, 100.001):
                seen |= set(admission_stages(100.0, 100.003, 100.030, outputs, received=received, queued=queued,
                                             opened=opened))
    assert seen == set(ADMISSION_STAGES)


def test_when_routing_began_splits_the_ingress_work_from_the_routers_answer():
    stages = admission_stages(100.0, 100.003, 100.020, [first_output(100.005, 100.015)], opened=100.001)
    assert stages == pytest.approx({"prepare": 0.001, "route": 0.002, "to_engine": 0.002, "prefill": 0.010,
                                    "back": 0.005})
