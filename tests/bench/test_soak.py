"""bench/soak.py and its parts: the traffic's judging against canned answers (httpx's mock
transport, no server), the probes on this test's own processes and a canned /metrics page, the
checks on a hand-built report, and (slow) a short soak against a real `tandem serve` with two
CPU backends of the tiny random model, whose own checks must find nothing lost or hung."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench import soak_probe
from bench.soak_report import checks, growth_by_process, rss_slope_mib_per_min
from bench.soak_traffic import KINDS, OUTCOMES, Planned, Planner, send, timeouts

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama-random"


# -- the traffic -----------------------------------------------------------------------------------
def test_planner_is_seeded_and_mixes_every_kind():
    planner, again = Planner(MODEL, 1024, 16, seed=3), Planner(MODEL, 1024, 16, seed=3)
    plans = [planner.next() for _ in range(400)]
    assert plans == [again.next() for _ in range(400)]
    assert plans != [Planner(MODEL, 1024, 16, seed=4).next() for _ in range(400)]
    assert {p.kind for p in plans} == set(KINDS)
    for p in plans:
        if p.kind == "long_prompt":  # near the context, never over it
            assert 1024 - 16 - 8 <= len(p.body["prompt"]) + p.body["max_tokens"] <= 1024 - 8
        elif p.kind == "malformed":
            assert p.expect_status in (400, 404, 415)
        else:
            assert p.expect_status == 200 and p.body["model"] == MODEL
        if p.kind == "tool_call":
            assert p.body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        if p.kind == "structured":
            assert p.body["response_format"]["type"] == "json_schema"


def _sse(*events: object, done: bool = True) -> bytes:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (text + ("data: [DONE]\n\n" if done else "")).encode()


CHUNK = {"choices": [{"index": 0, "text": "a"}]}
# path -> (status, body): what the canned server answers
CANNED = {
    "/ok-stream": (200, _sse(CHUNK, CHUNK)),
    "/ok-whole": (200, json.dumps({"choices": [{"index": 0}, {"index": 1}]}).encode()),
    "/unavailable-event": (200, _sse(CHUNK, {"error": {"type": "service_unavailable", "message": "gone"}})),
    "/internal-event": (200, _sse(CHUNK, {"error": {"type": "internal_error", "message": "bug"}})),
    "/cut": (200, _sse(CHUNK, done=False)),
    "/list-body": (200, b"[1, 2]"),  # JSON, but not an object: the judging code's .get breaks
    "/429": (429, b'{"error": {}}'),
    "/503": (503, b'{"error": {}}'),
    "/500": (500, b'{"error": {}}'),
    "/400": (400, b'{"error": {}}'),
}


def _judge(planned: Planned) -> tuple[str, str | None]:
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(CANNED[request.url.path][0], content=CANNED[request.url.path][1]))
        async with httpx.AsyncClient(transport=transport, base_url="http://soak", timeout=timeouts(5)) as client:
            record = await send(client, planned, lambda: 0.0)
            return record.outcome, record.detail

    return asyncio.run(go())


@pytest.mark.parametrize("path, stream, expect_status, hang_up_after, num_choices, outcome", [
    ("/ok-stream", True, 200, None, 1, "ok"),
    ("/ok-stream", True, 200, 1, 1, "hung_up"),
    ("/ok-stream", True, 200, 0, 1, "hung_up"),
    ("/ok-whole", False, 200, None, 2, "ok"),
    ("/ok-whole", False, 200, None, 3, "lost"),  # fewer choices than asked for
    ("/unavailable-event", True, 200, None, 1, "refused"),
    ("/internal-event", True, 200, None, 1, "lost"),
    ("/cut", True, 200, None, 1, "lost"),
    ("/429", False, 200, None, 1, "refused"),
    ("/503", True, 200, None, 1, "refused"),
    ("/500", False, 200, None, 1, "lost"),
    ("/400", False, 400, None, 1, "rejected"),
    ("/400", False, 404, None, 1, "lost"),  # a 4xx, but not the one it deserved
    ("/ok-whole", False, 400, None, 2, "lost"),  # a malformed request answered 200
    ("/list-body", False, 200, None, 1, "lost"),  # an answer of no planned shape is lost, not the soak's end
])
def test_each_answer_has_one_outcome(path, stream, expect_status, hang_up_after, num_choices, outcome):
    planned = Planned("k", "POST", path, {"x": 1}, stream=stream, expect_status=expect_status,
                      num_choices=num_choices, hang_up_after=hang_up_after)
    got, detail = _judge(planned)
    assert got == outcome, detail
    assert got in OUTCOMES


def test_no_byte_within_the_limit_is_hung():
    async def go():
        async def handler(request):
            raise httpx.ReadTimeout("no byte", request=request)

        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return await send(client, Planned("k", "POST", "/x", {}), lambda: 0.0)

    assert asyncio.run(go()).outcome == "hung"


# -- the probes ------------------------------------------------------------------------------------
def test_process_tree_finds_children_with_their_memory_and_fds():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = soak_probe.process_tree(os.getpid())
        assert pids[0] == os.getpid() and child.pid in pids
        samples = {s.pid: s for s in soak_probe.sample_processes(os.getpid())}
        assert samples[os.getpid()].role == "serve"  # the root is the server's process
        assert samples[child.pid].role == Path(sys.executable).name and samples[child.pid].rss_mib > 1
        assert samples[os.getpid()].num_fds >= 3  # stdin, stdout, stderr at least
    finally:
        child.kill()
        child.wait()


def test_the_cpu_timeline_names_the_process_that_is_busy():
    """A child spinning on a core and one sleeping: the timeline gives the spinner about a core in
    its busy seconds and the sleeper about nothing, and names the spinner first."""
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with soak_probe.CpuTimeline(os.getpid(), interval_s=0.5) as timeline:
            import time

            time.sleep(2.2)
        # two processes of one role: the lower pid takes the role's name, the other `#2` (by_role)
        name = Path(sys.executable).name
        first, second = sorted((spinner.pid, sleeper.pid))
        role = {first: name, second: f"{name}#2"}
        shares = timeline.shares
        assert len(shares["serve"]) >= 3  # one share per interval, for every role
        assert max(shares[role[spinner.pid]]) > 0.3  # a shared 2-core box may give it less than a core
        assert max(shares[role[sleeper.pid]]) < 0.1
        assert next(iter(timeline.peaks())) == role[spinner.pid]
    finally:
        for child in (spinner, sleeper):
            child.kill()
            child.wait()


def test_roles_name_actors_and_their_children():
    assert soak_probe.role_of(7, 7, ["python", "-m", "tandem.cluster.cli"]) == "serve"
    assert soak_probe.role_of(8, 7, ["ray::BackendActor.step", ""]) == "ray::BackendActor"
    assert soak_probe.role_of(8, 7, ["ray::ServeReplica:tandem:TandemIngress"]) == "ray::ServeReplica:tandem:TandemIngress"
    assert soak_probe.role_of(9, 7, ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"],
                              "ray::BackendActor") == "ray::BackendActor/spawned"
    assert soak_probe.role_of(9, 7, ["/usr/bin/python3", "/x/ray/dashboard/dashboard.py", "--a"]) == "dashboard.py"
    samples = [soak_probe.ProcessSample(30, "ray::BackendActor", 10.0, 5),
               soak_probe.ProcessSample(20, "ray::BackendActor", 12.0, 6),
               soak_probe.ProcessSample(40, "ray::IDLE", 50.0, 7), soak_probe.ProcessSample(41, "ray::IDLE", 1.5, 7)]
    assert soak_probe.by_role(samples, {s.pid: s.rss_mib for s in samples}) == {
        "ray::BackendActor": 12.0, "ray::BackendActor#2": 10.0, "ray::IDLE": 51.5}
    assert soak_probe.total(samples, "rss_mib") == 22.0  # idle pool workers left out
    assert soak_probe.by_role(samples, {30: 100.0}) == {"ray::BackendActor#2": 100.0}


def test_cpu_used_is_differenced_per_process_not_per_role_number():
    """A backend's process ends between two readings (a run's actor torn down): the surviving
    one's role loses its `#2`, and its use is its own difference, not the difference of two
    processes that shared a name in turn."""
    old, new = (soak_probe.ProcessSample(20, "ray::BackendActor", 10.0, 5),
                soak_probe.ProcessSample(30, "ray::BackendActor", 10.0, 5))
    spawned = soak_probe.ProcessSample(31, "python3", 1.0, 3)
    before = soak_probe.CpuReading([old, new], {20: 50.0, 30: 2.0})
    after = soak_probe.CpuReading([new, spawned], {30: 3.5, 31: 0.25})
    # a process new since the first reading used all its CPU seconds in between
    assert soak_probe.cpu_used_by_role(before, after) == {"ray::BackendActor": 1.5, "python3": 0.25}


def test_kv_blocks_from_a_prometheus_page():
    labels = 'backend="{b}",Component="core_worker",WorkerId="{w}"'
    page = "\n".join([
        "# HELP ray_tandem_backend_kv_cache_usage Fraction of KV blocks held by requests (0-1).",
        "# TYPE ray_tandem_backend_kv_cache_usage gauge",
        f"ray_tandem_backend_kv_cache_usage{{{labels.format(b='cpu0', w='a')}}} 0.25",
        f"ray_tandem_backend_kv_cache_free_blocks{{{labels.format(b='cpu0', w='a')}}} 768.0",
        f"ray_tandem_backend_kv_cache_usage{{{labels.format(b='cpu1', w='b')}}} 0.0",
        f"ray_tandem_backend_kv_cache_free_blocks{{{labels.format(b='cpu1', w='b')}}} 1024.0",
        # a killed worker's series, still exported for a few seconds, beside its successor's
        f"ray_tandem_backend_kv_cache_usage{{{labels.format(b='cpu1', w='c')}}} 0.5",
        f"ray_tandem_backend_kv_cache_free_blocks{{{labels.format(b='cpu1', w='c')}}} 512.0",
        f"ray_tandem_backend_running_requests{{{labels.format(b='cpu0', w='a')}}} 3.0",
    ])
    assert soak_probe.kv_blocks(page) == {
        "cpu0": {"usage": 0.25, "free_blocks": 768.0, "blocks_in_use": 256},
        "cpu1": {"usage": 0.5, "free_blocks": 512.0, "blocks_in_use": 512},
    }
    assert soak_probe.kv_blocks("") == {}


# -- the checks ------------------------------------------------------------------------------------
def _args(**overrides):
    values = dict(hang_s=60.0, max_rss_growth_mib=256.0, max_gpu_growth_mib=256.0, max_rss_slope_mib_per_min=16.0,
                  max_p99_growth=0.2)
    return argparse.Namespace(**{**values, **overrides})


def _report(rss: list[float], p99: list[float], lost: int = 0, idle_blocks: int = 0, gpu: list | None = None) -> dict:
    gpu = gpu or [None] * len(rss)
    intervals = [{"end_s": 60.0 * (k + 1), "rss_mib": m, "p99_ms": p, "gpu_mib": g}
                 for k, (m, p, g) in enumerate(zip(rss, p99, gpu))]
    outcomes = {o: 0 for o in OUTCOMES} | {"lost": lost}
    kv = {"cpu0": {"usage": 0.0, "free_blocks": 10.0, "blocks_in_use": idle_blocks}}
    return {"totals": {"outcomes": outcomes}, "intervals": intervals, "server": {"alive_at_end": True},
            "idle_kv": {"end": {"kv": kv, "idle": idle_blocks == 0}}}


def test_checks_pass_and_fail_on_their_bounds():
    # RSS after warm-up: 1000, 1010, 1020 MiB one minute apart: 10 MiB/min, +20 MiB.
    assert rss_slope_mib_per_min([{"end_s": 60.0, "rss_mib": 500.0}, {"end_s": 120.0, "rss_mib": 1000.0},
                                  {"end_s": 180.0, "rss_mib": 1010.0}, {"end_s": 240.0, "rss_mib": 1020.0}]) == 10.0
    # A kill at 200 s: the sample at 240 s (a replacement starting) is left out, and the step
    # from one segment to the next is not growth: 1000, 1010 | 1300, 1310, 1320 is 10 MiB/min.
    rows = [{"end_s": 60.0 * (i + 1), "rss_mib": m} for i, m in enumerate([500, 1000, 1010, 900, 1300, 1310, 1320])]
    assert rss_slope_mib_per_min(rows, [200.0]) == 10.0
    assert rss_slope_mib_per_min(rows) > 50  # fitted across the step
    good = {c["name"]: c for c in checks(_report([500, 1000, 1010, 1020], [900, 100, 300, 119],
                                                 gpu=[0, 9000, 9100, 9200]), _args())}
    assert all(c["passed"] for c in good.values()), good
    assert good["gpu_growth_mib"]["value"] == 200.0
    assert (good["rss_growth_mib"]["value"], good["rss_slope_mib_per_min"]["value"]) == (20.0, 10.0)
    assert good["p99_last_over_second"]["value"] == 1.19
    bad = {c["name"]: c for c in checks(_report([500, 1000, 1010, 1020], [900, 100, 300, 121], lost=1, idle_blocks=3,
                                                gpu=[0, 9000, 9100, 9300]),
                                        _args(max_rss_slope_mib_per_min=5.0, max_rss_growth_mib=10.0))}
    assert {n for n, c in bad.items() if c["passed"] is False} == {
        "lost", "rss_growth_mib", "rss_slope_mib_per_min", "gpu_growth_mib", "p99_last_over_second", "idle_kv_blocks"}
    short = {c["name"]: c["passed"] for c in checks(_report([500, 1000], [100, 100]), _args())}
    assert short["rss_growth_mib"] is None and short["p99_last_over_second"] is None  # too short to judge
    assert short["gpu_growth_mib"] is None
    assert short["lost"] and short["hung"]


def test_growth_by_process_largest_change_first():
    rows = [{"rss_mib_by_process": {"serve": 100.0}},
            {"rss_mib_by_process": {"serve": 300.0, "engine": 500.0, "gone": 7.0}},
            {"rss_mib_by_process": {"serve": 310.0, "engine": 450.0, "new": 9.0}}]
    assert list(growth_by_process(rows).items()) == [("engine", -50.0), ("serve", 10.0)]
    assert growth_by_process(rows[:2]) == {}


def test_the_recorded_commands_hide_api_keys():
    from bench.soak import redacted

    assert redacted("tandem bench soak --api-key k1 '--flags=--backends cpu --api-key k2' --api-key=k3") == (
        "tandem bench soak --api-key *** '--flags=--backends cpu --api-key ***' --api-key=***")


def test_a_bench_that_breaks_exits_3_with_its_traceback_in_the_report(tmp_path, monkeypatch):
    import argparse

    import bench.soak as soak

    def broken(args, report, out):
        raise KeyError("a shape nobody planned for")

    monkeypatch.setattr(soak, "soak_and_report", broken)
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    assert soak.run(parser.parse_args(["--out", str(tmp_path), "--duration-s", "5"])) == 3
    report = json.loads((tmp_path / "soak.json").read_text())
    assert "KeyError" in report["error"] and "a shape nobody planned for" in report["error"]


# -- end to end --------------------------------------------------------------------------------------
def test_a_server_that_does_not_start_exits_2_with_its_reason(tmp_path):
    from tests.cluster.conftest import free_port

    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "soak", "--model", MODEL,
               "--flags=--backends nosuch-device",
               "--duration-s", "5", "--port", str(free_port()), "--start-timeout-s", "60", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert "exited with code 2" in report["server"]["error"]
    assert "checks" not in report and (tmp_path / "soak.log").read_text()


@pytest.mark.slow
def test_a_short_soak_loses_nothing(tmp_path):
    """~60 s of the mix against two CPU backends behind an API key; timings are not asserted (a
    shared 2-core box), the bench's own verdict on them only has to agree with its exit code."""
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"cpu": {"prefill_tok_s": 5000.0, "decode_tok_s": 300.0}}))
    from tests.cluster.conftest import free_port

    flags = (f"--backends cpu*2 --cpu-threads 1 --http-replicas 1 --profile never --rates {rates} "
             f"--warmup-tokens 0 --metrics-port {free_port()} --api-key sekret")  # the server's
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "soak", "--model", MODEL, f"--flags={flags}",
               "--duration-s", "60",
               "--interval-s", "15", "--clients", "4", "--max-tokens", "16", "--hang-s", "30",
               "--port", str(free_port()), "--start-timeout-s", "180", "--out", str(out), "--api-key", "sekret"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("TANDEM_API_KEY", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    console = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode in (0, 1) and (out / "soak.json").exists(), console
    report = json.loads((out / "soak.json").read_text())
    verdicts = {c["name"]: c["passed"] for c in report["checks"]}
    assert (verdicts["lost"], verdicts["hung"], verdicts["server_alive"], verdicts["idle_kv_blocks"]) == (
        True, True, True, True), report["totals"]["failure_samples"]
    assert done.returncode == (0 if all(v is not False for v in verdicts.values()) else 1)
    assert report["passed"] == (done.returncode == 0)
    assert set(verdicts) == {"lost", "hung", "server_alive", "rss_growth_mib", "rss_slope_mib_per_min",
                             "gpu_growth_mib", "p99_last_over_second", "idle_kv_blocks"}
    assert verdicts["gpu_growth_mib"] is None  # no GPU here: not judged
    assert (report["model"], report["max_model_len"]) == (MODEL, 1024)
    assert "sekret" not in (out / "soak.json").read_text() + (out / "soak.md").read_text()
    assert [row["index"] for row in report["intervals"]] == [0, 1, 2, 3]
    totals = report["totals"]
    assert totals["num_sent"] == sum(totals["outcomes"].values()) > 0
    assert all(totals["by_kind"][kind]["ok"] + totals["by_kind"][kind]["hung_up"] + totals["by_kind"][kind]["rejected"]
               > 0 for kind in KINDS), totals["by_kind"]  # every kind ran and got its answer at least once
    for row in report["intervals"]:
        assert row["rss_mib"] > 0 and row["num_fds"] > 0 and row["gpu_mib"] is None
        assert set(row["kv"]) == {"cpu0", "cpu1"}
        roles = row["rss_mib_by_process"]
        assert {"serve", "ray::BackendActor", "ray::BackendActor#2", "ray::RouterActor"} <= set(roles)
    assert report["server"]["stop"]["clean"], report["server"]["stop"]
    assert (out / "soak.md").read_text().count("| lost | yes |") == 1
    assert (out / "soak.png").stat().st_size > 0


def test_backend_pids_come_from_the_ready_lines_the_latest_winning():
    log = "\n".join([
        "(BackendActor pid=840) backend cpu0: device cpu (configured cpu), dtype float32, ...",
        "(BackendActor pid=841) backend cuda0: device cuda (configured cuda), dtype bfloat16, ...",
        "(BackendActor pid=840) cpu engine: float32, kernels auto",
        "(RouterActor pid=846) router: backend cpu0 (cpu, instance ad3d1ae9e6ef) joined routing",
        "\x1b[36m(BackendActor pid=851)\x1b[0m backend cpu0: device cpu (configured cpu), ...",  # restarted
    ])
    assert soak_probe.backend_pids(log) == {"cpu0": 851, "cuda0": 841}
    assert soak_probe.backend_pids("") == {}
