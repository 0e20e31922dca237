"""`tandem serve` as a user runs it: a subprocess that profiles on first start, prints its
URLs and nothing alarming, answers HTTP, and stops cleanly on Ctrl-C (SIGINT); and a port
already in use, answered before Ray starts with one line naming the flag; and its --help, one
screen that points to docs/config.md, where every setting is described, with the README naming
each flag under the help that shows it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.cluster.conftest import TIMEOUT_S, free_port, start_serve

# Lines a healthy start used to print: Ray's token-auth notice, an error-level core_worker line
# about actor restarts, and Serve's "New http_options ... will not be applied".
ALARMING = ("Token authentication", "core_worker.cc", "will not be applied", "Traceback", "ERROR")


@pytest.mark.slow
def test_serve_cli_profiles_serves_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("TANDEM_CACHE_DIR", None)  # it would win over XDG_CACHE_HOME
    command = [sys.executable, "-m", "tandem.cluster.cli", "serve", "--model", "tiny-llama-random", "--backends", "cpu,auto",
               "--cpu-threads", "1", "--port", str(port), "--metrics-port", str(free_port()),
               "--routing-log", str(tmp_path / "routing.jsonl")]
    proc, seen = start_serve(command, env)
    try:
        output = "".join(seen)
        assert "profiling backend cpu0" in output and "rates for cpu1: the same device" in output  # one profile
        assert "auto -> cpu" in output and f"http://127.0.0.1:{port}/v1" in output
        assert f"routing log {tmp_path / 'routing.jsonl'}" in output
        assert f"cache       {tmp_path / 'cache' / 'tandem'}" in output
        assert [line for line in seen if any(word in line for word in ALARMING)] == []
        # Counted nouns agree with their numbers, and a pipe gets no colour codes.
        assert "cpu0: cpu (configured cpu), 1 thread, max_active 4" in output and "1 threads" not in output
        assert re.search(r"HTTP: (1 ingress replica|[2-9] ingress replicas), ", output), output
        assert "\x1b[" not in output
        body = {"model": "tiny-llama-random", "prompt": "hello", "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            returncode = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert returncode == 0
    from tandem.cluster.profile import profile_key

    cache_file = tmp_path / "cache" / "tandem" / "rates-cache.json"
    if "not stored in the profile cache" in output:  # busy cores: a noisy profile serves this run only
        assert not cache_file.exists()
    else:
        # keyed by the kernels `auto` ran in the server, as its ready line says (resolving `auto`
        # again here can differ: the ggml op library may finish building between the two)
        ran = re.search(r"backend cpu0 ready: cpu, float32, (\S+) kernels", output)
        assert ran is not None, output
        assert list(json.loads(cache_file.read_text())) == [
            profile_key("tiny-llama-random", "cpu", "float32", 1, 4, cpu_kernels=ran.group(1))]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_is_named_with_its_flag_before_ray_starts(flag, tmp_path):
    ports = {"--port": free_port(), "--metrics-port": free_port()}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[flag]))
        holder.listen()
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        command = [sys.executable, "-m", "tandem.cluster.cli", "serve", "--model", "tiny-llama-random",
                   "--port", str(ports["--port"]), "--metrics-port", str(ports["--metrics-port"])]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: port {ports[flag]} on 127.0.0.1 ({flag}) is already in use; stop what holds it or choose "
        f"another with {flag} N"]
    assert "backend cpu0" not in result.stdout  # stopped before Ray and the backends


def test_serve_help_fits_one_screen(monkeypatch, capsys):
    """One line per flag where it fits, on an 80-column terminal; the advanced flags show under
    --help-all, and the details live in docs/config.md, which the help names."""
    from tandem.cluster.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    helps = {}
    for flag in ("--help", "--help-all"):
        with pytest.raises(SystemExit) as exited:
            main(["serve", flag])
        assert exited.value.code == 0
        helps[flag] = capsys.readouterr().out
    lines = helps["--help"].splitlines()
    assert len(lines) <= 60, "\n".join(lines)
    assert "docs/config.md" in " ".join(lines[-2:]) and "--help-all" in lines[-1]
    assert "--spill-margin" not in helps["--help"] and "--spill-margin F " in helps["--help-all"]
    assert "--cpu-kernels KIND " in helps["--help-all"]


def test_the_readme_names_each_flag_where_the_help_shows_it(capsys):
    """The README's flags for `tandem serve --help` are all on that screen, and the ones it says
    `--help-all` adds are there and not on the short one."""
    from pathlib import Path

    from tandem.cluster.cli import main

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    common = readme.split("- `tandem serve --help` lists the common flags:", 1)[1]
    common, advanced = common.split("`tandem serve --help-all` adds the advanced ones", 1)
    advanced = advanced.split("\n- ", 1)[0]
    helps = {}
    for flag in ("--help", "--help-all"):
        with pytest.raises(SystemExit):
            main(["serve", flag])
        helps[flag] = set(re.findall(r"(?m)^  (--[a-z-]+)", capsys.readouterr().out))
    named = {kind: set(re.findall(r"`(--[a-z-]+)", text)) for kind, text in (("common", common), ("advanced", advanced))}
    assert len(named["common"]) >= 10 and len(named["advanced"]) >= 4, named
    assert named["common"] - helps["--help"] == set()
    assert named["advanced"] - helps["--help-all"] == set() and named["advanced"] & helps["--help"] == set()


def test_advanced_flags_work_without_being_listed():
    import argparse

    from tandem.cluster.serve_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--spill-margin", "0.1", "--device-shares"])
    assert args.spill_margin == 0.1 and args.device_shares is True


def test_docs_config_names_every_field_and_flag():
    import argparse
    from pathlib import Path

    from tandem.cluster.config import BackendConfig, TandemConfig
    from tandem.cluster.serve_cli import add_arguments

    reference = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}
    fields = set(TandemConfig.model_fields) | set(BackendConfig.model_fields)
    assert [field for field in sorted(fields) if f"`{field}`" not in reference] == []
    assert [flag for flag in sorted(flags - {"--help", "--config"}) if f"`{flag}`" not in reference] == []
