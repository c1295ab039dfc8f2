"""Extractive question answering: the answer is a span of the context (csrc/train/head_span.c), as
transformers' BertForQuestionAnswering, with the start and end softmax over the context only.

Inputs are question + context windows (fasttran.squad.SquadFeatures); the context rows of an
example are the features' context_mask (the tokenizer's sequence id 1) when the SquadFeatures are
given (targets, evaluation, predict(squad=...)), else its tokens of type 1 but the final [SEP] (the
same rows for BERT; an architecture without segment types needs the SquadFeatures). Targets are
(start_positions, end_positions), token positions within each example, or the SquadFeatures
(their positions); evaluation maps the best span of all windows of a question back to text and
scores it with SQuAD's official exact match and F1.
"""
import numpy as np

from ..errors import InputError, InputTypeError
from .base import Head, Prepared, gather_rows, token_offsets
from .base import per_token as _per_token


def context_rows(cache, idx=None, squad=None):
    """float32 flat over the tokens of examples idx (None: all), one example after another: 1 where
    a token is context -- the `squad` features' context_mask (the cache's example ids index them),
    else type 1 but not the final [SEP]"""
    ids = cache.example_ids if idx is None else cache.example_ids[idx]
    tokens, types, offsets = cache.inputs(None if idx is None else ids, ragged=True)
    if squad is not None:
        return _squad_context(squad, np.asarray(ids, np.int64), np.asarray(tokens), np.asarray(offsets, np.int64))
    ctx = (np.asarray(types) == 1).astype(np.float32)
    last = np.asarray(offsets[1:], np.int64) - 1
    ctx[last[last >= np.asarray(offsets[:-1], np.int64)]] = 0.0
    return ctx


def _squad_context(squad, ids, tokens, offsets):
    """the features' context_mask over the cache's examples `ids`, flat; the features must hold the
    cache's tokens (they are what it was built from)"""
    ctx_mask, input_ids = np.asarray(squad.context_mask), np.asarray(squad.input_ids)
    lengths = np.diff(offsets)
    if len(ids) and (ids.min() < 0 or ids.max() >= len(ctx_mask) or lengths.max() > ctx_mask.shape[1]):
        raise InputError(f"the SquadFeatures ({len(ctx_mask)} features of at most {ctx_mask.shape[1]} tokens) are not "
                         "the ones this cache was built from: its example ids or lengths lie outside them")
    real = np.arange(ctx_mask.shape[1])[None, :] < lengths[:, None]
    if not np.array_equal(input_ids[ids][real], tokens):
        raise InputError("the SquadFeatures are not the ones this cache was built from: their input_ids differ from "
                         "the cache's tokens")
    return (ctx_mask[ids][real] != 0).astype(np.float32)


def _squad_of(targets):
    """the SquadFeatures given as targets (they carry a context_mask), else None"""
    return targets if hasattr(targets, "context_mask") and hasattr(targets, "postprocess") else None


class QAHead(Head):
    """linear -> start/end logits over every token's state; the softmax of each runs over the
    context tokens only (`valid`); cross-entropy averaged over start and end."""
    kind = "qa"
    task = "qa"
    export_as = "question-answering"
    tasks = {"qa": {}}
    #: measured by benchmarks/sweep_defaults.py on a SQuAD v1.1 subset (see CLASSIFIER_LRS)
    default_lrs = {("lamb", "qa"): 0.1, ("adamw", "qa"): 0.01}
    takes_tokens = True
    main_metric = "exact_match"

    def __init__(self, hidden_size, dropout=0.0, seed=0, init_std=0.02, shape=None):
        super().__init__(hidden_size, 2, dropout, seed, init_std, shape=_per_token(shape))

    @classmethod
    def _from_config(cls, cfg):
        return cls(cfg["hidden_size"], dropout=cfg.get("dropout", 0.0), shape=cfg.get("shape"))

    @classmethod
    def for_task(cls, hidden_size, targets=None, num_labels=None, dropout=None, seed=0, pooling="mean", pooler=None,
                 label_names=None, examples=None, **task_kw):
        return cls(hidden_size, seed=seed, **({} if dropout is None else {"dropout": dropout}), **task_kw)

    def export_layout(self, mean=False):
        return ("question-answering", "BertForQuestionAnswering", {"num_labels": 2},
                {("bert." + n if n.startswith("pooler.") else n): n for n, _, _ in self._table})

    def check_features(self, cache):
        super().check_features(cache)

    def _repr_extra(self):
        return ""

    def prepare(self, cache, targets):
        """targets: (start_positions, end_positions), or the SquadFeatures (their positions and context)"""
        squad = _squad_of(targets)
        if squad is not None:
            targets = (squad.start_positions, squad.end_positions)
        return self._prepare(cache, targets, squad)

    def _prepare(self, cache, targets, squad):
        arch = getattr(getattr(cache, "encoder", None), "architecture", None)
        if squad is None and arch is not None and arch.token_types != "segments":
            raise InputError(
                f"question answering over {arch.hf_class} needs the SquadFeatures the cache was built from: its "
                "inputs carry no token types, and the features' context_mask says which tokens are context. Pass "
                "them: fit(cache, features), evaluate(cache, features), predict(cache, squad=features)")
        ctx = context_rows(cache, squad=squad)
        offsets = token_offsets(cache.lengths)
        if targets is None:
            return Prepared(None, ctx, offsets)
        N = len(cache)
        if not (isinstance(targets, (tuple, list)) and len(targets) == 2):
            raise InputError("QA targets must be (start_positions, end_positions)")
        s, e = (np.asarray(t) for t in targets)
        for name, a in (("start_positions", s), ("end_positions", e)):
            if a.dtype.kind not in "iu":
                raise InputTypeError(f"{name} must be integers, got {a.dtype}")
            if a.shape != (N,):
                raise InputError(f"{name} has {a.shape[0] if a.ndim else 0} entries but the cache has {N} examples")
        lengths = np.asarray(cache.lengths)
        bad = np.flatnonzero((s < 0) | (e < s) | (e >= lengths))
        if len(bad):
            i = int(bad[0])
            raise InputError(f"example {int(cache.example_ids[i])}: answer span ({int(s[i])}, {int(e[i])}) is not "
                             f"inside its {int(lengths[i])} tokens with start <= end")
        bad = np.flatnonzero((ctx[offsets[:-1] + s] == 0) | (ctx[offsets[:-1] + e] == 0))
        if len(bad):
            i = int(bad[0])
            raise InputError(f"example {int(cache.example_ids[i])}: answer span ({int(s[i])}, {int(e[i])}) "
                             + ("is not in the context (the features' context_mask)" if squad is not None else
                                "is not in the context (token type 1)"))
        return Prepared(np.stack([s, e]).astype(np.int32), ctx, offsets)

    def batch(self, prep, idx, lengths):
        t = None if prep.targets is None else np.ascontiguousarray(prep.targets[:, idx])
        return t, np.ascontiguousarray(gather_rows(prep.extra, prep.offsets, idx))

    def steps_batch(self, prep, idx, lengths, examples):
        """each step's (2, its examples) targets -- starts, then ends -- after the step before's"""
        t, valid = self.batch(prep, idx, lengths)
        if t is not None:
            t = np.concatenate([t[:, a:b].reshape(-1) for a, b in zip(examples[:-1], examples[1:])])
        return t, valid

    def denominator(self, targets):
        return float(targets.size)   # start and end of each example

    def outputs(self, logits, lengths, valid):
        """per example (2, its tokens): start and end logits, -inf outside the context"""
        lg = logits.reshape(2, -1)
        ends = np.cumsum(lengths)
        return [np.where(valid[e - n:e] > 0, lg[:, e - n:e], -np.inf) for n, e in zip(lengths, ends)]

    def collect(self, chunks):
        return [a for c in chunks for a in c]

    def prepare_eval(self, cache, targets):
        return self._prepare(cache, None, _squad_of(targets))   # (QA evaluates against the SquadFeatures)

    def predict(self, outputs, targets=None):
        """per example (start, end) logits, or with the SquadFeatures the answer text per question id"""
        return outputs if targets is None else targets.postprocess(outputs)

    def logits(self, outputs):
        """(start_logits, end_logits), each (examples, longest) as transformers' QA models give them:
        -inf outside an example's context and past its tokens"""
        T = max((o.shape[1] for o in outputs), default=0)
        out = np.full((2, len(outputs), T), -np.inf, np.float32)
        for i, o in enumerate(outputs):
            out[:, i, :o.shape[1]] = o
        return out[0], out[1]

    def probabilities(self, outputs):
        """(start, end) probabilities over each example's context tokens, (examples, longest) each"""
        from .sequence import softmax
        return tuple(softmax(z) for z in self.logits(outputs))

    def evaluate(self, outputs, targets, prep=None):
        """SQuAD exact match and F1 (official normalisation, best over every reference answer);
        `targets`: the SquadFeatures the cache was built from"""
        from ..squad import squad_metrics
        if not hasattr(targets, "postprocess"):
            raise InputError("evaluating a QA head needs the SquadFeatures the cache was built from")
        return squad_metrics(targets.postprocess(outputs), targets.examples)

    def step(self, x, valid, labels=None, grads=None, dx=None, training=False, seed=0, step=0):
        """x (B, T, C) token states (each row of T a token: padded positions take part where valid),
        valid (B, T), labels (2, B) start/end positions or None. Returns (logits (2, B, T), loss or None)."""
        x = self._features(x, "token states")
        if x.ndim != 3 or x.shape[2] != self.hidden_size:
            raise InputError(f"token states must be (batch, tokens, {self.hidden_size}), got shape {x.shape}")
        B, T = x.shape[:2]
        valid = np.ascontiguousarray(valid, np.float32)
        if valid.shape != (B, T):
            raise InputError(f"the context mask must have shape {(B, T)}, got {valid.shape}")
        y = None
        if labels is not None:
            y = np.ascontiguousarray(labels)
            if y.dtype.kind not in "iu":
                raise InputTypeError(f"positions must be integers, got {y.dtype}")
            if y.shape != (2, B):
                raise InputError(f"positions must have shape (2, {B}) (starts, ends), got {y.shape}")
            y = y.astype(np.int32)
        logits, loss = self._run(x.reshape(B * T, -1), np.full(B, T, np.int32), y, valid.reshape(-1), grads,
                                 None if dx is None else dx.reshape(B * T, -1), training, seed, step)
        return logits.reshape(2, B, T), loss
