"""Time to accuracy: what a user gets at convergence, and how fast, against transformers' Trainer
fine-tuning every layer of the same checkpoint on the same machine and threads.

    python benchmarks/time_to_accuracy.py [--tasks mrpc stsb cola sst2 conll squad] [--seeds 0 1 2]
        [--ref-lrs 2e-5 5e-5 1e-4] [--ref-bf16] [--ks 0 1 2 3 6] [--optimizer adamw|lamb]
        [--precision float32|bfloat16] [--epochs 3] [--threads 2]
        [--train-limit N] [--dev-limit N] [--no-reference] [--json benchmarks/last_time_to_accuracy.json]
        [--plot benchmarks/time_to_accuracy.png]

Tasks (from $FASTTRAN_DATA, default ../shared/data; all-MiniLM-L6-v2), data and metrics as in
benchmarks/tasks.py, plus SST-2 (accuracy): MRPC F1, STS-B Pearson, CoLA Matthews, SST-2 accuracy,
CoNLL-2003 entity F1 (valid.txt), SQuAD F1 (FastTran's small split: the first 3,433 answer windows
of the training subset; the first 1,000 dev questions). Scores are x 100.

The reference: transformers' `Trainer` fine-tuning every layer, the standard recipe -- AdamW, each
learning rate of --ref-lrs, --epochs epochs, batch 32, 10% linear warm-up then linear decay, weight
decay 0.01, dynamic padding, float32 (--ref-bf16: torch's bf16 autocast, TrainingArguments(bf16=True))
-- with AutoModelFor{SequenceClassification, TokenClassification,
QuestionAnswering}. Its best lr is the one with the best mean of its best epoch over the seeds
every lr ran (the sweep's: seed 0 where one lr has more); its score, the mean over all of that lr's
seeds.

fasttran: `Trainer(task, train_layers=k, optimizer=--optimizer, precision=--precision)` at its
defaults otherwise, as `fasttran finetune --train-layers k` trains it (the optimizer and precision by
default finetune's, trainer.FINETUNE_DEFAULT and trainer.finetune_precision: bf16 mixed precision
where the CPU has AVX512_BF16; k > 0 sentence tasks pool [CLS] through BERT's pooler) for --epochs
epochs, k in --ks (0: the frozen encoder and a head; 6: every layer of MiniLM), its cache of layer L
- k built once per k and counted in every seed's time.

Every run records the dev score after each epoch and the wall time to that point: training only,
evaluation time taken out, the cache build included for fasttran, tokenisation excluded for both
(the same token ids feed both). Summary per task: the reference's best score; for each fasttran k
the best score and the time to reach the reference's best minus one point (mean over the seeds
that reach it; `None` when none does), and that time against the reference's own (and against the
--ref-bf16 reference's time to the same target, "reference_bf16" in the JSON). --ref-frozen-embeddings:
the reference as fasttran trains every layer (k = L) -- its embeddings frozen and their output not dropped
(fasttran's cache holds it) -- an ablation kept apart ("reference_frozen_embeddings", its best score in
the summary). Writes the JSON
after every run and a plot of score against time (matplotlib) at the end."""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks as task_data  # noqa: E402  (benchmarks/tasks.py: the data loading)
from torch_topk import engines, out_path  # noqa: E402

task_data.TASKS.setdefault("sst2", ("classification", "accuracy", "sst2"))
ALL = ("mrpc", "stsb", "cola", "sst2", "conll", "squad")


def x100(task, v):
    return float(v) if task == "squad" else 100.0 * float(v)   # squad_metrics already in percent


# ---- the reference: transformers' Trainer over every layer -----------------------------------------
class _Rows:
    """the same token ids as fasttran's, unpadded (the collator pads per batch)"""

    def __init__(self, inputs, targets, kind):
        ids, mask, types = (np.asarray(a) for a in inputs)
        n = mask.sum(1)
        self.rows = []
        for i in range(len(ids)):
            r = {"input_ids": ids[i, :n[i]], "attention_mask": mask[i, :n[i]], "token_type_ids": types[i, :n[i]]}
            if kind == "qa" and targets is not None:
                r["start_positions"], r["end_positions"] = int(targets[0][i]), int(targets[1][i])
            elif kind == "token":
                r["labels"] = np.asarray(targets[i])[:n[i]]
            elif targets is not None:
                r["labels"] = targets[i]
            self.rows.append(r)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _collate(rows):
    import torch
    T = max(len(r["input_ids"]) for r in rows)
    out = {}
    for k in rows[0]:
        if np.ndim(rows[0][k]) == 0:
            v = np.asarray([r[k] for r in rows])
            out[k] = torch.tensor(v, dtype=torch.float32 if v.dtype.kind == "f" else torch.long)
            continue
        fill = -100 if k == "labels" else 0
        out[k] = torch.tensor(np.stack([np.pad(np.asarray(r[k]), (0, T - len(r[k])), constant_values=fill)
                                        for r in rows]), dtype=torch.long)
    return out


def _logits(model, dev, kind, batch=128):
    import torch
    model.eval()
    outs = []
    with torch.no_grad():
        for i in range(0, len(dev), batch):
            b = _collate(dev.rows[i:i + batch])
            b = {k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
            o = model(**b)
            if kind == "qa":
                outs += [np.stack([s, e]) for s, e in zip(o.start_logits.numpy(), o.end_logits.numpy())]
            else:
                outs += list(o.logits.numpy())
    model.train()
    return outs


def score_reference(task, kind, outs, dev, ydev, names):
    from fasttran import metrics
    from fasttran.squad import squad_metrics
    main = task_data.TASKS[task][1]
    if kind == "qa":
        lg = []
        for f, o in enumerate(outs):
            o = o.copy()
            n = min(o.shape[1], ydev.offsets.shape[1])
            o[:, :n][:, ydev.offsets[f, :n, 0] < 0] = -np.inf   # answers only inside the context
            o[:, n:] = -np.inf
            lg.append(o)
        return x100(task, squad_metrics(ydev.postprocess(lg), ydev.examples)[main])
    if kind == "token":
        true, pred = [], []
        for r, o in zip(dev.rows, outs):
            keep = np.asarray(r["labels"]) >= 0
            true.append([names[t] for t in np.asarray(r["labels"])[keep]])
            pred.append([names[t] for t in o[:len(keep)][keep].argmax(-1)])
        return x100(task, metrics.entity_scores(true, pred)[main])
    y = np.asarray(ydev)
    p = np.stack(outs)
    p = p[:, 0] if kind == "regression" else p.argmax(-1)
    return x100(task, metrics.glue_metrics(task, y, p)[main])


def run_reference(task, path, train, dev, ydev, names, lr, seed, args):
    """[(seconds, score) after each epoch] of transformers' Trainer over every layer"""
    import torch
    import transformers as tf
    kind = {"classification": "cls", "regression": "regression", "token-classification": "token", "qa": "qa"}[
        task_data.TASKS[task][0]]
    tf.set_seed(seed)
    if kind == "qa":
        model = tf.AutoModelForQuestionAnswering.from_pretrained(path)
    elif kind == "token":
        model = tf.AutoModelForTokenClassification.from_pretrained(path, num_labels=len(names))
    else:
        model = tf.AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1 if kind == "regression" else len(names),
            problem_type="regression" if kind == "regression" else "single_label_classification")
    if args.ref_frozen_embeddings:   # as fasttran's k = L: the cached embeddings' output, neither trained nor dropped
        emb = model.base_model.embeddings
        emb.requires_grad_(False)
        emb.dropout.p = 0.0
    steps = -(-len(train) // 32) * args.epochs
    curve, clock = [], {"eval": 0.0}

    class Epochs(tf.TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_epoch_end(self, a, state, control, model=None, **kw):
            t1 = time.perf_counter()
            trained = t1 - clock["t0"] - clock["eval"]   # the earlier epochs' evaluations taken out
            curve.append((trained, score_reference(task, kind, _logits(model, dev, kind), dev, ydev, names)))
            clock["eval"] += time.perf_counter() - t1

    with tempfile.TemporaryDirectory() as tmp:
        targs = tf.TrainingArguments(
            output_dir=tmp, learning_rate=lr, num_train_epochs=args.epochs, per_device_train_batch_size=32,
            warmup_steps=int(0.1 * steps), weight_decay=0.01, lr_scheduler_type="linear", eval_strategy="no",
            save_strategy="no", logging_strategy="no", report_to=[], seed=seed, use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0, bf16=args.ref_bf16)
        torch.set_num_threads(args.threads)
        tf.Trainer(model=model, args=targs, train_dataset=train, data_collator=_collate,
                   callbacks=[Epochs()]).train()
    return curve


# ---- fasttran ------------------------------------------------------------------------------------
def run_fasttran(task, enc, tr_in, y, dv_in, ydev, names, k, seeds, args):
    """(cache build seconds, {seed: [(seconds, score) after each epoch]}) for train_layers=k"""
    import fasttran
    head_task, main, _ = task_data.TASKS[task]
    kw = dict(epochs=args.epochs, train_layers=k, show_progress=False, optimizer=args.optimizer)
    if args.eps is not None:
        kw["eps"] = args.eps
    if args.embedding_dropout is not None:
        kw["embedding_dropout"] = args.embedding_dropout
    kw["train_embeddings"] = (fasttran.trainer.finetune_embeddings(k, enc.num_layers) if args.train_embeddings is None
                              else bool(args.train_embeddings) and k == enc.num_layers)
    precision = args.precision or fasttran.trainer.finetune_precision(k)   # a head alone: float32
    if precision != "float32":
        kw["precision"] = precision
    if k and head_task in ("classification", "regression"):   # as `fasttran finetune`: [CLS] through BERT's pooler
        kw.update(pooling="cls", pooler=True)
    if names is not None and head_task not in ("regression", "qa"):
        kw["label_names"] = names
    proto = fasttran.Trainer(head_task, seed=0, **kw)

    t0 = time.perf_counter()
    cache = proto.cache_for(enc, *tr_in, show_progress=False)   # k = 0: the frozen encoder's features
    build = time.perf_counter() - t0
    dev = proto.cache_for(enc, *dv_in, show_progress=False)   # evaluation: not counted
    curves = {}
    for seed in seeds:
        t = fasttran.Trainer(head_task, seed=seed, **kw)
        hist = t.fit(cache, y, eval=(dev, ydev))
        trained = build + np.cumsum([h["seconds"] for h in hist])   # each epoch's training, its evaluation apart
        curves[seed] = [(float(s), x100(task, h["eval_" + main])) for s, h in zip(trained, hist)]
    return build, curves


# ---- the summary ---------------------------------------------------------------------------------
def first_time(curve, target):
    return next((s for s, v in curve if v >= target), None)


def summarize(row):
    ref = {lr: c for lr, c in row.get("reference", {}).items() if c}   # learning rates with finished runs
    out = {}
    if ref:   # the best lr on the seeds every lr ran (the sweep's), its score over all of its seeds
        common = set.intersection(*(set(c) for c in ref.values()))
        best_lr = max(ref, key=lambda lr: np.mean([max(v for _, v in c) for s, c in ref[lr].items()
                                                   if s in common or not common]))
        rbest = float(np.mean([max(v for _, v in c) for c in ref[best_lr].values()]))
        target = rbest - 1.0
        rt = [first_time(c, target) for c in ref[best_lr].values()]
        rt = [t for t in rt if t is not None]
        out.update(reference_best_lr=float(best_lr), reference_best=rbest, target=target,
                   reference_time_to_target=float(np.mean(rt)) if rt else None)
    bf = {lr: c for lr, c in row.get("reference_bf16", {}).items() if c}   # --ref-bf16 runs: the float32
    if bf:                                                                # reference's target, when it has one
        best_bf = max(bf, key=lambda lr: np.mean([max(v for _, v in c) for c in bf[lr].values()]))
        bbest = float(np.mean([max(v for _, v in c) for c in bf[best_bf].values()]))
        out.setdefault("target", bbest - 1.0)
        bt = [t for t in (first_time(c, out["target"]) for c in bf[best_bf].values()) if t is not None]
        out.update(reference_bf16_best_lr=float(best_bf), reference_bf16_best=bbest,
                   reference_bf16_seeds=len(bf[best_bf]),
                   reference_bf16_time_to_target=float(np.mean(bt)) if bt else None)
    for key in ("reference_frozen_embeddings",):   # ablations: each lr's mean best
        for lr, c in row.get(key, {}).items():
            if c:
                out[f"{key}_best"] = {**out.get(f"{key}_best", {}),
                                      lr: float(np.mean([max(v for _, v in x) for x in c.values()]))}
    for name, per_k in row.get("fasttran_ablations", {}).items():   # fasttran's ablations: each k's mean best
        out.setdefault("fasttran_ablations_best", {})[name] = {
            k: float(np.mean([max(v for _, v in c) for c in curves.values()])) for k, (_, curves) in per_k.items()}
    for k, (build, curves) in row["fasttran"].items():
        best = float(np.mean([max(v for _, v in c) for c in curves.values()]))
        d = {"best": best, "cache_build_s": build, "total_s": float(np.mean([c[-1][0] for c in curves.values()]))}
        if "target" in out:
            ts = [first_time(c, out["target"]) for c in curves.values()]
            reached = [t for t in ts if t is not None]
            d["seeds_reaching_target"] = len(reached)
            d["time_to_target"] = float(np.mean(reached)) if reached else None
            if reached and out.get("reference_time_to_target"):
                d["speedup_to_target"] = out["reference_time_to_target"] / d["time_to_target"]
            if reached and out.get("reference_bf16_time_to_target"):
                d["speedup_to_target_vs_bf16"] = out["reference_bf16_time_to_target"] / d["time_to_target"]
            if ref:
                d["gap_to_reference"] = best - out["reference_best"]
        out[f"k={k}"] = d
    if "finetune_default_k" in row:   # the row `fasttran finetune` trains without --train-layers
        out["finetune_default"] = f"k={row['finetune_default_k']}"
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        s = row["summary"]
        if row.get("reference"):
            lr = str(s["reference_best_lr"]) if str(s["reference_best_lr"]) in row["reference"] else \
                next(iter(row["reference"]))
            for c in row["reference"][lr].values():
                ax.plot(*zip(*c), "k.-", alpha=0.6, label=f"transformers Trainer, all layers, lr {lr}")
        for lr, cs in row.get("reference_bf16", {}).items():
            for c in cs.values():
                ax.plot(*zip(*c), ".--", color="0.5", alpha=0.7,
                        label=f"transformers Trainer, all layers, lr {lr}, bf16 autocast")
        if "target" in s:
            ax.axhline(s["target"], color="k", lw=0.6, ls=":")
        ks = sorted({int(k) for r in rows for k in r["fasttran"]})   # one colour per k across the panels
        for k, (_, curves) in row["fasttran"].items():
            for j, c in enumerate(curves.values()):
                ax.plot(*zip(*c), ".-", color=f"C{ks.index(int(k))}", alpha=0.7,
                        label=f"fasttran k={k}" if j == 0 else None)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())   # decades only: no crowded labels
        ax.set_title(f"{row['task']} ({row['metric']} x 100)")
        ax.set_xlabel("seconds (training, cache build included)")
        h, lab = ax.get_legend_handles_labels()
        uniq = dict(zip(lab, h))
        ax.legend(uniq.values(), uniq.keys(), fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="*", default=list(ALL), choices=list(ALL))
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--ref-lrs", type=float, nargs="*", default=[2e-5, 5e-5, 1e-4])
    ap.add_argument("--ks", type=int, nargs="*", default=None, help="layers fasttran trains (default 0 1 2 L/2 L)")
    ap.add_argument("--optimizer", default=None, choices=["adamw", "lamb"],
                    help="fasttran's optimizer (default: fasttran finetune's, trainer.FINETUNE_DEFAULT)")
    ap.add_argument("--precision", default=None, choices=["float32", "bfloat16", "float16"],
                    help="the trained layers' products (default: fasttran finetune's, trainer.finetune_precision: "
                         "bf16 mixed precision where the CPU has AVX512_BF16, else float32)")
    ap.add_argument("--eps", type=float, default=None,
                    help="fasttran's optimizer eps (default: the Trainer's); the reference's is torch AdamW's 1e-8")
    ap.add_argument("--embedding-dropout", type=float, default=None,
                    help="fasttran's dropout on the embeddings' output at k = L, as the reference's embeddings drop "
                         "theirs (an ablation; default the Trainer's, 0)")
    ap.add_argument("--train-embeddings", type=int, choices=[0, 1], default=None,
                    help="fasttran at k = L: train the embeddings too (1) or not (0); default: finetune's "
                         "(trainer.finetune_embeddings)")
    ap.add_argument("--ref-bf16", action="store_true",
                    help="the reference in bf16 mixed precision (TrainingArguments(bf16=True): torch's autocast)")
    ap.add_argument("--ref-frozen-embeddings", action="store_true",
                    help="the reference with its embeddings frozen and undropped, as fasttran's k = L (an ablation)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-limit", type=int, default=None, help="the first N training examples of each task")
    ap.add_argument("--dev-limit", type=int, default=None, help="the first N dev examples (not SQuAD's questions)")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--json", default=out_path("last_time_to_accuracy.json"))
    ap.add_argument("--plot", default=out_path("time_to_accuracy.png"))
    ap.add_argument("--merge", nargs="+", metavar="PART", default=None,
                    help="run nothing: fold these earlier runs' JSON files into --json and remake its plot")
    ap.add_argument("--note", default=None, help="with --merge: when and beside what the parts ran")
    ap.add_argument("--ablation", default=None, help="with --merge: file the parts' fasttran runs as this ablation")
    args = ap.parse_args()
    if args.merge:
        meta, rows = merge(args.json, args.merge, args.note, args.ablation)
        _save(args.json, meta, rows)
        if args.plot:
            plot(rows, args.plot)
        print(f"merged {len(args.merge)} file(s) into {args.json}" + (f"; plot: {args.plot}" if args.plot else ""))
        return
    import fasttran
    import torch
    import transformers
    if args.optimizer is None:
        args.optimizer = fasttran.trainer.FINETUNE_DEFAULT["optimizer"]
    path, enc = engines(args.threads)
    L = enc.num_layers
    ks = args.ks if args.ks is not None else sorted({0, 1, 2, L // 2, L})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": args.threads, "epochs": args.epochs, "seeds": args.seeds,
            "ref_lrs": args.ref_lrs, "ref_bf16": args.ref_bf16,
            "ref_frozen_embeddings": args.ref_frozen_embeddings, "ks": ks, "optimizer": args.optimizer,
            "eps": args.eps if args.eps is not None else fasttran.Trainer().eps,
            "embedding_dropout": (args.embedding_dropout if args.embedding_dropout is not None
                                  else fasttran.Trainer().embedding_dropout),
            "train_embeddings": (bool(args.train_embeddings) if args.train_embeddings is not None
                                 else f"finetune's ({fasttran.trainer.FINETUNE_DEFAULT['embeddings']} at k = L)"),
            "precision": args.precision or f"finetune's ({fasttran.trainer.finetune_precision(1)} for k > 0)",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "fasttran": fasttran.__version__, "command": " ".join(sys.argv)}
    rows = []
    for task in args.tasks:
        tr_in, y, dv_in, ydev, names = task_data.load(task, enc, args.train_limit)
        if args.dev_limit and task != "squad":
            dv_in = tuple(np.asarray(a)[:args.dev_limit] for a in dv_in)
            ydev = ydev[:args.dev_limit]
        row = {"task": task, "metric": task_data.TASKS[task][1], "train": len(tr_in[0]), "dev": len(dv_in[0]),
               "finetune_default_k": fasttran.trainer.finetune_layers(L, len(tr_in[0])),   # finetune's depth here
               "load_avg_before": os.getloadavg(), "fasttran": {}, "reference": {}, "reference_bf16": {},
               "reference_frozen_embeddings": {}}
        rows.append(row)
        kind = task_data.TASKS[task][0]
        for k in ks:
            build, curves = run_fasttran(task, enc, tr_in, y, dv_in, ydev, names, k, args.seeds, args)
            row["fasttran"][k] = (build, curves)
            print(f"{task} fasttran k={k}: cache {build:.1f} s; " + "; ".join(
                f"seed {s}: " + " ".join(f"{v:.1f}@{t:.0f}s" for t, v in c) for s, c in curves.items()), flush=True)
            _save(args.json, meta, rows)
        if not args.no_reference:
            tkind = {"classification": "cls", "regression": "regression", "token-classification": "token",
                     "qa": "qa"}[kind]
            train = _Rows(tr_in, y, tkind)
            dev = _Rows(dv_in, None if tkind == "qa" else ydev, tkind)
            for lr in args.ref_lrs:
                refs = row["reference_frozen_embeddings" if args.ref_frozen_embeddings else
                           "reference_bf16" if args.ref_bf16 else "reference"]
                refs[str(lr)] = {}
                for seed in args.seeds:
                    c = run_reference(task, path, train, dev, ydev, names, lr, seed, args)
                    refs[str(lr)][seed] = c
                    print(f"{task} transformers{' bf16' if args.ref_bf16 else ''}"
                          f"{' frozen embeddings' if args.ref_frozen_embeddings else ''} lr {lr:g} seed {seed}: "
                          + " ".join(f"{v:.1f}@{t:.0f}s" for t, v in c), flush=True)
                    _save(args.json, meta, rows)
        row["load_avg_after"] = os.getloadavg()
        _save(args.json, meta, rows)
    print("\n| task | reference best (lr) | its time to best - 1 | fasttran k: best, time to best - 1, speed-up |")
    print("|---|---|---|---|")
    for r in rows:
        s = r["summary"]
        ref = (f"{s['reference_best']:.1f} ({s['reference_best_lr']:g}) | "
               f"{s['reference_time_to_target'] or float('nan'):.0f} s") if "reference_best" in s else "- | -"
        fast = "; ".join(f"{k}{' (default)' if s.get('finetune_default') == k else ''}: {d['best']:.1f}, " + (f"{d['time_to_target']:.0f} s, {d.get('speedup_to_target', 0):.1f}x"
                                                      if d.get("time_to_target") else "not reached")
                         for k, d in s.items() if k.startswith("k="))
        print(f"| {r['task']} | {ref} | {fast} |")
    if args.plot:
        plot(rows, args.plot)
        print("plot:", args.plot)


def merge(into, parts, note=None, ablation=None):
    """Fold the runs of earlier invocations' JSON files (`parts`) into the table at `into`: each run
    adds its seeds' curves beside those already there (fasttran's per k, the reference's per lr and
    variant), a seed run again replacing its old curve; its meta and load averages are kept, with
    `note` (when and beside what it ran), and `ablation` files its fasttran runs under
    fasttran_ablations[ablation] instead. Summaries and the plot are remade from the whole."""
    if os.path.exists(into):
        with open(into) as f:
            table = json.load(f)
        meta = table["meta"] if isinstance(table["meta"], list) else [table["meta"]]
        rows = table["rows"]
    else:
        meta, rows = [], []
    by_task = {r["task"]: r for r in rows}
    for part in parts:
        with open(part) as f:
            d = json.load(f)
        for m in d["meta"] if isinstance(d["meta"], list) else [dict(d["meta"], file=os.path.basename(part))]:
            meta.append(dict(m, note=note) if note else m)
        for prow in d["rows"]:
            row = by_task.get(prow["task"])
            if row is None:
                row = {k: prow[k] for k in ("task", "metric", "train", "dev")}
                row.update(fasttran={}, reference={})
                by_task[prow["task"]] = row
                rows.append(row)
            if (row["train"], row["dev"]) != (prow["train"], prow["dev"]):
                raise SystemExit(f"{part}: {prow['task']} ran on {prow['train']} / {prow['dev']} examples, the "
                                 f"table's on {row['train']} / {row['dev']}: not the same task")
            if "finetune_default_k" in prow:
                row["finetune_default_k"] = prow["finetune_default_k"]
            row.setdefault("runs", []).extend(prow.get("runs") or [{
                "file": os.path.basename(part), "load_avg_before": prow.get("load_avg_before"),
                "load_avg_after": prow.get("load_avg_after")}])
            ft = row.setdefault("fasttran_ablations", {}).setdefault(ablation, {}) if ablation else row["fasttran"]
            for k, run in prow["fasttran"].items():
                _fold(ft, k, run)
            for name, per_k in ({} if ablation else prow.get("fasttran_ablations", {})).items():
                for k, run in per_k.items():
                    _fold(row.setdefault("fasttran_ablations", {}).setdefault(name, {}), k, run)
            for key in ("reference", "reference_bf16", "reference_frozen_embeddings"):
                for lr, curves in prow.get(key, {}).items():
                    if curves:
                        row.setdefault(key, {}).setdefault(lr, {}).update(curves)
    return meta, rows


def _fold(per_k, k, run):
    """Add one part's fasttran run of depth k, [cache build s, {seed: curve}], to per_k: its seeds'
    curves replace those run again; the k's cache build time becomes the part's where the part runs
    every seed per_k holds for k again (each curve counts its own build either way)."""
    build, curves = run
    entry = per_k.setdefault(k, [build, {}])
    if set(entry[1]) <= set(curves):
        entry[0] = build
    entry[1].update(curves)


def _save(path, meta, rows):
    for r in rows:
        r["summary"] = summarize(r)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
