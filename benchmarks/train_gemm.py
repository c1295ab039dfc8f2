"""The backend's gemm op on the GEMM shapes of one top-k training step: the forward
(x W^T), the input gradients (dY W) and the weight gradients (dY^T X) of an encoder layer, for
MiniLM (C 384, I 1536) and BERT-base (C 768, I 3072) at 32 x 128 tokens.

    python benchmarks/train_gemm.py                          # this CPU's kernel set
    FASTTRAN_CPU_ISA=avx512 python benchmarks/train_gemm.py  # the same shapes on OpenBLAS

On the "amx" kernel set the op runs on fasttran's AMX product at float32 accuracy
(`ft_cpu_amx_gemm`, amx.h); on the others it is OpenBLAS's sgemm. Best of 5 calls per shape, 2
threads (FASTTRAN_BENCH_THREADS); appends a record to benchmarks/last_train_gemm.json."""
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import fasttran                      # noqa: E402
import test_backend_ops as T         # noqa: E402  (the backend table through ctypes)

THREADS = int(os.environ.get("FASTTRAN_BENCH_THREADS", "2"))


def shapes(C, I, N=4096):
    # (name, trans_a, trans_b, M, N, K): C = op(A) op(B), as model/layer.c calls them
    return [("fwd qkv", 0, 1, N, 3 * C, C), ("fwd ffn1", 0, 1, N, I, C), ("fwd ffn2", 0, 1, N, C, I),
            ("dX ffn2", 0, 0, N, I, C), ("dX ffn1", 0, 0, N, C, I), ("dX qkv", 0, 0, N, C, 3 * C),
            ("dW ffn2", 1, 0, C, I, N), ("dW ffn1", 1, 0, I, C, N), ("dW qkv", 1, 0, 3 * C, C, N)]


def main():
    fasttran.set_num_threads(THREADS)
    be = T.Backend(-1)
    isa = fasttran.build_info()["cpu_kernels"]
    rng = np.random.default_rng(0)
    rows = []
    for model, C, I in (("MiniLM", 384, 1536), ("BERT-base", 768, 3072)):
        total = 0.0
        for name, ta, tb, M, N, K in shapes(C, I):
            A = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            B = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            pa, pb, pc = be.upload(A), be.upload(B), be.alloc(M * N * 4)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                be.check(be.fn["gemm"](be.addr, ta, tb, M, N, K, 1.0, pa, A.shape[1], pb, B.shape[1], 0.0, pc, N),
                         "gemm")
                best = min(best, time.perf_counter() - t0)
            be.free_all()
            total += best
            rows.append({"model": model, "gemm": name, "M": M, "N": N, "K": K, "ms": best * 1e3,
                         "gflops": 2 * M * N * K / best / 1e9})
            print(f"{isa:7s} {model:9s} {name:9s} {M:5d} x {N:5d} x {K:5d}  {best * 1e3:7.2f} ms "
                  f"{2 * M * N * K / best / 1e9:6.0f} GFLOP/s")
        print(f"{isa:7s} {model:9s} one layer's GEMMs: {total * 1e3:.1f} ms")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_train_gemm.json")
    runs = json.load(open(out)) if os.path.exists(out) else []
    runs = [r for r in runs if r["isa"] != isa] + [{"isa": isa, "threads": THREADS, "date": time.strftime("%Y-%m-%d"),
                                                   "load_avg": os.getloadavg()[0], "rows": rows}]
    with open(out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
