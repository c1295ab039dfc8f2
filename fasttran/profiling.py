"""Where the time goes: per backend op kind (GEMM, attention, row ops, optimizer, cache reads,
host<->device copies), measured by timing wrappers around every op of the backend table
(csrc/core/profile.c) -- CLOCK_MONOTONIC on the CPU, CUDA events on the backend's stream on a
GPU -- against the wall time of the same work. What no op accounts for (Python, the binding,
input checks, idle device time) is the "other" column: wall - sum of the ops.

    >>> p = fasttran.profile(enc.forward, ids, mask)           # one phase, returns a Profile
    >>> print(p)                                               # the table
    >>> p.plot()                                               # stacked bars (matplotlib)
    >>> tr.profile(cache, labels, steps=20)                    # forward, training step, epoch

Profiles are for one thread of work at a time: the Trainer's profile reads its batches on the
calling thread, so the op times add up to at most the wall time.
"""
import contextlib
import html
import time

from . import _C
from .device import parse_device
from .errors import InputError, MissingDependencyError

KINDS = tuple(_C.profile_kinds())   # ('gemm', 'attention', 'row ops', 'optimizer', 'cache read', 'copy')


class Phase:
    """One measured phase: wall seconds, seconds per op kind and per op, divided by `per`
    (e.g. the number of steps measured) so a phase reads as one unit of work."""

    def __init__(self, name, wall, stats, per=1, device="cpu"):
        self.name, self.per, self.device = name, int(per), device
        self.wall = wall / self.per
        use_device = parse_device(device).is_cuda
        self.ops = {}
        self.kinds = {k: 0.0 for k in KINDS}
        for name_, kind, calls, host_s, dev_s, _args in stats:
            if not calls:
                continue
            t = (dev_s if use_device else host_s) / self.per
            self.ops[name_] = {"kind": kind, "calls": calls / self.per, "seconds": t,
                               "host_seconds": host_s / self.per}
            self.kinds[kind] += t

    @property
    def attributed(self):
        """Seconds the backend ops account for."""
        return sum(self.kinds.values())

    @property
    def other(self):
        """Wall time no op accounts for (Python, binding, checks; on a GPU also idle time)."""
        return self.wall - self.attributed

    @property
    def coverage(self):
        return self.attributed / self.wall if self.wall > 0 else 0.0

    def shares(self):
        """{kind: fraction of the wall time}, with "other"."""
        w = self.wall if self.wall > 0 else 1.0
        out = {k: v / w for k, v in self.kinds.items()}
        out["other"] = self.other / w
        return out

    def to_dict(self):
        return {"name": self.name, "per": self.per, "device": self.device, "wall_seconds": self.wall,
                "kinds": dict(self.kinds), "other_seconds": self.other, "ops": self.ops}


def _fmt_s(s):
    if abs(s) >= 1:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


class Profile:
    """A list of phases, each with its time per op kind. Print it for the table; plot() for
    stacked bars; to_dict() for the numbers."""

    def __init__(self, title=None):
        self.title = title
        self.phases = []
        self.result = None

    @contextlib.contextmanager
    def phase(self, name, per=1, device="cpu"):
        """Measure the block as phase `name` (times divided by `per`)."""
        if _C.profile_enabled():
            raise InputError("a profile is already being measured (profiles do not nest)")
        _C.profile_start()   # (the encoder's forward and the optimizer step return with their work done)
        t0 = time.perf_counter()
        try:
            yield self
        finally:
            wall = time.perf_counter() - t0
            _C.profile_stop()
        self.phases.append(Phase(name, wall, _C.profile_stats(), per=per, device=device))

    def __getitem__(self, name):
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(name)

    def kinds_used(self):
        return [k for k in KINDS if any(p.kinds[k] > 0 for p in self.phases)]

    def table(self):
        """The breakdown as text: per phase, wall time, then each kind's share of it."""
        kinds = self.kinds_used()
        cols = ["phase", "wall"] + list(kinds) + ["other", "ops cover"]
        rows = []
        for p in self.phases:
            sh = p.shares()
            label = p.name + (f" (mean of {p.per})" if p.per > 1 else "")
            rows.append([label, _fmt_s(p.wall)] + [f"{100 * sh[k]:.1f}%" for k in kinds]
                        + [f"{100 * sh['other']:.1f}%", f"{100 * p.coverage:.1f}%"])
        widths = [max(len(str(r[i])) for r in [cols] + rows) for i in range(len(cols))]
        line = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        out = [self.title] if self.title else []
        out += [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
        dev = {p.device for p in self.phases}
        out.append("times: " + ("CUDA events on the device" if dev - {"cpu"} else "host wall clock") +
                   "; 'other' = wall - ops (Python, binding, checks)")
        return "\n".join(out)

    def ops_table(self, phase=None):
        """Per-op detail of one phase (default: the last)."""
        p = self.phases[-1] if phase is None else self[phase]
        rows = sorted(p.ops.items(), key=lambda kv: -kv[1]["seconds"])
        out = [f"{p.name}: {_fmt_s(p.wall)} wall", f"{'op':<26} {'kind':<11} {'calls':>8} {'time':>10} {'share':>7}"]
        for name, o in rows:
            out.append(f"{name:<26} {o['kind']:<11} {o['calls']:>8.1f} {_fmt_s(o['seconds']):>10} "
                       f"{100 * o['seconds'] / p.wall if p.wall else 0:>6.1f}%")
        return "\n".join(out)

    def __str__(self):
        return self.table()

    def __repr__(self):
        return self.table()

    def _repr_html_(self):
        kinds = self.kinds_used()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in ["phase", "wall"] + kinds + ["other"])
        body = ""
        for p in self.phases:
            sh = p.shares()
            body += (f"<tr><td>{html.escape(p.name)}</td><td>{_fmt_s(p.wall)}</td>" +
                     "".join(f"<td>{100 * sh[k]:.1f}%</td>" for k in kinds) + f"<td>{100 * sh['other']:.1f}%</td></tr>")
        title = f"<b>{html.escape(self.title)}</b>" if self.title else ""
        return f"{title}<table><tr>{head}</tr>{body}</table>"

    def to_dict(self):
        return {"title": self.title, "phases": [p.to_dict() for p in self.phases]}

    def plot(self, ax=None, normalize=True):
        """Stacked bars, one per phase: each kind's share of the wall time (normalize=True) or
        seconds. Needs matplotlib. Returns the matplotlib Axes."""
        plt = _pyplot()
        if ax is None:
            _, ax = plt.subplots(figsize=(1.6 + 1.4 * len(self.phases), 4))
        kinds = self.kinds_used() + ["other"]
        names = [p.name for p in self.phases]
        bottom = [0.0] * len(self.phases)
        for k in kinds:
            vals = []
            for p in self.phases:
                v = p.shares()[k] if normalize else (p.other if k == "other" else p.kinds[k])
                vals.append(max(v * (100 if normalize else 1), 0.0))
            ax.bar(names, vals, bottom=bottom, label=k)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, p in enumerate(self.phases):
            ax.text(i, bottom[i], _fmt_s(p.wall), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("share of wall time (%)" if normalize else "seconds")
        if self.title:
            ax.set_title(self.title)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
        return ax


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("plotting needs matplotlib: pip install matplotlib "
                                     "(or pip install 'fasttran[plot]')") from None
    return plt


def profile(fn, *args, name=None, repeat=1, device=None, **kwargs):
    """Run fn(*args, **kwargs) `repeat` times under the backend profiler; returns a Profile
    with one phase (times per call) and fn's last result in `.result`."""
    if not callable(fn):
        raise InputError(f"profile() takes a function to run, got {type(fn).__name__}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise InputError(f"repeat must be a positive int, got {repeat!r}")
    if device is None:
        owner = getattr(fn, "__self__", None)
        device = getattr(owner, "device", "cpu") if isinstance(getattr(owner, "device", None), str) else "cpu"
    prof = Profile()
    with prof.phase(name or getattr(fn, "__name__", "call"), per=repeat, device=device):
        for _ in range(repeat):
            prof.result = fn(*args, **kwargs)
    return prof
