"""Where the bf16 CUDA encoder's time goes, beside transformers' SDPA on the same GPU: the next step
after benchmarks/test_gpu_encoder.py finds a gap.

For BERT-base (random weights in bf16, as test_gpu_encoder.py) at full batches 32 x 128, 256 x 128
and 64 x 512:
  fasttran   fasttran.profile(enc.forward, ...): CUDA-event time per op (GEMMs, attention, row ops)
  sdpa       torch.profiler over transformers BertModel (attn_implementation="sdpa"): CUDA time
             per kernel, grouped (GEMM, attention, the rest)
Each op's time is set against its floor: GEMM and attention FLOPs at the bf16 GEMM rate measured
in the same run (8192^3, torch.matmul).

  python3 benchmarks/gpu_profile.py [--json FILE] [--shapes 32x128,256x128,64x512]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

import fasttran


def peak_bf16(torch):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * 8192 ** 3 / best


def kernel_group(name):
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "efficient")):
        return "attention"
    if any(k in n for k in ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet", "matmul", "wgmma")):
        return "gemm"
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="32x128,256x128,64x512")
    args = ap.parse_args()
    import torch
    from transformers import BertConfig, BertModel
    cfg = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
               vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
    d = tempfile.mkdtemp(prefix="bert-base-")
    torch.manual_seed(0)
    BertModel(BertConfig(**cfg), add_pooling_layer=False).to(torch.bfloat16).save_pretrained(d)
    hf = BertModel.from_pretrained(d, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    enc = fasttran.Encoder.from_pretrained(d, device="cuda", dtype="bfloat16", load_tokenizer=False)
    peak = peak_bf16(torch)
    C, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "peak_bf16_tflops": peak / 1e12,
           "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "shapes": []}
    print(f"{out['device']}: bf16 GEMM {peak / 1e12:.0f} TFLOP/s")
    for shape in args.shapes.split(","):
        B, T = map(int, shape.split("x"))
        rng = np.random.default_rng(B * T)
        ids = torch.as_tensor(rng.integers(1000, 30000, (B, T)), device="cuda")
        mask = torch.ones_like(ids)
        types = torch.zeros_like(ids)
        tokens = B * T
        gemm_floor = 2.0 * L * tokens * (4 * C * C + 2 * C * I) / peak
        attn_floor = 2.0 * L * B * T * T * 2 * C / peak
        for _ in range(3):
            enc.forward(ids, mask, types, output="device")
        torch.cuda.synchronize()
        p = fasttran.profile(enc.forward, ids, mask, types, output="device", repeat=5)
        ph = p.phases[0]
        ours = {"wall_ms": 1e3 * ph.wall, "kinds_ms": {k: 1e3 * v for k, v in ph.kinds.items() if v},
                "ops": {n: {"ms": 1e3 * o["seconds"], "calls": o["calls"]} for n, o in ph.ops.items()}}

        def run_hf():
            with torch.inference_mode():
                return hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        for _ in range(3):
            run_hf()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            run_hf()
        torch.cuda.synchronize()
        hf_wall = (time.perf_counter() - t0) / 5
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run_hf()
            torch.cuda.synchronize()
        groups, kernels = {}, {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0)
            if not t or e.key.startswith("aten::") or e.key.startswith("cuda"):
                continue
            g = kernel_group(e.key)
            groups[g] = groups.get(g, 0.0) + t / 5 / 1e3
            kernels[e.key[:90]] = (t / 5 / 1e3, e.count / 5)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]
        sdpa = {"wall_ms": 1e3 * hf_wall, "groups_ms": groups, "top_kernels": [[k, v[0], v[1]] for k, v in top]}
        row = {"B": B, "T": T, "gemm_floor_ms": 1e3 * gemm_floor, "attention_floor_ms": 1e3 * attn_floor,
               "fasttran": ours, "sdpa": sdpa}
        out["shapes"].append(row)
        print(f"\n== BERT-base bf16 {B} x {T}: floors GEMM {1e3 * gemm_floor:.2f} ms, attention "
              f"{1e3 * attn_floor:.2f} ms")
        print(f"fasttran wall {ours['wall_ms']:.2f} ms; by kind: " +
              ", ".join(f"{k} {v:.2f}" for k, v in ours["kinds_ms"].items()))
        for n, o in sorted(ours["ops"].items(), key=lambda kv: -kv[1]["ms"])[:10]:
            print(f"   {n:<32} {o['ms']:8.3f} ms  ({o['calls']:.0f} calls)")
        print(f"sdpa wall {sdpa['wall_ms']:.2f} ms; kernels by group: " +
              ", ".join(f"{k} {v:.2f}" for k, v in groups.items()))
        for k, (ms, n) in top[:8]:
            print(f"   {k:<90} {ms:8.3f} ms ({n:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
