"""The training attention ops (attention_train_forward, attention_backward) alone, per
products' precision: float32, and mixed precision's bfloat16 / float16 (the operands of the six
products rounded; on CUDA the fused kernels' WMMA tensor cores, on the CPU the reference's rounded
copies), for MiniLM's heads (12 x 32) and BERT-base's (12 x 64) at 32 x 128 and 8 x 512 tokens,
dropout 0.1, probabilities kept.

    python benchmarks/train_attention.py                        # the CPU backend, 2 threads
    FASTTRAN_BENCH_DEVICE=cuda python benchmarks/train_attention.py
    FASTTRAN_CUDA_TRAIN_ATTENTION=per_sequence FASTTRAN_BENCH_DEVICE=cuda python benchmarks/train_attention.py

Each op is timed alone (its buffers made once; the backend synchronised after each call), best of
FASTTRAN_BENCH_ROUNDS (5) calls; TFLOP/s count the forward's two products (2 x 2 n^2 hs per head)
and the backward's four. Appends a record per (device, variant) to
benchmarks/last_train_attention.json."""
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
ROUNDS = int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "5"))
DEVICE = os.environ.get("FASTTRAN_BENCH_DEVICE", "cpu")
PRECISIONS = ("float32", "bfloat16", "float16")


def best_of(be, op, call):
    best = float("inf")
    for _ in range(ROUNDS):
        be.sync()
        t0 = time.perf_counter()
        be.check(be.fn[op](*call), op)
        be.sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    fasttran.set_num_threads(THREADS)
    be = T.Backend(0 if DEVICE == "cuda" else -1)
    variant = os.environ.get("FASTTRAN_CUDA_TRAIN_ATTENTION", "fused") if DEVICE == "cuda" else "cpu"
    rng = np.random.default_rng(0)
    rows = []
    for model, NH, hs in (("MiniLM", 12, 32), ("BERT-base", 12, 64)):
        for B, n in ((32, 128), (8, 512)):
            C, N = NH * hs, B * n
            seqs = np.stack([np.arange(B) * n, np.full(B, n), np.full(B, n)], axis=1).astype(np.int32)
            total = NH * B * n * n
            qkv = be.upload(rng.standard_normal((N, 3 * C)).astype(np.float32))
            dctx = be.upload(rng.standard_normal((N, C)).astype(np.float32))
            ctx, dqkv = be.alloc(N * C * 4), be.alloc(N * 3 * C * 4)
            probs, dmask = be.alloc(total * 4), be.alloc(total)
            nbytes = be.fn["attention_train_scratch_bytes"](be.addr, B, n, NH)
            scratch = be.alloc(nbytes)
            one = 2 * B * NH * n * n * hs   # FLOPs of one product over every head of every sequence
            for prec in PRECISIONS:
                code = T.DTYPE_CODES[prec]
                fwd = [be.addr, code, ctx, probs, None, dmask, qkv, seqs.ctypes.data, B, C, NH, 0.1, 7, scratch,
                       nbytes]
                bwd = [be.addr, code, dqkv, dctx, qkv, probs, None, dmask, seqs.ctypes.data, B, C, NH, 0.1, 7,
                       scratch, nbytes]
                try:
                    tf = best_of(be, "attention_train_forward", fwd)
                    tb = best_of(be, "attention_backward", bwd)
                except AssertionError as e:   # e.g. fp16 on the CPU is a reference only: it runs; bf16
                    print(f"{model} {B}x{n} {prec}: {e}")   # on a pre-Ampere GPU is refused
                    continue
                rows.append({"model": model, "batch": [B, n], "precision": prec, "forward_ms": tf * 1e3,
                             "backward_ms": tb * 1e3, "forward_tflops": 2 * one / tf / 1e12,
                             "backward_tflops": 4 * one / tb / 1e12})
                print(f"{DEVICE:4s} {variant:12s} {model:9s} {B:2d}x{n:3d} {prec:8s} forward {tf * 1e3:8.2f} ms "
                      f"({rows[-1]['forward_tflops']:6.2f} TFLOP/s)  backward {tb * 1e3:8.2f} ms "
                      f"({rows[-1]['backward_tflops']:6.2f} TFLOP/s)")
            be.free_all()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_train_attention.json")
    runs = json.load(open(out)) if os.path.exists(out) else []
    info = fasttran.build_info()
    record = {"device": DEVICE, "variant": variant, "threads": THREADS, "rounds": ROUNDS,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg()[0],
              "cpu_kernels": info.get("cpu_kernels"), "rows": rows}
    runs = [r for r in runs if (r["device"], r["variant"]) != (DEVICE, variant)] + [record]
    with open(out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
