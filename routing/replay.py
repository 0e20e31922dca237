"""A running server's routing log as a what-if scenario (`tandem route-sim --replay LOG`).

The router writes one JSON line per decision (actors/router.py): its time, the policy, every
backend's score terms with the rates and slots it used, the request's prompt and budget
lengths, and its prompt's block hashes at the finest block size. That is enough to rebuild
the traffic: requests arrive at their logged times (relative to the first), with their
lengths, and, where the log has block hashes, their real prefixes, so each simulated backend
keeps a prefix cache and every policy earns its own hits (as in a tenants scenario, with
unlimited cache room); without hashes, each request keeps the hits the backends reported for
it at the time (`cache_answers`, and the host KV tiers' runs after them, `host_cache_answers`,
which the router scores as it did; the simulated backends compute those tokens, as they model no
host tier). Backends run at the rates the router used while it served the log: the median of
the rates its decisions used, applied to the whole profile (batch table included) that the log
writes once per backend; older logs have only the two rates each score used, so their backends
decode at one aggregate rate.

What the log cannot tell, the replay assumes, and the report says so:
- each request generates its whole `max_tokens` (the decision comes before any output);
- the backends' caches start empty, and serve requests in arrival order: priorities are not
  simulated, and a request refused for its deadline (`placed` false) was not served, so it is
  left out;
- a request routed more than once (its backend failed) counts once, at its last placement.

The policy that served the traffic is the log's (the last decision's); the report sets its
simulated TTFT and makespan against the hindsight oracle's, its regret.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.cost_model import decode_rate_for
from tandem.routing.errors import ConfigError
from tandem.routing.rates import RateProfile, scale_decode
from tandem.routing.scenario import Scenario, SimBackendSpec, SimRequest


@dataclass
class Replay:
    scenario: Scenario
    served_policy: str
    num_refused: int  # lines of requests refused for their deadline (left out)
    num_rerouted: int  # requests placed more than once (kept at their last placement)


def load_replay(path: str | Path, window_s: tuple[float | None, float | None] = (None, None)) -> Replay:
    """Read a routing log; ConfigError (naming the line) when it is not one. `window_s`: replay
    only the decisions from `start` to `end` seconds after the log's first (either may be None),
    e.g. one run of a benchmark that sent several to the same server; the backends' profiles are
    read from the whole log."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--replay: cannot read routing log {path}: {exc.strerror}") from None
    every = [_parse(line, path, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    lines = _within(every, window_s)
    placed = [x for x in lines if x.get("placed", True)]
    if not placed:
        where = "" if window_s == (None, None) else " in that --window"
        raise ConfigError(f"--replay: {path} holds no placed decision{where}")
    last: dict[str, dict[str, Any]] = {}
    for line in placed:
        last[line["req_id"]] = line  # a re-route replaces the failed placement
    backends = _backends(placed, _profiles(every))
    start = min(x["ts"] for x in last.values())
    with_hashes = all(x.get("block_hashes") for x in last.values())
    requests = sorted((_request(x, start, with_hashes) for x in last.values()), key=lambda r: r.arrival_s)
    block_size = min(x["block_size"] for x in last.values()) if with_hashes else None
    scenario = Scenario(name=f"replay of {path.name}", policy=placed[-1]["policy"], backends=backends,
                        requests=requests, block_size=block_size)
    return Replay(scenario, placed[-1]["policy"], len(lines) - len(placed), len(placed) - len(last))


def _parse(line: str, path: Path, n: int) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--replay: {path}:{n}: not JSON ({exc.msg})") from None
    missing = [k for k in ("ts", "req_id", "policy", "backend_id", "per_backend", "num_prompt_tokens", "max_tokens")
               if k not in data]
    if missing:
        raise ConfigError(f"--replay: {path}:{n}: a routing-log line needs {', '.join(missing)} (logs written "
                          "before the router recorded request lengths cannot be replayed)")
    return data


def first_decision_s(path: str | Path) -> float:
    """The time (`ts`, the router's wall clock) of a routing log's first line, which `--window`
    counts from."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                return float(_parse(line, Path(path), n)["ts"])
    raise ConfigError(f"--replay: {path} is empty")


def _within(lines: list[dict[str, Any]], window_s: tuple[float | None, float | None]) -> list[dict[str, Any]]:
    """The lines from `start` to `end` seconds after the first line (None: no bound)."""
    start, end = window_s
    if not lines or window_s == (None, None):
        return lines
    first = lines[0]["ts"]
    return [x for x in lines if (start is None or x["ts"] - first >= start) and (end is None or x["ts"] - first <= end)]


def _profiles(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each backend's rate profile, from the first line that carries it (the router writes it
    with the first decision that scores the backend after it joined)."""
    profiles: dict[str, dict[str, Any]] = {}
    for line in lines:
        for backend_id, profile in line.get("rates", {}).items():
            profiles.setdefault(backend_id, profile)
    return profiles


def _backends(lines: list[dict[str, Any]], profiles: dict[str, dict[str, Any]]) -> list[SimBackendSpec]:
    """Every backend a decision scored, at the slots of its first decision and at the rates the
    router used while it served the log's traffic (`_serving_rates`)."""
    scores: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        for backend_id, score in line["per_backend"].items():
            scores.setdefault(backend_id, []).append(score)
    backends = []
    for backend_id, seen in scores.items():
        rates = _serving_rates(seen, profiles.get(backend_id))
        spec = BackendSpec(backend_id, seen[0]["device_kind"], rates, seen[0].get("max_active", 4))
        backends.append(SimBackendSpec(spec, rates))
    return sorted(backends, key=lambda b: b.spec.preference_key())


def _serving_rates(scores: list[dict[str, Any]], profile: dict[str, Any] | None) -> RateProfile:
    """A backend's rates over the log: the median prefill rate its scores used, and its decode
    rates, the logged profile's batch table (written with the first decision that scored it)
    scaled by the median ratio of the rate each score used to the table's rate at that score's
    batch size. Calibration moves the rates while the backend serves (a CPU backend beside busy
    neighbours prefills and decodes slower than its profile), and the median is what most of
    the traffic met. A log without a profile has only the scores' rates: one aggregate decode
    rate, their median."""
    prefill_tok_s = statistics.median(s["prefill_tok_s"] for s in scores)
    if profile is None:
        return RateProfile(prefill_tok_s, statistics.median(s["decode_tok_s"] for s in scores))
    logged = RateProfile(**profile)
    factor = statistics.median(
        s["decode_tok_s"] / decode_rate_for(logged, s.get("max_active", 4), s["num_active"] + s["num_queued"] + 1)
        for s in scores)
    return scale_decode(replace(logged, prefill_tok_s=prefill_tok_s), factor)


def _request(line: dict[str, Any], start: float, with_hashes: bool) -> SimRequest:
    return SimRequest(
        req_id=line["req_id"],
        arrival_s=line["ts"] - start,
        num_prompt_tokens=line["num_prompt_tokens"],
        max_tokens=line["max_tokens"],
        num_output_tokens=line["max_tokens"],
        num_cached_tokens={} if with_hashes else dict(line.get("cache_answers", {})),
        num_host_cached_tokens={} if with_hashes else dict(line.get("host_cache_answers") or {}),
        block_hashes=tuple(line["block_hashes"]) if with_hashes else (),
    )
