"""The search: approximations applied greedily by significance under a budget -- a maximum accuracy
drop, a target latency, a target size, or several -- with a brief re-fine-tuning after pruning.

1. Score every layer, head and FFN group on the selection set (masking; significance.py).
2. Prune in order of increasing significance, a step of parts at a time (each step applied for real:
   a smaller model, evaluated on the selection set; a step that breaks the accuracy budget is retried
   part by part). Stop when the latency / size target is met, or when no part of a step fits the
   budget (the parts after it are more significant).
3. Re-fine-tune the pruned model briefly (Trainer, its top layers, from the activation cache); if the
   accuracy budget is then broken, back off the last third of the pruned parts and train again.
4. Sign matching on the least significant remaining heads, while the budget holds -- kept only when
   it makes the model faster (it saves nothing on short sequences).
5. The vocabulary pruned to the training data's tokens (the word embeddings are half of MiniLM), and
6. int8 weights (Encoder.quantize: the projections and the word embeddings, else the projections
   only), each while the budget holds.
7. Measure the result on the dev set: accuracy, latency at batch 1 and at the latency batch size, size.

A budget that cannot be met returns the best model found with `met = False` and the reason, never a
model that silently breaks it. Decisions use the selection set (held out of the training data); the
dev set only reports."""
import copy
import json
import os
import tempfile
import time

import numpy as np

from ..errors import InputError
from .measure import latency, pareto, plot_tradeoff
from .model import TaskData, TaskModel, _with_tokenizer_of, _write_json, int8_size, quantize
from .plan import DEFAULT_SIGN_MATCH_KEYS, apply, ffn_group_size, vocabulary
from .significance import significance as _significance


def _plan_of(model, parts, group, keys, sign_match=()):
    """The plan removing `parts` ((kind, layer, index) of `model`) and sign-matching `sign_match` heads;
    heads and groups of removed layers, and parts that would empty their layer, are left out."""
    s = model.structure
    layers = {l for k, l, _ in parts if k == "layer"}
    heads, groups = {}, {}
    for kind, l, i in parts:
        if l in layers or kind == "layer":
            continue
        target = heads if kind == "head" else groups
        limit = s["layer_heads"][l] if kind == "head" else s["layer_intermediate"][l] // group
        if len(target.get(l, ())) + 1 < limit:   # never the layer's last head / group
            target.setdefault(l, set()).add(i)
    if len(layers) >= model.num_layers:   # never the last layer
        layers = set(sorted(layers)[:model.num_layers - 1])
    plan = {"ffn_group_size": group, "sign_match_keys": keys, "layers": {}}
    for l in sorted(layers):
        plan["layers"][str(l)] = "prune"
    for l in range(model.num_layers):
        if l in layers:
            continue
        entry = {}
        h = {str(i): "prune" for i in sorted(heads.get(l, ()))}
        h.update({str(i): "sign_match" for ll, i in sign_match if ll == l and i not in heads.get(l, ())})
        if h:
            entry["heads"] = h
        if groups.get(l):
            entry["ffn_groups"] = {str(i): "prune" for i in sorted(groups[l])}
        if entry:
            plan["layers"][str(l)] = entry
    return plan


def _retrain(model, train, epochs, layers, lr, batch_size, seed, show_progress, optimizer="lamb", teacher=None):
    """The model fine-tuned again: its top `layers` (default: all) and head, `epochs` over `train`,
    through the public Trainer (cache of layer L - layers, export, load). `teacher`: (examples,
    classes) logits of the unpruned model on `train`: the layers and the classifier learn to give
    them (mean squared error on the logits, a regression head over the same weights; knowledge
    distillation) instead of the labels."""
    from ..heads import Head, RegressionHead
    from ..trainer import Trainer
    head = Head.from_config(model.head.config())
    head.load_state_dict(model.head.state_dict())
    targets = train.labels
    if teacher is not None:
        cls = head
        head = RegressionHead(cls.hidden_size, cls.num_labels, pooler=cls.pooler, dropout=cls.dropout,
                              pooling=cls.pooling)
        head.load_state_dict(cls.state_dict())
        targets = np.asarray(teacher, np.float32)
    k = min(layers or model.num_layers, model.num_layers)
    tr = Trainer(head, optimizer=optimizer, train_layers=k, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                 pooling=model.pooling, show_progress=show_progress)
    ids, mask, types = train.padded()
    cache = tr.cache_for(model.encoder, ids, mask, types, show_progress=show_progress)
    tr.fit(cache, targets)
    with tempfile.TemporaryDirectory(prefix="fasttran-retrain-") as d:
        tr.export(d)
        if teacher is not None:   # the classifier again, over the weights the distillation gave (same names)
            with open(os.path.join(d, "head.json")) as f:
                head_json = json.load(f)
            head_json["head"] = model.head.config()
            _write_json(os.path.join(d, "head.json"), head_json)
        out = _with_tokenizer_of(TaskModel.load(d), model.encoder)
    out.origin = copy.deepcopy(model.origin)
    out.info = copy.deepcopy(model.info)
    out.info.setdefault("retrained", []).append({"epochs": epochs, "layers": k, "examples": len(train),
                                                  "lr": tr.lr, "history": tr.history,
                                                  "targets": "teacher logits" if teacher is not None else "labels"})
    return out


class SearchResult:
    """What the search returns: the compressed `model`, whether the budget was `met` (else the
    `reason`), `baseline` and `final` measurements, every evaluated `points` (accuracy on the
    selection set, latency, size; the trade-off), the `significance` used and a `log`."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def pareto(self):
        return [self.points[i] for i in pareto(self.points)]

    def plot(self, path=None):
        return plot_tradeoff(self.points, path, title="compression trade-off (selection set)",
                             baseline=self.baseline["select"]["accuracy"])

    def to_dict(self):
        return {"met": self.met, "reason": self.reason, "budget": self.budget, "baseline": self.baseline,
                "final": self.final, "plan": self.plan, "points": self.points, "pareto": pareto(self.points),
                "seconds": self.seconds, "log": self.log}

    def table(self):
        b, f = self.baseline, self.final

        def row(name, m):
            dev = f"{100 * m['dev']['accuracy']:.2f}%" if m.get("dev") else "-"
            return (f"{name:<12}{100 * m['select']['accuracy']:>10.2f}%{dev:>10}{m['latency_b1_ms']:>10.2f}"
                    f"{m['latency_ms']:>12.2f}{m['size_bytes'] / 1e6:>10.1f}")
        lines = [f"{'model':<12}{'select':>11}{'dev':>10}{'b1 ms':>10}{'b' + str(self.budget['latency_batch']) + ' ms':>12}"
                 f"{'MB':>10}", row("fine-tuned", b), row("compressed", f),
                 f"speed-up {b['latency_b1_ms'] / f['latency_b1_ms']:.2f}x (batch 1), "
                 f"{b['latency_ms'] / f['latency_ms']:.2f}x (batch {self.budget['latency_batch']}); "
                 f"{b['size_bytes'] / f['size_bytes']:.2f}x smaller",
                 "budget met" if self.met else f"CANNOT MEET the budget: {self.reason}"]
        return "\n".join(lines)

    __str__ = table

    def __repr__(self):
        return f"SearchResult(met={self.met}, {self.final['select']['accuracy']:.4f} on select, {self.model!r})"


def search(model, train, select, dev=None, *, max_drop=None, target_latency_ms=None, latency_batch=32,
           target_size_mb=None, significance=None, ffn_group_size_=None, steps=24, retrain_epochs=1,
           retrain_layers=None, retrain_lr=None, retrain_batch_size=32, retrain_optimizer="lamb", max_retrains=2,
           retrain_targets="labels", prune=("layer", "head", "ffn"),
           sign_match=True,
           sign_match_keys=DEFAULT_SIGN_MATCH_KEYS, prune_vocabulary=True, int8=True, threads=2, latency_examples=128,
           order_by=None, seed=0, show_progress=True):
    """Compress `model` (TaskModel) under a budget: `max_drop` (accuracy points on the selection set, e.g.
    0.5), `target_latency_ms` (per batch of `latency_batch`, `threads` threads) and/or `target_size_mb`.
    `train` (TaskData) re-fine-tunes after pruning, `select` (TaskData, held out of train) decides,
    `dev` (optional) reports. `order_by`: 'mask' or 'gradient' significance (default: mask when the
    significance has it). `prune`: the kinds of part pruning may remove, of "layer", "head" and "ffn"
    (FFN neuron groups); ("head", "ffn") never takes a whole layer, which pair tasks need (section 8
    of benchmarks/RESULTS.md); () prunes nothing. `prune_vocabulary`: keep only the embedding rows of
    the tokens `train` uses (True), of the tokens a TaskData given here uses (a task's whole training
    split, say), those of a `compress.vocabulary(...)` entry (its `min_count` or `size`), or every
    row (False); `int8`: try int8 weights last. `retrain_targets`: what the re-fine-tuning after pruning learns,
    "labels" or "teacher" (the fine-tuned model's logits on `train`: knowledge distillation).
    Returns a SearchResult; an unreachable budget gives met=False and why."""
    model.encoder.architecture.require("pruning")
    kinds = ("layer", "head", "ffn")
    if isinstance(prune, str) or not all(k in kinds for k in prune) or len(set(prune)) != len(tuple(prune)):
        raise InputError(f"prune must name kinds of part among {kinds} (a tuple, each at most once), got {prune!r}")
    if not (isinstance(prune_vocabulary, (bool, TaskData)) or
            (isinstance(prune_vocabulary, dict) and {"keep", "unknown"} <= set(prune_vocabulary))):
        raise InputError("prune_vocabulary must be True, False, the TaskData whose tokens to keep or a "
                         f"compress.vocabulary(...) entry, got {type(prune_vocabulary).__name__}")
    if retrain_targets not in ("labels", "teacher"):
        raise InputError(f"retrain_targets must be 'labels' or 'teacher', got {retrain_targets!r}")
    if max_drop is None and target_latency_ms is None and target_size_mb is None:
        raise InputError("search needs a budget: max_drop (accuracy points), target_latency_ms or target_size_mb")
    for name, v in (("max_drop", max_drop), ("target_latency_ms", target_latency_ms), ("target_size_mb", target_size_mb)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0 or
                              (v == 0 and name != "max_drop")):
            raise InputError(f"{name} must be a finite number > 0 (max_drop may be 0), got {v!r}")
    t0 = time.perf_counter()
    log = []

    def say(msg):
        log.append(msg)
        if show_progress:
            print(f"[compress] {msg}", flush=True)

    def measure(m, with_dev=False, b1=False):
        out = {"select": m.evaluate(select), "size_bytes": m.size_bytes,
               "latency_ms": latency(m, select, latency_batch, threads, latency_examples)}
        if b1:
            out["latency_b1_ms"] = latency(m, select, 1, threads, min(latency_examples, 64))
        if with_dev and dev is not None:
            out["dev"] = m.evaluate(dev)
        return out

    budget = {"max_drop": max_drop, "target_latency_ms": target_latency_ms, "latency_batch": latency_batch,
              "target_size_mb": target_size_mb, "threads": threads}
    base = measure(model, True, True)
    base_acc = base["select"]["accuracy"]
    say(f"fine-tuned: {100 * base_acc:.2f}% on {len(select)} selection examples, {base['latency_ms']:.1f} ms per batch "
        f"of {latency_batch}, {base['size_bytes'] / 1e6:.1f} MB")

    def drop_of(acc):
        return 100.0 * (base_acc - acc)

    def within(acc):
        return max_drop is None or drop_of(acc) <= max_drop + 1e-9

    def target_met(m_lat, m_size):
        return ((target_latency_ms is None or m_lat <= target_latency_ms) and
                (target_size_mb is None or m_size <= target_size_mb * 1e6))

    # the vocabulary to keep: the training data's tokens (ids only the selection or dev data use then read
    # [UNK], as they would in serving)
    voc = None
    if prune_vocabulary is not False and (isinstance(prune_vocabulary, dict) or model.encoder.tokenizer is not None) \
            and "fasttran_vocab_kept" not in model.encoder.config:
        voc = prune_vocabulary if isinstance(prune_vocabulary, dict) else \
            vocabulary(model, train if prune_vocabulary is True else prune_vocabulary)
    # with int8 and the vocabulary to come last, pruning stops at the target the final model will meet:
    # its size is exact (int8_size), its latency the float32 one times the int8 / float32 ratio measured here
    lat_ratio = 1.0
    if int8 and model.weights == "float32" and (target_latency_ms or target_size_mb):
        q0 = quantize(model)
        lat_ratio = latency(q0, select, latency_batch, threads, latency_examples) / base["latency_ms"]
        say(f"int8 at the end: latency x{lat_ratio:.2f}, size {model.size_bytes / 1e6:.1f} -> {q0.size_bytes / 1e6:.1f} MB "
            "(the pruning aims at the target after it)")

    def pruned_enough(m_lat, m):
        size = int8_size(m, vocab_rows=len(voc["keep"]) if voc else None, int8=int8) if m.weights == "float32" \
            else m.size_bytes
        return (target_latency_ms or target_size_mb) and target_met(m_lat * lat_ratio, size)

    if ffn_group_size_ is None and significance is not None:
        ffn_group_size_ = significance.group
    group = ffn_group_size(model, {"ffn_group_size": ffn_group_size_} if ffn_group_size_ else None)
    if significance is None:
        significance = _significance(model, select, ffn_group_size_=group, show_progress=show_progress)
    elif significance.group != group:
        raise InputError(f"the significance given was measured with FFN groups of {significance.group}, not {group}")
    order = [c for c in significance.order(order_by) if c[0] in prune]   # default: masking, else gradient
    points = [{"stage": "fine-tuned", "accuracy": base_acc, "latency_ms": base["latency_ms"],
               "size_bytes": base["size_bytes"], "plan": None}]

    # ---- 2. prune by increasing significance ------------------------------------------------------
    accepted, current = [], model
    cur_lat, cur_size = base["latency_ms"], base["size_bytes"]
    step = max(1, -(-len(order) // steps))
    pending = list(order)
    while pending and not pruned_enough(cur_lat, current):
        chunk, pending = pending[:step], pending[step:]
        trial_sets, before = [chunk], len(accepted)
        while trial_sets:
            parts = trial_sets.pop(0)
            plan = _plan_of(model, accepted + parts, group, sign_match_keys)
            if plan == _plan_of(model, accepted, group, sign_match_keys):
                continue   # nothing new (parts of removed layers, or a layer's last head / group)
            cand = apply(model, plan)
            acc = cand.evaluate(select)["accuracy"]
            lat = latency(cand, select, latency_batch, threads, latency_examples)
            points.append({"stage": "pruned", "accuracy": acc, "latency_ms": lat, "size_bytes": cand.size_bytes,
                           "plan": plan})
            if within(acc):
                accepted += parts
                current, cur_lat, cur_size = cand, lat, cand.size_bytes
                say(f"pruned {len(accepted)} parts: {100 * acc:.2f}% ({drop_of(acc):+.2f} points), {lat:.1f} ms, "
                    f"{cand.size_bytes / 1e6:.1f} MB")
                if pruned_enough(cur_lat, current):
                    break
            elif len(parts) > 1:   # the step broke the budget: try its parts one by one
                trial_sets = [[p] for p in parts] + trial_sets
        if len(accepted) == before and len(chunk) > 1:
            say(f"no part of the next step fits the accuracy budget: the pruning stops ({len(pending)} more significant "
                "parts left)")
            break
    if (target_latency_ms or target_size_mb) and not pruned_enough(cur_lat, current):
        say("the pruning order is exhausted before the latency / size target was met")

    # ---- 3. re-fine-tune after pruning ------------------------------------------------------------
    parts, retrains, teacher = accepted, 0, None
    while parts:
        pruned = current if parts is accepted else apply(model, _plan_of(model, parts, group, sign_match_keys))
        say(f"re-fine-tuning the model with {len(parts)} parts pruned ({retrain_epochs} epoch(s) over {len(train)} "
            "examples)")
        if retrain_targets == "teacher" and teacher is None:
            teacher = model.logits(train)   # the unpruned model's, once
        tuned = _retrain(pruned, train, retrain_epochs, retrain_layers, retrain_lr, retrain_batch_size,
                         seed + retrains, show_progress, retrain_optimizer, teacher)
        acc = tuned.evaluate(select)["accuracy"]
        lat = latency(tuned, select, latency_batch, threads, latency_examples)
        points.append({"stage": "re-fine-tuned", "accuracy": acc, "latency_ms": lat, "size_bytes": tuned.size_bytes,
                       "plan": _plan_of(model, parts, group, sign_match_keys)})
        say(f"re-fine-tuned: {100 * acc:.2f}% ({drop_of(acc):+.2f} points)")
        if within(acc):
            accepted, current, cur_lat, cur_size = parts, tuned, lat, tuned.size_bytes
            break
        retrains += 1
        if retrains > max_retrains:
            say(f"no pruning found that fits the accuracy budget after {retrains} re-fine-tunings; keeping every part")
            accepted, current, cur_lat, cur_size = [], model, base["latency_ms"], base["size_bytes"]
            break
        parts = parts[:len(parts) * 2 // 3]   # back off the most significant third of what was pruned
        say(f"over the budget: backing off to {len(parts)} pruned parts")
    else:
        current, cur_lat, cur_size = model, base["latency_ms"], base["size_bytes"]

    # ---- 4. sign matching on the least significant heads left -----------------------------------
    if sign_match and max_drop is not None:
        o = current.origin
        where = {(o["layers"][l], o["heads"][l][h]): (l, h) for l in range(current.num_layers)
                 for h in range(len(o["heads"][l]))}
        heads = [where[(ol, oh)] for kind, ol, oh in
                 (("head", model.origin["layers"][l], model.origin["heads"][l][i]) for k, l, i in order if k == "head")
                 if (ol, oh) in where]
        sm, sm_model, sm_lat = [], current, cur_lat
        hstep = max(1, -(-len(heads) // max(1, steps // 2)))
        for k in range(0, len(heads), hstep):
            trial = sm + heads[k:k + hstep]
            cand = apply(current, _plan_of(current, [], group, sign_match_keys, trial))
            acc = cand.evaluate(select)["accuracy"]
            lat = latency(cand, select, latency_batch, threads, latency_examples)
            points.append({"stage": "sign-matching", "accuracy": acc, "latency_ms": lat, "size_bytes": cand.size_bytes,
                           "plan": None})
            if not within(acc):
                break
            sm, sm_model, sm_lat = trial, cand, lat
        if sm:   # measured again side by side: the machine's load moves between measurements
            cur_lat = latency(current, select, latency_batch, threads, latency_examples)
            sm_lat = latency(sm_model, select, latency_batch, threads, latency_examples)
        if sm and sm_lat < 0.98 * cur_lat:
            say(f"sign matching on {len(sm)} heads: {cur_lat:.1f} -> {sm_lat:.1f} ms")
            current, cur_lat = sm_model, sm_lat
        elif sm:
            say(f"sign matching on {len(sm)} heads fits the budget but saves no time ({cur_lat:.1f} -> {sm_lat:.1f} ms "
                f"per batch): not applied")

    # ---- 5. the vocabulary: the word-embedding rows of the training data's tokens -------------------------
    if voc is not None and current.weights == "float32":
        cand = apply(current, {"vocabulary": voc})
        acc = cand.evaluate(select)["accuracy"]
        points.append({"stage": "vocabulary", "accuracy": acc, "latency_ms": cur_lat, "size_bytes": cand.size_bytes,
                       "plan": None})
        if within(acc):
            say(f"vocabulary pruned to the training data's {len(voc['keep'])} tokens: {100 * acc:.2f}% "
                f"({drop_of(acc):+.2f} points), {current.size_bytes / 1e6:.1f} -> {cand.size_bytes / 1e6:.1f} MB")
            current, cur_size = cand, cand.size_bytes
        else:
            say(f"the training data's vocabulary ({len(voc['keep'])} tokens) breaks the budget ({drop_of(acc):+.2f} "
                "points): every token kept")

    # ---- 6. int8 weights (the layers' projections, then the word embeddings too) -----------------------
    if int8 and current.weights == "float32":
        cur_lat = latency(current, select, latency_batch, threads, latency_examples)
        for emb in (True, False):
            cand = quantize(current, embeddings=emb)
            acc = cand.evaluate(select)["accuracy"]
            lat = latency(cand, select, latency_batch, threads, latency_examples)
            points.append({"stage": "int8" if emb else "int8 (float32 embeddings)", "accuracy": acc, "latency_ms": lat,
                           "size_bytes": cand.size_bytes, "plan": None})
            if within(acc):
                say(f"int8 weights{'' if emb else ' (embeddings float32)'}: {100 * acc:.2f}% "
                    f"({drop_of(acc):+.2f} points), {cur_lat:.1f} -> {lat:.1f} ms, {current.size_bytes / 1e6:.1f} -> "
                    f"{cand.size_bytes / 1e6:.1f} MB")
                current, cur_lat, cur_size = cand, lat, cand.size_bytes
                break
            say(f"int8 weights{'' if emb else ' (embeddings float32)'} break the budget ({drop_of(acc):+.2f} points)")

    # ---- 7. the result -------------------------------------------------------------------------------
    final = measure(current, True, True)
    reasons = []
    if not within(final["select"]["accuracy"]):
        reasons.append(f"accuracy drop {drop_of(final['select']['accuracy']):.2f} points > max_drop {max_drop}")
    if target_latency_ms is not None and final["latency_ms"] > target_latency_ms:
        reasons.append(f"latency {final['latency_ms']:.1f} ms > target {target_latency_ms} ms at batch {latency_batch}"
                       + (f" within the {max_drop}-point accuracy budget" if max_drop is not None else ""))
    if target_size_mb is not None and final["size_bytes"] > target_size_mb * 1e6:
        reasons.append(f"size {final['size_bytes'] / 1e6:.1f} MB > target {target_size_mb} MB"
                       + (f" within the {max_drop}-point accuracy budget" if max_drop is not None else ""))
    from .plan import in_original_numbering
    current.info["search"] = {"budget": budget, "met": not reasons, "final": final, "baseline": base}
    result = SearchResult(model=current, met=not reasons, reason="; ".join(reasons) or None, budget=budget,
                          baseline=base, final=final, points=points, significance=significance,
                          plan=in_original_numbering(current), seconds=time.perf_counter() - t0, log=log)
    say(result.table())
    return result


def save_result(result, path):
    """The compressed model (TaskModel.save) and, beside it, search.json (budget, measurements, points)."""
    from ..safetensors_io import write_file
    from .model import _jsonable
    result.model.save(path)
    write_file(os.path.join(path, "search.json"), json.dumps(_jsonable(result.to_dict()), indent=1).encode())
    return path
