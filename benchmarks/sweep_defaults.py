"""The learning-rate sweep behind the Trainer's defaults (fasttran.trainer.DEFAULT_LR).

Frozen all-MiniLM-L6-v2, mean-pooled features of all 67,349 SST-2 train sentences (cached
once in a persistent directory and reused), dev accuracy on the 872 dev sentences; every
other hyper-parameter at the Trainer's default (3 epochs, batch 32, linear schedule with 10%
warmup, weight decay 0.01, dropout 0.1, max_grad_norm 1.0). Grid: optimizer x head x lr x seed.
QA (extractive, SQuAD v1.1): a smaller grid on a subset (--qa-train questions of
train-subset-v1.1.json, --qa-dev questions of dev-v1.1.json), float16 token caches.

    python benchmarks/sweep_defaults.py [--data DIR] [--cache-dir /tmp/fasttran-sweep-cache]
        [--seeds 0 1 2] [--only sst2|qa] [--check-defaults]

Writes benchmarks/defaults_sweep.json (every run) and benchmarks/defaults_sweep.md (tables,
the chosen lr per optimizer and head, and the Trainer's defaults rerun as the acceptance check).
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.data import load_sst2

HERE = os.path.dirname(os.path.abspath(__file__))
GRID = {
    "lamb": [1e-3, 3e-3, 1e-2, 2e-2, 5e-2, 1e-1, 2e-1],
    "adamw": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2],
}
QA_GRID = {"lamb": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0], "adamw": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]}


def sst2_caches(enc, data, cache_dir, sample=False):
    """Train and dev caches: all of SST-2 train, or (sample=True) the 4,000-sentence sample
    fasttran ships for its demo; the dev set is the same 872 sentences."""
    from fasttran.data import sst2_path
    s, y = load_sst2(sst2_path("train") if sample else os.path.join(data, "sst2", "train.tsv"))
    sd, yd = load_sst2(os.path.join(data, "sst2", "dev.tsv"))
    t0 = time.perf_counter()
    # the same settings every run, so the directories are reused (build() reopens a matching cache)
    tr = ActivationCache.build(enc, *enc.tokenize(s), positions="mean", batch_size=128, show_progress=True,
                               disk_dir=os.path.join(cache_dir, "sst2-sample-train" if sample else "sst2-train"))
    dv = ActivationCache.build(enc, *enc.tokenize(sd), positions="mean", batch_size=128,
                               disk_dir=os.path.join(cache_dir, "sst2-dev"))
    print(f"SST-2 caches ready in {time.perf_counter() - t0:.1f} s: {tr!r}", flush=True)
    return tr, np.array(y), dv, np.array(yd)


def qa_caches(enc, data, cache_dir, n_train, n_dev):
    from fasttran.squad import SquadFeatures, load_squad
    tr_ex = load_squad(os.path.join(data, "squad", "train-subset-v1.1.json"))[:n_train]
    dv_ex = load_squad(os.path.join(data, "squad", "dev-v1.1.json"))[:n_dev]
    ftr = SquadFeatures(tr_ex, enc.tokenizer).with_answers()
    fdv = SquadFeatures(dv_ex, enc.tokenizer)
    t0 = time.perf_counter()
    ctr = ActivationCache.build(enc, ftr.input_ids, ftr.attention_mask, ftr.token_type_ids, positions="all",
                                dtype="float16", batch_size=32, show_progress=True,
                                disk_dir=os.path.join(cache_dir, f"squad-train-{n_train}"))
    cdv = ActivationCache.build(enc, fdv.input_ids, fdv.attention_mask, fdv.token_type_ids, positions="all",
                                dtype="float16", batch_size=32, show_progress=True,
                                disk_dir=os.path.join(cache_dir, f"squad-dev-{n_dev}"))
    print(f"SQuAD caches ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return ctr, ftr, cdv, fdv


def run_one(head, optimizer, lr, seed, train, targets, dev, dev_targets, **kw):
    """One training run; a run that diverges (non-finite loss or gradient) is recorded as such
    and scores 0 (a default must never diverge)."""
    tr = Trainer(head, optimizer=optimizer, lr=lr, seed=seed, show_progress=False, **kw)
    rec = {"head": head, "optimizer": optimizer, "lr": lr, "seed": seed}
    t0 = time.perf_counter()
    try:
        hist = tr.fit(train, targets)
    except (FloatingPointError, fasttran.InputError) as e:
        if "finite" not in str(e) and "loss is" not in str(e) and "diverged" not in str(e):
            raise
        metric = "f1" if head == "qa" else "accuracy"
        return dict(rec, seconds=round(time.perf_counter() - t0, 2), diverged=str(e), **{metric: 0.0})
    secs = time.perf_counter() - t0
    m = tr.evaluate(dev, dev_targets)
    return dict(rec, seconds=round(secs, 2), train_loss=hist[-1]["train_loss"], **{k: float(v) for k, v in m.items()})


def sweep(grid, heads, seeds, done, run, save):
    """Every (optimizer, head, lr, seed) of the grid, reusing the runs in `done` (resume)."""
    key = lambda r: (r["optimizer"], r["head"], r["lr"], r["seed"])
    have = {key(r): r for r in done}
    runs = []
    for opt, lrs in grid.items():
        for head in heads:
            for lr in lrs:
                for seed in seeds:
                    r = have.get((opt, head, lr, seed)) or run(head, opt, lr, seed)
                    if (opt, head, lr, seed) not in have:
                        print(json.dumps(r), flush=True)
                    runs.append(r)
                    save(runs)
    return runs


def choose(run_sets, metric):
    """Per (optimizer, head): the grid lr with the best score, the score being the mean over
    the run sets (e.g. the full training set and the small sample) of the mean `metric` over
    seeds; a diverged run scores 0. Returns {key: (lr, score, worst single run)}."""
    best = {}
    keys = sorted({(r["optimizer"], r["head"]) for runs in run_sets for r in runs})
    for key in keys:
        by_lr = {}
        for i, runs in enumerate(run_sets):
            for r in runs:
                if (r["optimizer"], r["head"]) == key:
                    by_lr.setdefault(r["lr"], [[] for _ in run_sets])[i].append(r[metric])
        score = {lr: float(np.mean([np.mean(v) for v in sets if v])) for lr, sets in by_lr.items()}
        lr = max(score, key=lambda v: (score[v], -v))
        best[key] = (lr, score[lr], float(min(min(v) for v in by_lr[lr] if v)))
    return best


def table(runs, metric, grid, scale=100):
    heads = sorted({r["head"] for r in runs})
    lines = []
    for opt in grid:
        lines += [f"\n**{opt.upper()}** -- dev {metric}, mean over seeds [min, max]\n",
                  "| lr | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(heads)]
        for lr in grid[opt]:
            cells = []
            for h in heads:
                rs = [r for r in runs if r["optimizer"] == opt and r["head"] == h and r["lr"] == lr]
                v = [r[metric] for r in rs]
                div = sum("diverged" in r for r in rs)
                cell = f"{scale * np.mean(v):.2f} [{scale * min(v):.1f}, {scale * max(v):.1f}]" if v else "-"
                cells.append(cell + (f" ({div} diverged)" if div else ""))
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=os.environ.get("FASTTRAN_DATA", os.path.join(HERE, "..", "..", "shared", "data")))
    p.add_argument("--cache-dir", default="/tmp/fasttran-sweep-cache")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", choices=["sst2", "qa"])
    p.add_argument("--qa-train", type=int, default=2000)
    p.add_argument("--qa-dev", type=int, default=1000)
    p.add_argument("--qa-epochs", type=int, default=2)
    p.add_argument("--fresh", action="store_true", help="ignore the runs already in --out (default: reuse them)")
    p.add_argument("--check-defaults", action="store_true",
                   help="only rerun the Trainer's defaults (no sweep) and print their dev results")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (the heads are tiny: one thread avoids waiting on a busy machine's cores; "
                        "results do not depend on the thread count)")
    p.add_argument("--out", default=os.path.join(HERE, "defaults_sweep.json"))
    a = p.parse_args()
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    build_threads = fasttran.get_num_threads()
    info = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "threads": a.threads, "fasttran": fasttran.__version__, "numpy": np.__version__,
            "command": "python " + " ".join(sys.argv)}
    prev = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            prev = json.load(f)
    out = dict(prev, **info)
    if a.only in (None, "sst2"):
        sets = {}
        for part, sample in (("sst2", False), ("sst2_sample", True)):
            fasttran.set_num_threads(build_threads)
            train, y, dev, yd = sst2_caches(enc, a.data, a.cache_dir, sample)
            fasttran.set_num_threads(a.threads)
            sets[part] = (train, y, dev, yd)
            if not a.check_defaults:
                def save(runs, part=part, train=train, dev=dev):
                    out[part] = {"runs": runs, "train_sentences": len(train), "dev_sentences": len(dev)}
                    _write(out, a.out)
                sweep(GRID, ("classification", "classification-pooler"), a.seeds,
                      [] if a.fresh else prev.get(part, {}).get("runs", []),
                      lambda h, o, lr, sd, c=(train, y, dev, yd): run_one(h, o, lr, sd, *c), save)
        if not a.check_defaults:
            out["sst2"]["chosen"] = {f"{o}/{h}": v for (o, h), v in
                                     choose([out["sst2"]["runs"], out["sst2_sample"]["runs"]], "accuracy").items()}
        checks = []
        for part, (train, y, dev, yd) in sets.items():
            for opt in GRID:
                for head in ("classification", "classification-pooler"):
                    tr = Trainer(head, optimizer=opt, show_progress=False)
                    tr.fit(train, y)
                    m = tr.evaluate(dev, yd)
                    checks.append({"train": part, "train_sentences": len(train), "call": f"Trainer({head!r}, optimizer={opt!r})",
                                   "lr": tr.lr, "accuracy": m["accuracy"]})
                    print(json.dumps(checks[-1]), flush=True)
        out["sst2"]["defaults_check"] = checks
    if a.only in (None, "qa"):
        fasttran.set_num_threads(build_threads)
        ctr, ftr, cdv, fdv = qa_caches(enc, a.data, a.cache_dir, a.qa_train, a.qa_dev)
        fasttran.set_num_threads(a.threads)
        targets = (ftr.start_positions, ftr.end_positions)
        if not a.check_defaults:
            def save(runs):
                out["qa"] = {"runs": runs, "train_questions": a.qa_train, "train_features": len(ftr),
                             "dev_questions": a.qa_dev, "epochs": a.qa_epochs}
                _write(out, a.out)
            runs = sweep(QA_GRID, ("qa",), [0], [] if a.fresh else prev.get("qa", {}).get("runs", []),
                         lambda h, o, lr, sd: run_one(h, o, lr, sd, ctr, targets, cdv, fdv, epochs=a.qa_epochs), save)
            out["qa"]["chosen"] = {f"{o}/{h}": v for (o, h), v in choose([runs], "f1").items()}
        checks = []
        for opt in QA_GRID:
            tr = Trainer("qa", optimizer=opt, show_progress=False, epochs=a.qa_epochs)
            tr.fit(ctr, targets)
            m = tr.evaluate(cdv, fdv)
            checks.append({"call": f"Trainer('qa', optimizer={opt!r}, epochs={a.qa_epochs})", "lr": tr.lr, **m})
            print(json.dumps(checks[-1]), flush=True)
        out.setdefault("qa", {})["defaults_check"] = checks
    _write(out, a.out)
    write_markdown(out, os.path.splitext(a.out)[0] + ".md")
    print("wrote", a.out)


def _write(out, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def write_markdown(out, path):
    L = ["# Trainer defaults: the learning-rate sweep", "",
         f"Generated by `benchmarks/sweep_defaults.py` ({out.get('command', '')}) on {out['date']}, "
         f"{out['machine']}, {out['threads']} threads, fasttran {out['fasttran']}. Frozen all-MiniLM-L6-v2, "
         "every other hyper-parameter at the Trainer's default (batch 32, linear schedule, 10% warmup, weight "
         "decay 0.01, max_grad_norm 1.0; classification dropout 0.1)."]
    s = out.get("sst2", {})
    for part, title in (("sst2", "all of SST-2 train"), ("sst2_sample", "the 4,000-sentence sample fasttran ships")):
        p = out.get(part, {})
        if "runs" in p:
            L += ["", f"## SST-2, {title} ({p['train_sentences']:,} train sentences, {p['dev_sentences']} dev; mean "
                  "pooling, 3 epochs)", table(p["runs"], "accuracy", GRID)]
    if "chosen" in s:
        L += ["", "Chosen: the lr with the best mean dev accuracy over the seeds and both training sets (a diverged "
              "run counts 0):", ""]
        L += [f"- {k}: lr {v[0]:g} (score {100 * v[1]:.2f}%, worst single run {100 * v[2]:.2f}%)"
              for k, v in s["chosen"].items()]
    if "defaults_check" in s:
        L += ["", "Acceptance check, the defaults exactly as a user gets them (seed 0, dev accuracy):", "",
              "| call | lr | all of SST-2 train | 4,000-sentence sample |", "| --- | --- | --- | --- |"]
        by = {}
        for c in s["defaults_check"]:
            by.setdefault((c["call"], c["lr"]), {})[c["train"]] = c["accuracy"]
        for (call, lr), v in by.items():
            cells = [f"{100 * v[k]:.2f}%" if k in v else "-" for k in ("sst2", "sst2_sample")]
            L.append(f"| `{call}` | {lr:g} | " + " | ".join(cells) + " |")
    q = out.get("qa", {})
    if "runs" in q:
        L += ["", f"## SQuAD v1.1 subset ({q['train_questions']} train questions -> {q['train_features']} windows "
              f"with the answer, {q['dev_questions']} dev questions; {q['epochs']} epochs, seed 0, float16 cache)",
              table(q["runs"], "f1", QA_GRID, scale=1), "",
              "Chosen: " + "; ".join(f"{k}: lr {v[0]:g} (F1 {v[1]:.2f})" for k, v in q["chosen"].items())]
    if "defaults_check" in q:
        L += ["", "Defaults check:", ""]
        L += [f"- `{c['call']}` (lr {c['lr']:g}): EM {c['exact_match']:.2f}, F1 {c['f1']:.2f}"
              for c in q["defaults_check"]]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
