"""One LAMB step over BERT-base and BERT-large sized parameter lists (the shapes of
transformers' BertModel, 199 / 391 tensors): fasttran's fused LAMB against a torch._foreach LAMB
(benchmarks/torch_lamb.py) and timm.optim.Lamb, all in this run on this machine, and the
achieved bandwidth against the machine's copy bandwidth (np.copyto on 1 GiB, same run).

Bytes per step: the minimum any LAMB must move, read g, w, m, v and write w, m, v = 28 bytes per
parameter. The copy bandwidth is the faster of NumPy's single-threaded copy and torch's
multi-threaded copy_ of 1 GiB. fasttran's CPU kernel actually moves more (pass 1 reads g again for the global norm;
pass 3 re-reads m, v, w, mostly from the last-level cache): the GB/s below count only the 28.
Run: pytest benchmarks/test_lamb_step.py -s  (writes benchmarks/last_lamb_run.json)"""
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
import pytest

import fasttran
from fasttran.optim import LAMB

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timm_shim import timm_lamb  # noqa: E402
from torch_lamb import ForeachLAMB, param_groups  # noqa: E402

SIZES = {"bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
         "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)}
OUT = {}


def shapes(cfg):
    with torch.device("meta"):
        model = transformers.BertModel(transformers.BertConfig(**cfg))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def timed(fn, reps):
    fn()                                  # warm-up (first touch of the state)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def copy_bandwidth():
    """Bytes read + written per second by the best plain copy of 1 GiB on this machine: NumPy's
    (one thread) or torch's copy_ (all threads), whichever is faster."""
    a = np.ones(1 << 28, np.float32)
    b = np.empty_like(a)
    t_np = timed(lambda: np.copyto(b, a), 5)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    t_pt = timed(lambda: tb.copy_(ta), 5)
    return 2 * a.nbytes / min(t_np, t_pt) / 1e9


@pytest.mark.parametrize("size", list(SIZES))
def test_lamb_step(size):
    reps = 5
    named = shapes(SIZES[size])
    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal(s).astype(np.float32) * 0.02 for n, s in named}
    g = [rng.standard_normal(s).astype(np.float32) * 1e-3 for _, s in named]
    n_params = sum(x.size for x in w.values())
    bytes_min = 28 * n_params
    res = {"tensors": len(named), "parameters": n_params, "bytes_per_step": bytes_min}
    res["copy_GBps"] = copy_bandwidth()

    # fasttran: pure LAMB (no clipping, no finiteness pass), and the Trainer's default (clip 1.0 + check)
    for label, kw in (("fasttran", dict(max_grad_norm=None, check_finite=False)),
                      ("fasttran_clip", dict(max_grad_norm=1.0, check_finite=True))):
        opt = LAMB(list(w.items()), lr=1e-3, weight_decay=0.01, **kw)
        t = timed(lambda: opt.step(g), reps)
        res[label] = {"seconds": t, "GBps": bytes_min / t / 1e9}
        del opt

    # torch: parameters are the same memory (from_numpy), gradients attached once
    tp = {n: torch.from_numpy(x) for n, x in w.items()}
    for p, gg in zip(tp.values(), g):
        p.grad = torch.from_numpy(gg)
    for label, make in (("torch_foreach", lambda: ForeachLAMB(param_groups(tp.items(), 0.01), lr=1e-3,
                                                                  max_grad_norm=None)),
                        ("torch_foreach_clip", lambda: ForeachLAMB(param_groups(tp.items(), 0.01), lr=1e-3,
                                                                       max_grad_norm=1.0))):
        opt = make()
        t = timed(opt.step, reps)
        res[label] = {"seconds": t, "GBps": bytes_min / t / 1e9}
        del opt
    Lamb = timm_lamb()
    if Lamb is not None:
        opt = Lamb(param_groups(tp.items(), 0.01), lr=1e-3, max_grad_norm=1.0)
        t = timed(opt.step, reps)
        res["timm_clip"] = {"seconds": t, "GBps": bytes_min / t / 1e9}
        del opt
    else:
        res["timm_clip"] = None
    res["speedup_vs_torch_foreach"] = res["torch_foreach"]["seconds"] / res["fasttran"]["seconds"]
    res["speedup_vs_torch_foreach_clip"] = res["torch_foreach_clip"]["seconds"] / res["fasttran_clip"]["seconds"]
    if res["timm_clip"]:
        res["speedup_vs_timm_clip"] = res["timm_clip"]["seconds"] / res["fasttran_clip"]["seconds"]
    res["fraction_of_copy_bandwidth"] = res["fasttran"]["GBps"] / res["copy_GBps"]
    OUT[size] = res
    print(f"\n{size}: {len(named)} tensors, {n_params / 1e6:.1f} M parameters, copy {res['copy_GBps']:.1f} GB/s")
    for k in ("fasttran", "fasttran_clip", "torch_foreach", "torch_foreach_clip", "timm_clip"):
        if res.get(k):
            print(f"  {k:20s} {1e3 * res[k]['seconds']:8.1f} ms  {res[k]['GBps']:6.1f} GB/s")
    print(f"  fused LAMB = {100 * res['fraction_of_copy_bandwidth']:.0f}% of copy bandwidth; "
          f"{res['speedup_vs_torch_foreach']:.2f}x torch._foreach, {res['speedup_vs_torch_foreach_clip']:.2f}x "
          f"with clipping" + (f", {res['speedup_vs_timm_clip']:.2f}x timm" if res["timm_clip"] else ""))
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": fasttran.get_num_threads(), "torch_threads": torch.get_num_threads(),
            "fasttran": fasttran.__version__, "torch": torch.__version__, "numpy": np.__version__}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_lamb_run.json"), "w") as f:
        json.dump({"meta": meta, "results": OUT}, f, indent=1)
