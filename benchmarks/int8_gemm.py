"""The reduced-precision linear layers (csrc/cpu/lowp.h) against the float32 ones, per
kernel path, on the linear layers of MiniLM (C 384, I 1536) and BERT-base (C 768, I 3072) at 1 x 128
and 32 x 128 tokens: out = x W^T + bias (the backend's linear_forward / linear_lp_forward ops, the
activations' per-token quantization or bf16 rounding included in the int8 and bf16 times).

    python benchmarks/int8_gemm.py        # every path this CPU runs, each in its own process

Each path is a CPU generation forced with FASTTRAN_CPU_ISA (this CPU's own set first, then the
exact int8 fallbacks without VNNI: avx512 -> avx512bw, avx2 -> avx2; AVX-VNNI and AMX-INT8 where
the CPU has them). Within a path, float32 and int8 (and bf16) run the same shapes in turn, best of
7 rounds of one call each, interleaved, 2 threads (FASTTRAN_BENCH_THREADS). GOP/s count 2 M N K; "x f32" is the ratio of
times against the float32 kernels of the same path and run. The rule the backend keeps
(lowp.c's `pays`): an encoder uses int8 products only where they beat float32 on every shape.
Writes benchmarks/last_int8_gemm.json (with the machine, its load and the versions)."""
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = int(os.environ.get("FASTTRAN_BENCH_THREADS", "2"))
REPEATS = 7

CHILD = r"""
import json, os, sys, time
import numpy as np
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fasttran
from fasttran import _C
import test_backend_ops as T
fasttran.set_num_threads(int(sys.argv[2]))
REPEATS = int(sys.argv[3])
be = T.Backend(-1)
int8, used, bf16 = _C.cpu_lowp_kernels()
rng = np.random.default_rng(0)

def best(calls):
    # {name: best time}: the calls in turn, REPEATS rounds (under a competing load each kernel sees
    # the same machine)
    t = {k: float("inf") for k in calls}
    for k, call in calls.items():
        be.check(call(), k)
    for _ in range(REPEATS):
        for k, call in calls.items():
            t0 = time.perf_counter()
            be.check(call(), k)
            t[k] = min(t[k], time.perf_counter() - t0)
    return t

rows = []
for model, C, I in (("MiniLM", 384, 1536), ("BERT-base", 768, 3072)):
    for layer, N, K in (("qkv", 3 * C, C), ("attn out", C, C), ("ffn in", I, C), ("ffn out", C, I)):
        w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
        q = np.clip(np.rint(w / (np.abs(w).max(1, keepdims=True) / 127)), -127, 127).astype(np.int8)
        s = (np.abs(w).max(1) / 127).astype(np.float32)
        pw, pq, ps, pb = be.upload(w), be.upload(q), be.upload(s), be.upload(np.zeros(N, np.float32))
        wf = be.alloc(be.fn["packed_weight_bytes"](be.addr, N, K))
        be.check(be.fn["pack_weight"](be.addr, wf, pw, N, K), "pack_weight")
        wi = be.alloc(be.fn["packed_weight_lp_bytes"](be.addr, 6, N, K))
        be.check(be.fn["pack_weight_i8"](be.addr, wi, pq, ps, N, K), "pack_weight_i8")
        wb = None
        if bf16:
            wb = be.alloc(be.fn["packed_weight_lp_bytes"](be.addr, 2, N, K))
            be.check(be.fn["pack_weight_bf16"](be.addr, wb, pw, N, K), "pack_weight_bf16")
        for batch in (1, 32):
            M = batch * 128
            x = be.upload(rng.standard_normal((M, K)).astype(np.float32))
            out = be.alloc(M * N * 4)
            calls = {"f32_s": lambda: be.fn["linear_forward"](be.addr, 0, out, x, pw, wf, pb, M, K, N, -1),
                     "int8_s": lambda: be.fn["linear_lp_forward"](be.addr, 6, out, x, wi, pb, M, K, N, -1)}
            if wb:
                calls["bf16_s"] = lambda: be.fn["linear_lp_forward"](be.addr, 2, out, x, wb, pb, M, K, N, -1)
            rows.append({"model": model, "layer": layer, "M": M, "N": N, "K": K, **best(calls)})
        be.free_all()
print(json.dumps({"cpu_kernels": _C.cpu_isa(), "int8_kernel": int8, "int8_used_by_encoders": used,
                  "bf16_kernel": bf16, "rows": rows}))
"""


def machine():
    from cpu_common import cpu_name_and_flags
    name, flags = cpu_name_and_flags()
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
            "isa": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))}


def paths():
    import fasttran
    have = fasttran._C.cpu_features()[1]
    out = ["auto"]
    if have["amx_int8"]:
        out.append("avx512_bf16")       # AMX CPUs: VNNI without the tiles too
    if have["avx_vnni"]:
        out.append("avx_vnni")
    if have["avx512"]:
        out.append("avx512")            # the exact fallback without VNNI, on AVX-512BW
    if have["avx2"]:
        out.append("avx2")              # ... on AVX2
    return out


def main():
    import fasttran
    runs = []
    load_before = os.getloadavg()
    for isa in paths():
        env = dict(os.environ, FASTTRAN_CPU_ISA=isa, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-c", CHILD, ROOT, str(THREADS), str(REPEATS)], env=env,
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"FASTTRAN_CPU_ISA={isa}: {r.stderr[-2000:]}")
        run = json.loads(r.stdout.strip().splitlines()[-1])
        run["FASTTRAN_CPU_ISA"] = isa
        runs.append(run)
        print(f"\n== FASTTRAN_CPU_ISA={isa}: float32 kernels {run['cpu_kernels']}, int8 {run['int8_kernel']} "
              f"(encoders use it: {run['int8_used_by_encoders']}), bf16 {run['bf16_kernel']}; {THREADS} threads")
        print(f"{'model':9s} {'layer':8s} {'M':>5s} {'N':>5s} {'K':>5s} {'f32 GF/s':>9s} {'int8 GOP/s':>10s} "
              f"{'x f32':>6s} {'bf16 GF/s':>9s} {'x f32':>6s}")
        for x in run["rows"]:
            ops = 2 * x["M"] * x["N"] * x["K"]
            line = (f"{x['model']:9s} {x['layer']:8s} {x['M']:5d} {x['N']:5d} {x['K']:5d} {ops / x['f32_s'] / 1e9:9.0f} "
                    f"{ops / x['int8_s'] / 1e9:10.0f} {x['f32_s'] / x['int8_s']:6.2f}")
            if "bf16_s" in x:
                line += f" {ops / x['bf16_s'] / 1e9:9.0f} {x['f32_s'] / x['bf16_s']:6.2f}"
            print(line)
        for M in (128, 4096):
            rs = [x["f32_s"] / x["int8_s"] for x in run["rows"] if x["M"] == M]
            print(f"   int8 / float32 at M = {M}: min {min(rs):.2f}x, geometric mean {np.exp(np.log(rs).mean()):.2f}x")
    rec = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/int8_gemm.py", "threads": THREADS,
           "machine": machine(), "load_avg_before": load_before, "fasttran": fasttran._C.version,
           "runs": runs}
    with open(os.path.join(HERE, "last_int8_gemm.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(f"\nload average before {load_before}, after {os.getloadavg()}; benchmarks/last_int8_gemm.json")


if __name__ == "__main__":
    main()
