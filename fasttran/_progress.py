"""Progress bars: tqdm's notebook widget inside a Jupyter kernel that has ipywidgets, plain
text everywhere else (tqdm.auto would warn "IProgress not found" in a kernel without
ipywidgets; the text bar works there too)."""
import sys

_CLS = None


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


def progress(iterable=None, **kw):
    """tqdm(iterable, **kw) of the right kind; text bars go to stderr."""
    cls = bar_class()
    if cls.__module__ == "tqdm.std":
        kw.setdefault("file", sys.stderr)
        kw.setdefault("dynamic_ncols", True)
    return cls(iterable, **kw)
