"""The tasks people fine-tune for, on real data: fasttran's Trainer(task, train_layers=k) against the
same training in PyTorch + transformers (benchmarks/torch_topk.py: same checkpoint, same top k
layers, same initial head, same cached inputs, same batches in the same order, same AdamW
hyper-parameters and schedule; dropout masks from each engine's generator), several seeds; dev
metric per epoch and seconds per epoch of both, in the same run.

    python benchmarks/tasks.py [--tasks mrpc stsb cola conll conll-types squad] [--k 2] [--seeds 0 1 2]
                               [--epochs 3] [--lr 1e-4] [--limit N] [--threads 2] [--no-torch]

Tasks (from $FASTTRAN_DATA, default ../shared/data; all-MiniLM-L6-v2; mean pooling, linear head):
  mrpc         GLUE MRPC sentence pairs, paraphrase or not: accuracy and F1
  stsb         GLUE STS-B sentence pairs, similarity 0-5: regression, Pearson and Spearman
  cola         GLUE CoLA single sentences, acceptable or not: Matthews correlation
  conll        CoNLL-2003 named entities (IOB2, 9 tags), a label per word: entity F1 (seqeval's rules)
  conll-types  CoNLL-2003 sentences labelled with the entity types they hold (PER, ORG, LOC, MISC;
               none, one or several): multi-label, micro / macro F1
  squad        SQuAD v1.1: FastTran's "small" split (the first 3,433 answer windows of the training
               subset, 384 tokens, stride 128) and the first 1,000 dev questions: exact match and F1
Dev sets: GLUE's dev files; CoNLL's valid.txt. Writes benchmarks/last_tasks.json."""
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
TYPES = ("PER", "ORG", "LOC", "MISC")

#: task -> (Trainer task, the metric reported first, GLUE / CoNLL files)
TASKS = {"mrpc": ("classification", "f1", "glue/MRPC"), "stsb": ("regression", "pearson", "glue/STS-B"),
         "cola": ("classification", "matthews_corrcoef", "glue/CoLA"),
         "conll": ("token-classification", "f1", "conll2003"), "conll-types": ("multi-label", "micro_f1", "conll2003"),
         "squad": ("qa", "f1", "squad")}


def load(task, enc, limit=None):
    """(train inputs, train targets, dev inputs, dev targets, label_names)"""
    from fasttran import readers
    d = os.path.join(DATA, TASKS[task][2])
    if task == "squad":
        from fasttran.squad import SquadFeatures, load_squad
        tr = SquadFeatures(load_squad(os.path.join(d, "train-subset-v1.1.json")), enc.tokenizer, max_length=384,
                           doc_stride=128).with_answers()
        n = min(limit or 3433, 3433)
        inputs = (tr.input_ids[:n], tr.attention_mask[:n], tr.token_type_ids[:n])
        dv = SquadFeatures(load_squad(os.path.join(d, "dev-v1.1.json"))[:1000], enc.tokenizer, max_length=384,
                           doc_stride=128)
        return inputs, (tr.start_positions[:n], tr.end_positions[:n]), \
            (dv.input_ids, dv.attention_mask, dv.token_type_ids), dv, None
    if task.startswith("conll"):
        tr = readers.read_conll(os.path.join(d, "train.txt"), limit=limit)
        dv = readers.read_conll(os.path.join(d, "valid.txt"), label_names=tr.label_names)
        if task == "conll":
            a, b = enc.tokenize_words(tr.words, tr.labels), enc.tokenize_words(dv.words, dv.labels)
            return tuple(a)[:3], a.labels, tuple(b)[:3], b.labels, tr.label_names

        def types(ex):
            names = np.array(ex.label_names)
            return np.array([[any(str(t).endswith("-" + ty) for t in names[lab]) for ty in TYPES] for lab in ex.labels],
                            np.float32)
        return enc.tokenize(tr.texts or [" ".join(w) for w in tr.words]), types(tr), \
            enc.tokenize([" ".join(w) for w in dv.words]), types(dv), list(TYPES)
    tr = readers.read_glue_tsv(os.path.join(d, "train.tsv"), limit=limit)
    dv = readers.read_glue_tsv(os.path.join(d, "dev.tsv"), label_names=tr.label_names)
    return (enc.tokenize(tr.texts, tr.text_pairs), tr.labels, enc.tokenize(dv.texts, dv.text_pairs), dv.labels,
            tr.label_names if TASKS[task][0] == "classification" else None)


def run_task(task, enc, path, args):
    import fasttran
    from fasttran.trainer import _epoch_seed
    head_task, main, _ = TASKS[task]
    tr_in, y, dv_in, ydev, names = load(task, enc, args.limit)
    kw = dict(optimizer="adamw", lr=args.lr, epochs=args.epochs, batch_size=32, train_layers=args.k,
              dropout=args.dropout, layer_dropout=args.dropout, warmup=0.1, weight_decay=0.01, max_grad_norm=1.0,
              show_progress=False)
    if names is not None and head_task != "regression":
        kw["label_names"] = names
    t0 = time.perf_counter()
    proto = fasttran.Trainer(head_task, seed=0, **kw)
    cache = proto.cache_for(enc, *tr_in, show_progress=False)
    dev = proto.cache_for(enc, *dv_in, show_progress=False)
    build = time.perf_counter() - t0
    print(f"{task}: {len(cache)} train / {len(dev)} dev examples, {int(cache.lengths.sum()):,} train tokens; cache "
          f"of layer {cache.layer}: {build:.1f} s", flush=True)
    row = {"task": task, "head": head_task, "metric": main, "train": len(cache), "dev": len(dev),
           "train_tokens": int(cache.lengths.sum()), "cache_build_s": build, "seeds": []}
    for seed in args.seeds:
        t = fasttran.Trainer(head_task, seed=seed, **kw)
        hist = t.fit(cache, y, eval=(dev, ydev))
        rec = {"seed": seed, "fasttran_epoch_s": [h["seconds"] for h in hist],
               "fasttran": [{k[5:]: h[k] for k in h if k.startswith("eval_") and not k.endswith("seconds")}
                            for h in hist]}
        print(f"  fasttran seed {seed}: {[round(h['seconds'], 1) for h in hist]} s/epoch, dev {main} "
              f"{[round(h['eval_' + main], 4) for h in hist]}", flush=True)
        if not args.no_torch:
            from torch_topk import TorchTopK
            head = fasttran.heads.Head.from_config(t.head.config())   # the Trainer's initial head
            fresh = fasttran.Trainer(head_task, seed=seed, **kw)
            fresh.head = fresh._new_head(cache, y)
            fresh.head.start_from(fresh.head.prepare(cache, y))   # as fit() starts it
            head.params[...] = fresh.head.params
            ref = TorchTopK(path, args.k, head, args.lr, args.epochs, (len(cache) + 31) // 32, dropout=args.dropout,
                            seed=seed)
            prep, dprep = head.prepare(cache, y), head.prepare_eval(dev, ydev)
            secs, evals = [], []
            for epoch in range(args.epochs):
                secs.append(ref.train_epoch(cache, prep, cache.epoch_order(_epoch_seed(seed, epoch))))
                evals.append({k: v for k, v in head.evaluate(ref.outputs(dev), ydev, dprep).items()
                              if not isinstance(v, (dict, np.ndarray))})
            rec.update(torch_epoch_s=secs, torch=evals)
            print(f"  torch    seed {seed}: {[round(s, 1) for s in secs]} s/epoch, dev {main} "
                  f"{[round(e[main], 4) for e in evals]}", flush=True)
        row["seeds"].append(rec)
    return row


def summary(row):
    m = row["metric"]
    f = [s["fasttran"][-1][m] for s in row["seeds"]]
    out = {"fasttran_mean": float(np.mean(f)), "fasttran_min": float(np.min(f)), "fasttran_max": float(np.max(f)),
           "fasttran_epoch_s": float(np.median([np.median(s["fasttran_epoch_s"]) for s in row["seeds"]]))}
    if all("torch" in s for s in row["seeds"]):
        p = [s["torch"][-1][m] for s in row["seeds"]]
        out.update(torch_mean=float(np.mean(p)), torch_min=float(np.min(p)), torch_max=float(np.max(p)),
                   torch_epoch_s=float(np.median([np.median(s["torch_epoch_s"]) for s in row["seeds"]])))
        out["speedup"] = out["torch_epoch_s"] / out["fasttran_epoch_s"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--limit", type=int, default=None, help="the first N training examples of each task")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=out_path("last_tasks.json"))
    args = ap.parse_args()
    import fasttran
    import torch
    path, enc = engines(args.threads)
    rows = []
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "threads": args.threads, "k": args.k, "epochs": args.epochs, "lr": args.lr, "dropout": args.dropout,
            "seeds": args.seeds, "torch": torch.__version__, "command": " ".join(sys.argv)}
    for task in args.tasks:
        load_before = os.getloadavg()
        row = run_task(task, enc, path, args)
        row["load_avg"] = [load_before, os.getloadavg()]
        row["summary"] = summary(row)
        rows.append(row)
        with open(args.out, "w") as f:   # after every task: a long run keeps what it has
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n| task | metric | fasttran (mean, min-max over seeds {args.seeds}) | PyTorch | fasttran s/epoch | "
          "PyTorch s/epoch | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"]
        torch_cols = (f"{s['torch_mean']:.4f} ({s['torch_min']:.4f}-{s['torch_max']:.4f}) | {s['fasttran_epoch_s']:.1f} "
                      f"| {s['torch_epoch_s']:.1f} | {s['speedup']:.2f}x") if "torch_mean" in s else \
            f"- | {s['fasttran_epoch_s']:.1f} | - | -"
        print(f"| {r['task']} | {r['metric']} | {s['fasttran_mean']:.4f} ({s['fasttran_min']:.4f}-"
              f"{s['fasttran_max']:.4f}) | {torch_cols} |")


if __name__ == "__main__":
    main()
