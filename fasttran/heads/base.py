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
import dataclasses
import html
from typing import NamedTuple

import numpy as np

from .. import _C
from ..errors import InputError, InputTypeError

_LOSS = {"xent": 0, "mse": 1, "bce": 2}
_POOL = {"cls": 1, "mean": 2}

#: every concrete head class, in the order they were defined (fasttran.heads builds HEADS and TASKS
#: from it); a class registers itself by naming its `tasks`
REGISTRY = []

#: The learning rates a classifier-style head (a linear layer, or BERT's pooler + a linear layer, on
#: frozen features) starts from, per (optimizer, C kind). Chosen by the sweep in
#: benchmarks/sweep_defaults.py (frozen all-MiniLM-L6-v2; classification heads on all 67,349 SST-2
#: train sentences and on the 4,000-sentence sample the demo ships; tables in
#: benchmarks/defaults_sweep.md): the grid value with the best mean dev score over seeds and
#: training-set sizes (a diverged run scores 0), every other hyper-parameter at its default. LAMB
#: scales each step by the weight norm, so its rates are far above AdamW's. Regression,
#: multi-label, token and multiple-choice heads are such a layer too and take these rates.
CLASSIFIER_LRS = {("lamb", "linear"): 0.02, ("lamb", "pooler"): 0.01, ("adamw", "linear"): 0.01,
                  ("adamw", "pooler"): 1e-3}


_NORMS = {None: 0, "layernorm": 1, "layernorm+bias": 2}


@dataclasses.dataclass(frozen=True)
class DenseShape:
    """The shape of the dense layer a head runs before its classifier (csrc/train/head_dense.c), as
    each architecture's *For* classes have it: `act` (tanh: BERT's pooler; relu: DistilBERT's
    pre_classifier; gelu, exact: ELECTRA's classification head, ModernBERT's prediction head), a bias
    or not, an optional LayerNorm after it ("layernorm" without a bias, "layernorm+bias") with `norm_eps`,
    and `per_token`: token and QA heads run it on every row before their classifier (ModernBERT's).
    `input_dropout`: training drops the dense layer's input as well as its output (RoBERTa's and
    ELECTRA's classification heads); BERT's pooler, DistilBERT's pre_classifier and ModernBERT's head
    drop its output only. It changes training, never a trained head's logits.
    fasttran.architectures says which shape each architecture's classes have."""
    act: str = "tanh"
    bias: bool = True
    norm: object = None
    norm_eps: float = 1e-5
    per_token: bool = False
    input_dropout: bool = False

    def __post_init__(self):
        if self.act not in _C.HEAD_ACTS:
            raise InputError(f"a head's dense activation must be one of {sorted(_C.HEAD_ACTS)}, got {self.act!r}")
        if self.norm not in _NORMS:
            raise InputError(f"a head's dense norm must be one of {list(_NORMS)}, got {self.norm!r}")
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise InputError(f"norm_eps must lie in (0, 1), got {eps!r}")
        if not all(isinstance(v, bool) for v in (self.bias, self.per_token, self.input_dropout)):
            raise InputError("a head's dense bias, per_token and input_dropout are True or False")

    def c_fields(self, per_token=False):
        """(act, no_dense_bias, norm, norm_eps, dense, dense_input_dropout) of the C head configuration"""
        return (_C.HEAD_ACTS[self.act], int(not self.bias), _NORMS[self.norm], float(self.norm_eps), int(per_token),
                int(self.input_dropout))

    def config(self):
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, value):
        """a DenseShape from itself, its config() dict or None (BERT's pooler)"""
        if value is None:
            return BERT_POOLER
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise InputError(f"unknown dense-shape fields {sorted(unknown)}")
            return cls(**value)
        raise InputTypeError(f"a head's shape is a DenseShape or its dict, got {type(value).__name__}")


#: BERT's pooler: dense + tanh (what every pooler head was before shapes)
BERT_POOLER = DenseShape()


class Prepared(NamedTuple):
    """A head's view of a data set: targets (None when evaluating without them) in example order,
    and per-token extras (QA's context rows), flat over the examples' tokens with `offsets`."""
    targets: object
    extra: object = None
    offsets: object = None


class Head:
    kind = None         # the C head (fasttran._C.HEAD_KINDS: "linear", "pooler", "token", "qa", ...)
    task = None         # the Trainer's task name of this class
    takes_tokens = False   # needs every token's state (positions="all"), not pooled features
    main_metric = None  # the metric the progress bar shows
    #: the Trainer's task names this class serves -> keyword arguments (a class without is abstract)
    tasks = {}
    #: default learning rates {(optimizer, kind): lr}; `lr_kind` is the kind whose rate this head
    #: takes (None: its own kind)
    default_lrs = CLASSIFIER_LRS
    lr_kind = None
    #: `fasttran train --task` names -> the fasttran.readers task that reads their files
    cli_tasks = {}
    #: examples per item: a head that scores groups of consecutive examples together (multiple
    #: choice) trains on whole groups; `batch_size` then counts groups
    group_size = 1

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "tasks" in cls.__dict__ and cls.tasks:
            REGISTRY.append(cls)

    def __init__(self, hidden_size, num_labels, dropout, seed, init_std, loss="xent", pooling="mean",
                 label_names=None, shape=None):
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
        self.shape = DenseShape.of(shape)
        self._cfg = (_C.HEAD_KINDS[self.kind][0], self.hidden_size, self.num_labels, self.dropout, _LOSS[loss],
                     _POOL[pooling]) + self.shape.c_fields(self.dense)
        self._table, total = _C.head_tensors(self._cfg)
        self._own = np.zeros(total, np.float32)   # the parameters' home until a model holds them
        self._home = None
        rng = np.random.default_rng(seed)
        for name, t in self.tensors.items():   # BERT's init: N(0, 0.02) weights, zero biases, LayerNorms at 1
            if name.endswith("norm.weight"):
                t[...] = 1.0
            elif name.endswith("weight"):
                t[...] = rng.normal(0.0, init_std, t.shape).astype(np.float32)

    # ---- parameters ---------------------------------------------------------------------------
    # The parameters have one home: the head's own array, or -- from the moment a fasttran.model.Model
    # is built over the head (the Trainer's) -- the model's flat table, which the training steps
    # update. `params` / `tensors` read the home: views of it in host memory, a read-only host copy
    # of a table in GPU memory (load_state_dict writes there).
    @property
    def params(self):
        """the flat float32 parameters (views of them in host memory; a read-only copy of GPU memory)"""
        return self._own if self._home is None else self._home.head_params()

    @property
    def tensors(self):
        """{Hugging Face name: view of `params`}"""
        return self.views(self.params)

    def _bind(self, home):
        """`home` (a Model) holds the parameters from now on: it gets their current values."""
        values = np.array(self.params)
        self._unbind()
        home.write_head_params(values)
        self._home = home

    def _unbind(self):
        """the parameters back home in the head's own array (the model that held them is let go)"""
        if self._home is not None:
            self._own = np.array(self._home.head_params(), dtype=np.float32)
            self._home = None

    def _write(self, flat):
        if self._home is None:
            self._own[...] = flat
        else:
            self._home.write_head_params(np.ascontiguousarray(flat, np.float32))

    @property
    def dense(self):
        """True when the head runs its dense layer (`shape`) before the classifier"""
        return self.kind in ("pooler", "choice") or self.shape.per_token

    def views(self, flat):
        """Named views of a flat buffer laid out like `params` (e.g. the gradients)."""
        return {name: flat[off:off + int(np.prod(shape))].reshape(shape) for name, shape, off in self._table}

    @property
    def num_parameters(self):
        return sum(int(np.prod(shape)) for _, shape, _ in self._table)   # (no read of GPU memory)

    def named_parameters(self):
        return list(self.tensors.items())

    def state_dict(self):
        return {k: v.copy() for k, v in self.tensors.items()}

    def load_state_dict(self, state):
        flat = np.array(self.params, dtype=np.float32)
        tensors = self.views(flat)
        for name, t in tensors.items():
            if name not in state:
                raise InputError(f"head state lacks tensor {name!r}")
            v = np.asarray(state[name])
            if v.shape != t.shape:
                raise InputError(f"head tensor {name!r}: state has shape {v.shape}, the head {t.shape}")
            t[...] = v
        extra = set(state) - set(tensors)
        if extra:
            raise InputError(f"head state has unknown tensors: {sorted(extra)}")
        self._write(flat)
        return self

    def label_config(self):
        """transformers' id2label / label2id of this head's labels (LABEL_i without names)"""
        names = self.label_names or [f"LABEL_{i}" for i in range(self.num_labels)]
        return {"id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)}}

    def config(self):
        cfg = {"head": type(self).__name__, "kind": self.kind, "hidden_size": self.hidden_size,
               "num_labels": self.num_labels, "dropout": self.dropout, "pooling": self.pooling}
        if self.label_names is not None:
            cfg["label_names"] = list(self.label_names)
        if self.shape != BERT_POOLER:
            cfg["shape"] = self.shape.config()
        return cfg

    # ---- what the rest of fasttran asks of a head class -------------------------------------------
    @classmethod
    def for_task(cls, hidden_size, targets=None, num_labels=None, dropout=None, seed=0, pooling="mean", pooler=None,
                 label_names=None, examples=None, **task_kw):
        """A head of this class for a task (make_head), trained on `targets` for `examples` cache
        examples: num_labels from label_names, else given, else what the targets need
        (infer_num_labels). `pooling` / `pooler` are for the classes that pool (they override this)."""
        return cls._sized(hidden_size, targets, num_labels, dropout, seed, label_names, task_kw)

    @classmethod
    def _sized(cls, hidden_size, targets, num_labels, dropout, seed, label_names, kw):
        kw = dict(kw)
        if label_names is not None:
            kw["label_names"] = label_names
            num_labels = num_labels or len(label_names)
        kw["num_labels"] = num_labels or cls.infer_num_labels(targets)
        if dropout is not None:
            kw["dropout"] = dropout
        return cls(hidden_size, seed=seed, **kw)

    @classmethod
    def class_default_lr(cls, optimizer, pooler=False):
        """The default learning rate of `optimizer` for heads of this class (`pooler`: the variant with
        BERT's pooler, for classes that have one)."""
        kind = cls.lr_kind or ("pooler" if pooler and ("lamb", "pooler") in cls.default_lrs else cls.kind or "linear")
        key = (str(optimizer).lower(), kind)
        if key not in cls.default_lrs:
            raise InputError(f"no default learning rate for optimizer {optimizer!r} and head {cls.__name__}")
        return cls.default_lrs[key]

    def default_lr(self, optimizer):
        """The default learning rate of `optimizer` for this head."""
        return type(self).class_default_lr(optimizer, pooler=self.dense)

    #: the layout of export_layout() (the architecture's class the head exports to)
    export_as = "sentence-transformers"

    @classmethod
    def has_dense(cls, pooler):
        """whether a head of this class made with `pooler` runs a dense layer before its classifier"""
        return bool(pooler)

    def export_layout(self, mean=False):
        """Where fasttran.export puts this head: (layout, transformers architecture or None,
        config entries, {transformers tensor name: head tensor name}); architecture None: the
        sentence-transformers layout (Pooling, then Dense modules). `mean`: the architecture's class
        pools by mean too (ModernBERT's classifier_pooling)."""
        return "sentence-transformers", None, {}, {}

    @staticmethod
    def from_config(cfg):
        """The head a config() describes (also the configs of fasttran 0.1 checkpoints)."""
        heads = {cls.__name__: cls for cls in REGISTRY}   # (not fasttran.heads.HEADS: that package imports this file)
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

    def steps_batch(self, prep, idx, lengths, examples):
        """batch() of several steps' examples one after another (step k: idx[examples[k]:examples[k + 1]]),
        each step's targets and row mask after the step before's: the Trainer's C loop takes them so"""
        return self.batch(prep, idx, lengths)

    def denominator(self, targets):
        return float(targets.size)

    def denominators(self, targets, counts):
        """denominator() of each of several batches' targets laid out one after another (`counts`
        elements each), as float64: the Trainer's C loop prepares its steps so"""
        pieces = np.split(np.asarray(targets).reshape(-1), np.cumsum(counts)[:-1])
        return np.array([self.denominator(t) for t in pieces], np.float64)

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

    def logits(self, outputs):
        """the raw scores of every example (Trainer.predict(output='logits'))"""
        return outputs

    def probabilities(self, outputs):
        """what the loss reads the scores as (Trainer.predict(output='probabilities'))"""
        from ..errors import UnsupportedError
        raise UnsupportedError(f"a {self.task} head gives scores, not probabilities: use output='logits'")

    def per_word(self, predictions, words, output):
        """token predictions back to words (Trainer.predict(words=...)); only token heads have them"""
        raise InputError(f"words= is for token heads: a {self.task} head predicts per example")

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
        extra = self._repr_extra()
        return (f"{type(self).__name__}(kind={self.kind!r}, hidden_size={self.hidden_size}, "
                f"num_labels={self.num_labels}, dropout={self.dropout}{extra}, parameters={self.num_parameters:,})")

    def _repr_extra(self):
        return f", pooling={self.pooling!r}"

    def _repr_html_(self):
        rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{tuple(t.shape)}</td></tr>" for n, t in self.tensors.items())
        return f"<b>{html.escape(repr(self))}</b><table>{rows}</table>"


def per_token(shape):
    """a token / QA head's shape: a given one runs on every row (ModernBERT's prediction head), None none"""
    return None if shape is None else dataclasses.replace(DenseShape.of(shape), per_token=True)


def describe_shape(shape):
    """'dense + gelu + LayerNorm (no bias)' ...; None: 'no dense layer'"""
    if shape is None:
        return "no dense layer"
    norm = {None: "", "layernorm": " + LayerNorm without bias", "layernorm+bias": " + LayerNorm"}[shape.norm]
    return (f"{'dropout + ' if shape.input_dropout else ''}dense{'' if shape.bias else ' without bias'} + "
            f"{shape.act}{norm}" + (" on every token" if shape.per_token else ""))


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
