"""Compression plans: which layers, attention heads and FFN neuron groups to remove, and which heads
compute by sign matching -- a plain dict (JSON) the user can read and edit:

    {"ffn_group_size": 96, "sign_match_keys": 16,
     "layers": {"3": "prune",                                   # the whole layer
                "0": {"heads": {"1": "prune", "5": "sign_match"},  # per head: remove, or approximate
                      "ffn_groups": {"2": "prune"}}}}             # neurons 192..287 of layer 0's FFN

Indices are those of the model the plan is applied to (0-based layers, heads, FFN groups of
`ffn_group_size` neurons). `apply(model, plan)` returns a physically smaller model (compressed in C:
the kept rows and columns copied into smaller matrices); `masks(model, plan)` the forward masks that
give the same outputs without changing the model (what significance analysis evaluates)."""
import copy
import re

import numpy as np

from ..errors import InputError, InputTypeError
from ..heads import Head

HEAD_ACTIONS = ("prune", "sign_match")
DEFAULT_SIGN_MATCH_KEYS = 16


def _index(key, n, what, where):
    try:
        i = int(key)
    except (TypeError, ValueError):
        raise InputError(f"{where}: {what} {key!r} is not an index") from None
    if str(i) != str(key).strip() or not 0 <= i < n:
        raise InputError(f"{where}: {what} {key!r} is out of range; this model has {what}s 0..{n - 1}")
    return i


def ffn_group_size(model, plan=None):
    """The FFN group size a plan uses on this model: the plan's, else the one the model was pruned with,
    else intermediate_size / 16."""
    fixed = model.origin.get("ffn_group_size")
    g = (plan or {}).get("ffn_group_size") or fixed or model.encoder.config["intermediate_size"] // 16 or 1
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
        raise InputError(f"plan['ffn_group_size'] must be a positive integer, got {g!r}")
    if fixed and g != fixed:
        raise InputError(f"plan['ffn_group_size'] = {g}, but this model was pruned in groups of {fixed}; use {fixed}")
    for l, n in enumerate(model.structure["layer_intermediate"]):
        if n % g:
            raise InputError(f"FFN group size {g} does not divide layer {l}'s {n} neurons")
    return int(g)


def parse(model, plan):
    """The plan checked against `model`, as {"layers": set to remove, "heads": {l: {h: action}},
    "ffn": {l: set of groups}, "group": size, "keys": sign-matching keys}; every error names the entry."""
    if not isinstance(plan, dict):
        raise InputTypeError(f"a plan is a dict (see fasttran.compress.plan), got {type(plan).__name__}")
    unknown = set(plan) - {"layers", "ffn_group_size", "sign_match_keys", "weights", "vocabulary"}
    if unknown:
        raise InputError(f"plan: unknown key(s) {sorted(unknown)}; a plan has 'layers', 'ffn_group_size', "
                         "'sign_match_keys', 'vocabulary' and 'weights'")
    if plan.get("weights", "float32") not in ("float32", "int8", "int8-layers"):
        raise InputError(f"plan['weights'] = {plan['weights']!r}; expected 'float32', 'int8' (the layers' projections "
                         "and the word embeddings) or 'int8-layers' (the projections only)")
    if model.weights == "int8" and (plan.get("layers") or plan.get("vocabulary") or
                                    plan.get("weights", "float32") == "float32"):
        raise InputError("this model is int8: prune and approximate the float32 model, then quantize it "
                         "(plan['weights'] = 'int8')")
    s = model.structure
    L = model.num_layers
    group = ffn_group_size(model, plan)
    keys = plan.get("sign_match_keys", s["sign_match_keys"] or DEFAULT_SIGN_MATCH_KEYS)
    if isinstance(keys, bool) or not isinstance(keys, (int, np.integer)) or keys < 1:
        raise InputError(f"plan['sign_match_keys'] must be a positive integer, got {keys!r}")
    layers = plan.get("layers", {})
    if not isinstance(layers, dict):
        raise InputTypeError(f"plan['layers'] must be a dict {{layer: 'prune' or {{...}}}}, got {type(layers).__name__}")
    out = {"layers": set(), "heads": {}, "ffn": {}, "group": group, "keys": int(keys), "vocab": None}
    voc = plan.get("vocabulary")
    if voc is not None:   # {"keep": [token ids], "unknown": id}: the word-embedding rows kept
        V = model.encoder.config["vocab_size"]
        if not isinstance(voc, dict) or set(voc) != {"keep", "unknown"}:
            raise InputError("plan['vocabulary'] must be {'keep': [token ids], 'unknown': the id the others read} "
                             "(compress.vocabulary(model, data) makes one from a task's data)")
        try:
            keep = np.asarray(voc["keep"], np.int64)
            unk = int(voc["unknown"])
        except (TypeError, ValueError, OverflowError):
            raise InputError("plan['vocabulary']: 'keep' must list token ids and 'unknown' be one") from None
        if keep.ndim != 1 or not len(keep) or keep.min() < 0 or keep.max() >= V:
            raise InputError(f"plan['vocabulary']['keep'] must list token ids in [0, {V})")
        mask = np.zeros(V, np.uint8)
        mask[keep] = 1
        if not (0 <= unk < V and mask[unk]):
            raise InputError(f"plan['vocabulary']['unknown'] = {unk} must be one of the kept ids (the removed ids read "
                             "its row)")
        out["vocab"] = (mask, unk)
    for key, spec in layers.items():
        where = f"plan['layers'][{key!r}]"
        l = _index(key, L, "layer", "plan['layers']")
        if spec == "prune":
            out["layers"].add(l)
            continue
        if not isinstance(spec, dict) or set(spec) - {"heads", "ffn_groups"}:
            raise InputError(f"{where} must be 'prune' or {{'heads': {{...}}, 'ffn_groups': {{...}}}}, got {spec!r}")
        nh, ng = s["layer_heads"][l], s["layer_intermediate"][l] // group
        heads = spec.get("heads", {})
        if not isinstance(heads, dict):
            raise InputTypeError(f"{where}['heads'] must be a dict {{head: 'prune' or 'sign_match'}}")
        for hk, action in heads.items():
            h = _index(hk, nh, "head", f"{where}['heads'] (layer {l})")
            if action not in HEAD_ACTIONS:
                raise InputError(f"{where}['heads'][{hk!r}] = {action!r}; a head is 'prune' or 'sign_match'")
            out["heads"].setdefault(l, {})[h] = action
        groups = spec.get("ffn_groups", {})
        if not isinstance(groups, dict):
            raise InputTypeError(f"{where}['ffn_groups'] must be a dict {{group: 'prune'}}")
        for gk, action in groups.items():
            g = _index(gk, ng, "FFN group", f"{where}['ffn_groups'] (layer {l}, groups of {group})")
            if action != "prune":
                raise InputError(f"{where}['ffn_groups'][{gk!r}] = {action!r}; an FFN group can only be 'prune'd")
            out["ffn"].setdefault(l, set()).add(g)
    for l in range(L):
        if l in out["layers"]:
            continue
        if sum(a == "prune" for a in out["heads"].get(l, {}).values()) == s["layer_heads"][l]:
            raise InputError(f"plan: layer {l} would lose all {s['layer_heads'][l]} of its heads; a layer needs one "
                             f"(remove the whole layer instead: plan['layers']['{l}'] = 'prune')")
        if len(out["ffn"].get(l, ())) == s["layer_intermediate"][l] // group:
            raise InputError(f"plan: layer {l} would lose all its FFN groups; a layer needs one (remove the whole "
                             f"layer instead: plan['layers']['{l}'] = 'prune')")
    if L and len(out["layers"]) == L:
        raise InputError(f"plan: removes all {L} layers; keep at least one")
    return out


def _keep_arrays(model, p):
    s = model.structure
    L = model.num_layers
    keep_layers = np.array([l not in p["layers"] for l in range(L)], np.uint8)
    keep_heads, modes, keep_neurons = [], [], []
    for l in range(L):
        acts = p["heads"].get(l, {})
        for h in range(s["layer_heads"][l]):
            keep_heads.append(acts.get(h) != "prune")
        groups = p["ffn"].get(l, set())
        keep_neurons.append(np.repeat([g not in groups for g in range(s["layer_intermediate"][l] // p["group"])],
                                      p["group"]))
    k = 0
    for l in range(L):
        acts = p["heads"].get(l, {})
        for h in range(s["layer_heads"][l]):
            modes.append(1 if acts.get(h) == "sign_match" else s["head_attention"][k])
            k += 1
    neurons = np.concatenate(keep_neurons).astype(np.uint8) if keep_neurons else np.zeros(0, np.uint8)
    return keep_layers, np.array(keep_heads, np.uint8), neurons, np.array(modes, np.uint8)


def apply(model, plan):
    """A new TaskModel: `model` with the plan carried out -- layers, heads and FFN groups removed (the
    matrices made smaller), sign matching set on the heads named, then the weights quantized when
    plan['weights'] says 'int8' (the projections and the word embeddings) or 'int8-layers' (the
    projections only). `model` is unchanged; the head is copied."""
    from .model import TaskModel, quantize
    p = parse(model, plan)
    weights = plan.get("weights", "float32")
    if weights != "float32" and not plan.get("layers") and not plan.get("vocabulary"):
        return quantize(model, embeddings=weights == "int8")
    if weights != "float32":
        return quantize(apply(model, {k: v for k, v in plan.items() if k != "weights"}), embeddings=weights == "int8")
    model.encoder.architecture.require("pruning")   # (a plan that only quantizes: above, every architecture)
    keep_layers, keep_heads, keep_neurons, modes = _keep_arrays(model, p)
    voc = {"keep_tokens": p["vocab"][0], "unknown_token": p["vocab"][1]} if p["vocab"] else {}
    enc = model.encoder.compressed_copy(keep_layers=keep_layers, keep_heads=keep_heads, keep_neurons=keep_neurons,
                                        head_attention=modes, sign_match_keys=p["keys"], **voc)
    head = Head.from_config(model.head.config())
    head.load_state_dict(model.head.state_dict())
    # the origin of what is kept, in the original model's numbering
    o = model.origin
    origin = {"layers": [], "heads": [], "neurons": [], "ffn_group_size": p["group"]}
    hk, nk = 0, 0
    s = model.structure
    for l in range(model.num_layers):
        nh, ni = s["layer_heads"][l], s["layer_intermediate"][l]
        if keep_layers[l]:
            origin["layers"].append(o["layers"][l])
            origin["heads"].append([o["heads"][l][h] for h in range(nh) if keep_heads[hk + h]])
            origin["neurons"].append([o["neurons"][l][i] for i in range(ni) if keep_neurons[nk + i]])
        hk, nk = hk + nh, nk + ni
    info = copy.deepcopy(model.info)
    info.setdefault("plans", []).append(copy.deepcopy(plan))
    return TaskModel(enc, head, model.pooling, origin=origin, info=info)


def masks(model, plan):
    """The forward masks (keyword arguments of TaskModel.evaluate / logits) that switch the plan's
    removed parts off in `model` as it is: equal outputs to apply(model, plan), without copying it.
    Sign matching is not a mask: a plan with sign-matching heads is refused here."""
    model.encoder.architecture.require("pruning")
    p = parse(model, plan)
    if any(a == "sign_match" for acts in p["heads"].values() for a in acts.values()):
        raise InputError("masks(): sign matching changes how a head computes, it is not a mask; use apply()")
    keep_layers, keep_heads, keep_neurons, _ = _keep_arrays(model, p)
    g = p["group"]
    return {"skip_layers": (1 - keep_layers).astype(np.uint8), "head_keep": keep_heads,
            "ffn_keep": np.ascontiguousarray(keep_neurons[::g]), "ffn_group": g}


def in_original_numbering(model):
    """What compression removed or approximated so far, in the numbering of the model it started from:
    {"layers_removed": [...], "heads": {layer: {head: 'prune' | 'sign_match'}}, "ffn_groups_removed":
    {layer: [...]}} (groups of the origin's group size)."""
    o, s = model.origin, model.structure
    g = o.get("ffn_group_size")
    first = model.info.get("original_structure")
    if not first:
        return None
    L0 = len(first["layer_heads"])
    kept = set(o["layers"])
    out = {"layers_removed": [l for l in range(L0) if l not in kept], "heads": {}, "ffn_groups_removed": {}}
    k = 0
    for j, l in enumerate(o["layers"]):
        heads = {h: "prune" for h in range(first["layer_heads"][l]) if h not in o["heads"][j]}
        for i, h in enumerate(o["heads"][j]):
            if s["head_attention"][k + i] == 1:
                heads[h] = "sign_match"
        k += len(o["heads"][j])
        if heads:
            out["heads"][l] = dict(sorted(heads.items()))
        if g:
            groups = sorted(set(range(first["layer_intermediate"][l] // g)) - {n // g for n in o["neurons"][j]})
            if groups:
                out["ffn_groups_removed"][l] = groups
    return out


def vocabulary(model, *data, special=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "<pad>", "</s>", "<unk>",
                                      "<mask>"), unknown=None, size=None, min_count=1):
    """A plan's 'vocabulary' entry keeping the token ids `data` (TaskData) uses and the tokenizer's special
    tokens (BERT's and RoBERTa's names, those the vocabulary has); every other id reads the unknown token's
    row (the tokenizer's [UNK] or <unk>, or `unknown`). Build it
    from the training data only: ids that appear only in evaluation data then read [UNK], as they would
    in serving.

    `min_count`: keep only the tokens the data uses at least this often (2: not the words seen once,
    which fine-tuning barely learned and serving rarely meets).

    `size`: keep this many tokens. When the data's are more, the data's most used ones (ties: the
    lower id); when they are fewer, fill up with the tokens the pre-training corpus used most.
    WordPiece and BPE vocabularies list their tokens about in that order (BERT's: "the", "of",
    "and", "in", "to" from id 1996 on), so these are the kept ids' lowest others, placeholder
    tokens ("[unused...]", "<unused...>") skipped. Each kept token costs one embedding row (hidden
    size bytes in int8); fewer unknown words at serving time. The special tokens and the unknown
    token are always kept, beyond `size` if need be."""
    tok = model.encoder.tokenizer
    V = int(model.encoder.config["vocab_size"])
    if size is not None and (not isinstance(size, (int, np.integer)) or isinstance(size, bool) or not 0 < size <= V):
        raise InputError(f"vocabulary(size={size!r}): a token count in [1, {V}]")
    if not isinstance(min_count, (int, np.integer)) or isinstance(min_count, bool) or min_count < 1:
        raise InputError(f"vocabulary(min_count={min_count!r}): a count >= 1")
    counts = np.zeros(V, np.int64)
    for d in data:
        tokens = d.ids[np.arange(d.ids.shape[1])[None, :] < d.lengths[:, None]]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= V):
            raise InputError(f"vocabulary(): the data has token ids outside [0, {V})")
        counts += np.bincount(tokens.ravel(), minlength=V)
    always = set()
    if tok is not None:
        always.update(i for i in (tok.token_to_id(t) for t in special) if i is not None)
        if unknown is None:
            unknown = tok.token_to_id("[UNK]")
            if unknown is None:
                unknown = tok.token_to_id("<unk>")
    if unknown is None:
        raise InputError("vocabulary(): the model has no tokenizer to name its unknown token: pass unknown=<id>")
    always.add(int(unknown))
    used = np.setdiff1d(np.flatnonzero(counts >= min_count), np.fromiter(always, np.int64))
    if size is not None and len(used) + len(always) > size:   # the data's most used tokens
        used = used[np.lexsort((used, -counts[used]))][:max(0, size - len(always))]
    ids = always | set(used.tolist())
    if size is not None:
        placeholder = re.compile(r"^(\[unused\d+\]|<unused\d+>)$")
        for i in range(V):
            if len(ids) >= size:
                break
            if i in ids:
                continue
            name = tok.id_to_token(i) if tok is not None else None
            if name is not None and placeholder.match(name):
                continue
            ids.add(i)
    return {"keep": sorted(int(i) for i in ids), "unknown": int(unknown)}
