"""Significance analysis: how much each layer, attention head and FFN neuron group of a fine-tuned
model matters for its task, measured two ways on the task's data.

- **mask** (exact, forward only): the component is switched off in the C forward pass (the encoder's
  forward masks: a head's attention output zero, a group's activations zero, a layer skipped) and the
  rise of the mean loss is its score (the drop of accuracy is kept beside it). Layers below the
  component are run once per layer, not per component (the forward starts from their cached
  output). One forward per component: L + heads + groups passes of the part above it.
- **gradient** (first order, one backward pass): the derivative of the loss with respect to a gate on
  the component at 1 -- for a head |sum over its tokens of dL/dctx_h . ctx_h| (Michel et al. 2019,
  "Are Sixteen Heads Really Better than One?"), for a group the same with its activations, for a
  layer with its residual branch (out - x) -- per example, averaged over the examples. It runs in the
  layer-training code (csrc/model/layer.c) with every layer in the stack.

`Significance` holds both, their rank agreement (Spearman, per kind and overall), a random-order
control (the Spearman of random orders, and the accuracy after masking the least significant
quarter and half of the heads and groups by each order and by random ones) and the time each took.
"""
import time

import numpy as np

from ..errors import InputError, UnsupportedError
from .._progress import progress
from .plan import ffn_group_size


def components(model, group):
    """[(kind, layer, index)] of `model`: each layer, then its heads, then its FFN groups"""
    s = model.structure
    out = []
    for l in range(model.num_layers):
        out.append(("layer", l, 0))
        out += [("head", l, h) for h in range(s["layer_heads"][l])]
        out += [("ffn", l, g) for g in range(s["layer_intermediate"][l] // group)]
    return out


def spearman(a, b):
    """Spearman's rank correlation (average ranks for ties)"""
    def ranks(x):
        x = np.asarray(x, np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):   # ties share their mean rank
            t = x == v
            if t.sum() > 1:
                r[t] = r[t].mean()
        return r
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    d = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / d) if d > 0 else float("nan")


class _Masks:
    """The encoder core's forward masks for one component switched off"""

    def __init__(self, model, group):
        s = model.structure
        self.L, self.group = model.num_layers, group
        self.head_first = np.concatenate([[0], np.cumsum(s["layer_heads"])]).astype(int)
        groups = [n // group for n in s["layer_intermediate"]]
        self.group_first = np.concatenate([[0], np.cumsum(groups)]).astype(int)

    def off(self, kind, layer, index):
        if kind == "layer":
            skip = np.zeros(self.L, np.uint8)
            skip[layer] = 1
            return {"skip_layers": skip}
        if kind == "head":
            keep = np.ones(self.head_first[-1], np.uint8)
            keep[self.head_first[layer] + index] = 0
            return {"head_keep": keep}
        keep = np.ones(self.group_first[-1], np.uint8)
        keep[self.group_first[layer] + index] = 0
        return {"ffn_keep": keep, "ffn_group": self.group}

    def many(self, comps):
        """masks switching several components off at once"""
        skip = np.zeros(self.L, np.uint8)
        heads = np.ones(self.head_first[-1], np.uint8)
        ffn = np.ones(self.group_first[-1], np.uint8)
        for kind, layer, index in comps:
            if kind == "layer":
                skip[layer] = 1
            elif kind == "head":
                heads[self.head_first[layer] + index] = 0
            else:
                ffn[self.group_first[layer] + index] = 0
        return {"skip_layers": skip, "head_keep": heads, "ffn_keep": ffn, "ffn_group": self.group}


def mask_scores(model, data, group, batch_size=64, show_progress=True):
    """{component: (loss rise, accuracy drop in points)} by switching each off in the forward pass"""
    comps = components(model, group)
    mk = _Masks(model, group)
    enc = model.encoder
    batches = list(data.batches(batch_size))

    def run(start, hidden, **masks):
        logits = np.empty((len(data), model.head.num_labels), np.float32)
        for k, (idx, ids, mask, types) in enumerate(batches):
            extra = {"start_layer": start, "start_hidden": hidden[k]} if start else {}
            pooled = enc.forward_masked(ids, mask, types, layer=model.num_layers, pooling=model.pooling, **extra,
                                        **masks)
            logits[idx] = model.head.step(pooled)[0]
        return _loss_acc(logits, data.labels)

    base_loss, base_acc = run(0, None)
    scores = {}
    hidden = None   # the input of layer l for every batch (None: the embeddings, computed by the forward)
    with progress(total=len(comps), desc="significance: masking", unit="part", disable=not show_progress,
                  delay=2.0) as bar:
        for l in range(model.num_layers):
            start = l
            for c in (c for c in comps if c[1] == l):
                loss, acc = run(start, hidden, **mk.off(*c))
                scores[c] = (loss - base_loss, 100.0 * (base_acc - acc))
                bar.update(1)
            if l + 1 < model.num_layers:   # the next layer's input, from this one's
                nxt = []
                for k, (idx, ids, mask, types) in enumerate(batches):
                    extra = {"start_layer": start, "start_hidden": hidden[k]} if start else {}
                    nxt.append(enc.forward_masked(ids, mask, types, layer=l + 1, **extra))
                hidden = nxt
    return scores, (base_loss, base_acc)


def _loss_acc(logits, labels):
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean()), float((logits.argmax(1) == labels).mean())


def gradient_scores(model, data, group, batch_size=32, show_progress=True):
    """{component: mean over examples of |d loss / d gate|} from one backward pass over `data`, every layer
    in the training stack (dropout off)"""
    if model.encoder.device.is_cuda:
        raise UnsupportedError("gradient significance runs on the CPU encoder")
    from ..finetune import TopLayers
    L = model.num_layers
    stack = TopLayers(model.encoder, L, device="cpu", hidden_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0,
                      inplace_gelu=False, inplace_layernorm=False, recompute_attention_dropout=True)
    stack.record_significance(group)
    s = model.structure
    H, G = sum(s["layer_heads"]), sum(n // group for n in s["layer_intermediate"])
    heads, ffn, layers = np.zeros(H), np.zeros(G), np.zeros(L)
    cls = model.pooling == "cls"
    head_grads = np.zeros_like(model.head.params)
    steps = (len(data) + batch_size - 1) // batch_size
    with progress(total=steps, desc="significance: gradient", unit="batch", disable=not show_progress,
                  delay=2.0) as bar:
        for idx, ids, mask, types in data.batches(batch_size):
            emb = model.encoder.forward(ids, mask, types, output_layers=0)
            lengths = data.lengths[idx].astype(np.int32)
            x = np.ascontiguousarray(emb[mask.astype(bool)])   # real tokens, packed (right padding)
            out = stack.forward(x, lengths, training=True)
            pooled = stack.pool(out, cls=cls)
            dpooled = np.empty_like(pooled)
            model.head.step(pooled, data.labels[idx], grads=head_grads, dx=dpooled)   # (the head's dx needs its grads)
            stack.backward(stack.pool_backward(dpooled, cls=cls))
            h, f, lay = stack.significance()
            B = len(idx)   # the head's loss is the batch mean: times B, each example's own derivative
            heads += np.abs(B * h.astype(np.float64)).sum(0)
            ffn += np.abs(B * f.astype(np.float64)).sum(0)
            layers += np.abs(B * lay.astype(np.float64)).sum(0)
            bar.update(1)
    n = len(data)
    out, hk, gk = {}, 0, 0
    for l in range(L):
        out[("layer", l, 0)] = layers[l] / n
        for h in range(s["layer_heads"][l]):
            out[("head", l, h)] = heads[hk] / n
            hk += 1
        for g in range(s["layer_intermediate"][l] // group):
            out[("ffn", l, g)] = ffn[gk] / n
            gk += 1
    return out


class Significance:
    """Scores of every component of a model by masking and by gradient x activation, their agreement,
    a random-order control and timings. `rows` is the table (one dict per component); `order(method)`
    the components least significant first."""

    def __init__(self, model, group, mask, gradient, base, seconds, control=None):
        self.group, self.mask, self.gradient, self.base, self.seconds = group, mask, gradient, base, seconds
        self.origin = model.origin
        self.control = control or {}
        self.components = components(model, group)

    @property
    def methods(self):
        return [m for m in ("mask", "gradient") if getattr(self, m)]

    def score(self, c, method=None):
        """a component's score by `method` (default: mask when measured, else gradient)"""
        method = method or self.methods[0]
        if not getattr(self, method):
            raise InputError(f"this analysis has no {method!r} scores; it measured {self.methods}")
        return self.mask[c][0] if method == "mask" else self.gradient[c]

    def order(self, method=None, kind=None):
        """components (kind, layer, index) least significant first (mask: by loss rise; default: mask when
        measured, else gradient)"""
        scores = {c: self.score(c, method) for c in self.components if kind is None or c[0] == kind}
        return sorted(scores, key=lambda c: (scores[c], c))

    def agreement(self):
        """Spearman's rank correlation of the two scores: overall and per kind"""
        out = {}
        if not (self.gradient and self.mask):
            return out
        for kind in (None, "layer", "head", "ffn"):
            cs = [c for c in self.components if kind is None or c[0] == kind]
            out[kind or "all"] = spearman([self.mask[c][0] for c in cs], [self.gradient[c] for c in cs])
        return out

    @property
    def rows(self):
        o = self.origin
        out = []
        for c in self.components:
            kind, l, i = c
            r = {"kind": kind, "layer": l, "index": i, "original_layer": o["layers"][l]}
            if self.mask:
                r["mask_loss_rise"], r["mask_accuracy_drop"] = self.mask[c]
            if kind == "head":
                r["original_index"] = o["heads"][l][i]
            if self.gradient:
                r["gradient"] = self.gradient[c]
            out.append(r)
        return out

    def to_dict(self):
        return {"ffn_group_size": self.group, "methods": self.methods,
                "baseline": {"loss": self.base[0], "accuracy": self.base[1]},
                "seconds": self.seconds, "spearman": self.agreement(), "control": self.control, "rows": self.rows}

    def table(self, top=None):
        """The table as text: per layer, then its heads and FFN groups (scores x 1000 for the loss rise)"""
        lines = [f"significance on {self.base[2]} examples (baseline accuracy {100 * self.base[1]:.2f}%, "
                 f"loss {self.base[0]:.4f}); FFN groups of {self.group} neurons",
                 f"{'part':<14}{'mask: loss rise':>16}{'acc drop':>10}{'gradient':>12}"]
        for r in self.rows:
            name = {"layer": f"layer {r['layer']}", "head": f"  head {r['layer']}.{r['index']}",
                    "ffn": f"  ffn {r['layer']}.{r['index']}"}[r["kind"]]
            g = f"{r['gradient']:12.5f}" if "gradient" in r else " " * 12
            m = f"{r['mask_loss_rise']:16.5f}{r['mask_accuracy_drop']:10.2f}" if "mask_loss_rise" in r else " " * 26
            lines.append(f"{name:<14}{m}{g}")
        agr = self.agreement()
        if agr:
            lines.append("rank agreement (Spearman) mask vs gradient: " +
                         ", ".join(f"{k} {v:.3f}" for k, v in agr.items()))
        rnd = self.control.get("random_spearman")
        if rnd:
            lines.append(f"random order vs {self.methods[0]}: Spearman {rnd['mean']:+.3f} +/- {rnd['sd']:.3f} "
                         f"({rnd['draws']} draws)")
        for kind, rows in self.control.get("pruned_accuracy", {}).items():
            for frac, accs in rows.items():
                lines.append(f"least significant {float(frac):.0%} of the {kind}s off: " +
                             ", ".join(f"{k} {100 * v:.2f}%" for k, v in accs.items()))
        lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)

    __str__ = table

    def __repr__(self):
        agr = self.agreement()
        return (f"Significance({len(self.components)} parts, FFN groups of {self.group}, "
                + (f"Spearman {agr.get('all', float('nan')):.3f}, " if agr else "")
                + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()) + ")")


def significance(model, data, methods=("mask", "gradient"), ffn_group_size_=None, batch_size=64, control=True,
                 seed=0, show_progress=True):
    """Score every layer, head and FFN group of `model` (a TaskModel) on `data` (TaskData) by masking
    and / or by gradient x activation (`methods`; see the module's text). `ffn_group_size_`: neurons per FFN group
    (default intermediate_size / 16). control=True adds the random-order control. Returns a
    Significance."""
    model.encoder.architecture.require("pruning")
    methods = tuple(methods)
    unknown = set(methods) - {"mask", "gradient"}
    if unknown or not methods:
        raise InputError(f"methods are 'mask' and / or 'gradient', got {methods!r}")
    group = ffn_group_size(model, {"ffn_group_size": ffn_group_size_} if ffn_group_size_ else None)
    seconds = {}
    mask = {}
    if "mask" in methods:
        t = time.perf_counter()
        mask, (base_loss, base_acc) = mask_scores(model, data, group, batch_size, show_progress)
        seconds["mask"] = time.perf_counter() - t
    else:
        ev = model.evaluate(data, batch_size)
        base_loss, base_acc = ev["loss"], ev["accuracy"]
    grad = {}
    if "gradient" in methods:
        t = time.perf_counter()
        grad = gradient_scores(model, data, group, min(batch_size, 32), show_progress)
        seconds["gradient"] = time.perf_counter() - t
    sig = Significance(model, group, mask, grad, (base_loss, base_acc, len(data)), seconds)
    if control:
        t = time.perf_counter()
        sig.control = _control(model, data, sig, batch_size, seed)
        seconds["control"] = time.perf_counter() - t
    return sig


def _control(model, data, sig, batch_size, seed, draws=1000, random_orders=3):
    """Random orders against the two scores: the Spearman of a random order with the mask order, and
    the accuracy after switching off the least significant 25% and 50% of the heads and of the FFN
    groups by each order (random: the mean of `random_orders` draws)"""
    rng = np.random.default_rng(seed)
    first = [sig.score(c) for c in sig.components]
    rs = [spearman(first, rng.permutation(len(first))) for _ in range(draws)]
    out = {"random_spearman": {"mean": float(np.mean(rs)), "sd": float(np.std(rs)), "draws": draws},
           "pruned_accuracy": {}}
    mk = _Masks(model, sig.group)
    for kind in ("head", "ffn"):
        cs = [c for c in sig.components if c[0] == kind]
        per_kind = {}
        for frac in (0.25, 0.5):
            k = int(round(frac * len(cs)))
            if k == 0:
                continue
            orders = {m: sig.order(m, kind) for m in sig.methods}
            accs = {name: model.evaluate(data, batch_size, **mk.many(o[:k]))["accuracy"] for name, o in orders.items()}
            accs["random"] = float(np.mean([
                model.evaluate(data, batch_size, **mk.many([cs[i] for i in rng.permutation(len(cs))[:k]]))["accuracy"]
                for _ in range(random_orders)]))
            per_kind[str(frac)] = accs
        out["pruned_accuracy"][kind] = per_kind
    return out
