"""Host time of one fused optimizer step: everything a step costs besides the C
kernel, for 200 parameter tensors, with torch parameters (read through .grad, in place, version
counters bumped) and with NumPy arrays (gradients passed as a list).

host overhead = step time - kernel time, where the kernel time is what the table object measured
around its one C call (ft_optim_table_step: checks, block table, the fused pass(es)), both as
wall time and as the calling thread's CPU time (time.thread_time: a shared machine's other
processes do not count; the tensors are small, so the kernel runs on the calling thread and its
CPU time is exact). The torch case gives the parameters new .grad tensors before every step (what
zero_grad(set_to_none=True) + backward does), so the step re-points every gradient.

Peers, same tensors, same run: torch.optim.AdamW with foreach=True and fused=True (their whole
step: Python bookkeeping + kernels).

Run: pytest benchmarks/test_optim_overhead.py -s   (writes benchmarks/last_optim_overhead.json)"""
import datetime
import json
import os
import platform
import time

import numpy as np
import pytest

import fasttran
from fasttran.optim import AdamW, LAMB

N_TENSORS = 200
SHAPES = [(8,), (4, 4), (16,), (2, 3, 5)]     # 200 tensors, 3,500 elements in all: kernel time small
ROUNDS, REPS = 7, 400
OUT = {}


def tensor_shapes():
    return [SHAPES[i % len(SHAPES)] for i in range(N_TENSORS)]


def measure(setup, step, table):
    """medians (us) over ROUNDS x REPS steps: step wall, step CPU, kernel wall, kernel CPU"""
    for _ in range(50):
        setup()
        step()
    rounds = []
    for _ in range(ROUNDS):
        w, c, kw, kc = [], [], [], []
        for _ in range(REPS):
            setup()
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            step()
            w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            k = table.kernel_ns if table is not None else (0, 0)
            w.append(w1 - w0)
            c.append(c1 - c0)
            kw.append(k[0])
            kc.append(k[1])
        rounds.append([np.median(x) / 1e3 for x in (w, c, kw, kc)])
    r = np.array(rounds)
    med = np.median(r, axis=0)
    host_cpu = r[:, 1] - r[:, 3]
    host_wall = r[:, 0] - r[:, 2]
    return {"step_wall_us": med[0], "step_cpu_us": med[1], "kernel_wall_us": med[2], "kernel_cpu_us": med[3],
            "host_cpu_us": float(np.median(host_cpu)), "host_wall_us": float(np.median(host_wall)),
            "host_cpu_us_min_max": [float(host_cpu.min()), float(host_cpu.max())],
            "host_wall_us_min_max": [float(host_wall.min()), float(host_wall.max())]}


@pytest.mark.parametrize("kind", ["adamw", "lamb"])
def test_host_overhead_numpy(kind):
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal(s).astype(np.float32) for s in tensor_shapes()]
    gs = [rng.standard_normal(s).astype(np.float32) * 1e-3 for s in tensor_shapes()]
    opt = (AdamW if kind == "adamw" else LAMB)(ws, lr=1e-3)
    res = measure(lambda: None, lambda: opt.step(gs), opt._table)
    OUT[f"numpy_{kind}"] = res
    report(f"NumPy arrays, {kind}", res)
    write()


@pytest.mark.parametrize("kind", ["adamw", "lamb"])
def test_host_overhead_torch(kind):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in tensor_shapes()]
    grads = [[torch.randn(s) * 1e-3 for s in tensor_shapes()] for _ in range(2)]
    flip = [0]

    def new_grads():   # fresh .grad tensors each step: every gradient address changes
        flip[0] ^= 1
        for p, g in zip(ps, grads[flip[0]]):
            p.grad = g

    opt = (AdamW if kind == "adamw" else LAMB)(ps, lr=1e-3)
    v0 = ps[0]._version
    res = measure(new_grads, opt.step, opt._table)
    assert ps[0]._version > v0    # the steps did update in place, visibly to autograd
    OUT[f"torch_{kind}"] = res
    report(f"torch parameters, {kind}", res)
    if kind == "adamw":   # peers: torch's own AdamW over the same tensors, whole step
        for label, kw in (("torch_adamw_foreach", dict(foreach=True)), ("torch_adamw_fused", dict(fused=True))):
            topt = torch.optim.AdamW(ps, lr=1e-3, **kw)
            r = measure(new_grads, topt.step, None)
            OUT[label] = {"step_wall_us": r["step_wall_us"], "step_cpu_us": r["step_cpu_us"]}
            print(f"  {label:22s} step {r['step_wall_us']:8.1f} us wall, {r['step_cpu_us']:8.1f} us CPU "
                  f"(fasttran AdamW: {res['step_cpu_us'] / r['step_cpu_us']:.3f}x its CPU time)")
    write()


def report(label, r):
    print(f"\n{label}, {N_TENSORS} tensors: step {r['step_wall_us']:.1f} us wall / {r['step_cpu_us']:.1f} us CPU; "
          f"kernel {r['kernel_wall_us']:.1f} / {r['kernel_cpu_us']:.1f} us; host overhead "
          f"{r['host_wall_us']:.1f} us wall (rounds {r['host_wall_us_min_max'][0]:.1f}-{r['host_wall_us_min_max'][1]:.1f}), "
          f"{r['host_cpu_us']:.1f} us CPU (rounds {r['host_cpu_us_min_max'][0]:.1f}-{r['host_cpu_us_min_max'][1]:.1f}); "
          f"bar <= 50 us: {'met' if r['host_cpu_us'] <= 50 else 'NOT met'}")


def write():
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": fasttran.get_num_threads(), "fasttran": fasttran.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "tensors": N_TENSORS,
            "elements": int(sum(np.prod(s) for s in tensor_shapes())), "rounds": ROUNDS, "reps": REPS}
    try:
        import torch
        meta.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_optim_overhead.json"), "w") as f:
        json.dump({"meta": meta, "results": OUT}, f, indent=1, default=float)
