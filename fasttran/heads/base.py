"""What every task head shares: the parameter table, checkpoints, and the interface through which
the Trainer runs a head without knowing its task.

The parameters of a head live in one flat float32 array (`head.params`) with named views
(`head.tensors`), in the order and with the names Hugging Face uses (`classifier.weight`,
`pooler.dense.weight`, `qa_outputs.weight`...). Forward, loss and backward run in C
(csrc/train/head_*.c) over the backend interface; this class is the Python side: checks,
targets, metrics.

A head's task interface (what the Trainer and the model call):
    prepare(cache, targets)   targets checked once, in the cache's example order (+ what the head
                              needs per token, e.g. QA's context rows): a `Prepared`
    batch(prep, idx, lengths) (targets, valid) host arrays for the C step of examples `idx`
    denominator(targets)      the number of loss terms of those targets (the loss is their mean)
    correct(logits, targets)  (right, counted) for the running training accuracy, or None
    outputs(logits, lengths, valid)  one batch's logits as the head reports them
    evaluate(outputs, targets, prep) / predict(outputs): metrics and predictions
"""
import html
from typing import NamedTuple

import numpy as np

from .. import _C
from ..errors import InputError, InputTypeError

_KIND = {"linear": 0, "pooler": 1, "qa": 2, "token": 3}
_LOSS = {"xent": 0, "mse": 1, "bce": 2}
_POOL = {"cls": 1, "mean": 2}


class Prepared(NamedTuple):
    """A head's view of a data set: targets (None when evaluating without them) in example order,
    and per-token extras (QA's context rows), flat over the examples' tokens with `offsets`."""
    targets: object
    extra: object = None
    offsets: object = None


class Head:
    kind = None         # the C head: "linear", "pooler", "token", "qa"
    task = None         # the Trainer's task name
    takes_tokens = False   # needs every token's state (positions="all"), not pooled features
    main_metric = None  # the metric the progress bar shows
    _by_name = {}       # the head classes by name, for from_config (filled as each is defined)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        Head._by_name.setdefault(cls.__name__, cls)   # the first of a name: fasttran's own, defined at import

    def __init__(self, hidden_size, num_labels, dropout, seed, init_std, loss="xent", pooling="mean",
                 label_names=None):
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, (int, np.integer)) or hidden_size < 1:
            raise InputError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise InputError(f"dropout must lie in [0, 1), got {dropout!r}")
        if pooling not in _POOL:
            raise InputError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        if label_names is not None:
            label_names = [str(n) for n in label_names]
            if len(label_names) != num_labels or len(set(label_names)) != len(label_names):
                raise InputError(f"label_names must be {num_labels} distinct names, got {label_names!r}")
        self.hidden_size = int(hidden_size)
        self.num_labels = int(num_labels)
        self.dropout = float(dropout)
        self.loss, self.pooling, self.label_names = loss, pooling, label_names
        self._cfg = (_KIND[self.kind], self.hidden_size, self.num_labels, self.dropout, _LOSS[loss], _POOL[pooling])
        self._table, total = _C.head_tensors(self._cfg)
        self.params = np.zeros(total, np.float32)
        self.tensors = self.views(self.params)
        rng = np.random.default_rng(seed)
        for name, t in self.tensors.items():   # BERT's init: N(0, 0.02) weights, zero biases
            if name.endswith("weight"):
                t[...] = rng.normal(0.0, init_std, t.shape).astype(np.float32)

    # ---- parameters ---------------------------------------------------------------------------
    def views(self, flat):
        """Named views of a flat buffer laid out like `params` (e.g. the gradients)."""
        return {name: flat[off:off + int(np.prod(shape))].reshape(shape) for name, shape, off in self._table}

    @property
    def num_parameters(self):
        return self.params.size

    def named_parameters(self):
        return list(self.tensors.items())

    def state_dict(self):
        return {k: v.copy() for k, v in self.tensors.items()}

    def load_state_dict(self, state):
        for name, t in self.tensors.items():
            if name not in state:
                raise InputError(f"head state lacks tensor {name!r}")
            v = np.asarray(state[name])
            if v.shape != t.shape:
                raise InputError(f"head tensor {name!r}: state has shape {v.shape}, the head {t.shape}")
            t[...] = v
        extra = set(state) - set(self.tensors)
        if extra:
            raise InputError(f"head state has unknown tensors: {sorted(extra)}")
        return self

    def config(self):
        cfg = {"head": type(self).__name__, "kind": self.kind, "hidden_size": self.hidden_size,
               "num_labels": self.num_labels, "dropout": self.dropout, "pooling": self.pooling}
        if self.label_names is not None:
            cfg["label_names"] = list(self.label_names)
        return cfg

    @staticmethod
    def from_config(cfg):
        """The head a config() describes (also the configs of fasttran 0.1 checkpoints)."""
        heads = Head._by_name
        name = cfg.get("head")
        if name not in heads:   # fasttran 0.1 named only the kind
            name = "QAHead" if cfg.get("kind") == "qa" else "ClassificationHead"
        return heads[name]._from_config(cfg)

    # ---- the task interface (subclasses) --------------------------------------------------------
    def prepare(self, cache, targets):
        raise NotImplementedError

    def prepare_eval(self, cache, targets):
        """prepare() for evaluation targets (QA evaluates against SquadFeatures, not spans)"""
        return self.prepare(cache, targets)

    def start_from(self, prep):
        """A new head's starting point from its training targets (the Trainer calls it once, on the
        head it made): nothing here; regression and multi-label heads start at the targets' mean."""

    def batch(self, prep, idx, lengths):
        raise NotImplementedError

    def denominator(self, targets):
        return float(targets.size)

    def correct(self, logits, targets):
        return None

    def outputs(self, logits, lengths, valid):
        return logits

    def collect(self, chunks):
        return np.concatenate(chunks)

    def evaluate(self, outputs, targets, prep):
        raise NotImplementedError

    def predict(self, outputs, targets=None):
        raise NotImplementedError

    def check_features(self, cache):
        """Refuse features this head cannot read (an InputError saying which it needs)."""
        if self.takes_tokens and cache.positions != "all":
            raise InputError(f"a {self.task} head needs every token's state: a cache with positions='all', this one has "
                             f"positions={cache.positions!r}")
        if cache.hidden != self.hidden_size:
            raise InputError(f"the cache holds width {cache.hidden}, the head expects {self.hidden_size}")
        if cache.positions in _POOL and cache.positions != self.pooling:
            raise InputError(f"the head pools with {self.pooling!r} but the cache holds {cache.positions!r}-pooled "
                             f"features; build the cache with positions={self.pooling!r} (or 'all')")

    # ---- direct use on NumPy arrays (CPU) --------------------------------------------------------
    @staticmethod
    def _features(x, what="features"):
        if not isinstance(x, np.ndarray):
            if hasattr(x, "__dlpack__"):
                x = np.from_dlpack(x)
            else:
                raise InputTypeError(f"{what} must be a NumPy array or a CPU DLPack tensor, got {type(x).__name__}")
        if x.dtype != np.float32:
            raise InputTypeError(f"{what} must be float32, got {x.dtype}")
        return np.ascontiguousarray(x)

    def _run(self, x, lengths, targets, valid, grads, dx, training, seed, step):
        """The C step on host arrays: logits (flat, the head's layout) and the mean loss (or None)."""
        nl, _, _, _ = _C.head_counts(self._cfg, len(lengths), int(lengths.sum()))
        logits = np.empty(nl, np.float32)
        loss = _C.head_step(self._cfg, self.params, x, lengths, targets, valid, logits, grads, dx, bool(training),
                            int(seed), int(step))
        return logits, loss

    def __repr__(self):
        extra = "" if self.kind in ("qa",) else f", pooling={self.pooling!r}"
        return (f"{type(self).__name__}(kind={self.kind!r}, hidden_size={self.hidden_size}, "
                f"num_labels={self.num_labels}, dropout={self.dropout}{extra}, parameters={self.num_parameters:,})")

    def _repr_html_(self):
        rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{tuple(t.shape)}</td></tr>" for n, t in self.tensors.items())
        return f"<b>{html.escape(repr(self))}</b><table>{rows}</table>"


def token_offsets(lengths):
    """(examples + 1) int64: where each example's tokens start in flat per-token arrays"""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def gather_rows(flat, offsets, idx):
    """the rows of examples idx (offsets: token_offsets) of a flat per-token array, one example after
    another"""
    idx = np.asarray(idx, np.int64)
    starts, counts = offsets[idx], offsets[idx + 1] - offsets[idx]
    if len(idx) == 0:
        return flat[:0]
    pos = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(int(counts.sum()))
    return flat[pos]
