"""Task heads: what differs between the tasks people fine-tune for, on one training step that knows
no task (fasttran.model.Model runs any of them).

    ClassificationHead        single-label classification (sentences or sentence pairs)
    RegressionHead            scores (STS-B's similarity)
    MultiLabelHead            several labels per example
    TokenClassificationHead   a label per token (named entities)
    QAHead                    extractive question answering (spans)

One small file each over the C heads of csrc/train/head_*.c; the shared parameter table and the
Trainer's interface are in base.py. Each head class declares what the rest of fasttran needs to
know about it -- its task names, default learning rates, main metric, export layout, command-line
task and reader task -- and registers itself by subclassing `Head`: this package imports every
module in it, so a new head is one file here (plus its C descriptor), never an entry in a table
elsewhere.
"""
import importlib
import pkgutil

from ..errors import InputError
from .base import BERT_POOLER, REGISTRY, DenseShape, Head, Prepared

for _m in pkgutil.iter_modules(__path__):   # every head module registers its classes
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

from .sequence import ClassificationHead, MultiLabelHead, RegressionHead  # noqa: E402
from .span import QAHead  # noqa: E402
from .token import TokenClassificationHead  # noqa: E402

#: head classes by name (the name a checkpoint's head.json records)
HEADS = {cls.__name__: cls for cls in REGISTRY}

#: the Trainer's task names -> (head class, keyword arguments)
TASKS = {task: (cls, dict(kw)) for cls in REGISTRY for task, kw in cls.tasks.items()}

_Head = Head   # the name fasttran 0.1 used


def head_class(task):
    """The head class of a task name (TASKS), or an InputError listing them."""
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; choose one of {sorted(TASKS)} or pass a head object")
    return TASKS[task][0]


def make_head(task, hidden_size, targets=None, num_labels=None, dropout=None, seed=0, pooling="mean", pooler=None,
              label_names=None, examples=None, shape=None, encoder=None):
    """The head for a task name (TASKS), sized from the targets it will train on (for `examples`
    cache examples): num_labels from label_names, else given, else what the targets need (the head
    class decides: Head.for_task). A head with a dense layer before its classifier (pooler=True;
    multiple choice; token and QA heads with pooler=True where the architecture's classes have one)
    takes `shape` (a DenseShape), else the shape of `encoder`'s architecture's class for the task
    (fasttran.architectures: DistilBERT's ReLU, ELECTRA's GELU, ModernBERT's prediction head), so
    that it exports to that class; else BERT's pooler. Where that class runs the base model's pooler
    on the first token (BERT's; architectures.Architecture.dense_from_pooler) and `encoder` has one,
    the head's pooler starts from the checkpoint's, as transformers starts its class."""
    cls = head_class(task)
    kw = dict(TASKS[task][1])
    own = kw.pop("pooler", None)
    pooler = own if pooler is None else pooler   # an explicit pooler= wins over the task's
    if shape is None and encoder is not None and cls.has_dense(pooler):
        shape = encoder.architecture.head_shape(cls.export_as, encoder._raw_config)
    if shape is not None:
        if not cls.has_dense(pooler):
            raise InputError(f"shape= is the dense layer's before the classifier: a {task} head has one with "
                             "pooler=True")
        kw["shape"] = shape
    head = cls.for_task(hidden_size, targets, num_labels=num_labels, dropout=dropout, seed=seed, pooling=pooling,
                        pooler=pooler, label_names=label_names, examples=examples, **kw)
    if encoder is not None and cls.has_dense(pooler):
        start_from_pooler(head, encoder)
    return head


def start_from_pooler(head, encoder):
    """Set `head`'s dense layer to `encoder`'s pooler (the checkpoint's) where the architecture's class
    for the head runs that pooler: BERT's shape, on the [CLS] row, the same width. Returns whether it did."""
    if not (head.shape == BERT_POOLER and getattr(head, "pooling", None) == "cls"
            and encoder.architecture.dense_from_pooler(head.export_as)):
        return False
    src, mine = encoder.pooler_state(), head.tensors
    if not src or any(name not in mine or mine[name].shape != v.shape for name, v in src.items()):
        return False
    for name, v in src.items():
        mine[name][...] = v
    return True


def default_lr(optimizer, head="classification", pooler=None):
    """The default learning rate of an optimizer ('lamb'/'adamw') for a head (a task name or a head
    object): its class's `default_lrs` (benchmarks/sweep_defaults.py chose them)."""
    if isinstance(head, Head):
        return head.default_lr(optimizer)
    if head not in TASKS:
        return None
    cls, kw = TASKS[head]
    return cls.class_default_lr(optimizer, pooler=bool(kw.get("pooler", pooler)))


__all__ = ["DenseShape", "BERT_POOLER", "make_head", "head_class", "default_lr", "Head", "Prepared", "ClassificationHead", "RegressionHead",
           "MultiLabelHead", "TokenClassificationHead", "QAHead", "HEADS", "TASKS", "REGISTRY"]
