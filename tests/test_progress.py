"""Progress output: whole lines at most every log_interval() seconds where the output is not a
terminal (a log file, torchrun's captured output, CI), carriage-return redraws on a terminal,
and nothing on ranks other than 0."""
import io
import time

from fasttran import _progress
from fasttran._progress import progress


def long_loop(f, n=4000, seconds=1.5):
    for _ in progress(range(n), desc="build cache", unit="batch", file=f):
        time.sleep(seconds / n)


def test_a_log_file_gets_a_line_every_interval(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTTRAN_PROGRESS_INTERVAL", raising=False)
    assert _progress.log_interval() == 10.0
    monkeypatch.setenv("FASTTRAN_PROGRESS_INTERVAL", "0.4")
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "log.txt"
    t0 = time.monotonic()
    with open(path, "w") as f:
        long_loop(f)
    seconds = time.monotonic() - t0
    text = path.read_text()
    lines = text.splitlines()
    assert "\r" not in text and all(line.startswith("build cache:") for line in lines)
    # the first line, one per 0.4 s at most, the last: 4,000 updates give a handful of lines
    assert 3 <= len(lines) <= seconds / 0.4 + 3, lines
    assert "4000/4000" in lines[-1]


def test_a_terminal_gets_redraws_and_other_ranks_get_nothing(monkeypatch):
    monkeypatch.setenv("FASTTRAN_PROGRESS_INTERVAL", "0.4")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    long_loop(tty, seconds=0.6)
    assert tty.getvalue().count("\r") > 3
    from fasttran import distributed
    monkeypatch.setattr(distributed, "_group", None)   # no group joined in this process: RANK tells
    monkeypatch.setenv("RANK", "1")   # a worker of torchrun, before any process group exists
    quiet = io.StringIO()
    long_loop(quiet, n=100, seconds=0.1)
    assert quiet.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    shown = io.StringIO()
    long_loop(shown, n=100, seconds=0.1)
    assert "100/100" in shown.getvalue()
