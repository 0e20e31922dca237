"""The oracle for a benchmark cell: the best makespan over which requests go to the CPU.

Measuring every split (2^N full runs) is far too slow, so the oracle comes from the what-if
simulator calibrated to the cell's own measurements. The scenario is the cell as it ran (the
backends, the rates file the router believed, the workload's arrivals and lengths and the
prefix each backend reported reusable); each backend's rates are scaled by one factor so the
simulation reproduces its measured time (the accelerator: the accelerator-only arm's mean
makespan; a CPU backend: when it finished its requests in the hybrid runs that sent it any; a
backend that got nothing keeps its profile, or shares the accelerator's factor when it is the
same kind of device); `routing.oracle.find_oracle` then searches assignments (exhaustively up
to 2^16, else locally, making the oracle's gain a lower bound), seeded with the hybrid's own.

Gains are fractions of the accelerator-only makespan in the same calibrated simulation, so
run-to-run noise does not enter them: the oracle's `1 - oracle / accelerator-only`, the
router's `1 - replay / accelerator-only` with `replay` the simulated makespan of the assignments
the router really made. The router's share is their ratio (0 for a router that offloaded
nothing, whatever the measured makespans say); the measured comparison with its spread is what
judges "not worse than accelerator-only".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any, Callable, Sequence

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.oracle import AssignmentEvaluator, find_oracle
from tandem.routing.rates import RateProfile
from tandem.routing.scenario import Scenario, SimBackendSpec, SimRequest
from tandem.routing.simulator import simulate

MIN_ORACLE_GAIN = 1e-3  # below this fraction of the baseline's makespan the share is undefined


def scaled(profile: RateProfile, factor: float) -> RateProfile:
    """The profile with every rate multiplied by `factor` (a uniformly faster or slower backend)."""
    table = profile.decode_tok_s_by_batch
    return replace(profile, prefill_tok_s=profile.prefill_tok_s * factor, decode_tok_s=profile.decode_tok_s * factor,
                   decode_tok_s_by_batch=None if table is None else {b: r * factor for b, r in table.items()})


def build_scenario(record: dict[str, Any], rates: dict[str, dict[str, Any]],
                   factors: dict[str, float] | None = None, policy: str = "cost") -> Scenario:
    """A route-sim scenario of one run record (hybrid cluster), actual rates scaled by `factors`."""
    factors = factors or {}
    backends = []
    for b in record["cluster"]["backends"]:
        profile = RateProfile(**rates[b["backend_id"]])
        spec = BackendSpec(b["backend_id"], b["device_kind"], profile, b["max_active"])
        backends.append(SimBackendSpec(spec, scaled(profile, factors.get(b["backend_id"], 1.0))))
    workload = record["workload"]
    cached = record["seeded_cached_tokens"]
    requests = [SimRequest(f"r{i + 1}", t, workload["num_prompt_tokens"], workload["max_tokens"],
                           workload["max_tokens"], {b: min(n, workload["num_prompt_tokens"]) for b, n in cached.items()})
                for i, t in enumerate(workload["arrivals_s"])]
    return Scenario(workload["name"], policy, backends, requests)


def fit_factor(makespan_at: Callable[[float], float], target_s: float, lo: float = 1e-3, hi: float = 1e3) -> float:
    """The factor f with makespan_at(f) == target_s (makespan falls as f grows), by bisection in log space."""
    if not target_s > 0:
        return 1.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if makespan_at(mid) > target_s:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def _makespan(scenario: Scenario, assignment: Sequence[str], backend_id: str | None = None) -> float:
    """Makespan of a fixed assignment, or the time `backend_id` finishes its share (from the first arrival)."""
    evaluator = AssignmentEvaluator(scenario)
    index = {b: i for i, b in enumerate(evaluator.backend_ids)}
    outcomes = evaluator.outcomes(tuple(index[b] for b in assignment))
    chosen = [o for o in outcomes if backend_id is None or o.backend_id == backend_id]
    return max(o.finish_s for o in chosen) - min(r.arrival_s for r in scenario.requests)


def calibrate(template: dict[str, Any], rates: dict[str, dict[str, Any]], accel_id: str, baseline_makespan_s: float,
              hybrid_runs: Sequence[dict[str, Any]]) -> tuple[dict[str, float], dict[str, str]]:
    """Per-backend factors and, for each, where it came from."""
    n = len(template["workload"]["arrivals_s"])
    all_accel = [accel_id] * n
    f_accel = fit_factor(lambda f: _makespan(build_scenario(template, rates, {accel_id: f}), all_accel),
                         baseline_makespan_s)
    factors, sources = {accel_id: f_accel}, {accel_id: "fitted to the accelerator-only arm's mean makespan"}
    accel_kind = _kind(template, accel_id)
    for b in (b["backend_id"] for b in template["cluster"]["backends"] if b["backend_id"] != accel_id):
        fits = []
        for run in hybrid_runs:
            assignment = [r["backend"] for r in sorted(run["requests"], key=lambda r: r["index"])]
            mine = [r for r in run["requests"] if r["backend"] == b and r.get("end_s") is not None]
            if not mine or None in assignment:
                continue
            target = max(r["end_s"] for r in mine) - min(r["send_s"] for r in run["requests"])
            fits.append(fit_factor(lambda f: _makespan(build_scenario(template, rates, {accel_id: f_accel, b: f}),
                                                       assignment, b), target))
        if fits:
            factors[b], sources[b] = statistics.median(fits), f"fitted to its finish time in {len(fits)} hybrid run(s)"
        elif _kind(template, b) == accel_kind:
            factors[b], sources[b] = f_accel, "no hybrid run used it; same device kind as the accelerator: its factor"
        else:
            factors[b], sources[b] = 1.0, "no hybrid run used it: the profile's rates, not calibrated"
    return factors, sources


def _kind(record: dict[str, Any], backend_id: str) -> str:
    return next(b["device_kind"] for b in record["cluster"]["backends"] if b["backend_id"] == backend_id)


def _sim_summary(scenario: Scenario, accel_id: str, seeds: Sequence[Sequence[str]]) -> dict[str, Any]:
    all_accel = [accel_id] * len(scenario.requests)
    cost = simulate(scenario, "cost")
    oracle = find_oracle(scenario, seeds=[*seeds, all_accel, cost.assignment])
    span = max(o.finish_s for o in cost.outcomes) - min(o.arrival_s for o in cost.outcomes)
    return {"accelerator_only_s": _makespan(scenario, all_accel), "cost_s": span,
            "cost_requests_by_backend": _counts(cost.assignment), "oracle_s": oracle.makespan_s,
            "oracle_requests_by_backend": _counts(oracle.assignment), "oracle_assignment": oracle.assignment,
            "search": oracle.method}


def _counts(assignment: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in assignment:
        out[b] = out.get(b, 0) + 1
    return out


def cell_oracle(baseline_runs: Sequence[dict[str, Any]], hybrid_runs: Sequence[dict[str, Any]],
                accel_id: str) -> dict[str, Any]:
    """The oracle and the router's share of its gain for one cell (see the module docstring)."""
    template = hybrid_runs[0]
    rates = template["cluster"]["rates"]
    measured_baseline = statistics.fmean(r["metrics"]["makespan_s"] for r in baseline_runs)
    measured_hybrid = statistics.fmean(r["metrics"]["makespan_s"] for r in hybrid_runs)
    seeds = [[r["backend"] for r in sorted(run["requests"], key=lambda r: r["index"])] for run in hybrid_runs]
    seeds = [s for s in seeds if None not in s]
    factors, sources = calibrate(template, rates, accel_id, measured_baseline, hybrid_runs)
    profile_sim = _sim_summary(build_scenario(template, rates), accel_id, seeds)
    calibrated = build_scenario(template, rates, factors)
    calibrated_sim = _sim_summary(calibrated, accel_id, seeds)
    sim_baseline = calibrated_sim["accelerator_only_s"]
    replays = [_makespan(calibrated, s) for s in seeds]
    calibrated_sim["router_replay_s"] = statistics.fmean(replays) if replays else math.nan
    oracle_s = measured_baseline * calibrated_sim["oracle_s"] / sim_baseline
    note = None
    if measured_hybrid < oracle_s:
        note = ("the measured hybrid arm was faster than the oracle estimate: the difference is within the "
                "run-to-run spread, or the calibrated simulation is pessimistic")
    return {
        "method": "route-sim oracle (routing/oracle.py) on the cell's workload, each backend's rates from the rates "
                  "file scaled to the measured runs; the router's share replays its measured assignments in the "
                  "same calibrated simulation",
        "factors": {b: round(f, 4) for b, f in factors.items()}, "factor_sources": sources,
        "sim_profile_rates": _rounded(profile_sim), "sim_calibrated": _rounded(calibrated_sim),
        **share_of_oracle_gain(sim_baseline, calibrated_sim["router_replay_s"], calibrated_sim["oracle_s"]),
        "baseline_makespan_s": round(measured_baseline, 6), "hybrid_makespan_s": round(measured_hybrid, 6),
        "oracle_makespan_s": round(oracle_s, 6),
        "measured_router_gain": round((measured_baseline - measured_hybrid) / measured_baseline, 6), "note": note,
    }


def share_of_oracle_gain(baseline_s: float, router_s: float, oracle_s: float) -> dict[str, Any]:
    """Gains as fractions of the baseline makespan, and the share of the oracle's gain captured."""
    oracle_gain, router_gain = baseline_s - oracle_s, baseline_s - router_s
    share = router_gain / oracle_gain if oracle_gain > MIN_ORACLE_GAIN * baseline_s else None
    return {"oracle_gain": round(oracle_gain / baseline_s, 6), "router_gain": round(router_gain / baseline_s, 6),
            "share": None if share is None else round(share, 6)}


def meets_target(oracle: dict[str, Any], min_gain: float = 0.05, min_share: float = 0.8) -> bool | None:
    """The issue's bar: where the oracle gains >= 5%, the router captures >= 80%. None if it does not apply."""
    if oracle["oracle_gain"] < min_gain:
        return None
    return oracle["share"] is not None and oracle["share"] >= min_share


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
