"""`tandem route-sim --replay ROUTING_LOG` on a small recorded log (fixtures/routing-log.jsonl:
written by the router actor under round-robin for two backends, cuda0 at 2551/293 tok/s and
cpu0 at 73/45, 4 slots each; eight requests of 80 prompt tokens sharing a 64-token prefix and
32 tokens of budget, and one refused for a 2 ms deadline; its timestamps set 50 ms apart)."""

import json
from pathlib import Path

import pytest

from tandem.routing.errors import ConfigError
from tandem.routing.replay import load_replay
from tandem.routing.sim_cli import main
from tandem.routing.simulator import simulate

LOG = Path(__file__).parent / "fixtures" / "routing-log.jsonl"


def test_the_log_becomes_the_scenario_it_served():
    replay = load_replay(LOG)
    scenario = replay.scenario
    assert (replay.served_policy, replay.num_refused, replay.num_rerouted) == ("round-robin", 1, 0)
    assert [r.req_id for r in scenario.requests] == [f"r{i}" for i in range(8)]
    # The refused request's line (the 7th) is left out, not its time slot.
    assert [round(r.arrival_s, 6) for r in scenario.requests] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.4]
    assert {(r.num_prompt_tokens, r.max_tokens, r.num_output_tokens, len(r.block_hashes))
            for r in scenario.requests} == {(80, 32, 32, 5)}
    assert len({r.block_hashes[:4] for r in scenario.requests}) == 1  # the shared 64-token prefix
    assert scenario.block_size == 16
    assert [(b.spec.backend_id, b.spec.rates.prefill_tok_s, b.spec.rates.decode_tok_s, b.spec.max_active)
            for b in scenario.backends] == [("cuda0", 2551.0, 293.0, 4), ("cpu0", 73.0, 45.0, 4)]


def test_replaying_the_served_policy_reproduces_its_placements():
    logged = [json.loads(line) for line in LOG.read_text().splitlines()]
    placed = [x["backend_id"] for x in logged if x["placed"]]
    assert simulate(load_replay(LOG).scenario, "round-robin").assignment == placed


def test_cli_reports_every_policy_the_oracle_and_the_served_policys_regret(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["--replay", str(LOG), "--no-decisions", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    summaries = {s["name"]: s for s in report["summaries"]}
    assert set(summaries) == {"accelerator-only", "cost", "cpu-only", "round-robin", "random", "least-requests",
                              "prefix-affinity", "oracle"}
    assert report["oracle_method"] == "exhaustive over 256 assignments"
    oracle, served = summaries["oracle"], summaries["round-robin"]
    assert all(oracle["makespan_s"] <= s["makespan_s"] for s in summaries.values())
    regret = report["replay"]
    assert regret["served_policy"] == "round-robin" and regret["num_refused"] == 1
    for field in ("ttft_p50_s", "ttft_p95_s", "makespan_s"):
        assert regret[f"regret_{field}"] == pytest.approx(served[field] - oracle[field], abs=2e-6)
    assert regret["regret_makespan_s"] > 0  # round-robin sent half the requests to the slow CPU
    text = capsys.readouterr().out
    assert '"type":"regret"' in text and "served by round-robin; regret vs the oracle: ttft_p50 +" in text


def test_a_log_without_request_lengths_is_refused_with_the_reason(tmp_path):
    old = tmp_path / "old.jsonl"
    line = json.loads(LOG.read_text().splitlines()[0])
    del line["num_prompt_tokens"], line["max_tokens"]
    old.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match="old.jsonl:1: a routing-log line needs num_prompt_tokens, max_tokens"):
        load_replay(old)
    assert main(["--replay", str(old)]) == 2


def test_a_scenario_or_a_replay_not_both(capsys):
    assert main([]) == 2
    assert "give a scenario file or --replay" in capsys.readouterr().err


TABLE = {1: 37.2, 2: 61.4, 4: 89.9}


def _cpu_only_log(tmp_path, with_rates: bool) -> Path:
    """The fixture's traffic as if both backends were CPUs that the router's calibration found
    at half their profiled decode speed and 200 tok/s of prefill, the first line carrying each
    backend's profile with a batch table (as the router actor logs it) or not (older logs)."""
    from tandem.routing import RateProfile

    profile = RateProfile(261.0, 37.2, TABLE)
    lines = [json.loads(line) for line in LOG.read_text().splitlines()]
    for line in lines:
        for score in line["per_backend"].values():
            batch = min(score["max_active"], score["num_active"] + score["num_queued"] + 1)
            score.update(device_kind="cpu", prefill_tok_s=200.0, decode_tok_s=0.5 * profile.decode_rate(batch))
    if with_rates:
        lines[0]["rates"] = {b: {"prefill_tok_s": 261.0, "decode_tok_s": 37.2,
                                 "decode_tok_s_by_batch": {str(k): v for k, v in TABLE.items()}}
                             for b in lines[0]["per_backend"]}
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_replay_runs_at_the_rates_the_router_used_on_the_logged_batch_table(tmp_path):
    backends = load_replay(_cpu_only_log(tmp_path, with_rates=True)).scenario.backends
    for b in backends:
        assert b.spec.rates.prefill_tok_s == pytest.approx(200.0)
        assert b.spec.rates.decode_tok_s_by_batch == pytest.approx({k: 0.5 * v for k, v in TABLE.items()})
    older = load_replay(_cpu_only_log(tmp_path, with_rates=False)).scenario.backends
    assert [b.spec.rates.decode_tok_s_by_batch for b in older] == [None, None]  # one aggregate rate each
    assert all(b.spec.rates.prefill_tok_s == pytest.approx(200.0) for b in older)


def test_a_cpu_only_log_replays_every_policy_that_can_place_a_request(tmp_path, capsys):
    log = _cpu_only_log(tmp_path, with_rates=True)
    out = tmp_path / "report.json"
    assert main(["--replay", str(log), "--no-decisions", "--no-oracle", "--json-out", str(out)]) == 0
    names = {s["name"] for s in json.loads(out.read_text())["summaries"]}
    assert "accelerator-only" not in names and {"cost", "cpu-only", "round-robin"} <= names
    assert main(["--replay", str(log), "--policy", "accelerator-only"]) == 2
    assert "--policy accelerator-only: the scenario has no accelerator backend" in capsys.readouterr().err


def test_a_window_replays_part_of_the_log_with_the_profiles_of_all_of_it(tmp_path, capsys):
    log = _cpu_only_log(tmp_path, with_rates=True)  # the fixture's decisions are 50 ms apart
    part = load_replay(log, (0.12, 0.26)).scenario
    assert [r.req_id for r in part.requests] == ["r3", "r4", "r5"]
    assert part.requests[0].arrival_s == 0.0  # times count from the window's first decision
    # The profile is on the log's first line, outside the window: its batch table still applies.
    assert all(b.spec.rates.decode_tok_s_by_batch is not None for b in part.backends)
    assert [r.req_id for r in load_replay(log, (None, 0.06)).scenario.requests] == ["r0", "r1"]
    assert [r.req_id for r in load_replay(log, (0.36, None)).scenario.requests] == ["r7"]
    with pytest.raises(ConfigError, match="no placed decision in that --window"):
        load_replay(log, (5.0, None))
    assert main(["--replay", str(log), "--window", "0.12:0.26", "--policy", "cost", "--no-decisions"]) == 0
    for bad, why in (("3", "expected START:END"), ("b:", "expected START:END"), ("2:1", "START is after END")):
        assert main(["--replay", str(log), "--window", bad]) == 2
        assert why in capsys.readouterr().err
    assert main([str(log), "--window", "1:2"]) == 2
    assert "--window needs --replay" in capsys.readouterr().err


def test_a_log_without_hashes_replays_the_host_tiers_answers_as_the_router_saw_them(tmp_path):
    lines = [json.loads(line) for line in LOG.read_text().splitlines()]
    for line in lines:
        del line["block_hashes"]
        line["cache_answers"] = {"cuda0": 16, "cpu0": 0}
        line["host_cache_answers"] = {"cuda0": 48}
    lines[0]["rates"] = {"cuda0": {"prefill_tok_s": 2551.0, "decode_tok_s": 293.0, "reload_tok_s": 40000.0},
                         "cpu0": {"prefill_tok_s": 73.0, "decode_tok_s": 45.0}}
    del lines[1]["host_cache_answers"]  # a line from before the router logged the host tier's answers
    path = tmp_path / "tier.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = {r.req_id: r for r in load_replay(path).scenario.requests}
    assert requests["r0"].num_host_cached_tokens == {"cuda0": 48} and requests["r1"].num_host_cached_tokens == {}
    scores = {d.record.req_id: d.record.per_backend["cuda0"]
              for d in simulate(load_replay(path).scenario, "cost").decisions}
    assert (scores["r0"].num_host_cached_tokens, scores["r0"].reload_term_s) == (48, pytest.approx(48 / 40000))
    assert scores["r1"].num_host_cached_tokens == 0
