"""`route-sim` end to end: decision lines, summaries, the oracle line, the table, errors."""

import argparse
import json

from tandem.routing import sim_cli

from routing_test_helpers import EXAMPLE


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    code = sim_cli.run(parser.parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return code, out, err


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_default_policy_prints_decisions_summaries_oracle_and_table(capsys, tmp_path):
    code, out, _ = run_cli(capsys, EXAMPLE, "--json-out", tmp_path / "report.json")
    assert code == 0
    lines = json_lines(out)
    decisions = [l for l in lines if l["type"] == "decision"]
    assert [d["backend_id"] for d in decisions] == ["mps0"] * 7 + ["cpu0"]
    assert decisions[7]["req_id"] == "r8" and decisions[7]["time_s"] == 0.35
    summaries = {l["name"]: l for l in lines if l["type"] in ("summary", "oracle")}
    assert list(summaries) == ["accelerator-only", "cost", "oracle"]
    assert summaries["cost"]["num_requests_by_backend"] == {"mps0": 7, "cpu0": 1}
    assert summaries["oracle"]["share_of_oracle_gain"] == 1.0
    assert 0 < summaries["cost"]["share_of_oracle_gain"] < 1
    assert "makespan_s" in out.split("\n\n")[-1]  # the table
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["oracle_method"] == "exhaustive over 256 assignments"


def test_policy_all_without_decisions(capsys):
    code, out, _ = run_cli(capsys, EXAMPLE, "--policy", "all", "--no-decisions", "--no-oracle")
    assert code == 0
    names = [l["name"] for l in json_lines(out)]
    assert names == ["accelerator-only", "cost", "cpu-only", "round-robin", "random", "least-requests",
                     "prefix-affinity"]


def test_errors_exit_2_and_name_the_problem(capsys, tmp_path):
    code, _, err = run_cli(capsys, EXAMPLE, "--policy", "cost,fastest")
    assert code == 2 and "--policy: unknown policy 'fastest'" in err
    (tmp_path / "s.json").write_text(json.dumps({"backends": [{"backend_id": "a", "device_kind": "cpu"}]}))
    code, _, err = run_cli(capsys, tmp_path / "s.json")
    assert code == 2 and "backends.0.rates: required field is missing" in err
