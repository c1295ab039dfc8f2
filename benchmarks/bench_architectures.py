"""fasttran's CPU forward per architecture against PyTorch fp32, same run, same inputs, same threads.

Models: random weights at the base models' shapes, written by transformers' own classes and loaded
by both engines -- bert-base, roberta-base, xlm-roberta-base (its vocabulary cut to 32,000 rows: the
embedding table is read, not multiplied, so the forward's cost is the same), distilbert-base
(6 layers), electra-base (embedding_size = hidden_size = 768), modernbert-base (22 pre-LN layers,
GeGLU, RoPE, local windows of 128: at 128 tokens every layer sees the whole sequence). Engines:
  fasttran   Encoder.forward (its own kernels), FASTTRAN threads = --threads
  torch      transformers' base class of the architecture (BertModel, RobertaModel, XLMRobertaModel,
             DistilBertModel, ElectraModel, ModernBertModel), attn_implementation="sdpa", float32,
             torch.set_num_threads(--threads), torch.inference_mode()
Workload: one batch of 32 x 128 random token ids (no padding), last hidden state. fasttran's output
is checked against torch's before anything is timed (within 1e-4). Rounds are interleaved (each
round runs every architecture on both engines, the engine order alternating, a pause between
runs) and the median is reported, with the ratio torch / fasttran per architecture. Writes
benchmarks/last_architectures.json (--output) with the CPU, its instruction sets, the load average
and the versions.

  FASTTRAN_NUM_THREADS=2 python benchmarks/bench_architectures.py            # the measurement
  python benchmarks/bench_architectures.py --rounds 1 --layers 2 --output /tmp/a.json   # does it run?

--layers overrides every model's depth (a quick check: the ratio of a few layers is close to the whole
model's, the embeddings being a small part); the measurement keeps the real depths.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BASE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=12)
ROBERTA = dict(BASE, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1,
               bos_token_id=0, eos_token_id=2)
#: name -> (config class, base model class, config keywords, config key of the depth)
MODELS = {
    "bert-base": ("BertConfig", "BertModel", dict(BASE, vocab_size=30522), "num_hidden_layers"),
    "roberta-base": ("RobertaConfig", "RobertaModel", dict(ROBERTA, vocab_size=50265), "num_hidden_layers"),
    "xlm-roberta-base": ("XLMRobertaConfig", "XLMRobertaModel", dict(ROBERTA, vocab_size=32000), "num_hidden_layers"),
    "distilbert-base": ("DistilBertConfig", "DistilBertModel",
                        dict(vocab_size=30522, dim=768, n_heads=12, hidden_dim=3072, n_layers=6, pad_token_id=0),
                        "n_layers"),
    "electra-base": ("ElectraConfig", "ElectraModel", dict(BASE, vocab_size=30522, embedding_size=768, pad_token_id=0),
                     "num_hidden_layers"),
    # ModernBERT-base: 22 pre-LN layers, GeGLU FFN 1152, RoPE, a global layer every third, local windows of 128
    "modernbert-base": ("ModernBertConfig", "ModernBertModel",
                        dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                             num_attention_heads=12, pad_token_id=50283), "num_hidden_layers"),
}


def cpu_description():
    from cpu_common import cpu_name_and_flags
    name, flags = cpu_name_and_flags()
    isa = [x for x in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16") if x in flags]
    return {"cpu": name, "isa": isa, "cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg()}


def build(name, path, layers, seed=0):
    """the transformers model of MODELS[name] (random weights, saved to path) and fasttran's Encoder of it"""
    import torch
    import transformers

    import fasttran
    cfg_cls, model_cls, kw, depth = MODELS[name]
    kw = dict(kw)
    if layers:
        kw[depth] = layers
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**kw)
    model = getattr(transformers, model_cls)(config)
    model.save_pretrained(path, safe_serialization=True)
    ref = getattr(transformers, model_cls).from_pretrained(path, attn_implementation="sdpa",
                                                           dtype=torch.float32).eval()
    return ref, fasttran.Encoder.from_pretrained(path)


def inputs(enc, B, T, seed=0):
    rng = np.random.default_rng(seed)
    pad = enc.config["pad_token_id"]
    ids = rng.integers(3, enc.config["vocab_size"], (B, T))
    ids[ids == pad] = pad + 1
    return ids, np.ones_like(ids)


def engines(ref, enc, ids, mask):
    import torch
    ti, tm = torch.from_numpy(ids), torch.from_numpy(mask)

    def ft():
        return enc.forward(ids, mask)

    def pt():
        with torch.inference_mode():
            return ref(input_ids=ti, attention_mask=tm).last_hidden_state.numpy()
    return {"fasttran": ft, "torch": pt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("FASTTRAN_BENCH_THREADS", "2")))
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "5")))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=0, help="every model's depth (0: the real one)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--output", default=os.path.join(HERE, "last_architectures.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("FASTTRAN_NUM_THREADS", str(args.threads))
    import torch
    import transformers

    import fasttran
    torch.set_num_threads(args.threads)
    fasttran.set_num_threads(args.threads)
    names = [n for n in args.models.split(",") if n]
    unknown = set(names) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    runs, results = {}, {}
    with tempfile.TemporaryDirectory(prefix="fasttran-archs-") as tmp:
        for n in names:
            ref, enc = build(n, os.path.join(tmp, n), args.layers)
            ids, mask = inputs(enc, args.batch, args.seq)
            e = engines(ref, enc, ids, mask)
            err = float(np.abs(e["fasttran"]() - e["torch"]()).max())   # (and a warm-up of each)
            if err > 1e-4:
                raise SystemExit(f"{n}: fasttran differs from transformers by {err:.2e}")
            runs[n] = e
            results[n] = {"architecture": enc.architecture.name, "layers": enc.num_layers,
                          "hidden": enc.hidden_size, "vocab_size": enc.config["vocab_size"],
                          "max_error_vs_torch": err, "times": {"fasttran": [], "torch": []}}
        for r in range(args.rounds):
            for n in names:
                for eng in (("fasttran", "torch") if r % 2 == 0 else ("torch", "fasttran")):
                    time.sleep(0.2)
                    t0 = time.perf_counter()
                    runs[n][eng]()
                    results[n]["times"][eng].append(time.perf_counter() - t0)
    lines = [f"\n{args.batch} x {args.seq} tokens, {args.threads} threads, {args.rounds} interleaved rounds",
             "model | layers | fasttran s | torch (sdpa) s | torch / fasttran | max err"]
    for n in names:
        r = results[n]
        r["fasttran_median_s"] = float(np.median(r["times"]["fasttran"]))
        r["torch_median_s"] = float(np.median(r["times"]["torch"]))
        r["ratio_torch_over_fasttran"] = r["torch_median_s"] / r["fasttran_median_s"]
        lines.append(f"{n} | {r['layers']} | {r['fasttran_median_s']:.3f} | {r['torch_median_s']:.3f} | "
                     f"{r['ratio_torch_over_fasttran']:.2f}x | {r['max_error_vs_torch']:.1e}")
    print("\n".join(lines))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), **cpu_description(), "threads": args.threads,
            "rounds": args.rounds, "batch": args.batch, "seq": args.seq, "layers_override": args.layers or None,
            "fasttran": fasttran.__version__, "fasttran_kernels": fasttran.build_info()["cpu_kernels"],
            "openblas": fasttran.build_info()["blas"], "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_attention": "sdpa"}
    with open(args.output, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
