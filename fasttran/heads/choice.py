"""Multiple choice (SWAG, RACE, ARC, COPA...): a question and its G candidate answers, as
transformers' BertForMultipleChoice (csrc/train/head_choice.c).

Each choice is one example of the cache -- the pair (question, choice), encoded like any sentence
pair -- and a question's G choices are G consecutive examples. Each choice is scored from its [CLS]
row through BERT's pooler (dense + tanh) and a one-output classifier; a softmax over a question's G
scores gives its answer. Targets are one choice index per question (len(cache) / G of them). The
Trainer keeps each question's choices together in a batch (`batch_size` counts questions), and
export() writes a directory AutoModelForMultipleChoice loads.
"""
import numpy as np

from .. import metrics as M
from ..errors import InputError, InputTypeError
from .base import Head, Prepared
from .sequence import softmax, xent


class MultipleChoiceHead(Head):
    """dropout -> pooler (dense, tanh) -> dropout -> linear (1 output) on each choice's pooled row;
    softmax cross-entropy over each question's `num_choices` scores."""
    kind = "choice"
    task = "multiple-choice"
    tasks = {"multiple-choice": {}}
    lr_kind = "pooler"   # BERT's pooler + a linear layer: the classifier's rates with the pooler
    main_metric = "accuracy"
    export_as = "multiple-choice"

    @classmethod
    def has_dense(cls, pooler):
        return True

    def __init__(self, hidden_size, num_choices=None, dropout=0.1, seed=0, init_std=0.02, pooling="cls",
                 num_labels=None, label_names=None, shape=None):
        G = num_choices if num_choices is not None else num_labels
        if isinstance(G, bool) or not isinstance(G, (int, np.integer)) or G < 2:
            raise InputError(f"num_choices (choices per question) must be an int >= 2, got {G!r}")
        if label_names is not None:
            raise InputError("a multiple-choice head has no label names: its answers are choice positions")
        super().__init__(hidden_size, int(G), dropout, seed, init_std, pooling=pooling, shape=shape)

    @property
    def num_choices(self):
        return self.num_labels

    @property
    def group_size(self):
        return self.num_labels

    @classmethod
    def for_task(cls, hidden_size, targets=None, num_labels=None, dropout=None, seed=0, pooling="cls", pooler=None,
                 label_names=None, examples=None, **task_kw):
        """num_choices given (num_labels), else the cache's examples per target"""
        if num_labels is None:
            n = len(np.asarray(targets).reshape(-1)) if targets is not None else 0
            if not n or not examples or examples % n:
                raise InputError(f"multiple choice: {examples} cache examples are not the same number of choices for "
                                 f"each of the {n} answers; lay out each question's choices one after another, "
                                 "or pass num_labels=<choices per question>")
            num_labels = examples // n
        return cls(hidden_size, num_labels, seed=seed, pooling="cls" if pooling == "mean" else pooling,
                   **({} if dropout is None else {"dropout": dropout}), **task_kw)

    @classmethod
    def _from_config(cls, cfg):
        return cls(cfg["hidden_size"], cfg["num_labels"], dropout=cfg.get("dropout", 0.1),
                   pooling=cfg.get("pooling", "cls"), shape=cfg.get("shape"))

    def config(self):
        return dict(super().config(), task=self.task)

    # ---- targets ----------------------------------------------------------------------------------
    def check_targets(self, answers, questions):
        y = np.asarray(answers)
        if y.dtype.kind not in "iu":
            raise InputTypeError(f"multiple-choice answers must be integer choice positions, got {y.dtype}")
        if y.shape != (questions,):
            raise InputError(f"multiple-choice answers must be one choice position per question ({questions}), "
                             f"got shape {y.shape}")
        bad = np.flatnonzero((y < 0) | (y >= self.num_choices))
        if len(bad):
            raise InputError(f"the answer of question {int(bad[0])} is choice {int(y[bad[0]])}, outside "
                             f"[0, {self.num_choices})")
        return y.astype(np.int32)

    def prepare(self, cache, targets):
        G, N = self.num_choices, len(cache)
        if N % G:
            raise InputError(f"the cache holds {N} examples, not whole questions of {G} choices")
        return Prepared(None if targets is None else self.check_targets(targets, N // G))

    def _questions(self, idx):
        """the questions of examples idx, which must be whole questions, their choices in order"""
        G = self.num_choices
        idx = np.asarray(idx, np.int64)
        q = idx[::G] // G
        if len(idx) % G or not np.array_equal(idx, (q[:, None] * G + np.arange(G)).reshape(-1)):
            raise InputError(f"a multiple-choice batch must hold whole questions, their {G} choices in order "
                             "(cache.batches(..., group=num_choices) reads them so)")
        return q

    def batch(self, prep, idx, lengths):
        q = self._questions(idx)
        return (None if prep.targets is None else np.ascontiguousarray(prep.targets[q])), None

    def correct(self, logits, targets):
        return int((logits.reshape(len(targets), -1).argmax(1) == targets).sum()), len(targets)

    # ---- outputs ----------------------------------------------------------------------------------
    def outputs(self, logits, lengths, valid):
        """(questions, num_choices) scores"""
        return logits.reshape(-1, self.num_choices)

    def predict(self, outputs, targets=None):
        """the chosen position per question"""
        return outputs.argmax(1)

    def probabilities(self, outputs):
        """(questions, num_choices): each question's softmax over its choices"""
        return softmax(outputs)

    def evaluate(self, outputs, targets, prep=None):
        """accuracy and the loss over the questions"""
        y = prep.targets if prep is not None and prep.targets is not None else self.check_targets(targets, len(outputs))
        return {"accuracy": M.accuracy(y, outputs.argmax(1)), "loss": xent(outputs, y)}

    def step(self, x, targets=None, grads=None, dx=None, training=False, seed=0, step=0, lengths=None):
        """Forward over pooled rows x (B, C), B = questions x num_choices (or (N, C) rows with
        `lengths`); with targets (questions) the mean loss, with `grads` the backward. Returns
        (scores (questions, num_choices), loss or None)."""
        x = self._features(x)
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise InputError(f"features must be (rows, {self.hidden_size}), got shape {x.shape}")
        lengths = np.ones(len(x), np.int32) if lengths is None else np.ascontiguousarray(lengths, np.int32)
        if int(lengths.sum()) != len(x) or len(lengths) % self.num_choices:
            raise InputError(f"{len(lengths)} sequences of {int(lengths.sum())} rows for {len(x)} rows of x: need "
                             f"whole questions of {self.num_choices} choices")
        t = None if targets is None else self.check_targets(targets, len(lengths) // self.num_choices)
        logits, loss = self._run(x, lengths, t, None, grads, dx, training, seed, step)
        return logits.reshape(-1, self.num_choices), loss

    def export_layout(self, mean=False):
        names = [name for name, _, _ in self._table]
        if self.pooling != "cls" and not mean:
            raise InputError("BertForMultipleChoice scores the [CLS] row: only a head with pooling='cls' exports")
        return ("multiple-choice", "BertForMultipleChoice", {},
                {("bert." + n if n.startswith("pooler.") else n): n for n in names})
