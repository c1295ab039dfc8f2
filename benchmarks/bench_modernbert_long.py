"""Long documents on ModernBERT: fasttran against transformers' ModernBertModel (SDPA), float32, CPU.

A random-weight model at ModernBERT-base's shape (hidden 768, 12 heads, FFN 1152, 22 layers, local
attention of 128 with a global layer every 3rd, the 50368-token vocabulary), written once by
transformers into a temporary directory; random token ids, all real (no padding), batch 1 and 2 at
4,096 and 8,192 tokens; the last hidden states of both (fasttran: hidden state 22, final_norm's output;
transformers: last_hidden_state) compared to report the largest difference. Both on the same threads
(torch.set_num_threads, fasttran.set_num_threads); median of `--repeats` timed runs after one warm-up.

    python benchmarks/bench_modernbert_long.py [--tokens 4096 8192] [--batch 1 2] [--threads 2] [--repeats 3]
                                               [--layers 22]

Writes benchmarks/last_modernbert_long.json: per (batch, tokens) the seconds of each, fasttran's
speed-up and tokens per second, the largest absolute difference, and the settings."""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(fn, repeats):
    fn()   # warm-up: workspace, packed weights, torch's allocator
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), ts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--out", default=os.path.join(HERE, "last_modernbert_long.json"))
    args = ap.parse_args(argv)

    import torch
    import transformers
    import fasttran

    torch.set_num_threads(args.threads)
    fasttran.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(num_hidden_layers=args.layers, max_position_embeddings=max(8192, max(args.tokens)))
    results = []
    with tempfile.TemporaryDirectory() as d:
        transformers.ModernBertModel(config).save_pretrained(d, safe_serialization=True)
        hf = transformers.AutoModel.from_pretrained(d, attn_implementation="sdpa").eval()
        enc = fasttran.Encoder.from_pretrained(d)
        rng = np.random.default_rng(0)
        for T in args.tokens:
            for B in args.batch:
                ids = rng.integers(5, config.vocab_size, (B, T))
                mask = np.ones((B, T), np.int64)
                t_ids, t_mask = torch.as_tensor(ids), torch.as_tensor(mask)

                def run_hf():
                    with torch.no_grad():
                        return hf(input_ids=t_ids, attention_mask=t_mask).last_hidden_state.numpy()

                def run_ft():
                    return enc.forward(ids, mask)

                ours, theirs = run_ft(), run_hf()
                diff = float(np.abs(ours - theirs).max())
                ft_s, ft_all = timed(run_ft, args.repeats)
                hf_s, hf_all = timed(run_hf, args.repeats)
                row = {"batch": B, "tokens": T, "fasttran_s": ft_s, "transformers_sdpa_s": hf_s,
                       "speedup": hf_s / ft_s, "fasttran_tokens_per_s": B * T / ft_s,
                       "transformers_tokens_per_s": B * T / hf_s, "max_abs_diff": diff,
                       "fasttran_runs_s": ft_all, "transformers_runs_s": hf_all,
                       "fasttran_workspace_mib": enc.memory_report()["workspace"] / 2 ** 20}
                results.append(row)
                print(f"B={B} T={T}: fasttran {ft_s:.2f} s, transformers (SDPA) {hf_s:.2f} s, x{hf_s / ft_s:.2f}, "
                      f"max |diff| {diff:.2e}", flush=True)
    out = {"settings": {"threads": args.threads, "repeats": args.repeats, "layers": args.layers, "dtype": "float32",
                        "device": "cpu", "attn_implementation": "sdpa", "cpu_isa": fasttran.build_info().get("cpu_isa"),
                        "torch": torch.__version__, "transformers": transformers.__version__},
           "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
