"""Data-parallel top-k training beyond one machine, on paper: gradient bytes per step, ring
all-reduce time, and the scaling they allow against a one-GPU step time (docs/distributed.md
explains every input). An estimate, not a measurement: rerun it with a measured step time and
measured all-reduce bandwidth (nccl-tests' all_reduce_perf "busbw") when a GPU cluster is at hand.

    python benchmarks/comm_estimate.py                       # the tables of docs/distributed.md
    python benchmarks/comm_estimate.py --layer-ms 0.9 --busbw 180 --tokens 4096

Writes benchmarks/last_comm_estimate.json and prints markdown tables."""
import argparse
import json
import os

MODELS = {   # hidden, intermediate, layers
    "BERT-base": (768, 3072, 12),
    "BERT-large": (1024, 4096, 24),
}


def layer_params(C, I):
    """Trainable parameters of one encoder layer (Hugging Face BertLayer)."""
    qkv = 3 * (C * C + C)
    out = C * C + C
    ffn_in = C * I + I
    ffn_out = I * C + C
    norms = 2 * (2 * C)
    return {"qkv": qkv, "attention output": out, "ffn in": ffn_in, "ffn out": ffn_out, "layer norms": norms,
            "total": qkv + out + ffn_in + ffn_out + norms}


def flops_per_token(C, I, T):
    """Forward multiply-adds x 2 of one layer per token at sequence length T."""
    return 2 * (4 * C * C + 2 * C * I) + 4 * T * C


def allreduce_seconds(nbytes, ranks, busbw):
    """Ring all-reduce: each rank sends and receives 2 (n - 1) / n of the buffer; busbw (bytes/s)
    is nccl-tests' bus bandwidth, which folds that factor in."""
    return 2 * (ranks - 1) / ranks * nbytes / busbw


def exposed(k, c, b):
    """Communication left after overlap: one bucket per layer, sent top layer first while the
    layers below run their backward (b seconds each); the network takes c seconds a bucket.
    Bucket j (from the top) is ready at j b and ends at F_j = max(F_{j-1}, j b) + c; the
    backward ends at k b: exposed = F_k - k b = c + (k - 1) max(0, c - b)."""
    return c + (k - 1) * max(0.0, c - b)


def table(args):
    rows = []
    for name, (C, I, L) in MODELS.items():
        p = layer_params(C, I)["total"]
        # one layer's forward + backward at the reference per-GPU batch, scaled from BERT-large by flops
        large = flops_per_token(1024, 4096, args.seq)
        layer_s = args.layer_ms / 1000 * flops_per_token(C, I, args.seq) / large * args.tokens / 4096
        for k in sorted({1, 2, 4, L}):
            for grad_bytes, gname in ((4, "fp32"), (2, "bf16")):
                nbytes = k * p * grad_bytes
                for where, ranks, bw in (("8 GPUs, NVLink", 8, args.nvlink), ("64 GPUs, 8 nodes, IB", 64, args.busbw)):
                    c = allreduce_seconds(p * grad_bytes, ranks, bw * 1e9)   # one layer's bucket
                    f, b = layer_s / 3, 2 * layer_s / 3
                    compute = k * (f + b)
                    x = exposed(k, c, b) / args.accumulate
                    eff = compute / (compute + x)
                    rows.append({"model": name, "k": k, "gradients": gname, "MB per step": nbytes / 1e6,
                                 "network": where, "ranks": ranks, "all-reduce ms": k * c * 1e3,
                                 "compute ms": compute * 1e3, "exposed ms": x * 1e3, "efficiency": eff,
                                 "speed-up": ranks * eff})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer-ms", type=float, default=2.30,
                    help="one BERT-large layer's forward + backward on one GPU for 4096 tokens at --seq "
                         "(default: A100 mixed precision, from NVIDIA's 580 sequences/s; docs/distributed.md)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length of the step")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per step (32 x 128 = 4096)")
    ap.add_argument("--nvlink", type=float, default=200.0, help="all-reduce bus bandwidth in one node, GB/s")
    ap.add_argument("--busbw", type=float, default=160.0, help="all-reduce bus bandwidth across nodes, GB/s")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per all-reduce (gradient accumulation)")
    args = ap.parse_args(argv)
    for name, (C, I, L) in MODELS.items():
        p = layer_params(C, I)
        print(f"{name}: " + ", ".join(f"{k} {v:,}" for k, v in p.items()) + " parameters per layer")
    rows = table(args)
    print("\n| model | k | gradients | MB / step | network | all-reduce | compute | exposed | efficiency | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['k']} | {r['gradients']} | {r['MB per step']:.1f} | {r['network']} | "
              f"{r['all-reduce ms']:.2f} ms | {r['compute ms']:.2f} ms | {r['exposed ms']:.2f} ms | "
              f"{100 * r['efficiency']:.0f}% | {r['speed-up']:.1f}x |")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_comm_estimate.json")
    with open(out, "w") as f:
        json.dump({"inputs": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
