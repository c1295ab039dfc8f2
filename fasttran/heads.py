"""Task heads trained on frozen features: sequence classification and extractive QA.

The parameters of a head live in one flat float32 array (`head.params`) with named views
(`head.tensors`), in the order and with the names Hugging Face uses (`classifier.weight`,
`pooler.dense.weight`, `qa_outputs.weight`...). Forward, loss and backward run in C
(csrc/train/heads.c) over the backend interface.
"""
import html

import numpy as np

from . import _C
from .errors import InputError, InputTypeError

_KIND = {"linear": 0, "pooler": 1, "qa": 2}


class _Head:
    kind = None

    def __init__(self, hidden_size, num_labels, dropout, seed, init_std):
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, (int, np.integer)) or hidden_size < 1:
            raise InputError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise InputError(f"dropout must lie in [0, 1), got {dropout!r}")
        self.hidden_size = int(hidden_size)
        self.num_labels = int(num_labels)
        self.dropout = float(dropout)
        self._cfg = (_KIND[self.kind], self.hidden_size, self.num_labels, self.dropout)
        self._table, total = _C.head_tensors(self._cfg)
        self.params = np.zeros(total, np.float32)
        self.tensors = self.views(self.params)
        rng = np.random.default_rng(seed)
        for name, t in self.tensors.items():   # BERT's init: N(0, 0.02) weights, zero biases
            if name.endswith("weight"):
                t[...] = rng.normal(0.0, init_std, t.shape).astype(np.float32)

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
        return {"head": type(self).__name__, "kind": self.kind, "hidden_size": self.hidden_size,
                "num_labels": self.num_labels, "dropout": self.dropout}

    @staticmethod
    def from_config(cfg):
        if cfg.get("kind") == "qa":
            return QAHead(cfg["hidden_size"], dropout=cfg.get("dropout", 0.0))
        return ClassificationHead(cfg["hidden_size"], cfg["num_labels"], pooler=cfg.get("kind") == "pooler",
                                  dropout=cfg.get("dropout", 0.1))

    @staticmethod
    def _features(x, ndim, what="features"):
        if not isinstance(x, np.ndarray):
            if hasattr(x, "__dlpack__"):
                x = np.from_dlpack(x)
            else:
                raise InputTypeError(f"{what} must be a NumPy array or a CPU DLPack tensor, got {type(x).__name__}")
        if x.dtype != np.float32:
            raise InputTypeError(f"{what} must be float32, got {x.dtype}")
        if x.ndim != ndim:
            raise InputError(f"{what} must have {ndim} dimensions, got shape {x.shape}")
        return np.ascontiguousarray(x)

    def __repr__(self):
        return (f"{type(self).__name__}(kind={self.kind!r}, hidden_size={self.hidden_size}, "
                f"num_labels={self.num_labels}, dropout={self.dropout}, parameters={self.num_parameters:,})")

    def _repr_html_(self):
        rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{tuple(t.shape)}</td></tr>" for n, t in self.tensors.items())
        return f"<b>{html.escape(repr(self))}</b><table>{rows}</table>"


class ClassificationHead(_Head):
    """dropout -> linear (pooler=False), or dropout -> dense -> tanh -> dropout -> linear
    (pooler=True, BERT's pooler + classifier) on a pooled vector (B, C); cross-entropy loss."""

    def __init__(self, hidden_size, num_labels=2, pooler=False, dropout=0.1, seed=0, init_std=0.02):
        if isinstance(num_labels, bool) or not isinstance(num_labels, (int, np.integer)) or num_labels < 2:
            raise InputError(f"num_labels must be an int >= 2, got {num_labels!r}")
        self.kind = "pooler" if pooler else "linear"
        super().__init__(hidden_size, num_labels, dropout, seed, init_std)

    def check_features(self, x):
        x = self._features(x, 2)
        if x.shape[1] != self.hidden_size:
            raise InputError(f"features have width {x.shape[1]}, the head expects hidden_size {self.hidden_size}")
        return x

    def check_labels(self, labels, n):
        y = np.asarray(labels)
        if y.dtype.kind not in "iu":
            raise InputTypeError(f"labels must be integers, got {y.dtype}")
        if y.shape != (n,):
            raise InputError(f"labels must have shape ({n},), got {y.shape}")
        bad = np.flatnonzero((y < 0) | (y >= self.num_labels))
        if len(bad):
            raise InputError(f"label {int(y[bad[0]])} at position {int(bad[0])} is outside [0, {self.num_labels})")
        return y.astype(np.int32)

    def step(self, x, labels=None, grads=None, dx=None, training=False, seed=0, step=0):
        """Forward, and with labels the mean loss; with `grads` (like params) the backward.
        Returns (logits (B, K), loss or None)."""
        x = self.check_features(x)
        B = x.shape[0]
        y = self.check_labels(labels, B) if labels is not None else None
        logits = np.empty((B, self.num_labels), np.float32)
        loss = _C.head_step(self._cfg, self.params, x, B, 1, None, y, logits, grads, dx, bool(training),
                            int(seed), int(step))
        return logits, loss

    def predict(self, x):
        return self.step(x)[0].argmax(1)


class QAHead(_Head):
    """Extractive QA: linear -> start/end logits over token states (B, T, C), softmax over the
    context positions only (`valid`), cross-entropy averaged over start and end."""
    kind = "qa"

    def __init__(self, hidden_size, dropout=0.0, seed=0, init_std=0.02):
        super().__init__(hidden_size, 2, dropout, seed, init_std)

    def step(self, x, valid, labels=None, grads=None, dx=None, training=False, seed=0, step=0):
        """x (B, T, C), valid (B, T), labels (2, B) start/end positions or None. Returns
        (logits (2, B, T), loss or None)."""
        x = self._features(x, 3, "token states")
        if x.shape[2] != self.hidden_size:
            raise InputError(f"token states have width {x.shape[2]}, the head expects {self.hidden_size}")
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
        logits = np.empty((2, B, T), np.float32)
        loss = _C.head_step(self._cfg, self.params, x, B, T, valid, y, logits, grads, dx, bool(training),
                            int(seed), int(step))
        return logits, loss
