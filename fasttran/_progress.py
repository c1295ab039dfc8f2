"""Progress bars: tqdm's notebook widget inside a Jupyter kernel that has ipywidgets, plain
text everywhere else (tqdm.auto would warn "IProgress not found" in a kernel without
ipywidgets; the text bar works there too).

Only rank 0 of a process group shows progress (fasttran.distributed.is_main: not a collective).
Where the text goes to something other than a terminal (a log file, torchrun's captured output,
CI), a bar writes plain lines instead of carriage-return redraws: at most one every
`log_interval()` seconds (FASTTRAN_PROGRESS_INTERVAL, default 10), and its last state when it
closes."""
import os
import re
import sys

_CLS = None
LOG_INTERVAL = 10.0


def _in_notebook():
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    try:
        shell = ip.get_ipython()
    except Exception:   # pragma: no cover - an unusual IPython
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def bar_class():
    """The tqdm class to use here (the widget one needs a kernel and ipywidgets)."""
    global _CLS
    if _CLS is None:
        from tqdm.std import tqdm as text
        cls = text
        if _in_notebook():
            try:
                import ipywidgets  # noqa: F401
                from tqdm.notebook import tqdm as widget
                cls = widget
            except ImportError:
                pass
        _CLS = cls
    return _CLS


def log_interval():
    """Seconds between the lines of a bar written to a file or pipe."""
    v = os.environ.get("FASTTRAN_PROGRESS_INTERVAL", "").strip()
    try:
        return max(0.0, float(v)) if v else LOG_INTERVAL
    except ValueError:
        return LOG_INTERVAL


class _Lines:
    """A stream for tqdm that turns its redraws ("\\r" + status) into whole lines, skipping
    blank ones (a bar cleared on close) and repeats of the line just written."""

    def __init__(self, f):
        self._f, self._buf, self._last = f, "", None

    def write(self, s):
        self._buf += s

    def flush(self):
        parts, self._buf = re.split(r"[\r\n]", self._buf), ""
        for p in parts:
            p = p.rstrip()
            if p and p != self._last:
                self._f.write(p + "\n")
                self._last = p
        self._f.flush()


def _is_terminal(f):
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def progress(iterable=None, **kw):
    """tqdm(iterable, **kw) of the right kind; text bars go to stderr. Disabled on ranks other
    than 0; lines at most every log_interval() seconds where the output is not a terminal."""
    from .distributed import is_main
    if not is_main():
        kw["disable"] = True
    cls = bar_class()
    if cls.__module__ == "tqdm.std":
        f = kw.setdefault("file", sys.stderr)
        if _is_terminal(f):
            kw.setdefault("dynamic_ncols", True)
        else:
            kw["file"] = _Lines(f)
            every = log_interval()
            kw["mininterval"] = max(kw.get("mininterval", 0.1), every)
            kw["maxinterval"] = max(kw.get("maxinterval", 10.0), kw["mininterval"])
    return cls(iterable, **kw)
