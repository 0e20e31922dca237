"""`tandem route-sim SCENARIO`: run the what-if simulator and compare policies with the oracle.

`tandem route-sim --replay ROUTING_LOG` replays the requests a running server saw instead
(routing/replay.py), under every policy by default and the oracle, and adds the regret of the
policy that served them: its simulated TTFT p50/p95 and makespan minus the oracle's (a
`"type": "regret"` line and a line under the table).

Output on stdout: one JSON line per routing decision (`"type": "decision"`), one per policy
summary (`"type": "summary"`) and one for the oracle (`"type": "oracle"`), then a blank line
and a plain-text table. `--no-decisions` drops the decision lines; `--json-out` also writes
everything as one JSON document. The `tandem` CLI calls `add_arguments` and `run`; until then
`python -m tandem.routing.sim_cli SCENARIO` does the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tandem.routing.errors import ConfigError
from tandem.routing.oracle import find_oracle
from tandem.routing.policies import POLICIES
from tandem.routing.replay import Replay, load_replay
from tandem.routing.scenario import Scenario, load_scenario
from tandem.routing.sim_report import Summary, add_gains, format_table, summarize
from tandem.routing.simulator import SimResult, simulate

BASELINE = "accelerator-only"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", type=Path, nargs="?", help="scenario file (.json, .yaml or .yml)")
    parser.add_argument("--replay", type=Path, default=None, metavar="ROUTING_LOG",
                        help="replay a server's routing log (tandem serve --routing-log) instead of a scenario")
    parser.add_argument("--window", default=None, metavar="START:END",
                        help="with --replay: only the decisions START to END seconds after the log's first "
                             "(either may be left out, e.g. 120: or :60), such as one run of several")
    parser.add_argument("--policy", default=None,
                        help=f"policy, comma-separated list, or 'all' ({', '.join(POLICIES)}); "
                             "default: the scenario's policy ('all' with --replay)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="override generate.num_requests in the scenario")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one scenario field, e.g. tenants.rate_per_s=100 or "
                             "backends.0.num_kv_blocks=384 (repeatable; VALUE is YAML)")
    parser.add_argument("--no-decisions", action="store_true", help="do not print decision lines")
    parser.add_argument("--no-oracle", action="store_true", help="skip the oracle search")
    parser.add_argument("--oracle-exhaustive-max", type=int, default=2**16,
                        help="search all assignments when there are at most this many (default 65536)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write a JSON report here")


def run(args: argparse.Namespace, backend_factory: Any = None) -> int:
    """`backend_factory`: how each backend is simulated, the oracle's too (routing/simulator.py's
    BackendFactory; None: routing/sim_backend.py's model)."""
    replay = None
    try:
        if (args.scenario is None) == (args.replay is None):
            raise ConfigError("give a scenario file or --replay ROUTING_LOG (one of them)")
        if args.replay is not None:
            replay = load_replay(args.replay, _window(args.window))
            scenario = replay.scenario
        elif args.window is not None:
            raise ConfigError("--window needs --replay")
        else:
            scenario = load_scenario(args.scenario, num_requests=args.num_requests, overrides=args.set)
        policies = _policies(args.policy if args.policy or replay is None else "all", scenario)
    except ConfigError as exc:
        print(f"route-sim: {exc}", file=sys.stderr)
        return 2
    try:
        results = [simulate(scenario, policy, backend_factory) for policy in policies]
        report, summaries = _report(scenario, results, args, replay is not None, backend_factory)
    except ConfigError as exc:  # a backend the chosen model cannot simulate
        print(f"route-sim: {exc}", file=sys.stderr)
        return 2
    if replay is not None:
        report["replay"] = _regret(replay, summaries)
        print(json.dumps({"type": "regret", **report["replay"]}, separators=(",", ":")))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(f"scenario {scenario.name}: {len(scenario.requests)} requests; oracle: {report['oracle_method']}")
    print(format_table(summaries))
    if replay is not None:
        print(_regret_line(report["replay"]))
    return 0


def _regret(replay: Replay, summaries: list[Summary]) -> dict[str, Any]:
    """The served policy's simulated TTFT p50/p95 and makespan minus the oracle's (None where
    the oracle was not searched)."""
    by_name = {s.name: s for s in summaries}
    served, oracle = by_name.get(replay.served_policy), by_name.get("oracle")
    regret = {"served_policy": replay.served_policy, "num_refused": replay.num_refused,
              "num_rerouted": replay.num_rerouted}
    for field in ("ttft_p50_s", "ttft_p95_s", "makespan_s"):
        value = None if served is None or oracle is None else getattr(served, field) - getattr(oracle, field)
        regret[f"regret_{field}"] = None if value is None else round(value, 6)
    return regret


def _regret_line(regret: dict[str, Any]) -> str:
    parts = [f"served by {regret['served_policy']}"]
    if regret["regret_makespan_s"] is None:
        parts.append("no oracle to compare with")
    else:
        parts.append("regret vs the oracle: " + ", ".join(
            f"{name} {regret[f'regret_{name}_s']:+.3f} s" for name in ("ttft_p50", "ttft_p95", "makespan")))
    parts.append(f"{regret['num_refused']} refused for their deadline (not replayed), "
                 f"{regret['num_rerouted']} re-routed (replayed once); every request assumed to use its whole max_tokens")
    return "; ".join(parts)


def _window(value: str | None) -> tuple[float | None, float | None]:
    """`--window START:END` as seconds (None where a side is left out)."""
    if value is None:
        return None, None
    start, sep, end = value.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = tuple(float(x) if x.strip() else None for x in (start, end))
    except ValueError:
        raise ConfigError(f"--window: expected START:END in seconds (e.g. 30:90, 30: or :90), got {value!r}") from None
    if None not in bounds and bounds[0] > bounds[1]:
        raise ConfigError(f"--window: START is after END ({value!r})")
    return bounds


def _policies(value: str | None, scenario: Scenario) -> list[str]:
    if value is None:
        return [scenario.policy]
    unusable = _unusable_policies(scenario)
    if value == "all":  # every policy that has a backend to use here
        return [name for name in POLICIES if name not in unusable]
    names = [v.strip() for v in value.split(",") if v.strip()]
    for name in names:
        if name not in POLICIES:
            raise ConfigError(f"--policy: unknown policy {name!r}; choose from {sorted(POLICIES)} or 'all'")
        if name in unusable:
            raise ConfigError(f"--policy {name}: {unusable[name]}")
    return names


def _unusable_policies(scenario: Scenario) -> dict[str, str]:
    """Policies that could place no request on the scenario's backends, and why."""
    kinds = {"cpu" if b.spec.is_cpu else "accelerator" for b in scenario.backends}
    unusable = {}
    if "cpu" not in kinds:
        unusable["cpu-only"] = "the scenario has no cpu backend"
    if "accelerator" not in kinds:
        unusable["accelerator-only"] = "the scenario has no accelerator backend"
    return unusable


def _report(scenario: Scenario, results: list[SimResult], args: argparse.Namespace,
            replay: bool = False, backend_factory: Any = None) -> tuple[dict[str, Any], list[Summary]]:
    """Print decision and summary lines; return the JSON report and the summaries. The baseline,
    when not among `results`, is simulated on the same backend model."""
    backend_ids = [b.spec.backend_id for b in scenario.backends]
    has_accelerator = any(not b.spec.is_cpu for b in scenario.backends)
    by_policy = {r.policy: r for r in results}
    if has_accelerator:
        # The gains are measured against accelerator-only; it leads the table.
        by_policy = {BASELINE: by_policy.get(BASELINE) or simulate(scenario, BASELINE, backend_factory),
                     **by_policy}
    summaries = [summarize(r.policy, r.outcomes, backend_ids) for r in by_policy.values()]
    oracle_summary, oracle_method, oracle_assignment = None, "skipped", None
    num_assignments = len(scenario.backends) ** len(scenario.requests)
    if scenario.has_prefix_caches and not (replay and num_assignments <= args.oracle_exhaustive_max):
        # Its local search replays every backend per move: far too slow for hundreds of requests
        # (a small replayed log is searched exhaustively).
        oracle_method = "skipped (not searched in tenants scenarios or large replays)"
    elif not args.no_oracle:
        oracle = find_oracle(scenario, [r.assignment for r in by_policy.values()], args.oracle_exhaustive_max,
                             backend_factory=backend_factory)
        oracle_summary = summarize("oracle", oracle.outcomes, backend_ids)
        oracle_method, oracle_assignment = oracle.method, oracle.assignment
        summaries.append(oracle_summary)
    baseline = next((s for s in summaries if s.name == BASELINE), None)
    add_gains(summaries, baseline, oracle_summary)
    _print_lines(results, summaries, oracle_method, oracle_assignment, args.no_decisions)
    report = {
        "scenario": scenario.name,
        "num_requests": len(scenario.requests),
        "oracle_method": oracle_method,
        "oracle_assignment": oracle_assignment,
        "summaries": [s.to_dict() for s in summaries],
        "decisions": {r.policy: [{"time_s": d.time_s, **d.record.to_dict()} for d in r.decisions]
                      for r in results},
    }
    return report, summaries


def _print_lines(results: list[SimResult], summaries: list[Summary], oracle_method: str,
                 oracle_assignment: list[str] | None, no_decisions: bool) -> None:
    if not no_decisions:
        for result in results:
            for d in result.decisions:
                print(json.dumps({"type": "decision", "time_s": round(d.time_s, 6), **d.record.to_dict()},
                                 separators=(",", ":")))
    for s in summaries:
        kind = "oracle" if s.name == "oracle" else "summary"
        extra = {"method": oracle_method, "assignment": oracle_assignment} if kind == "oracle" else {}
        print(json.dumps({"type": kind, **s.to_dict(), **extra}, separators=(",", ":")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="route-sim", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
