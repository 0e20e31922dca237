"""Progress bars written to a file or a pipe (a backend actor's stderr, `tandem serve > log`)
come out as plain lines: no carriage returns, no escape codes, no bar drawing
(engine/progress.py); Ray's coloured worker prefix is off when the console is not a terminal,
for `tandem` and the Python driver alike (cluster/launcher.py's `ray_env_defaults`)."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm
from tqdm.auto import tqdm as auto_tqdm

from tandem.engine.progress import PlainLines, plain_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_written_to_a_file_is_plain_lines(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with plain_progress(interval_s=0.0):
        for _ in auto_tqdm(range(50), desc="Converting", mininterval=0):  # transformers' GGUF bar
            pass
        for _ in tqdm(range(5), desc="Loading weights", leave=False, mininterval=0):
            pass
        with tqdm(total=3, desc="outer", position=0, mininterval=0) as outer:  # nested: tqdm moves the cursor
            for _ in tqdm(range(3), desc="inner", position=1, mininterval=0):
                outer.update()
        print("a log line", file=sys.stderr)
    text = log.getvalue()
    assert "\x1b[" not in text and "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("Converting:   0% 0/50 [") and any(line.startswith("Converting: 100% 50/50 [")
                                                                for line in lines)
    assert not any(char in text for char in "|█▏▌"), text  # no bar drawing: the percentage says it
    assert any(line.startswith("Loading weights: 100%") for line in lines)  # a bar that clears itself
    assert any(line.startswith("inner: 100%") for line in lines) and lines[-1] == "a log line"
    assert all(line.strip() for line in lines)
    assert sys.stderr is log  # restored


def test_an_ascii_bar_and_a_bar_with_no_total_are_plain_too():
    out = io.StringIO()
    plain = PlainLines(out, interval_s=0.0)
    for _ in tqdm(range(20), desc="ascii", ascii=True, file=plain, mininterval=0):
        pass
    for _ in tqdm(iter(range(3)), desc="no total", file=plain, mininterval=0):
        pass
    plain.finish()
    lines = out.getvalue().splitlines()
    assert any(line.startswith("ascii:  50% 10/20 [") for line in lines), lines
    assert lines[-1].startswith("no total: 3it [") and not any("|" in line or "#" in line for line in lines), lines


def test_redraws_are_thinned_to_one_line_per_interval_and_the_last():
    now = [0.0]
    out = io.StringIO()
    plain = PlainLines(out, interval_s=5.0, clock=lambda: now[0])
    bar = tqdm(total=100, desc="bar", file=plain, mininterval=0, miniters=1)
    for _ in range(100):
        now[0] += 0.1  # 10 s in all
        bar.update()
    bar.close()
    plain.finish()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("bar:   0%") and lines[-1].startswith("bar: 100%")
    assert 3 <= len(lines) <= 4, lines  # 0%, about 50%, (100% at 10 s), the final 100% once


def test_on_a_terminal_nothing_changes(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with plain_progress():
        assert sys.stderr is terminal
        for _ in tqdm(range(3), desc="bar"):
            pass
    assert "\r" in terminal.getvalue()  # tqdm's own redraws


def test_a_kept_redraw_and_unterminated_text_are_written_at_the_end():
    out = io.StringIO()
    plain = PlainLines(out, interval_s=60.0, clock=lambda: 0.0)
    plain.write("\rbar: 0%")
    plain.write("\rbar: 50%")
    plain.write("\rbar: 60%\x1b[A\r")  # a bar left where it stopped
    plain.finish()
    assert out.getvalue() == "bar: 0%\nbar: 60%\n"
    out = io.StringIO()
    plain = PlainLines(out)
    plain.write("no newline")
    plain.finish()
    assert out.getvalue() == "no newline\n"


def test_a_gguf_conversion_shows_its_bars_as_lines(monkeypatch, tmp_path):
    from tandem.engine.model import loader

    def fake_convert(gguf_path, out_dir):
        for _ in tqdm(range(10), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        (out_dir / "model.safetensors").write_text("")

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    loader._ensure_converted(tmp_path / "model.gguf", tmp_path / "converted")
    assert "Converting and de-quantizing GGUF tensors...: 100% 10/10 [" in log.getvalue()
    assert "\r" not in log.getvalue() and "\x1b[" not in log.getvalue()


def test_rays_coloured_prefix_is_off_unless_the_console_is_a_terminal(monkeypatch):
    from tandem.cluster.launcher import plain_worker_log_prefix

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    plain_worker_log_prefix((Terminal(), Terminal()))
    assert "RAY_COLOR_PREFIX" not in __import__("os").environ
    plain_worker_log_prefix((Terminal(), io.StringIO()))
    assert __import__("os").environ["RAY_COLOR_PREFIX"] == "0"
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # the user's choice stands
    plain_worker_log_prefix((io.StringIO(), io.StringIO()))
    assert __import__("os").environ["RAY_COLOR_PREFIX"] == "1"
