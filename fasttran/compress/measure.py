"""What a compressed model costs: CPU latency at a batch size (wall time of the encoder and the head
on real examples, median of repeats), size (bytes of its weights as stored), and the Pareto-optimal
points of a trade-off with the plot of accuracy against latency and size."""
import time

import numpy as np

from .. import get_num_threads, set_num_threads


def latency(model, data, batch_size, threads=2, examples=64, repeats=3):
    """Milliseconds per batch of `batch_size` examples of `data` (in their own order, so batches are
    mixed lengths as a server sees them, each padded to its longest), median of `repeats` passes over
    the first `examples` examples (at least one batch), with `threads` threads; one pass warms up."""
    n = min(len(data), max(int(examples), int(batch_size)))
    old = get_num_threads()
    set_num_threads(int(threads))
    try:
        batches = []
        for k in range(0, n - batch_size + 1, batch_size):
            idx = np.arange(k, k + batch_size)
            T = int(data.lengths[idx].max())
            mask = (np.arange(T)[None, :] < data.lengths[idx][:, None]).astype(np.int64)
            batches.append((data.ids[idx, :T], mask, data.types[idx, :T]))
        times = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            for ids, mask, types in batches:
                model.head.step(model.pooled(ids, mask, types))
            if r:
                times.append((time.perf_counter() - t) / len(batches))
        return 1000.0 * float(np.median(times))
    finally:
        set_num_threads(old)


def pareto(points, keys=(("accuracy", 1), ("latency_ms", -1), ("size_bytes", -1))):
    """Indices of the points no other point beats on every key (+1: higher is better, -1: lower)
    and strictly on one; points missing a key are left out."""
    pts = [(i, p) for i, p in enumerate(points) if all(p.get(k) is not None for k, _ in keys)]
    out = []
    for i, p in pts:
        dominated = any(all(s * q[k] >= s * p[k] for k, s in keys) and any(s * q[k] > s * p[k] for k, s in keys)
                        for j, q in pts if j != i)
        if not dominated:
            out.append(i)
    return out


def plot_tradeoff(points, path=None, title=None, baseline=None):
    """Accuracy against latency and against size (two panels); Pareto-optimal points filled and joined,
    the others hollow, each labelled by its stage. Returns the matplotlib figure (saved to `path`)."""
    try:
        import matplotlib
        if path:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..errors import MissingDependencyError
        raise MissingDependencyError("the plot needs matplotlib: pip install 'fasttran[plot]'") from None
    front = set(pareto(points))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label, scale in ((axes[0], "latency_ms", "latency (ms per batch)", 1.0),
                                  (axes[1], "size_bytes", "size (MB)", 1e-6)):
        pts = [(i, p) for i, p in enumerate(points) if p.get(key) is not None and p.get("accuracy") is not None]
        stages = sorted({p.get("stage", "") for _, p in pts})
        colors = {s: plt.cm.tab10(k % 10) for k, s in enumerate(stages)}
        for i, p in pts:
            on = i in front
            ax.scatter(p[key] * scale, 100 * p["accuracy"], s=46 if on else 30, edgecolors=colors[p.get("stage", "")],
                       facecolors=colors[p.get("stage", "")] if on else "none", zorder=3)
        fr = sorted(((p[key] * scale, 100 * p["accuracy"]) for i, p in pts if i in front))
        if fr:
            ax.plot(*zip(*fr), color="0.3", lw=1, zorder=2, label="Pareto-optimal (filled)")
        for s in stages:
            ax.scatter([], [], color=colors[s], label=s or "point")
        if baseline is not None:
            ax.axhline(100 * baseline, color="0.6", ls="--", lw=0.8, label="fine-tuned model")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
