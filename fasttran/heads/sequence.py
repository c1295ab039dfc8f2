"""Sequence-level heads: one prediction per example from its pooled state (csrc/train/head_sequence.c).

    ClassificationHead  single-label classification: softmax cross-entropy; accuracy, F1, Matthews
    RegressionHead      scores (STS-B's similarity): squared error; MSE, Pearson, Spearman
    MultiLabelHead      any number of labels per example: binary cross-entropy per label; micro /
                        macro F1 at a threshold (or one per label)

Each reads pooled features (a cache with positions="mean" / "cls"), or every token's state
(positions="all", or the top layers' output), pooled in C by `pooling`. `pooler=True` puts BERT's
pooler (dense + tanh) in front of the classifier, as transformers' BertForSequenceClassification,
whose checkpoints these heads export to (with CLS pooling).
"""
import numpy as np

from .. import metrics as M
from ..errors import InputError, InputTypeError
from .base import BERT_POOLER, DenseShape, Head, Prepared


class _SequenceHead(Head):
    loss_name = None
    least_labels = 2   # classes; regression and multi-label take one column or more
    default_labels = 2
    problem_type = None   # transformers' config.problem_type of the export
    export_as = "sequence-classification"

    def __init__(self, hidden_size, num_labels=None, pooler=False, dropout=0.1, seed=0, init_std=0.02, pooling="mean",
                 label_names=None, shape=None):
        least = self.least_labels
        num_labels = self.default_labels if num_labels is None else num_labels
        if isinstance(num_labels, bool) or not isinstance(num_labels, (int, np.integer)) or num_labels < least:
            raise InputError(f"num_labels{' (outputs per example)' if least == 1 else ''} must be an int >= {least}, "
                             f"got {num_labels!r}")
        self.kind = "pooler" if pooler else "linear"
        if shape is not None and not pooler and DenseShape.of(shape) != BERT_POOLER:
            raise InputError("shape= is the pooler's (the dense layer before the classifier): pass pooler=True with it")
        super().__init__(hidden_size, num_labels, dropout, seed, init_std, loss=self.loss_name, pooling=pooling,
                         label_names=label_names, shape=shape)

    @property
    def pooler(self):
        return self.kind == "pooler"

    @classmethod
    def for_task(cls, hidden_size, targets=None, num_labels=None, dropout=None, seed=0, pooling="mean", pooler=None,
                 label_names=None, examples=None, **task_kw):
        if pooler is not None:
            task_kw["pooler"] = bool(pooler)
        return cls._sized(hidden_size, targets, num_labels, dropout, seed, label_names, dict(task_kw, pooling=pooling))

    def export_layout(self, mean=False):
        """BERT's pooler on the [CLS] row + classifier: transformers' BertForSequenceClassification
        (another architecture's class: fasttran.export; `mean`: its class also pools by mean, as
        ModernBERT's); any other pooling or no pooler has no transformers class: sentence-transformers'
        layout."""
        if not (self.pooler and (self.pooling == "cls" or mean)):
            return super().export_layout()
        names = [name for name, _, _ in self._table]
        return ("sequence-classification", "BertForSequenceClassification",
                dict(self.label_config(), num_labels=self.num_labels, problem_type=self.problem_type),
                {("bert." + n if n.startswith("pooler.") else n): n for n in names})

    def config(self):
        return dict(super().config(), task=self.task)

    def prepare(self, cache, targets):
        return Prepared(None if targets is None else self.check_targets(targets, len(cache), cache.example_ids))

    def batch(self, prep, idx, lengths):
        return (None if prep.targets is None else np.ascontiguousarray(prep.targets[idx])), None

    def denominator(self, targets):
        return float(targets.size)

    def denominators(self, targets, counts):
        return np.asarray(counts, np.float64)   # each batch's targets.size

    def step(self, x, targets=None, grads=None, dx=None, training=False, seed=0, step=0, lengths=None):
        """Forward over features x: (B, C) pooled, or (N, C) rows with `lengths` (rows per example,
        pooled by `pooling`); with targets also the mean loss, with `grads` (like params) the backward
        (dx: like x). Returns (logits (B, K), loss or None)."""
        x = self._features(x)
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise InputError(f"features must be (rows, {self.hidden_size}), got shape {x.shape}")
        lengths = np.ones(len(x), np.int32) if lengths is None else np.ascontiguousarray(lengths, np.int32)
        if int(lengths.sum()) != len(x):
            raise InputError(f"lengths add up to {int(lengths.sum())} rows, x has {len(x)}")
        B = len(lengths)
        t = None if targets is None else self.check_targets(targets, B)
        logits, loss = self._run(x, lengths, t, None, grads, dx, training, seed, step)
        return logits.reshape(B, self.num_labels), loss

    @classmethod
    def _from_config(cls, cfg):
        return cls(cfg["hidden_size"], cfg["num_labels"], pooler=cfg.get("kind") == "pooler",
                   dropout=cfg.get("dropout", 0.1), pooling=cfg.get("pooling", "mean"),
                   label_names=cfg.get("label_names"), shape=cfg.get("shape"))


def _numbers(values, what, want, fix=""):
    """`values` as an array, refusing what cannot be one and strings or objects, with a few of them shown"""
    try:
        y = np.asarray(values)
    except ValueError as e:
        raise InputError(f"{what} could not be read as an array: {e}") from None
    if y.dtype.kind in "USO":
        vals = list(dict.fromkeys(str(v) for v in y.reshape(-1)[:1000]))[:3]
        raise InputTypeError(f"{what} must be {want}, got {'objects' if y.dtype.kind == 'O' else 'strings'} such as "
                             f"{vals}{fix}")
    return y


def softmax(z, axis=-1):
    """float32 softmax of float scores along `axis` (-inf: probability 0), computed in float64"""
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis, keepdims=True))
    return (e / e.sum(axis, keepdims=True)).astype(np.float32)


def xent(outputs, y):
    """the mean softmax cross-entropy of rows of scores against their class ids y"""
    z = outputs - outputs.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def _where(example_ids, i):
    return f"of example {int(example_ids[i])}" if example_ids is not None else f"at position {int(i)}"


class ClassificationHead(_SequenceHead):
    """dropout -> linear (pooler=False), or dropout -> dense -> tanh -> dropout -> linear (pooler=True,
    BERT's pooler + classifier) on the pooled state; softmax cross-entropy over num_labels classes."""
    task = "classification"
    tasks = {"classification": {}, "classification-pooler": {"pooler": True}}
    cli_tasks = {"classification": "classification", "pair": "classification"}
    loss_name = "xent"
    problem_type = "single_label_classification"
    main_metric = "accuracy"

    @classmethod
    def infer_num_labels(cls, labels):
        y = cls.labels_array(labels)
        return max(2, int(y.max()) + 1) if y.size else 2

    @staticmethod
    def labels_array(labels):
        """Labels as an integer array, with the errors a user can act on (strings, floats, ragged)."""
        y = _numbers(labels, "labels", "integer class ids 0..K-1", "; map them to ids first, e.g. classes, y = "
                     "numpy.unique(labels, return_inverse=True) (fasttran.readers does it for files)")
        if y.dtype.kind == "f":
            whole = y.size and np.all(np.isfinite(y)) and np.all(y == np.round(y))
            raise InputTypeError(f"labels must be integer class ids, got {y.dtype}"
                                 + (" (whole numbers: pass labels.astype(int))" if whole else
                                    " with fractions: for scores use Trainer('regression')"))
        if y.dtype.kind not in "iub":
            raise InputTypeError(f"labels must be integers, got {y.dtype}")
        return y

    def check_targets(self, labels, n, example_ids=None):
        y = self.labels_array(labels)
        if y.shape != (n,):
            there = "the cache has" if example_ids is not None else "there are"
            raise InputError(f"labels has {y.shape[0] if y.ndim else 0} entries but {there} {n} examples"
                             if y.ndim == 1 else f"labels must be 1-D (one class id per example), got shape {y.shape}")
        bad = np.flatnonzero((y < 0) | (y >= self.num_labels))
        if len(bad):
            raise InputError(f"label {int(y[bad[0]])} {_where(example_ids, bad[0])} is outside [0, {self.num_labels})"
                             + (": a label the training data never had" if example_ids is not None else ""))
        return y.astype(np.int32)

    def correct(self, logits, targets):
        return int((logits.reshape(len(targets), -1).argmax(1) == targets).sum()), len(targets)

    def outputs(self, logits, lengths, valid):
        return logits.reshape(len(lengths), self.num_labels)

    def predict(self, outputs, targets=None):
        return outputs.argmax(1)

    def probabilities(self, outputs):
        """(examples, classes) softmax"""
        return softmax(outputs)

    def evaluate(self, outputs, targets, prep=None):
        """accuracy, F1 (binary: of class 1; else macro), Matthews correlation and the loss"""
        y = prep.targets if prep is not None and prep.targets is not None else self.check_targets(targets, len(outputs))
        pred = outputs.argmax(1)
        f1 = M.f1_score(y, pred, average="binary" if self.num_labels == 2 else "macro",
                        **({"labels": list(range(self.num_labels))} if self.num_labels > 2 else {}))
        return {"accuracy": M.accuracy(y, pred), "f1": f1, "matthews_corrcoef": M.matthews_corrcoef(y, pred),
                "loss": xent(outputs, y)}


class RegressionHead(_SequenceHead):
    """A score per example (num_labels scores; STS-B's similarity is one): linear (or BERT's pooler +
    linear) on the pooled state, mean squared error, as transformers' problem_type='regression'."""
    task = "regression"
    tasks = {"regression": {}}
    cli_tasks = {"regression": "regression"}
    loss_name = "mse"
    problem_type = "regression"
    least_labels = default_labels = 1
    main_metric = "pearson"

    @classmethod
    def infer_num_labels(cls, targets):
        y = np.asarray(targets)
        return int(y.shape[1]) if y.ndim == 2 else 1

    def check_targets(self, targets, n, example_ids=None):
        y = _numbers(targets, "regression targets", "numbers")
        if y.dtype.kind not in "iubf":
            raise InputTypeError(f"regression targets must be numbers, got {y.dtype}")
        K = self.num_labels
        if y.shape not in ((n,), (n, K)) or (y.ndim == 1 and K != 1):
            raise InputError(f"regression targets must have shape ({n},)" + (f" or ({n}, {K})" if K > 1 else "")
                             + f" (one score per example{'' if K == 1 else f', {K} each'}), got {y.shape}")
        y = y.astype(np.float32).reshape(n, K)
        bad = np.flatnonzero(~np.isfinite(y).all(1))
        if len(bad):
            raise InputError(f"the target {_where(example_ids, bad[0])} is {y[bad[0]].tolist()}: not a finite number")
        return y

    def start_from(self, prep):
        """the classifier's bias at the targets' mean: the first steps learn the features, not the offset
        (a zero bias against scores of 0-5 costs LAMB, whose steps scale with the weights' norm, most
        of an epoch)"""
        self.load_state_dict(dict(self.state_dict(), **{"classifier.bias": prep.targets.mean(0)}))

    def outputs(self, logits, lengths, valid):
        return logits.reshape(len(lengths), self.num_labels)

    def predict(self, outputs, targets=None):
        return outputs[:, 0] if self.num_labels == 1 else outputs

    def evaluate(self, outputs, targets, prep=None):
        """MSE, Pearson and Spearman (averaged over the scores when there are several)"""
        y = prep.targets if prep is not None and prep.targets is not None else self.check_targets(targets, len(outputs))
        cols = range(self.num_labels)
        return {"mse": float(np.mean((outputs.astype(np.float64) - y) ** 2)),
                "pearson": float(np.mean([M.pearson(y[:, k], outputs[:, k]) for k in cols])),
                "spearman": float(np.mean([M.spearman(y[:, k], outputs[:, k]) for k in cols])),
                "loss": float(np.mean((outputs.astype(np.float64) - y) ** 2))}


class MultiLabelHead(_SequenceHead):
    """Any number of the num_labels labels per example: binary cross-entropy per label on the logits
    (transformers' problem_type='multi_label_classification'); label k is predicted where its
    probability exceeds `threshold` (a number, or one per label: see fasttran.metrics.best_thresholds)."""
    task = "multi-label"
    tasks = {"multi-label": {}}
    cli_tasks = {"multi-label": "multilabel"}
    loss_name = "bce"
    problem_type = "multi_label_classification"
    least_labels = 1
    main_metric = "micro_f1"

    def __init__(self, hidden_size, num_labels, pooler=False, dropout=0.1, seed=0, init_std=0.02, pooling="mean",
                 label_names=None, threshold=0.5, shape=None):
        super().__init__(hidden_size, num_labels, pooler, dropout, seed, init_std, pooling, label_names, shape)
        th = np.asarray(threshold, np.float64)
        if th.shape not in ((), (num_labels,)) or not np.all((th > 0) & (th < 1)):
            raise InputError(f"threshold must be a probability in (0, 1), or one per label ({num_labels}), "
                             f"got {threshold!r}")
        self.threshold = float(th) if th.ndim == 0 else th

    def config(self):
        th = self.threshold
        return dict(super().config(), threshold=th if isinstance(th, float) else [float(v) for v in th])

    @classmethod
    def _from_config(cls, cfg):
        return cls(cfg["hidden_size"], cfg["num_labels"], pooler=cfg.get("kind") == "pooler",
                   dropout=cfg.get("dropout", 0.1), pooling=cfg.get("pooling", "mean"),
                   label_names=cfg.get("label_names"), threshold=cfg.get("threshold", 0.5), shape=cfg.get("shape"))

    @classmethod
    def infer_num_labels(cls, targets):
        if isinstance(targets, (list, tuple)) and targets and np.ndim(targets[0]) == 1 and not np.ndim(targets) == 2:
            return max((int(max(t)) + 1 for t in targets if len(t)), default=1)
        y = np.asarray(targets)
        if y.ndim != 2:
            raise InputError(f"multi-label targets must be an (examples, labels) array of 0/1, got shape {y.shape}")
        return int(y.shape[1])

    def check_targets(self, targets, n, example_ids=None):
        """(n, K) 0/1 (or probabilities), or one list of label ids per example"""
        K = self.num_labels
        if isinstance(targets, (list, tuple)) and len(targets) == n and all(
                isinstance(t, (list, tuple, set, np.ndarray)) and np.ndim(t) == 1 for t in targets):
            y = np.zeros((n, K), np.float32)
            for i, ids in enumerate(targets):
                ids = np.asarray(list(ids))
                if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= K):
                    raise InputError(f"the example {_where(example_ids, i)} has labels {ids.tolist()}; label ids must be ints "
                                     f"in [0, {K})")
                y[i, ids.astype(np.int64)] = 1.0
            return y
        y = np.asarray(targets)
        if y.dtype.kind in "USO":
            raise InputTypeError("multi-label targets must be an (examples, labels) array of 0/1, or one list of label "
                                 "ids per example")
        if y.shape != (n, K):
            raise InputError(f"multi-label targets must have shape ({n}, {K}) (a 0/1 column per label), got {y.shape}")
        y = y.astype(np.float32)
        bad = np.flatnonzero(~((y >= 0) & (y <= 1)).all(1))
        if len(bad):
            raise InputError(f"the targets {_where(example_ids, bad[0])} are {y[bad[0]].tolist()}: each must lie "
                             "in [0, 1]")
        return y

    def start_from(self, prep):
        """the classifier's bias at each label's log-odds in the targets: the first loss is the labels'
        entropy, not log 2 per label"""
        p = np.clip(prep.targets.mean(0), 1e-4, 1 - 1e-4)
        self.load_state_dict(dict(self.state_dict(), **{"classifier.bias": np.log(p / (1 - p))}))

    def correct(self, logits, targets):   # exact-match (subset) accuracy
        pred = 1.0 / (1.0 + np.exp(-logits.reshape(targets.shape))) > self.threshold
        return int((pred == (targets > 0.5)).all(1).sum()), len(targets)

    def outputs(self, logits, lengths, valid):
        return logits.reshape(len(lengths), self.num_labels)

    def predict(self, outputs, targets=None):
        """(examples, labels) 0/1"""
        return (1.0 / (1.0 + np.exp(-outputs)) > self.threshold).astype(np.int8)

    def probabilities(self, outputs):
        """(examples, labels): each label's sigmoid"""
        return (1.0 / (1.0 + np.exp(-outputs.astype(np.float64)))).astype(np.float32)

    def evaluate(self, outputs, targets, prep=None):
        """micro / macro F1 and precision / recall at the head's threshold, subset accuracy, loss"""
        y = prep.targets if prep is not None and prep.targets is not None else self.check_targets(targets, len(outputs))
        prob = 1.0 / (1.0 + np.exp(-outputs.astype(np.float64)))
        f = M.multilabel_f1(y > 0.5, prob, threshold=self.threshold)
        z = outputs.astype(np.float64)
        bce = np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
        return {"micro_f1": f["micro_f1"], "macro_f1": f["macro_f1"], "micro_precision": f["micro_precision"],
                "micro_recall": f["micro_recall"],
                "subset_accuracy": float(((prob > self.threshold) == (y > 0.5)).all(1).mean()), "loss": float(bce.mean())}
