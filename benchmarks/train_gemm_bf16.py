"""The products of a layer's training step in bf16 on the CPU (the backend's `gemm_prec` with bf16
products: inputs rounded to bf16, float32 sums; vdpbf16ps, or AMX's bf16 term) against float32
(`gemm`) and against torch's bf16 matmul (oneDNN) on the same operands, in one process: MiniLM's
projections (C 384, I 1536) at a short-sentence batch (32 x 11.3 tokens = 362 rows, CoLA's mean)
and at 32 x 128 = 4,096 rows, each as the step runs it -- forward (x W^T), the input's gradient
(dY W) and the weights' gradient (dY^T x, accumulated: beta = 1).

    python benchmarks/train_gemm_bf16.py [--rows 362 4096] [--threads 1]

Best of 7 rounds of 5 calls, the engines interleaved. GFLOP/s count 2 M N K. torch's row: its
bf16 tensors made once outside the timing (fasttran rounds float32 operands inside each call, as
the layer stack hands them over), and its weight gradient without the accumulation. Writes
benchmarks/last_train_gemm_bf16.json (machine, load, versions, commit)."""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def shapes(rows, C=384, inter=1536):
    """(name, trans_a, trans_b, M, N, K, beta) of one layer's products at `rows` tokens"""
    out = []
    for name, n_out, n_in in (("qkv", 3 * C, C), ("out", C, C), ("ffn1", inter, C), ("ffn2", C, inter)):
        out += [(f"{name} forward", 0, 1, rows, n_out, n_in, 0.0),
                (f"{name} dX", 0, 0, rows, n_in, n_out, 0.0),
                (f"{name} dW", 1, 0, n_out, n_in, rows, 1.0)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[362, 4096])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch
    import fasttran
    import test_backend_ops as T
    fasttran.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    if not fasttran._C.cpu_lowp_kernels()[2]:
        sys.exit("this CPU has no bf16 products (AVX512_BF16 or AMX): nothing to measure")
    be = T.Backend(-1)
    rng = np.random.default_rng(0)
    results = []
    for rows in args.rows:
        for name, ta, tb, M, N, K, beta in shapes(rows):
            a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            pa, pb, pc = be.upload(a), be.upload(b), be.alloc(M * N * 4)
            common = (ta, tb, M, N, K, 1.0, pa, a.shape[1], pb, b.shape[1], beta, pc, N)
            ta_, tb_ = torch.from_numpy(a).bfloat16(), torch.from_numpy(b).bfloat16()
            opa = ta_.t() if ta else ta_
            opb = tb_.t() if tb else tb_
            calls = {"fasttran bf16": lambda: be.fn["gemm_prec"](be.addr, 2, *common),
                     "fasttran fp32": lambda: be.fn["gemm"](be.addr, *common),
                     "torch bf16": lambda: torch.matmul(opa, opb)}
            best = {n: float("inf") for n in calls}
            for r in range(7):
                names = list(calls)[r % 3:] + list(calls)[:r % 3]
                for n in names:
                    calls[n]()
                    t0 = time.perf_counter()
                    for _ in range(5):
                        calls[n]()
                    best[n] = min(best[n], (time.perf_counter() - t0) / 5)
            fl = 2.0 * M * N * K
            row = {"rows": rows, "product": name, "M": M, "N": N, "K": K, "beta": beta,
                   "seconds": best, "gflops": {n: fl / t / 1e9 for n, t in best.items()}}
            results.append(row)
            g = row["gflops"]
            print(f"{rows:5d} rows {name:14s} {M:5d}x{N:5d}x{K:5d}: fasttran bf16 {g['fasttran bf16']:6.1f}, "
                  f"fp32 {g['fasttran fp32']:6.1f}, torch bf16 {g['torch bf16']:6.1f} GFLOP/s")
            be.free_all()
    for rows in args.rows:
        sub = [r for r in results if r["rows"] == rows]
        tot = {n: sum(r["seconds"][n] for r in sub) for n in sub[0]["seconds"]}
        print(f"{rows} rows, a layer's products: fasttran bf16 {tot['fasttran bf16'] * 1e3:.2f} ms, "
              f"fp32 {tot['fasttran fp32'] * 1e3:.2f} ms ({tot['fasttran fp32'] / tot['fasttran bf16']:.2f}x), "
              f"torch bf16 {tot['torch bf16'] * 1e3:.2f} ms ({tot['torch bf16'] / tot['fasttran bf16']:.2f}x)")
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "cpu": platform.processor() or platform.machine(),
           "bf16_kernel": fasttran._C.cpu_lowp_kernels()[2], "threads": args.threads, "load_avg": os.getloadavg(),
           "torch": torch.__version__, "fasttran": fasttran.__version__, "command": " ".join(sys.argv),
           "results": results}
    with open(os.path.join(HERE, "last_train_gemm_bf16.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
