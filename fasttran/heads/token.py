"""Token classification (named entities, part of speech): a label per token (csrc/train/head_token.c),
as transformers' BertForTokenClassification.

Targets are per token, aligned to the tokens the cache was built from: an (examples, tokens) array
padded with -100, or one array per example -- `Encoder.tokenize_words(words, labels)` gives both the
inputs and these labels, the first sub-token of each word labelled and the others -100 (ignored),
as transformers' examples do. Predictions go back to words through the same positions; the
evaluation scores entities with seqeval's rules (IOB2) when the head has `label_names`.
"""
import numpy as np

from .. import metrics as M
from ..errors import InputError, InputTypeError
from .base import Head, Prepared, gather_rows, token_offsets
from .base import per_token as _per_token

IGNORE = -100   # transformers' ignore_index: a token without a label


class TokenClassificationHead(Head):
    """dropout -> linear on every token's state; softmax cross-entropy over the labelled tokens.
    label_names (e.g. ['O', 'B-PER', 'I-PER', ...]) let evaluate() score entities."""
    kind = "token"
    task = "token-classification"
    export_as = "token-classification"
    tasks = {"token-classification": {}}
    cli_tasks = {"token": "tokens"}
    lr_kind = "linear"   # a linear layer like the classifier: its rates
    takes_tokens = True
    main_metric = "f1"

    def __init__(self, hidden_size, num_labels, dropout=0.1, seed=0, init_std=0.02, label_names=None, shape=None):
        if isinstance(num_labels, bool) or not isinstance(num_labels, (int, np.integer)) or num_labels < 2:
            raise InputError(f"num_labels must be an int >= 2, got {num_labels!r}")
        super().__init__(hidden_size, num_labels, dropout, seed, init_std, label_names=label_names,
                         shape=_per_token(shape))

    @classmethod
    def infer_num_labels(cls, labels):
        if getattr(labels, "labels", None) is not None and hasattr(labels, "word_ids"):   # WordTokens
            labels = labels.labels
        rows = list(labels) if isinstance(labels, (np.ndarray, list, tuple)) else []
        top = max((int(np.max(r)) for r in rows if np.size(r)), default=1)
        return max(2, top + 1)

    @classmethod
    def _from_config(cls, cfg):
        return cls(cfg["hidden_size"], cfg["num_labels"], dropout=cfg.get("dropout", 0.1),
                   label_names=cfg.get("label_names"), shape=cfg.get("shape"))

    def config(self):
        return dict(super().config(), task=self.task)

    def export_layout(self, mean=False):
        return ("token-classification", "BertForTokenClassification",
                dict(self.label_config(), num_labels=self.num_labels),
                {("bert." + n if n.startswith("pooler.") else n): n for n, _, _ in self._table})

    def check_features(self, cache):
        super().check_features(cache)

    # ---- targets ----------------------------------------------------------------------------------
    def check_targets(self, labels, lengths, example_ids=None):
        """flat int32 token labels (-1: none) for examples of `lengths` tokens, from an (examples,
        tokens) array padded with -100 or a list of per-example arrays"""
        n = len(lengths)
        where = (lambda i: f"example {int(example_ids[i])}") if example_ids is not None else (lambda i: f"example {i}")
        if getattr(labels, "labels", None) is not None and hasattr(labels, "word_ids"):   # WordTokens
            labels = labels.labels
        if isinstance(labels, np.ndarray) and labels.ndim == 2:
            rows = list(labels)
        elif isinstance(labels, (list, tuple)):
            rows = [np.asarray(r) for r in labels]
        else:
            raise InputTypeError("token labels must be an (examples, tokens) array padded with -100, or one array per "
                                 f"example (Encoder.tokenize_words gives them), got {type(labels).__name__}")
        if len(rows) != n:
            raise InputError(f"token labels are given for {len(rows)} examples but there are {n}")
        out = []
        for i, (r, L) in enumerate(zip(rows, lengths)):
            r = np.asarray(r)
            if r.dtype.kind in "USO" or r.dtype.kind == "f" and not np.all(r == np.round(r)):
                raise InputTypeError(f"token labels must be integer class ids (or -100: none), got {r.dtype} for "
                                     f"{where(i)}")
            if r.ndim != 1:
                raise InputError(f"token labels of {where(i)} must be 1-D, got shape {r.shape}")
            r = r.astype(np.int64)
            if len(r) < L:
                raise InputError(f"{where(i)} has {int(L)} tokens but {len(r)} token labels: labels must be aligned "
                                 "to the tokens (Encoder.tokenize_words aligns word labels)")
            if np.any(r[L:] != IGNORE):
                raise InputError(f"{where(i)} has {int(L)} tokens but labels beyond them: the labels are not aligned "
                                 "to its tokens (padding must be -100)")
            r = r[:L]
            bad = np.flatnonzero((r != IGNORE) & ((r < 0) | (r >= self.num_labels)))
            if len(bad):
                raise InputError(f"token {int(bad[0])} of {where(i)} has label {int(r[bad[0]])}, outside [0, "
                                 f"{self.num_labels}) and not -100" + (": a label the training data never had"
                                                                         if example_ids is not None else ""))
            out.append(np.where(r == IGNORE, -1, r).astype(np.int32))
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    def prepare(self, cache, targets):
        if targets is None:
            return Prepared(None)
        lengths = np.asarray(cache.lengths)
        return Prepared(self.check_targets(targets, lengths, cache.example_ids), None, token_offsets(lengths))

    def batch(self, prep, idx, lengths):
        if prep.targets is None:
            return None, None
        return np.ascontiguousarray(gather_rows(prep.targets, prep.offsets, idx)), None

    def denominator(self, targets):
        return float(max(1, int((targets >= 0).sum())))

    def denominators(self, targets, counts):
        counts = np.asarray(counts, np.int64)
        labelled = np.add.reduceat((np.asarray(targets).reshape(-1) >= 0).astype(np.int64), np.cumsum(counts) - counts)
        return np.maximum(labelled, 1).astype(np.float64)

    def correct(self, logits, targets):
        keep = targets >= 0
        return int((logits.reshape(len(targets), -1).argmax(1)[keep] == targets[keep]).sum()), int(keep.sum())

    # ---- outputs ----------------------------------------------------------------------------------
    def outputs(self, logits, lengths, valid):
        lg = logits.reshape(-1, self.num_labels)
        ends = np.cumsum(lengths)
        return [lg[e - n:e] for n, e in zip(lengths, ends)]

    def collect(self, chunks):
        return [a for c in chunks for a in c]

    def predict(self, outputs, targets=None):
        """(examples, longest) the predicted label id of every token, -100 past an example's tokens:
        what fasttran.tokens.words_from_tokens takes (or Trainer.predict(..., words=) gives words)"""
        out = np.full((len(outputs), max((len(o) for o in outputs), default=0)), IGNORE, np.int64)
        for i, o in enumerate(outputs):
            out[i, :len(o)] = o.argmax(1)
        return out

    def logits(self, outputs):
        """(examples, longest, labels), NaN past an example's tokens"""
        out = np.full((len(outputs), max((len(o) for o in outputs), default=0), self.num_labels), np.nan, np.float32)
        for i, o in enumerate(outputs):
            out[i, :len(o)] = o
        return out

    def probabilities(self, outputs):
        """(examples, longest, labels): each token's softmax over the labels, NaN past its tokens"""
        from .sequence import softmax
        return softmax(self.logits(outputs))

    def per_word(self, predictions, words, output):
        """per sentence, one prediction per word (its first sub-token's): label names where the head
        has them and output='labels', else ids, logits or probabilities (`words`: the
        fasttran.tokens.WordTokens the cache's inputs came from)"""
        from ..tokens import words_from_tokens
        T = int(np.shape(getattr(words, "word_ids", words))[1])
        p = np.asarray(predictions)
        if p.shape[1] > T:
            raise InputError(f"the cache's examples have up to {p.shape[1]} tokens but words has {T} per sentence: "
                             "pass the WordTokens the cache was built from")
        pad = [(0, 0), (0, T - p.shape[1])] + [(0, 0)] * (p.ndim - 2)
        p = np.pad(p, pad, constant_values=IGNORE if output == "labels" else np.nan)
        out = words_from_tokens(p, words)
        if output == "labels" and self.label_names is not None:
            out = [[None if w is None else self.label_names[int(w)] for w in s] for s in out]
        return out

    def evaluate(self, outputs, targets, prep=None):
        """token accuracy over the labelled tokens (each word's first sub-token) and, with label_names,
        entity-level precision / recall / F1 (seqeval's rules) over the words"""
        lengths = np.array([len(o) for o in outputs])
        y = prep.targets if prep is not None and prep.targets is not None else self.check_targets(targets, lengths)
        ends = np.cumsum(lengths)
        gold, pred = [], []
        for o, e, n in zip(outputs, ends, lengths):
            t = y[e - n:e]
            keep = t >= 0
            gold.append(t[keep])
            pred.append(o.argmax(1)[keep])
        g, p = np.concatenate(gold), np.concatenate(pred)
        res = {"token_accuracy": float((g == p).mean()) if len(g) else 0.0}
        if self.label_names is not None:
            s = M.entity_scores([t.tolist() for t in gold], [t.tolist() for t in pred], self.label_names)
            res.update(precision=s["precision"], recall=s["recall"], f1=s["f1"], accuracy=s["accuracy"])
        return res

