"""The Python driver ends cleanly: `Tandem.shutdown()` cancels the tasks left on the driver's
event loop (each backend channel's reader, the router wire's reader) and lets them close their
sockets, so the interpreter's exit prints no "Task was destroyed but it is pending!"; and what
it prints to a file or pipe carries no colour codes (Ray's worker prefix is plain there), and
one thread is "1 thread"."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.cluster.driver_loop import DriverLoop


def test_close_cancels_the_readers_left_on_the_loop_and_lets_them_clean_up(caplog):
    driver = DriverLoop()
    cleaned = []

    async def reader(name: str) -> None:  # like Channel._read: lives past every request
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(name)

    async def open_readers() -> None:
        loop = asyncio.get_running_loop()
        readers.extend([loop.create_task(reader("channel")), loop.create_task(reader("wire"))])

    readers: list[asyncio.Task] = []
    driver.run(open_readers())
    assert driver.run(asyncio.sleep(0, result=42)) == 42
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        driver.close()
        loop = driver.loop
        del driver, readers
        gc.collect()
    assert sorted(cleaned) == ["channel", "wire"]
    assert loop.is_closed()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


def test_close_is_idempotent_and_a_closed_loop_reports_it():
    driver = DriverLoop()
    driver.close()
    assert driver.closed
    driver.close()


SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    from tandem import cluster
    from tandem.engine.sampling_params import SamplingParams

    rates = pathlib.Path(sys.argv[1]) / "rates.json"
    rates.write_text(json.dumps({"cpu": {"prefill_tok_s": 200.0, "decode_tok_s": 15.0}}))
    tandem = cluster.start(model="tiny-llama-random", backends=["cpu", "cpu"], cpu_threads=1, max_active=1,
                           serve_http=False, rates=str(rates), profile="never", metrics_port=0,
                           warmup_tokens=0)
    for _ in range(2):  # both backends' channels are opened, one per request or both on one
        outs = list(tandem.generate(list(range(10, 30)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    print("RESULT " + json.dumps({"tokens": sum(len(o.new_token_ids) for o in outs)}), flush=True)
    tandem.shutdown()
""")


@pytest.mark.slow
def test_the_readme_driver_exits_without_pending_tasks_or_colour_codes(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("RAY_COLOR_PREFIX", None)
    env.pop("TANDEM_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, output[-4000:]
    assert json.loads(lines[0].removeprefix("RESULT ")) == {"tokens": 4}
    assert "(BackendActor pid=" in output  # the backends' own lines reached this console...
    assert "\x1b[" not in output, output[-4000:]  # ...with a plain prefix
    assert "backend cpu0: cpu (configured cpu), 1 thread, max_active 1" in output and "1 threads" not in output
    assert "Task was destroyed" not in output and "Task exception was never retrieved" not in output, output[-4000:]
