"""The sweep behind the top-layer fine-tuning recipes (fasttran.trainer.DEFAULT_TOPK_RECIPES).

all-MiniLM-L6-v2, LAMB (the Trainer's default optimizer), on the GLUE data shipped in
/work/shared/data: for each k in --ks (0: the head on the frozen encoder; k > 0: the top k layers
and the head, as `fasttran finetune --train-layers k` trains them: [CLS] through BERT's pooler) it
chooses the layers' lr, the head's lr, the layer-wise lr decay and the epochs, in stages:

    A. lr in LRS (head_lr = lr, decay 1, 2 epochs)             k = 0: the head's lr in HEAD_ONLY_LRS
    B. at A's lr: head_lr in HEAD_LRS x decay in DECAYS         (decay only for k >= 2)
    C. at B's choice: 3 epochs instead of 2

Every choice is made on a slice HELD OUT OF EACH TRAINING SPLIT (its last --holdout fraction,
at most --holdout-max examples), never on dev: a run's score is the best epoch's held-out metric
(the epoch `fit(keep_best=...)` would keep), the selection's the mean over the tasks of the task's
metric (MRPC F1, SST-2 accuracy, CoLA Matthews correlation). Training sets are subsampled (the first
--train examples of the rest of the split) to keep the whole sweep on a shared 2-core CPU under
25 minutes. Only then, as the final check, each k's chosen recipe trains once more and is scored on
the dev split (the dev score plays no part in any choice).

    python benchmarks/sweep_recipes.py [--data /work/shared/data] [--tasks mrpc sst2]
        [--ks 0 3 6 1 2] [--train 500] [--out benchmarks/recipes_sweep.json]

Writes the JSON after every run (a stopped sweep keeps what it ran): the settings, every run (task,
k, recipe, held-out metric per epoch, seconds), the choice per stage and k, and the dev check.
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
from fasttran.finetune_cli import read_split, task_files, task_spec

HERE = os.path.dirname(os.path.abspath(__file__))
LRS = [1.5e-4, 5e-4, 1.5e-3]                 # the layers' lr (LAMB: the step is lr x ||w|| per tensor)
HEAD_LRS = [1e-2]                            # the head's own lr (the pooler head alone defaults to 1e-2)
DECAYS = [0.8]                               # layer-wise decay (beside 1.0, A's)
HEAD_ONLY_LRS = [5e-3, 1e-2, 2e-2, 4e-2]     # k = 0: the head's lr (the classification head's default 2e-2)


def task_data(enc, task, data, n_train, holdout, holdout_max, max_length):
    """token ids of the sweep's train subset, the held-out slice (the end of the train split) and dev"""
    files = task_files(task, data)
    tr = read_split(task, files["train"])
    dv = read_split(task, files["dev"], label_names=tr.label_names)
    n = len(tr.labels)
    h = min(int(round(holdout * n)), holdout_max)
    rest = n - h

    def pick(ex, idx):
        texts = [ex.texts[i] for i in idx]
        pairs = None if ex.text_pairs is None else [ex.text_pairs[i] for i in idx]
        ids, mask, types = enc.tokenize(texts, pairs, max_length=max_length)
        return (ids, mask, types), np.asarray(ex.labels)[idx]
    train_idx = np.arange(min(n_train, rest))
    out = {"train": pick(tr, train_idx), "holdout": pick(tr, np.arange(rest, n)),
           "dev": pick(dv, np.arange(len(dv.labels)))}
    sizes = {"train_split": n, "train": len(train_idx), "holdout": n - rest, "dev": len(dv.labels)}
    return out, sizes


def caches_for(enc, parts, k):
    """the caches a run at k reads: k = 0 mean-pooled last layer, else every token at layer L - k"""
    L = enc.num_layers
    kw = dict(positions="mean") if k == 0 else dict(positions="all", layer=L - k)
    return {split: (ActivationCache.build(enc, *ids, show_progress=False, batch_size=64, **kw), y)
            for split, (ids, y) in parts.items()}


def trainer_args(k, recipe, seed):
    kw = dict(optimizer=recipe.get("optimizer", "lamb"), seed=seed, batch_size=32, show_progress=False, reduction=None,
              warmup=recipe.get("warmup", 0.1), epochs=recipe["epochs"], lr=recipe["lr"])
    if k:
        kw.update(train_layers=k, pooling="cls", pooler=True, head_lr=recipe["head_lr"],
                  layer_lr_decay=recipe["layer_lr_decay"], precision=recipe.get("precision", "float32"),
                  train_embeddings=recipe.get("train_embeddings", False))
    return kw


def run_one(task, metric, k, recipe, caches, seed, on="holdout"):
    """one training run, scored per epoch on `on` (the held-out slice; dev for the final check)"""
    train, targets = caches["train"]
    ev = caches[on]
    tr = Trainer("classification", **trainer_args(k, recipe, seed))
    t0 = time.perf_counter()
    rec = {"task": task, "k": k, "recipe": dict(recipe), "seed": seed, "scored_on": on}
    try:
        hist = tr.fit(train, targets, eval=ev, keep_best=metric)
        scores = [float(h[f"eval_{metric}"]) for h in hist]
        rec.update(scores=scores, best=max(scores), best_epoch=tr.best_epoch,
                   train_loss=[float(h["train_loss"]) for h in hist])
    except (FloatingPointError, fasttran.InputError) as e:   # a diverged run scores nothing
        rec.update(scores=[], best=float("-inf"), error=str(e))
    rec["seconds"] = time.perf_counter() - t0
    return rec


class Sweep:
    def __init__(self, args, enc):
        self.args, self.enc = args, enc
        self.out = {"what": "benchmarks/sweep_recipes.py: LAMB recipes per k chosen on held-out slices of the "
                            "training splits; dev only as the final check",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": {"cpu": platform.processor() or platform.machine(), "threads": fasttran.get_num_threads(),
                                "fasttran": fasttran.__version__},
                    "model": "all-MiniLM-L6-v2", "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), "grid": {
                        "lr": LRS, "head_lr": HEAD_LRS, "decay": [1.0] + DECAYS, "head_only_lr": HEAD_ONLY_LRS},
                    "tasks": {}, "runs": [], "choice": {}, "dev_check": []}
        self.data, self.done = {}, {}
        for task in args.tasks:
            spec = task_spec(task)
            parts, sizes = task_data(enc, task, args.data, args.train, args.holdout, args.holdout_max,
                                     args.max_length)
            metric = spec.metric
            self.data[task] = (parts, metric)
            self.out["tasks"][task] = dict(sizes, metric=metric)
            print(f"{task}: {sizes}, metric {metric}", flush=True)
        for path in args.reuse:   # thread counts do not change a run's bits (the cache and training are invariant)
            with open(path) as f:
                old = json.load(f)
            if any(old["tasks"].get(t, {}) != self.out["tasks"][t] for t in args.tasks):
                raise SystemExit(f"{path}: another data split than this sweep's")
            for rec in old["runs"]:
                if rec["task"] in self.data and rec.get("scored_on", "holdout") == "holdout" and \
                        rec.get("seed") == args.seed:
                    key = json.dumps([rec["task"], rec["k"], rec["recipe"]], sort_keys=True)
                    self.done[key] = dict(rec, reused_from=os.path.basename(path))
                    self.out["runs"].append(self.done[key])
        self.t0 = time.perf_counter()

    def save(self):
        self.out["sweep_seconds"] = time.perf_counter() - self.t0
        with open(self.args.out, "w") as f:
            json.dump(self.out, f, indent=1)

    def score(self, k, recipe, caches):
        """the mean over the tasks of each task's held-out score (its best epoch); a run is run once"""
        vals = []
        for task, (parts, metric) in self.data.items():
            key = json.dumps([task, k, recipe], sort_keys=True)
            if key in self.done:
                vals.append(self.done[key]["best"])
                continue
            rec = self.done[key] = run_one(task, metric, k, recipe, caches[task], self.args.seed)
            self.out["runs"].append(rec)
            self.save()
            print(f"  k={k} {task:5} {json.dumps(recipe)}: held-out {metric} "
                  f"{' '.join(f'{s:.4f}' for s in rec['scores']) or rec.get('error')} ({rec['seconds']:.0f} s)",
                  flush=True)
            vals.append(rec["best"])
        return float(np.mean(vals))

    def best_of(self, k, recipes, caches, stage):
        scored = [(self.score(k, r, caches), i, r) for i, r in enumerate(recipes)]
        s, _, r = max(scored, key=lambda t: (t[0], -t[1]))   # ties: the earlier (smaller) setting
        self.out["choice"].setdefault(str(k), {})[stage] = {"recipe": r, "mean_holdout": s,
                                                            "tried": [(x, rr) for x, _, rr in scored]}
        print(f"k={k} stage {stage}: {json.dumps(r)} (mean held-out {s:.4f})", flush=True)
        return r, s

    def run_k(self, k):
        t0 = time.perf_counter()
        caches = {task: caches_for(self.enc, parts, k) for task, (parts, _) in self.data.items()}
        if k == 0:
            r, _ = self.best_of(k, [{"lr": lr, "epochs": 2} for lr in HEAD_ONLY_LRS], caches, "A")
        else:
            r, _ = self.best_of(k, [{"lr": lr, "head_lr": lr, "layer_lr_decay": 1.0, "epochs": 2} for lr in LRS],
                                caches, "A")
            decays = [1.0] + (DECAYS if k >= 2 else [])
            cands = [dict(r, head_lr=h, layer_lr_decay=d) for h in [r["lr"]] + HEAD_LRS for d in decays]
            prev = self.out["choice"][str(k)]["A"]["mean_holdout"]
            r, _ = self.best_of(k, [r] + [c for c in cands if c != r], caches, "B") if len(cands) > 1 else (r, prev)
        r, _ = self.best_of(k, [r, dict(r, epochs=3)], caches, "C")
        self.out["choice"][str(k)]["chosen"] = r
        # the final check, on dev: the chosen recipe once more (nothing is chosen from it)
        for task, (parts, metric) in self.data.items():
            rec = run_one(task, metric, k, r, caches[task], self.args.seed, on="dev")
            self.out["dev_check"].append(rec)
            print(f"  k={k} {task:5} chosen recipe on dev: {metric} {rec['best']:.4f}", flush=True)
        self.out["choice"][str(k)]["seconds"] = time.perf_counter() - t0
        self.save()

    def run_default(self, candidates):
        """`fasttran finetune`'s default: each (k, recipe) of `candidates` scored on the held-out slices
        like a stage above; the best mean is the choice (ties: the earlier, i.e. the cheaper, candidate)
        -- or, with --tolerance t, the fastest candidate whose mean is within t of the best --, then
        checked once on dev (unless --no-dev-check)"""
        scored = []
        for i, (k, recipe) in enumerate(candidates):
            keys = [json.dumps([task, k, recipe], sort_keys=True) for task in self.data]
            caches = None if all(key in self.done for key in keys) else \
                {task: caches_for(self.enc, parts, k) for task, (parts, _) in self.data.items()}   # (reused: none)
            s = self.score(k, recipe, caches)
            # its cost: the training runs' seconds (a reused run's as it was measured)
            scored.append((s, -i, k, recipe, sum(self.done[key]["seconds"] for key in keys)))
            print(f"default candidate k={k} {json.dumps(recipe)}: mean held-out {s:.4f}", flush=True)
            self.out["choice"]["finetune_default"] = {"tried": [(x, kk, r, sec) for x, _, kk, r, sec in scored]}
            self.save()
        s, _, k, r, _ = max(scored, key=lambda t: (t[0], t[1]))
        if self.args.tolerance:
            s, _, k, r, _ = min((t for t in scored if t[0] >= s - self.args.tolerance), key=lambda t: t[4])
        self.out["choice"]["finetune_default"].update(chosen={"train_layers": k, "recipe": r}, mean_holdout=s,
                                                      tolerance=self.args.tolerance)
        if not self.args.dev_check:
            self.save()
            return
        caches = {task: caches_for(self.enc, parts, k) for task, (parts, _) in self.data.items()}
        for task, (parts, metric) in self.data.items():
            rec = run_one(task, metric, k, r, caches[task], self.args.seed, on="dev")
            self.out["dev_check"].append(rec)
            print(f"  default k={k} {task:5} on dev: {metric} {rec['best']:.4f}", flush=True)
        self.save()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/work/shared/data")
    ap.add_argument("--tasks", nargs="+", default=["mrpc", "sst2"])
    ap.add_argument("--ks", nargs="+", type=int, default=[0, 3, 6, 1, 2])
    ap.add_argument("--train", type=int, default=500, help="training examples per task (the split's first)")
    ap.add_argument("--holdout", type=float, default=0.12, help="the held-out fraction: the train split's end")
    ap.add_argument("--holdout-max", type=int, default=300)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "recipes_sweep.json"))
    ap.add_argument("--default-candidates", default=None, metavar="JSON",
                    help="instead of the staged sweep: a JSON list of [k, recipe] pairs (a recipe may name its "
                         "optimizer, precision and train_embeddings), scored on the held-out slices; the best is `fasttran finetune`'s default")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="--default-candidates: the fastest candidate within this of the best mean held-out score "
                         "(0: the best)")
    ap.add_argument("--no-dev-check", dest="dev_check", action="store_false",
                    help="--default-candidates: skip the final dev run of the choice (its dev score measured elsewhere)")
    ap.add_argument("--reuse", nargs="*", default=[], metavar="JSON",
                    help="earlier sweeps' runs at the same data, sizes and seed: not run again")
    args = ap.parse_args()
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    sw = Sweep(args, enc)
    if args.default_candidates:
        sw.run_default([(int(k), r) for k, r in json.loads(args.default_candidates)])
        sw.save()
        print(json.dumps(sw.out["choice"]["finetune_default"].get("chosen"), indent=1))
        return
    for k in args.ks:
        sw.run_k(k)
    sw.save()
    print(json.dumps({k: v.get("chosen") for k, v in sw.out["choice"].items()}, indent=1))
    print(f"sweep: {sw.out['sweep_seconds']:.0f} s")


if __name__ == "__main__":
    main()
