"""Compression on real data: all-MiniLM-L6-v2 fine-tuned by fasttran's top-k Trainer, then
compressed, per task and seed -- dev metric (flips against the fine-tuned model counted pairwise),
CPU latency at batch 1 and batch 32 (2 threads) and size -- for: the fine-tuned model; pruned at
several levels (significance order, re-fine-tuned); int8, pruned + int8 and those with the
vocabulary pruned to the tokens of the task's whole training split; the pruned + int8 goal's rows at 6x
smaller (the vocabulary cut to the split's most used tokens; heads and FFN groups pruned by the search, with
the tokens seen twice); sign matching on the least significant heads; the search under a 0.5-point budget; and ONNX
Runtime's dynamic int8 quantization of the same fine-tuned model (and its float32), measured in the
same run. Then "train big, then compress": the 6-layer model fine-tuned and compressed to the cost of
3 layers against the 3-layer truncation fine-tuned directly for the same number of steps.

    python benchmarks/compress_table.py                        # SST-2 and MRPC, seeds 0 1 2
    python benchmarks/compress_table.py --tasks sst2 --seeds 0 --quick   # a smoke run (minutes)
    python benchmarks/compress_table.py --core --tasks mrpc --levels --cache DIR   # the goals' rows only

Writes benchmarks/last_compress_table.json and prints the table. Reads $FASTTRAN_DATA (or
../shared/data): sst2/{train,dev}.tsv, glue/MRPC/{train,dev}.tsv. Pair tasks are tokenized with
transformers' tokenizer of the model (the ids Encoder.tokenize gives for pairs too)."""
import argparse
import datetime
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

import fasttran
from fasttran import compress
from fasttran.compress.model import _with_tokenizer_of
from fasttran.compress.tasks import load_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("FASTTRAN_DATA", os.path.join(ROOT, "..", "shared", "data"))
OUT = os.path.join(ROOT, "benchmarks", "last_compress_table.json")


def load_avg():
    return os.getloadavg()[0]


def tokenize(model_dir, a, b, y, max_length):
    """TaskData through transformers' tokenizer (pairs: [CLS] a [SEP] b [SEP], token types 0 / 1)"""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(a, b, truncation=True, max_length=max_length, padding=True, return_tensors="np")
    types = enc.get("token_type_ids", np.zeros_like(enc["input_ids"]))
    return compress.TaskData(enc["input_ids"], enc["attention_mask"], types, np.asarray(y))


def finetune(encoder, train, epochs, seed, lr, layers=None, head=None):
    """fasttran's top-k Trainer over every layer (or `layers`), AdamW; returns the TaskModel (through export)"""
    k = layers or encoder.num_layers
    tr = fasttran.Trainer(head or "classification", optimizer="adamw", lr=lr, train_layers=k, epochs=epochs,
                          seed=seed, show_progress=False, num_labels=int(train.labels.max()) + 1)
    ids, mask, types = train.padded()
    t = time.perf_counter()
    cache = tr.cache_for(encoder, ids, mask, types, show_progress=False)
    tr.fit(cache, train.labels)
    secs = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        tr.export(d)
        model = _with_tokenizer_of(compress.TaskModel.load(d), encoder)
    steps = tr.global_step
    return model, {"seconds": secs, "steps": steps, "epochs": epochs, "layers": k}


def metric(model, dev, task):
    logits = model.logits(dev)
    m = compress.metrics(logits, dev.labels)
    return {"accuracy": m["accuracy"], "f1": m["f1"], "pred": logits.argmax(1)}


def flips(pred, ref_pred, labels):
    right, ref_right = pred == labels, ref_pred == labels
    return {"flipped": int((pred != ref_pred).sum()), "lost": int((ref_right & ~right).sum()),
            "gained": int((~ref_right & right).sum())}


class OrtModel:
    """ONNX Runtime session over the exported model (2 threads), evaluated and timed like a TaskModel"""

    def __init__(self, path, threads):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.size_bytes = os.path.getsize(path)

    def run(self, ids, mask, types):
        return self.sess.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]

    def logits(self, data):
        parts = [(idx, self.run(ids, mask, types)) for idx, ids, mask, types in data.batches(64)]
        out = np.empty((len(data), parts[0][1].shape[1]), np.float32)
        for idx, r in parts:
            out[idx] = r
        return out


def timed(fn, batches, repeats):
    times = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        for x in batches:
            fn(*x)
        if r:
            times.append((time.perf_counter() - t) / len(batches))
    return 1000 * float(np.median(times))


def latencies(models, data, threads, repeats, examples):
    """{name: (batch-1 ms, batch-32 ms)}: every model on the same batches of dev examples in dev order
    (mixed lengths, each padded to its longest), round-robin so the machine's load moves evenly"""
    fasttran.set_num_threads(threads)
    sets = {}
    for bs, n in ((1, examples // 2), (32, max(examples, 64))):
        batches = []
        for k in range(0, min(n, len(data)) - bs + 1, bs):
            idx = np.arange(k, k + bs)
            T = int(data.lengths[idx].max())
            mask = (np.arange(T)[None, :] < data.lengths[idx][:, None]).astype(np.int64)
            batches.append((data.ids[idx, :T], mask, data.types[idx, :T]))
        sets[bs] = batches
    out = {name: [[], []] for name in models}
    for _ in range(3):
        for name, m in models.items():
            fn = m.run if isinstance(m, OrtModel) else (lambda i, a, t, m=m: m.head.step(m.pooled(i, a, t)))
            for j, bs in enumerate((1, 32)):
                out[name][j].append(timed(fn, sets[bs], repeats))
    return {name: (float(np.median(v[0])), float(np.median(v[1]))) for name, v in out.items()}


def layer_bytes(model):
    return 4 * sum(int(np.prod(v.shape)) for k, v in model.encoder.state_dict().items() if k.startswith("encoder.layer."))


def run_seed(task, seed, args, data, log):
    train, select, dev, model_dir, vocab_data = data
    base_enc = fasttran.Encoder.from_pretrained(model_dir)
    lr, epochs = 1e-4, args.epochs[task]
    say = lambda m: (log.append(m), print(f"[{task} seed {seed}] {m}", flush=True))   # noqa: E731
    cached = None
    if args.cache:   # fine-tuning and significance are deterministic: reuse them across runs of this script
        cached = os.path.join(args.cache, f"{task}-seed{seed}-train{len(train)}-select{len(select)}-epochs{epochs}")
    if cached and os.path.exists(os.path.join(cached, "significance.pickle")):
        ft = _with_tokenizer_of(compress.TaskModel.load(os.path.join(cached, "model")), base_enc)
        with open(os.path.join(cached, "significance.pickle"), "rb") as f:
            ft_info, sig = pickle.load(f)
        say(f"fine-tuned model and significance from {cached}")
    else:
        ft, ft_info = finetune(base_enc, train, epochs, seed, lr)
        sig = None
    retrain = {"retrain_optimizer": "adamw", "retrain_lr": lr,   # re-fine-tuning as the fine-tuning
               "retrain_targets": args.retrain_targets}
    say(f"fine-tuned in {ft_info['seconds']:.0f} s ({ft_info['steps']} steps)")
    ref = metric(ft, dev, task)
    out = {"fine_tune": ft_info, "variants": {}, "load": [load_avg()]}
    models = {"fine-tuned": ft}

    # significance on the selection set (held out of train)
    if sig is None:
        sig = compress.significance(ft, select, seed=seed, show_progress=False)
        if cached:
            ft.save(os.path.join(cached, "model"))
            with open(os.path.join(cached, "significance.pickle"), "wb") as f:
                pickle.dump((ft_info, sig), f)
    out["significance"] = {"seconds": sig.seconds, "spearman": sig.agreement(), "control": sig.control,
                           "rows": sig.rows}
    say(f"significance: mask {sig.seconds['mask']:.0f} s, gradient {sig.seconds['gradient']:.1f} s, Spearman "
        + ", ".join(f"{k} {v:.2f}" for k, v in sig.agreement().items()))

    # pruned at several levels: the least significant parts until the layers' weights shrink by `level`
    lb = layer_bytes(ft)
    for level in args.levels:
        res = compress.search(ft, train, select, target_size_mb=(ft.size_bytes - level * lb) / 1e6,
                              significance=sig, retrain_epochs=args.retrain_epochs, sign_match=False, int8=False,
                              prune_vocabulary=False, seed=seed, latency_examples=64, show_progress=False, **retrain)
        models[f"pruned {int(100 * level)}%"] = res.model
        say(f"pruned {level:.0%} of the layers' weights: {res.model}")

    # int8 weights: the layers' projections and the word embeddings; pruned + int8; and with the
    # vocabulary pruned to the tokens of the task's whole training split (dev-only tokens then read [UNK])
    voc = compress.vocabulary(ft, vocab_data)
    out["vocabulary"] = {"kept": len(voc["keep"]), "of": ft.encoder.config["vocab_size"],
                         "from_examples": len(vocab_data)}
    models["int8"] = compress.quantize(ft)
    models["vocabulary + int8"] = compress.apply(ft, {"vocabulary": voc, "weights": "int8"})
    row = ft.encoder.hidden_size + 4   # an int8 embedding row and its scale
    for level in args.levels:
        name = f"pruned {int(100 * level)}%"
        models[name + " + int8"] = compress.quantize(models[name])
        models[name + " + vocabulary + int8"] = compress.apply(models[name], {"vocabulary": voc, "weights": "int8"})
        # the vocabulary filled up (the pre-training's most used tokens after the task's) to the most
        # rows that keep the model 6x smaller than the fine-tuned one: fewer unknown words, same goal
        fill = int((ft.size_bytes / 6 - compress.model.int8_size(models[name], vocab_rows=0)) // row)
        if fill > len(voc["keep"]):
            vfill = compress.vocabulary(ft, vocab_data, size=fill)
            models[name + " + vocabulary to 6x + int8"] = compress.apply(models[name], {"vocabulary": vfill,
                                                                                       "weights": "int8"})
            out.setdefault("vocabulary_to_6x", {})[name] = len(vfill["keep"])
    # no structural pruning, the vocabulary cut to the training split's most used tokens to 6x smaller
    rows6 = int((ft.size_bytes / 6 - compress.model.int8_size(ft, vocab_rows=0)) // row)
    v6 = compress.vocabulary(ft, vocab_data, size=rows6)
    models["vocabulary to 6x (most used) + int8"] = compress.apply(ft, {"vocabulary": v6, "weights": "int8"})
    out["vocabulary_most_used_to_6x"] = len(v6["keep"])

    # the pruned + int8 goal's row: the search's size target at 6x smaller than the fine-tuned model,
    # pruning heads and FFN groups only (never a whole layer), then the vocabulary (the training split's
    # tokens seen at least twice) and int8
    v2 = compress.vocabulary(ft, vocab_data, min_count=2)
    out["vocabulary_min_count_2"] = len(v2["keep"])
    res = compress.search(ft, train, select, target_size_mb=ft.size_bytes / 6 / 1e6, prune=("head", "ffn"),
                          significance=sig, retrain_epochs=args.retrain_epochs, sign_match=False,
                          prune_vocabulary=v2, seed=seed, latency_examples=64, show_progress=False, **retrain)
    name = "pruned to 6x (heads, FFN) + vocabulary (seen twice) + int8"
    models[name] = res.model
    out.setdefault("searches", {})[name] = {"met": res.met, "reason": res.reason, "plan": res.plan, "log": res.log}
    say(f"{name}: met={res.met}; {res.model}")
    if args.core:
        return finish_seed(task, ft, models, dev, ref, args, out, say)

    # sign matching on the least significant quarter / half of the heads, no re-fine-tuning
    heads = sig.order("mask", "head")
    for frac in (0.25, 0.5):
        chosen = heads[:int(frac * len(heads))]
        plan = {"sign_match_keys": args.sign_match_keys, "layers": {}}
        for _, l, h in chosen:
            plan["layers"].setdefault(str(l), {"heads": {}})["heads"][str(h)] = "sign_match"
        models[f"sign-match {int(100 * frac)}% heads (k={args.sign_match_keys})"] = compress.apply(ft, plan)

    # the search under the accuracy budget
    res = compress.search(ft, train, select, max_drop=args.max_drop, significance=sig,
                          retrain_epochs=args.retrain_epochs, seed=seed, latency_examples=64, show_progress=False,
                          **retrain)
    models[f"search (max drop {args.max_drop})"] = res.model
    out["search"] = {"met": res.met, "reason": res.reason, "plan": res.plan, "points": res.points, "log": res.log}
    say(f"search: met={res.met}; {res.model}")

    finish_seed(task, ft, models, dev, ref, args, out, say)

    # train big, then compress: 6 layers fine-tuned and compressed to 3 layers' cost, against the
    # 3-layer truncation fine-tuned directly with the same number of steps
    three = compress.apply(compress.TaskModel(base_enc, fasttran.ClassificationHead(base_enc.hidden_size,
                                                                                      int(train.labels.max()) + 1)),
                           {"layers": {"3": "prune", "4": "prune", "5": "prune"}})
    big = compress.search(ft, train, select, target_size_mb=three.size_bytes / 1e6 + 1e-3, significance=sig,
                          retrain_epochs=args.retrain_epochs, sign_match=False, int8=False, prune_vocabulary=False,
                          seed=seed, latency_examples=64, show_progress=False, **retrain)
    small, small_info = finetune(three.encoder, train, epochs + args.retrain_epochs, seed, lr)
    bm, sm_ = metric(big.model, dev, task), metric(small, dev, task)
    per_epoch = -(-len(train) // 32)   # the Trainer's batch of 32
    out["train_big"] = {"compressed": {"accuracy": bm["accuracy"], "f1": bm["f1"], "size_bytes": big.model.size_bytes,
                                       "structure": big.model.structure,
                                       "steps": ft_info["steps"] + per_epoch * args.retrain_epochs * len(
                                           big.model.info.get("retrained", []))},
                        "truncated": {"accuracy": sm_["accuracy"], "f1": sm_["f1"], "size_bytes": small.size_bytes,
                                      "steps": small_info["steps"]},
                        "epochs": {"big": [epochs, args.retrain_epochs], "small": epochs + args.retrain_epochs}}
    say(f"train big then compress: {100 * bm['accuracy']:.2f}% vs the 3-layer truncation {100 * sm_['accuracy']:.2f}%")
    out["load"].append(load_avg())
    return out


def finish_seed(task, ft, models, dev, ref, args, out, say):
    """The peer (ONNX Runtime's dynamic int8 of the same fine-tuned model, and its float32), then every
    model's dev metric, flips against the fine-tuned model, latency and size into out["variants"]."""
    with tempfile.TemporaryDirectory() as d:
        from onnxruntime.quantization import QuantType, quantize_dynamic
        f32 = compress.export_onnx(ft, os.path.join(d, "model.onnx"))
        q8 = os.path.join(d, "model.int8.onnx")
        quantize_dynamic(f32, q8, weight_type=QuantType.QInt8)
        models["ONNX Runtime float32"] = OrtModel(f32, args.threads)
        models["ONNX Runtime dynamic int8"] = OrtModel(q8, args.threads)

        # the dev metric, flips against the fine-tuned model, latency, size
        out["load"].append(load_avg())
        lat = latencies(models, dev, args.threads, args.repeats, args.latency_examples)
        out["load"].append(load_avg())
        for name, m in models.items():
            r = metric(m, dev, task) if isinstance(m, compress.TaskModel) else None
            if r is None:
                logits = m.logits(dev)
                r = {**{k: v for k, v in compress.metrics(logits, dev.labels).items() if k in ("accuracy", "f1")},
                     "pred": logits.argmax(1)}
            out["variants"][name] = {"accuracy": r["accuracy"], "f1": r["f1"], **flips(r["pred"], ref["pred"], dev.labels),
                                     "latency_b1_ms": lat[name][0], "latency_b32_ms": lat[name][1],
                                     "size_bytes": int(m.size_bytes),
                                     "structure": m.structure if isinstance(m, compress.TaskModel) else None}
    return out


def sign_match_cost(model_dir, threads, keys=(16, 32), lengths=(32, 64, 128, 256, 512), batch=8, repeats=3):
    """What sign matching buys where it can: the whole model's forward (batch of `batch` sequences of
    one length, random tokens) and its attention op alone (the backend profiler), every head exact
    against every head sign-matching `keys` keys, per sequence length; round-robin, median of
    `repeats`. Returns rows."""
    fasttran.set_num_threads(threads)
    enc = fasttran.Encoder.from_pretrained(model_dir)
    base = compress.TaskModel(enc, fasttran.ClassificationHead(enc.hidden_size, 2))
    L, H = enc.num_layers, enc.config["num_attention_heads"]
    variants = {"exact": base}
    for k in keys:
        variants[f"sign-match k={k}"] = compress.apply(base, {"sign_match_keys": k, "layers": {
            str(l): {"heads": {str(h): "sign_match" for h in range(H)}} for l in range(L)}})
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        ids = rng.integers(1000, 20000, (batch, n))
        mask, types = np.ones_like(ids), np.zeros_like(ids)
        wall = {name: [] for name in variants}
        attn = {name: [] for name in variants}
        for _ in range(repeats):
            for name, m in variants.items():
                ph = fasttran.profile(lambda m=m: m.pooled(ids, mask, types))["<lambda>"]
                wall[name].append(1000 * ph.wall)
                attn[name].append(1000 * ph.kinds["attention"])   # the attention op alone
        row = {"tokens": n, "batch": batch, "forward_ms": {k: float(np.median(v)) for k, v in wall.items()},
               "attention_ms": {k: float(np.median(v)) for k, v in attn.items()}}
        rows.append(row)
        print(f"  {n:>4} tokens x {batch}: forward " + ", ".join(f"{k} {v:.1f} ms" for k, v in row["forward_ms"].items())
              + "; attention op " + ", ".join(f"{k} {v:.1f} ms" for k, v in row["attention_ms"].items()), flush=True)
    return rows


def summarize(results):
    rows = []
    for task, seeds in results.items():
        names = list(dict.fromkeys(n for s in seeds.values() for n in s["variants"]))
        for name in names:
            have = [s for s in seeds.values() if name in s["variants"]]   # a row some seeds lack: theirs only
            acc = [s["variants"][name]["accuracy"] for s in have]
            f1 = [s["variants"][name]["f1"] for s in have]
            base = [s["variants"]["fine-tuned"]["accuracy"] for s in have]
            v0 = [s["variants"][name] for s in have]
            rows.append({"task": task, "model": name, "accuracy": float(np.mean(acc)), "accuracy_sd": float(np.std(acc)),
                         "f1": float(np.mean(f1)), "drop_points": float(100 * (np.mean(base) - np.mean(acc))),
                         "lost": float(np.mean([v["lost"] for v in v0])), "gained": float(np.mean([v["gained"] for v in v0])),
                         "latency_b1_ms": float(np.median([v["latency_b1_ms"] for v in v0])),
                         "latency_b32_ms": float(np.median([v["latency_b32_ms"] for v in v0])),
                         "size_mb": v0[0]["size_bytes"] / 1e6})
    return rows


NAMES = {"sst2": "SST-2", "mrpc": "MRPC", "cola": "CoLA"}


def markdown(rows):
    """RESULTS.md's table of `rows` (summarize's)"""
    base = {r["task"]: r for r in rows if r["model"] == "fine-tuned"}
    out = ["| task | model | dev acc % | drop | lost / gained | batch 1 ms | x | batch 32 ms | x | MB | x |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        b = base[r["task"]]
        lg = "-" if r["model"] == "fine-tuned" else f"{r['lost']:.1f} / {r['gained']:.1f}"
        out.append(f"| {NAMES.get(r['task'], r['task'])} | {r['model']} | {100 * r['accuracy']:.2f} +- "
                   f"{100 * r['accuracy_sd']:.2f} | {r['drop_points']:.2f} | {lg} | {r['latency_b1_ms']:.2f} | "
                   f"{b['latency_b1_ms'] / r['latency_b1_ms']:.2f} | {r['latency_b32_ms']:.1f} | "
                   f"{b['latency_b32_ms'] / r['latency_b32_ms']:.2f} | {r['size_mb']:.1f} | "
                   f"{b['size_mb'] / r['size_mb']:.2f} |")
    return "\n".join(out)


def print_table(rows, results):
    base = {r["task"]: r for r in rows if r["model"] == "fine-tuned"}
    print(f"\n{'task':<6}{'model':<38}{'dev acc':>14}{'drop':>7}{'lost/gained':>13}{'b1 ms':>8}{'x':>6}"
          f"{'b32 ms':>9}{'x':>6}{'MB':>7}{'x':>6}")
    for r in rows:
        b = base[r["task"]]
        print(f"{r['task']:<6}{r['model']:<38}{100 * r['accuracy']:>8.2f}+-{100 * r['accuracy_sd']:<4.2f}"
              f"{r['drop_points']:>7.2f}{r['lost']:>7.1f}/{r['gained']:<5.1f}{r['latency_b1_ms']:>8.2f}"
              f"{b['latency_b1_ms'] / r['latency_b1_ms']:>6.2f}{r['latency_b32_ms']:>9.1f}"
              f"{b['latency_b32_ms'] / r['latency_b32_ms']:>6.2f}{r['size_mb']:>7.1f}{b['size_mb'] / r['size_mb']:>6.2f}")
    runs = [(task, seed, s) for task, seeds in results.items() for seed, s in seeds.items()]
    print("\ntrain big, then compress (dev accuracy; the same number of training steps):")
    for task, seed, s in runs:
        if "train_big" not in s:   # --core
            continue
        t = s["train_big"]
        win = "compressed 6-layer" if t["compressed"]["accuracy"] > t["truncated"]["accuracy"] else (
            "3-layer truncation" if t["compressed"]["accuracy"] < t["truncated"]["accuracy"] else "tie")
        print(f"  {task} seed {seed}: 6 layers compressed to 3 layers' size {100 * t['compressed']['accuracy']:.2f}% "
              f"({t['compressed']['size_bytes'] / 1e6:.1f} MB) vs 3-layer truncation "
              f"{100 * t['truncated']['accuracy']:.2f}% ({t['truncated']['size_bytes'] / 1e6:.1f} MB): {win}")
    print("\nsignificance (per seed): time and rank agreement")
    for task, seed, s in runs:
        g = s["significance"]
        print(f"  {task} seed {seed}: mask {g['seconds']['mask']:.0f} s, gradient {g['seconds']['gradient']:.1f} s; "
              "Spearman " + ", ".join(f"{k} {v:.2f}" for k, v in g["spearman"].items()) +
              f"; random order {g['control']['random_spearman']['mean']:+.2f}+-{g['control']['random_spearman']['sd']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["sst2", "mrpc"], choices=["sst2", "mrpc", "cola"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--train-limit", type=int, default=20000, help="training examples per task (SST-2 has 67,349)")
    p.add_argument("--select", type=int, default=400, help="selection examples held out of train")
    p.add_argument("--levels", nargs="*", type=float, default=[0.25, 0.5, 0.75],
                   help="fractions of the layers' weights pruned (none: no such rows)")
    p.add_argument("--retrain-epochs", type=int, default=1)
    p.add_argument("--retrain-targets", choices=["labels", "teacher"], default="labels",
                   help="what re-fine-tuning after pruning learns: the labels, or the fine-tuned model's logits "
                        "(distillation)")
    p.add_argument("--max-drop", type=float, default=0.5)
    p.add_argument("--sign-match-keys", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-examples", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="small data, one level: a smoke run")
    p.add_argument("--core", action="store_true",
                   help="only the rows the goals name (fine-tuned, pruned, int8, pruned + int8 with and without the "
                        "vocabulary, ONNX Runtime): no sign matching (nor its cost), search or train-big rows")
    p.add_argument("--cache", metavar="DIR",
                   help="keep each seed's fine-tuned model and significance here and reuse them on the next run "
                        "with the same task, seed, sizes and epochs (both are deterministic)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--markdown", nargs="+", metavar="JSON",
                   help="only print RESULTS.md's table from these runs' files (a task's seeds from the last file "
                        "that has it)")
    args = p.parse_args()
    if args.markdown:
        results = {}
        for path in args.markdown:
            with open(path) as f:
                results.update(json.load(f)["results"])
        print(markdown(summarize(results)))
        return
    args.epochs = {"sst2": 1, "mrpc": 3, "cola": 2}
    if args.quick:
        args.train_limit, args.select, args.levels, args.latency_examples = 1200, 100, [0.5], 64
    fasttran.set_num_threads(args.threads)
    model_dir = fasttran.models.minilm_path()
    meta = {"date": datetime.date.today().isoformat(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "machine": platform.processor() or platform.machine(), "cpu_kernels": fasttran.build_info().get("cpu_kernels"),
            "threads": args.threads, "load_start": load_avg(), "python": platform.python_version(),
            "fasttran": fasttran.__version__, "args": {k: v for k, v in vars(args).items()}}
    try:
        meta["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
        with open("/proc/cpuinfo") as f:
            meta["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    for mod in ("torch", "transformers", "onnxruntime"):
        try:
            meta[mod] = __import__(mod).__version__
        except ImportError:
            meta[mod] = None
    results = {}
    sm_rows = None
    if not args.core:
        print("sign matching where sequences are long (every head of all-MiniLM-L6-v2, forward, 2 threads):")
        sm_rows = sign_match_cost(model_dir, args.threads, lengths=(32, 128) if args.quick else (32, 64, 128, 256, 512))
    for task in args.tasks:
        a, b, y = load_task(task, "train", DATA, args.train_limit)
        full = tokenize(model_dir, a, b, y, 128)
        va, vb, vy = load_task(task, "train", DATA)   # the whole training split: the vocabulary's tokens
        vocab_data = tokenize(model_dir, va, vb, vy, 128)
        da, db, dy = load_task(task, "dev", DATA)
        dev = tokenize(model_dir, da, db, dy, 128)
        results[task] = {}
        for seed in args.seeds:
            select, train = full.split(args.select, seed=seed)
            log = []
            results[task][seed] = run_seed(task, seed, args, (train, select, dev, model_dir, vocab_data), log)
            results[task][seed]["log"] = log
            meta["load_end"] = load_avg()
            rows = summarize(results)
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows, "sign_match_cost": sm_rows, "results": results}, f, indent=1,
                          default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    print_table(summarize(results), results)
    print(f"\nload average: {meta['load_start']:.2f} at the start, {meta['load_end']:.2f} at the end; wrote {args.out}")


if __name__ == "__main__":
    main()
