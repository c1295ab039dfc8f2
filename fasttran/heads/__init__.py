"""Task heads: what differs between the tasks people fine-tune for, on one training step that knows
no task (fasttran.model.Model runs any of them).

    ClassificationHead        single-label classification (sentences or sentence pairs)
    RegressionHead            scores (STS-B's similarity)
    MultiLabelHead            several labels per example
    TokenClassificationHead   a label per token (named entities)
    QAHead                    extractive question answering (spans)

One small file each (sequence.py, token.py, span.py) over the C heads of csrc/train/head_*.c; the
shared parameter table and the Trainer's interface are in base.py.
"""
from .base import Head, Prepared
from .sequence import ClassificationHead, MultiLabelHead, RegressionHead
from .span import QAHead
from .token import TokenClassificationHead

HEADS = {cls.__name__: cls for cls in (ClassificationHead, RegressionHead, MultiLabelHead, TokenClassificationHead,
                                       QAHead)}

#: the Trainer's task names -> (head class, keyword arguments)
TASKS = {
    "classification": (ClassificationHead, {}),
    "classification-pooler": (ClassificationHead, {"pooler": True}),
    "regression": (RegressionHead, {}),
    "multi-label": (MultiLabelHead, {}),
    "token-classification": (TokenClassificationHead, {}),
    "qa": (QAHead, {}),
}

_Head = Head   # the name fasttran 0.1 used


def make_head(task, hidden_size, targets=None, num_labels=None, dropout=None, seed=0, pooling="mean", pooler=None,
              label_names=None):
    """The head for a task name (TASKS), sized from the targets it will train on: num_labels from
    label_names, else given, else the largest class id + 1 (regression: the score columns)."""
    if task not in TASKS:
        from ..errors import InputError
        raise InputError(f"unknown task {task!r}; choose one of {sorted(TASKS)} or pass a head object")
    cls, kw = TASKS[task]
    kw = dict(kw)
    if pooler is not None and cls in (ClassificationHead, RegressionHead, MultiLabelHead):
        kw["pooler"] = bool(pooler)
    if cls is not QAHead:
        if label_names is not None:
            kw["label_names"] = label_names
            num_labels = num_labels or len(label_names)
        kw["num_labels"] = num_labels or cls.infer_num_labels(targets)
    if cls in (ClassificationHead, RegressionHead, MultiLabelHead):
        kw["pooling"] = pooling
    if dropout is not None:
        kw["dropout"] = dropout
    return cls(hidden_size, seed=seed, **kw)

__all__ = ["make_head", "Head", "Prepared", "ClassificationHead", "RegressionHead", "MultiLabelHead", "TokenClassificationHead",
           "QAHead", "HEADS", "TASKS"]
