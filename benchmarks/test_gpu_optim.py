"""fasttran's fused LAMB and AdamW on the GPU against PyTorch's optimizers, same run, same
parameters (the GPU optimizers' benchmark).

Parameters: the tensors of transformers' BertModel, BERT-base (199 tensors, 109.5 M) and BERT-large
(391, 335 M), fp32 torch CUDA tensors with gradients attached once; two groups (weight decay 0.01,
none for biases and LayerNorm). Every optimizer updates torch tensors in place:
  fasttran_lamb / fasttran_adamw   fasttran.optim.LAMB / AdamW over the torch parameters (the fused
                                   multi-tensor kernels; the tensor table kept on the device)
  torch_adamw_fused                torch.optim.AdamW(fused=True)
  torch_adamw_foreach              torch.optim.AdamW(foreach=True)
  torch_lamb_foreach               benchmarks/torch_lamb.py (LAMB on torch._foreach ops)
  timm_lamb                        timm.optim.Lamb (skipped when timm is not installed; it is pure
                                   Python: carry its wheel)
Clipping off for the bandwidth figures (max_grad_norm=None, no finiteness pass), then LAMB with
clipping at 1.0 against timm's (which clips by default). Time: wall time per step, CUDA
synchronised, median of REPS after a warm-up. Bytes: 28 per parameter (read g, w, m, v; write w,
m, v), against the device's copy bandwidth (torch copy_ of 1 GiB, read + write, same run).
Bars: AdamW >= 1.0x torch fused AdamW; LAMB >= 80% of copy bandwidth; LAMB >= 3x timm.

  python3 -m pytest benchmarks/test_gpu_optim.py -s -p no:cacheprovider   # -> last_gpu_optim.json
Skipped, with the reason, where there is no GPU (the emulator is not one).
"""
import json
import os
import sys
import time

import numpy as np
import pytest

import fasttran
from fasttran.optim import LAMB, AdamW

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import needs_real_gpu  # noqa: E402
from timm_shim import timm_lamb  # noqa: E402
from torch_lamb import ForeachLAMB, param_groups  # noqa: E402

pytestmark = needs_real_gpu(torch)

REPS = int(os.environ.get("FASTTRAN_BENCH_REPS", "20"))
SIZES = {"bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
         "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)}
OUT = {}


def step_time(step, reps=REPS):
    step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def copy_bandwidth():
    a = torch.ones(1 << 28, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / step_time(lambda: b.copy_(a), 10) / 1e9


@pytest.mark.parametrize("size", list(SIZES))
def test_gpu_optim(size):
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in transformers.BertModel(transformers.BertConfig(**SIZES[size])).named_parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = {n: (torch.randn(s, device="cuda", generator=gen) * 0.02).requires_grad_() for n, s in shapes}
    for p in params.values():
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    n = sum(p.numel() for p in params.values())
    res = {"tensors": len(shapes), "parameters": n, "bytes_per_step": 28 * n, "copy_GBps": copy_bandwidth()}
    groups = lambda: param_groups(params.items(), 0.01)   # noqa: E731
    makers = {
        "fasttran_lamb": lambda: LAMB(groups(), lr=1e-3, max_grad_norm=None, check_finite=False),
        "fasttran_adamw": lambda: AdamW(groups(), lr=1e-3, max_grad_norm=None, check_finite=False),
        "torch_adamw_fused": lambda: torch.optim.AdamW(groups(), lr=1e-3, fused=True),
        "torch_adamw_foreach": lambda: torch.optim.AdamW(groups(), lr=1e-3, foreach=True),
        "torch_lamb_foreach": lambda: ForeachLAMB(groups(), lr=1e-3, max_grad_norm=None),
        "fasttran_lamb_clip": lambda: LAMB(groups(), lr=1e-3, max_grad_norm=1.0),
    }
    Lamb = timm_lamb()
    if Lamb is not None:
        makers["timm_lamb_clip"] = lambda: Lamb(groups(), lr=1e-3, max_grad_norm=1.0)
    for name, make in makers.items():
        opt = make()
        t = step_time(opt.step)
        res[name] = {"ms": 1e3 * t, "GBps": 28 * n / t / 1e9}
        del opt
    res["adamw_vs_torch_fused"] = res["torch_adamw_fused"]["ms"] / res["fasttran_adamw"]["ms"]
    res["lamb_fraction_of_copy"] = res["fasttran_lamb"]["GBps"] / res["copy_GBps"]
    if "timm_lamb_clip" in res:
        res["lamb_vs_timm"] = res["timm_lamb_clip"]["ms"] / res["fasttran_lamb_clip"]["ms"]
    OUT[size] = res
    print(f"\n{size}: {len(shapes)} tensors, {n / 1e6:.1f} M parameters, copy {res['copy_GBps']:.0f} GB/s")
    for name in makers:
        print(f"  {name:22s} {res[name]['ms']:8.3f} ms  {res[name]['GBps']:7.0f} GB/s")
    print(f"  AdamW {res['adamw_vs_torch_fused']:.2f}x torch fused; LAMB {100 * res['lamb_fraction_of_copy']:.0f}% of copy"
          + (f"; LAMB {res['lamb_vs_timm']:.1f}x timm" if "lamb_vs_timm" in res else ""))
    p = torch.cuda.get_device_properties(0)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": p.name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "fasttran": fasttran.__version__, "reps": REPS, "command": " ".join(sys.argv)}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_gpu_optim.json"), "w") as f:
        json.dump({"meta": meta, "results": OUT}, f, indent=1)
