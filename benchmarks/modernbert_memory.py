"""Training ModernBERT's top k layers on long documents, CPU: the memory a step holds against what
`TopLayers.memory_report()` predicts.

A random-weight model at ModernBERT-base's shape (hidden 768, 12 heads of 64, FFN 1152, 22 layers,
local attention of 128 with a global layer every 3rd: layer 21 is global, 20 local), written once by
transformers into a temporary directory (no download); one sequence (batch 1) of 4,096 and 8,192
tokens of random hidden states into TopLayers(encoder, k) for k = 1 and 2, one training forward and
backward (d input too). Measured as tests/test_topk_trainer.py measures BERT's: the stack's own peak
(`allocated()`, its arena and workspace) against the report's weights + gradients + saved activations
(the input excluded: the caller's) + workspace, which must bound the peak within 64 x 64 bytes; the
report's excess over the peak is printed too, as is the growth of the process's resident set from
before the stack is made to after its step (VmRSS: the arena's touched pages plus what the ops hold
on their own). With the probabilities kept (recompute_attention_probs=False: NH n^2 floats per layer,
local layers too) and recomputed from the softmax statistics (True); a configuration whose predicted
total passes --max-gib is not run (its prediction is written, marked skipped).

    python benchmarks/modernbert_memory.py [--tokens 4096 8192] [--k 1 2] [--recompute 1 0] [--threads 2]
                                           [--max-gib 8]

Writes benchmarks/last_modernbert_memory.json: per (tokens, k, recompute) the measured peak, the
predicted bytes and their categories, the excess, the resident-set growth and the step's seconds.
Exits nonzero when a prediction falls below its peak."""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SLACK = 64 * 64   # tests/test_topk_trainer.py's bound on the report's shortfall (alignment)


def held(rep):
    """the bytes of the report the stack itself holds (the input is the caller's, optimizer state the trainer's)"""
    return rep["weights"] + rep["gradients"] + sum(v for k, v in rep["activations"].items() if k != "input") \
        + rep["workspace"]


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(enc, k, tokens, recompute, max_bytes, seed=0):
    """one training step of the top k layers over one sequence of `tokens` rows: (row dict)"""
    from fasttran.finetune import TopLayers
    rss0 = rss()
    top = TopLayers(enc, k, recompute_attention_probs=bool(recompute))
    rep = top.memory_report(batch_size=1, seq_len=tokens)
    if rep["total"] > max_bytes:
        return {"tokens": tokens, "k": k, "recompute_attention_probs": bool(recompute), "skipped": True,
                "predicted_bytes": int(held(rep)), "report": {key: rep[key] for key in ("weights", "gradients",
                                                                                       "workspace", "total")},
                "activations": dict(rep["activations"])}
    C = enc.config["hidden_size"]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, C)).astype(np.float32)
    lengths = np.array([tokens], np.int32)
    t = time.perf_counter()
    out = np.asarray(top.forward(x, lengths, training=True))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    top.backward(dout, want_dx=True)
    seconds = time.perf_counter() - t
    now, peak = top.allocated()
    predicted = held(rep)
    rss1 = rss()
    row = {"tokens": tokens, "k": k, "recompute_attention_probs": bool(recompute), "peak_bytes": int(peak),
           "now_bytes": int(now), "predicted_bytes": int(predicted), "excess_bytes": int(predicted - peak),
           "excess_fraction": (predicted - peak) / peak if peak else None, "bounded": bool(peak <= predicted + SLACK),
           "report": {key: rep[key] for key in ("weights", "gradients", "workspace", "total")},
           "activations": dict(rep["activations"]), "rss_growth_bytes": int(rss1 - rss0), "step_s": seconds}
    del top
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--recompute", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--max-gib", type=float, default=8.0)
    ap.add_argument("--out", default=os.path.join(HERE, "last_modernbert_memory.json"))
    args = ap.parse_args(argv)

    import transformers
    import fasttran

    fasttran.set_num_threads(args.threads)
    config = transformers.ModernBertConfig(num_hidden_layers=args.layers,
                                           max_position_embeddings=max(8192, max(args.tokens)))
    results = []
    with tempfile.TemporaryDirectory() as d:
        import torch
        torch.manual_seed(0)
        transformers.ModernBertModel(config).save_pretrained(d, safe_serialization=True)
        enc = fasttran.Encoder.from_pretrained(d)
    for T in args.tokens:
        for k in args.k:
            for rc in args.recompute:
                row = measure(enc, k, T, rc, args.max_gib * 2 ** 30)
                results.append(row)
                if row.get("skipped"):
                    print(f"T={T} k={k} recompute_probs={bool(rc)}: predicted total {row['report']['total'] / 2**30:.1f} "
                          f"GiB > --max-gib {args.max_gib}: not run", flush=True)
                    continue
                print(f"T={T} k={k} recompute_probs={bool(rc)}: peak {row['peak_bytes'] / 2**20:.1f} MiB, predicted "
                      f"{row['predicted_bytes'] / 2**20:.1f} MiB ({100 * row['excess_fraction']:+.2f}%), "
                      f"{'bounded' if row['bounded'] else 'UNDER THE PEAK'}; RSS +"
                      f"{row['rss_growth_bytes'] / 2**20:.0f} MiB; step {row['step_s']:.1f} s", flush=True)
    out = {"settings": {"threads": args.threads, "layers": args.layers, "batch": 1, "dtype": "float32",
                        "max_gib": args.max_gib,
                        "device": "cpu", "slack_bytes": SLACK, "cpu_isa": fasttran.build_info().get("cpu_isa"),
                        "transformers": transformers.__version__},
           "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)
    return all(r.get("bounded", True) for r in results)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
