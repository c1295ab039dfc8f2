"""Where the time goes on the CPU, per backend op kind: the breakdown of the "Demystifying BERT"
paper (Pati et al., IISWC 2022: GEMMs dominate BERT training, memory-bound non-GEMM ops feature
prominently, the LAMB update is the next largest part), measured with fasttran's profiler.

  1. BERT-base (random weights, BERT-base architecture: 12 layers, hidden 768, 12 heads,
     intermediate 3072, vocab 30522): the encoder forward (batch x seq of random token ids), and
     one fused LAMB step over all 108.9 M parameters (no pooler) -- the update a full fine-tuning step ends
     with. fasttran freezes the encoder (no backward pass), so the "full fine-tuning" row is the
     measured forward plus the measured LAMB step, not a measured training step.
  2. MiniLM fine-tuning as fasttran does it (frozen all-MiniLM-L6-v2, real SST-2 sentences,
     linear head + LAMB): a training step with the encoder in the loop (no cache), and a step
     and an epoch reading the activation cache.

    python benchmarks/profile_breakdown.py [--batch 16] [--seq 128] [--threads N] [--plot out.png]
        [--out benchmarks/last_profile.json]
"""
import argparse
import datetime
import json
import os
import platform
import tempfile

import numpy as np

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.data import load_sst2, sst2_path
from fasttran.optim import make_optimizer
from fasttran.safetensors_io import write_safetensors

HERE = os.path.dirname(os.path.abspath(__file__))
BERT_BASE = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072, "hidden_act": "gelu",
             "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12}


def random_bert_base(path, seed=0):
    """A BERT-base checkpoint with random weights (N(0, 0.02) matrices, LayerNorm 1/0, zero
    biases), written as config.json + model.safetensors without torch."""
    blank = fasttran.Encoder(BERT_BASE)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, w in blank.state_dict().items():
        if "LayerNorm.weight" in name:
            tensors[name] = np.ones(w.shape, np.float32)
        elif name.endswith("weight"):
            tensors[name] = rng.normal(0, 0.02, w.shape).astype(np.float32)
        else:
            tensors[name] = np.zeros(w.shape, np.float32)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(BERT_BASE, f)
    return path


def shares(ph):
    s = ph.shares()
    gemm = s["gemm"]
    non_gemm = s["attention"] + s["row ops"] + s["copy"] + s["cache read"]
    return {"wall_seconds": ph.wall, "gemm": gemm, "attention": s["attention"], "row_ops": s["row ops"],
            "non_gemm": non_gemm, "optimizer": s["optimizer"], "other": s["other"], "coverage": ph.coverage}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="training steps measured with the encoder in the loop")
    p.add_argument("--out", default=os.path.join(HERE, "last_profile.json"))
    p.add_argument("--plot", default=None, help="also save the stacked bars to this PNG")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: fasttran's)")
    a = p.parse_args()
    if a.threads:
        fasttran.set_num_threads(a.threads)
    out = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "threads": fasttran.get_num_threads(), "fasttran": fasttran.__version__,
           "blas": fasttran.build_info()["blas"], "loadavg_before": os.getloadavg(), "batch": a.batch, "seq": a.seq}
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (a.batch, a.seq))
    mask = np.ones_like(ids)

    # ---- 1. BERT-base -------------------------------------------------------------------------
    with tempfile.TemporaryDirectory() as d:
        bert = fasttran.Encoder.from_pretrained(random_bert_base(os.path.join(d, "bert-base")))
    bert.forward(ids[:2], mask[:2])                                  # warm-up
    fwd = fasttran.profile(bert.forward, ids, mask, name="BERT-base forward", repeat=2)
    print(fwd, "\n", fwd.ops_table(), flush=True)
    params = {n: w for n, w in bert.state_dict().items()}
    n_params = sum(w.size for w in params.values())
    grads = [rng.normal(0, 1e-3, w.shape).astype(np.float32) for w in params.values()]
    opt = make_optimizer("lamb", list(params.items()), lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                         max_grad_norm=1.0)
    opt.step(grads)                                                 # warm-up (first touch of the state)
    lamb = fasttran.profile(opt.step, grads, name="LAMB, all BERT-base parameters", repeat=3)
    print(lamb, flush=True)
    f, l = fwd.phases[0], lamb.phases[0]
    total = f.wall + l.wall
    out["bert_base"] = {
        "parameters": int(n_params), "forward": shares(f), "lamb_step": shares(l),
        "forward_plus_lamb": {"wall_seconds": total, "gemm": f.kinds["gemm"] / total,
                              "non_gemm": (f.kinds["attention"] + f.kinds["row ops"] + f.kinds["copy"]) / total,
                              "lamb": l.kinds["optimizer"] / total, "other": (f.other + l.other) / total},
        "forward_ops": f.ops}

    # ---- 2. MiniLM fine-tuning on real SST-2 -------------------------------------------------------
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    s, y = load_sst2(sst2_path("train"))
    y = np.array(y)
    toks = enc.tokenize(s)
    tr = Trainer("classification", show_progress=False)
    unc = ActivationCache.uncached(enc, *toks, positions="mean")
    p_unc = tr.profile(unc, y, steps=a.steps, epoch=False)
    print(p_unc, flush=True)
    cache = ActivationCache.build(enc, *toks, positions="mean", show_progress=True)
    p_c = tr.profile(cache, y, steps=50, epoch=True, forward=False)
    print(p_c, flush=True)
    out["minilm"] = {"train_sentences": len(s), "uncached": {ph.name: shares(ph) for ph in p_unc.phases},
                     "cached": {ph.name: shares(ph) for ph in p_c.phases}}
    out["loadavg_after"] = os.getloadavg()
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", a.out)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from fasttran.profiling import Profile
        allp = Profile("CPU time per op kind")
        allp.phases = [f, l, *p_unc.phases, *p_c.phases]
        names = ["BERT-base fwd", "LAMB 110M", "MiniLM fwd", "step (no cache)", "step (cache)", "epoch (cache)"]
        for ph, n in zip(allp.phases, names):
            ph.name = n
        ax = allp.plot()
        ax.figure.set_size_inches(10, 4)
        ax.figure.savefig(a.plot, bbox_inches="tight", dpi=90)
        plt.close(ax.figure)


if __name__ == "__main__":
    main()
