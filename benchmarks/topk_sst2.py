"""Top-k fine-tuning on real SST-2: fasttran's Trainer(train_layers=k) against the same
configuration in PyTorch + transformers, from the same initial weights, inputs, batch order and
hyper-parameters; dev accuracy and per-epoch times side by side, the cache build included.

    python benchmarks/topk_sst2.py [--k 0 1 2 6] [--epochs 1] [--lr 5e-5] [--seed 0] [--dropout 0.1]
                                   [--limit N] [--threads 2]

Data: $FASTTRAN_DATA/sst2/{train,dev}.tsv (default ../shared/data). Model: all-MiniLM-L6-v2.
fasttran: the cache of layer L - k (every token's state, float32) is built once; every epoch reads
it and trains the top k layers + a linear head on mean-pooled outputs with AdamW (weight decay 0.01
except biases and LayerNorm, clipping at 1.0, linear schedule with 10% warmup, dropout 0.1 in the
layers and before the head, --dropout). PyTorch: transformers' BertLayer modules of the same top k layers and
an nn.Linear with the head's initial weights, fed the same cached states (padded batches with an
attention mask), the same examples in the same order per step, torch.optim.AdamW with the same
parameter groups and schedule; its dropout draws from torch's generator (the only difference;
--dropout 0 makes both runs the same computation up to fp32 rounding).
The frozen-encoder baseline (k = 0: a head on mean-pooled final states) is trained the same way.
Writes benchmarks/last_topk_sst2.json."""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from torch_topk import engines, out_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("FASTTRAN_DATA", os.path.join(ROOT, "..", "shared", "data"))


def load(split, limit=None):
    from fasttran.data import load_sst2
    s, y = load_sst2(os.path.join(DATA, "sst2", f"{split}.tsv"))
    if limit:
        s, y = s[:limit], y[:limit]
    return s, np.asarray(y, np.int32)


def run_fasttran(enc, k, tr_inputs, y, dev_inputs, ydev, args):
    import fasttran
    t = fasttran.Trainer("classification", optimizer="adamw", lr=args.lr, epochs=args.epochs, batch_size=32,
                         seed=args.seed, train_layers=k, dropout=args.dropout, layer_dropout=args.dropout,
                         show_progress=False, warmup=0.1, weight_decay=0.01, max_grad_norm=1.0)
    t0 = time.perf_counter()
    if k:
        cache = t.cache_for(enc, *tr_inputs, show_progress=False)
        dev = t.cache_for(enc, *dev_inputs, show_progress=False)
    else:
        cache = fasttran.ActivationCache.build(enc, *tr_inputs, positions="mean", show_progress=False)
        dev = fasttran.ActivationCache.build(enc, *dev_inputs, positions="mean", show_progress=False)
    build = time.perf_counter() - t0
    hist = t.fit(cache, y, eval=(dev, ydev))
    return t, cache, dev, build, hist


def torch_reference(enc_path, k, cache, y, dev, ydev, init_head, args):
    """The same configuration in PyTorch (benchmarks/torch_topk.py): (per-epoch seconds, dev accuracy per epoch)."""
    import fasttran
    from fasttran.trainer import _epoch_seed
    from torch_topk import TorchTopK
    head = fasttran.ClassificationHead(init_head["classifier.weight"].shape[1], 2, dropout=args.dropout)
    head.load_state_dict(init_head)
    ref = TorchTopK(enc_path, k, head, args.lr, args.epochs, (len(cache) + 31) // 32, dropout=args.dropout,
                    seed=args.seed)
    prep = head.prepare(cache, y)
    seconds, accs = [], []
    for epoch in range(args.epochs):
        seconds.append(ref.train_epoch(cache, prep, cache.epoch_order(_epoch_seed(args.seed, epoch))))
        accs.append(float((ref.outputs(dev).argmax(1) == ydev).mean()))
        print(f"  torch k={k} epoch {epoch + 1}: {seconds[-1]:.1f} s, dev accuracy {accs[-1]:.4f}", flush=True)
    return seconds, accs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, nargs="*", default=[0, 1, 2, 6])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--head-lr", type=float, default=None, help="lr of the k=0 frozen baseline (default: the Trainer's)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=0.1,
                    help="dropout in the layers and before the head, both engines (0: the same computation "
                         "in both, up to fp32 rounding)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=out_path("last_topk_sst2.json"))
    args = ap.parse_args()
    import fasttran
    import torch
    path, enc = engines(args.threads)
    s, y = load("train", args.limit)
    sd, ydev = load("dev")
    tr_inputs, dev_inputs = enc.tokenize(s), enc.tokenize(sd)
    print(f"SST-2: {len(s)} train, {len(sd)} dev sentences; MiniLM, {args.threads} threads, lr {args.lr}, "
          f"{args.epochs} epoch(s)", flush=True)
    rows = []
    for k in args.k:
        lr = args.lr if k else (args.head_lr or fasttran.trainer.default_lr("adamw", "classification"))
        a = argparse.Namespace(**dict(vars(args), lr=lr))
        t, cache, dev, build, hist = run_fasttran(enc, k, tr_inputs, y, dev_inputs, ydev, a)
        row = {"k": k, "lr": lr, "cache_build_s": build,
               "fasttran_epoch_s": [h["seconds"] for h in hist],
               "fasttran_dev_accuracy": [h["eval_accuracy"] for h in hist]}
        print(f"fasttran k={k}: cache {build:.1f} s, epochs {[round(v, 1) for v in row['fasttran_epoch_s']]} s, "
              f"dev accuracy {row['fasttran_dev_accuracy']}", flush=True)
        if not args.no_torch:
            init = fasttran.ClassificationHead(enc.hidden_size, 2, dropout=args.dropout, seed=args.seed).state_dict()
            secs, accs = torch_reference(path, k, cache, y, dev, ydev, init, a)
            row.update(torch_epoch_s=secs, torch_dev_accuracy=accs,
                       gap_points=100 * (row["fasttran_dev_accuracy"][-1] - accs[-1]))
        rows.append(row)
        del cache, dev, t
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "threads": args.threads, "train": len(s), "dev": len(sd), "epochs": args.epochs,
            "seed": args.seed, "dropout": args.dropout,
            "torch": torch.__version__, "load_avg": os.getloadavg(), "command": " ".join(sys.argv)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n| k | cache build s | fasttran s/epoch | torch s/epoch | fasttran dev acc | torch dev acc |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['cache_build_s']:.0f} | {np.mean(r['fasttran_epoch_s']):.0f} | "
              f"{np.mean(r.get('torch_epoch_s', [float('nan')])):.0f} | {r['fasttran_dev_accuracy'][-1]:.4f} | "
              f"{r.get('torch_dev_accuracy', [float('nan')])[-1]:.4f} |")


if __name__ == "__main__":
    main()
