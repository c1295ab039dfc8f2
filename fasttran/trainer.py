"""fasttran.Trainer: fine-tunes a task head -- and optionally the encoder's top layers -- on
features from the activation cache, with a fused LAMB/AdamW.

Features come from an :class:`ActivationCache` (computed once, read every epoch), or from the
same object built with ``max_fraction=0`` (``ActivationCache.uncached``): then every batch runs
through the encoder -- the paper's baseline. Both give identical losses and weights for a seed.

The Trainer knows no task and no device. A step is: the reader's next batch (packed rows on the
model's device), the head's targets for it (fasttran.heads), one C call for the model's forward,
loss and backward (fasttran.model.Model over csrc/train/model.c: [cache] -> [top layers] -> head,
one flat parameter and gradient table), the gradients through the reduction hook (the identity
in one process; fasttran.distributed plugs torch.distributed in), one fused optimizer step, and
the bookkeeping (schedule, float16 loss scale, checkpoints, progress). In one process, on features
all cached, the steps of an epoch run in C many at a time, whatever the head and precision
(Model.train_steps over csrc/train/loop.c: the same calls and float16 decisions in the same order,
so the same bits; `_c_loop_refusal` says when not; on a GPU whose cache holds every row in its
device tier, each step's rows are gathered there), calling back every 20 steps for the bookkeeping
and Ctrl-C.
"""
import contextlib
import html
import json
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _C
from ._progress import progress
from .cache import ActivationCache
from .device import parse_device
from .errors import (CacheMismatchError, CheckpointError, InputError, InputTypeError, NoGPUError, UnsupportedError)
from .finetune import MEMORY_OPTIONS
from .heads import REGISTRY, TASKS, Head, head_class, make_head
from .heads import default_lr as _default_lr
from .model import Model, rows_of
from .optim import SCHEDULES, flat_state, load_flat_state, make_optimizer, schedule_factor
from .safetensors_io import read_safetensors, write_safetensors

#: The learning rate a Trainer uses when none is given, per (optimizer, head kind): each head class
#: declares its own (fasttran.heads: Head.default_lrs, chosen by benchmarks/sweep_defaults.py);
#: this is their union, for reading.
DEFAULT_LR = {k: v for cls in REGISTRY for k, v in cls.default_lrs.items()}


def default_lr(optimizer, head="classification"):
    """The default learning rate for an optimizer ('lamb'/'adamw') and a head (a task name or a head
    object): the head class's `default_lrs`."""
    lr = _default_lr(optimizer, head) if (isinstance(head, Head) or head in TASKS) else None
    if lr is None:
        raise InputError(f"no default learning rate for optimizer {optimizer!r} and head {head!r}")
    return lr


#: Top-layer fine-tuning (train_layers = k > 0) with lr=None: a recipe per optimizer and k -- the
#: layers' lr (the top layer's), the head's lr, the layer-wise lr decay (layer d below the top trains
#: at lr x decay**d), and optionally warmup and epochs (where the Trainer is given None). A k between
#: those listed takes the nearest one listed below it. LAMB's were chosen by benchmarks/sweep_recipes.py
#: (benchmarks/recipes_sweep.json: MiniLM, selected on a slice held out of each training split; k = 3
#: from the sweep at full training size over MRPC and CoLA, benchmarks/recipes_sweep_full_k3.json);
#: AdamW's k = 1 is the rate usual for fine-tuning BERT-family encoders (benchmarks/topk_sst2.py), its
#: k = 3 and 6 from the sweep behind FINETUNE_DEFAULT below.
#: (The sweep's k = 0 pick, lr 4e-2 for the head alone after 2 x 16 steps, is not taken: the heads'
#: DEFAULT_LR come from all of SST-2, benchmarks/sweep_defaults.py.)
DEFAULT_TOPK_RECIPES = {
    "lamb": {1: {"lr": 1.5e-3, "head_lr": 1e-2, "layer_lr_decay": 1.0, "epochs": 3},
             2: {"lr": 1.5e-3, "head_lr": 1e-2, "layer_lr_decay": 1.0, "epochs": 3},
             3: {"lr": 1.5e-3, "head_lr": 1.5e-3, "layer_lr_decay": 0.8, "epochs": 2},
             6: {"lr": 1.5e-3, "head_lr": 1.5e-3, "layer_lr_decay": 0.8, "epochs": 3}},
    "adamw": {1: {"lr": 1e-4, "head_lr": 1e-4, "layer_lr_decay": 1.0},
              3: {"lr": 2e-4, "head_lr": 2e-4, "layer_lr_decay": 1.0, "epochs": 3},
              6: {"lr": 1e-4, "head_lr": 1e-4, "layer_lr_decay": 1.0, "epochs": 3}},
}
#: `fasttran finetune`'s default where the user names neither: the share of the encoder's layers
#: trained (K = round(share x L), at least 1) and the optimizer, whose DEFAULT_TOPK_RECIPES entry
#: trains them. Chosen by benchmarks/sweep_recipes.py --default-candidates
#: (benchmarks/recipes_sweep_default.json: k = L/2 and L, LAMB and AdamW at full training size, scored
#: on slices held out of MRPC's and CoLA's training splits; the AdamW entries at 3 and 6 from the same
#: sweep). The precision: bf16 mixed precision where the device multiplies bf16 natively (CUDA, or a
#: CPU with AVX512_BF16), float32 elsewhere -- the same held-out scores as float32 on MRPC and CoLA
#: (benchmarks/recipes_sweep_default_precision.json), in 0.63x the time; see finetune_precision.
#: The depth depends on the training split's size (`finetune_layers`): every layer up to
#: `large_train` examples, `large_layers` of them from there -- on SST-2 (65,349 training
#: sentences) half the layers scored as all of them on 2,000 sentences held out of its training split
#: (94.50 against 94.55 % accuracy) in 0.6x the time (benchmarks/recipes_sweep_sst2_depth.json: the
#: fastest candidate within 0.5 point of the best), where on MRPC's and CoLA's (3,227 and 7,551) all
#: of them scored 2.7 points higher. The boundary sits between the two sizes measured (their
#: geometric mean); where between them the two depths cross is not measured. "embeddings": whether
#: every-layer training trains the embeddings too (`finetune_embeddings`): off -- on the slices held
#: out of MRPC's and CoLA's training splits, seeds 0-2 (benchmarks/recipes_sweep_embeddings*.json),
#: training them moved the two tasks' mean by +0.8, +2.2 and -1.2 points: +0.6 in all, less than one
#: standard error of the difference (1.0); on dev, no better over three seeds (RESULTS section 12);
#: for about 15% more time a step and a quarter more memory. A default moves on a gain beyond the
#: seeds' noise.
FINETUNE_DEFAULT = {"layers": 1.0, "large_layers": 0.5, "large_train": 22_000, "optimizer": "adamw",
                    "precision": "bfloat16", "embeddings": False}
#: the layers' default lr per optimizer at k = 1 (the recipes above hold every k's)
DEFAULT_TOPK_LR = {name: r[1]["lr"] for name, r in DEFAULT_TOPK_RECIPES.items()}
_DEFAULT_WARMUP, _DEFAULT_EPOCHS = 0.1, 3


def topk_recipe(optimizer, k):
    """The default recipe (a dict: lr, head_lr, layer_lr_decay[, warmup, epochs]) for training the top
    `k` layers with `optimizer` ('lamb' | 'adamw'): DEFAULT_TOPK_RECIPES at the largest k listed <= k."""
    table = DEFAULT_TOPK_RECIPES[str(optimizer).lower()]
    ks = sorted(table)
    return dict(table[max([x for x in ks if x <= k] or ks[:1])])


def lr_factors(model, lr, head_lr=None, layer_lr_decay=1.0):
    """Each tensor's factor of the schedule's learning rate, in the model's table order (that of
    model.named_parameters()): the head's tensors head_lr / lr (1 when head_lr is None), the tensors of
    the trained layer d layers below the top one layer_lr_decay ** d. The one place these factors are
    computed: the Trainer's optimizer groups carry them (lr_scale), both training loops apply them."""
    head = 1.0 if head_lr is None else float(head_lr) / float(lr)
    out = []
    buckets = [(int(o), int(n)) for o, n in model._core.buckets()]   # the head, then the top layer down
    for name, shape, off in model._table:
        where = next((b for b, (o, n) in enumerate(buckets) if o <= off < o + n), None)
        if where is None:   # pragma: no cover - every tensor lies in a bucket
            raise RuntimeError(f"tensor {name} lies in no gradient bucket")
        out.append(head if where == 0 else float(layer_lr_decay) ** (where - 1))
    return out
_TEMPO = MEMORY_OPTIONS   # the Trainer's `tempo` keys: the layer stack's memory options


#: one Model.train_steps call: at most this many bytes of features (or one batch) and, where they are
#: read before the call, this many steps; on the CPU the next call's features are read while one
#: trains. 32 steps: 16.5 us a step on a linear head over 384 features, batch 32, one thread (8 MiB
#: calls: 22 us, 5 batches: 23 us)
_C_LOOP_STEPS = 32
_C_LOOP_CHUNK_BYTES = 64 << 20

#: evaluation and predictions: at most this many token pairs (examples x the longest's tokens^2) a
#: batch, so that one layer's attention probabilities stay near 200 MiB a 12-head layer: 256 examples
#: up to 128 tokens, 28 SQuAD windows of 384, one ModernBERT document of 2,048 or more
_EVAL_TOKEN_PAIRS = 256 * 128 * 128


class TrainingInterrupted(Exception):
    pass


_SCALE_GROWTH_STEPS, _SCALE_MAX = 2000, 2.0 ** 24   # float16 loss scaling (as torch.amp.GradScaler)


def _cpu_isa():
    return _C.cpu_isa()


def native_bf16(device="cpu"):
    """Whether `device` multiplies bf16 natively: CUDA, or a CPU with AVX512_BF16 (vdpbf16ps: Intel
    Cooper Lake, Sapphire Rapids and later, AMD Zen 4 and later). Elsewhere bf16 products are a slow
    reference and the Trainer refuses precision='bfloat16' on the CPU."""
    return parse_device(device).is_cuda or bool(_C.cpu_features()[0]["avx512_bf16"])


def finetune_layers(num_layers, n_train):
    """`fasttran finetune`'s depth where the user names none: K = round(share x num_layers), at least
    1, the share FINETUNE_DEFAULT's "layers" below "large_train" training examples (QA: windows),
    "large_layers" from there."""
    d = FINETUNE_DEFAULT
    share = d["layers"] if int(n_train) < d["large_train"] else d["large_layers"]
    return max(1, int(round(share * int(num_layers))))


def finetune_embeddings(train_layers, num_layers):
    """`fasttran finetune`'s train_embeddings where the user says nothing: FINETUNE_DEFAULT's when
    every layer trains (the embeddings sit under layer 0), else False."""
    return bool(FINETUNE_DEFAULT["embeddings"]) and int(train_layers) == int(num_layers)


def finetune_precision(train_layers, device="cpu"):
    """`fasttran finetune`'s precision where the user names none: FINETUNE_DEFAULT's (bf16 mixed
    precision) when layers train on a device that multiplies bf16 natively, else float32 (a head
    alone always trains in float32)."""
    return FINETUNE_DEFAULT["precision"] if train_layers and native_bf16(device) else "float32"




class Reduction:
    """The Trainer's gradient reduction hook, here the identity: one process. A data-parallel one
    (fasttran.distributed.DataParallel) sums each gradient bucket over the processes as the
    backward hands it over, and the loss after the step, so that every process takes the same
    optimizer step.

    rank, world_size   this process's place: it trains on slice `rank` of `world_size` of every
                       global batch of `batch_size` examples
    start(model, run)  once per fit, with the model (its buckets: model.buckets()) and what must be
                       the same for every process (`run`: data, settings)
    begin(step)        before each step
    ready              None, or a callable(bucket) the model calls as each gradient bucket is final
    finish(loss)       after the step's backward: wait for the reductions; returns the global loss
    sum(values)        per-epoch counters over the processes
    shared_grads       the model's gradient table in memory the processes of this machine share
    """
    rank, world_size = 0, 1
    ready = None
    shared_grads = False

    def start(self, model, run):
        pass

    def begin(self, step):
        pass

    def finish(self, loss):
        return loss

    def sum(self, values):
        return np.asarray(values, np.float64)


def _auto_reduction():
    """DataParallel() when this process is one of several ranks, else None (one process)"""
    from . import distributed
    if not distributed.launched():
        return None
    dp = distributed.DataParallel()
    if dp.rank == 0:
        print(f"fasttran: rank 0 of {dp.world_size}: training data-parallel (each rank takes its slice of every "
              "global batch of batch_size examples); Trainer(..., reduction=None) trains each rank alone",
              file=sys.stderr, flush=True)
    return dp


def _epoch_seed(seed, epoch):
    return (int(seed) * 1_000_003 + epoch * 7919) % (2 ** 63)


def _not_a_cache(obj, what):
    """The error for features that are not an ActivationCache, saying how to make one."""
    got = type(obj).__name__
    hint = ""
    if isinstance(obj, np.ndarray) or hasattr(obj, "__dlpack__") or isinstance(obj, (list, tuple)):
        hint = (": build one from token ids with ActivationCache.build(encoder, input_ids, attention_mask, "
                "token_type_ids, positions='mean') (texts: encoder.tokenize(texts) first), or "
                "ActivationCache.uncached(...) to run the encoder every epoch")
    return InputTypeError(f"{what} must be an ActivationCache, got {got}{hint}")


class Trainer:
    """Fine-tunes a task head on frozen features, or with the encoder's top layers.

        >>> tr = fasttran.Trainer("classification")            # LAMB, its default lr, 3 epochs
        >>> tr.fit(cache, labels, eval=(dev_cache, dev_labels))
        >>> tr.evaluate(dev_cache, dev_labels)      # {'accuracy': ..., 'f1': ..., 'loss': ...}
        >>> tr.history                              # one dict per epoch; tr.plot() draws it

    `head` is a head object (fasttran.heads), or a task: "classification" (sentences or sentence
    pairs), "classification-pooler" (BERT's pooler before the classifier), "regression" (scores:
    MSE; Pearson / Spearman), "multi-label" (0/1 per label: binary cross-entropy; micro / macro F1),
    "token-classification" (a label per token: cross-entropy; entity F1 with `label_names`), "qa"
    (extractive spans; SQuAD EM / F1). The head is sized from the cache and the targets at fit time;
    `pooler=True` puts BERT's pooler in front of a classification, regression or multi-label head
    (the layout transformers' AutoModelForSequenceClassification has: export() writes it) -- in the
    encoder's architecture's shape (DistilBERT's ReLU, ELECTRA's GELU, ModernBERT's prediction head,
    also on every token of a token or QA head: fasttran.architectures' head_shapes), so that the
    export is that architecture's own class.
    `lr=None` takes the measured default for the optimizer and head (`DEFAULT_LR`, from
    benchmarks/sweep_defaults.py); with train_layers=k the recipe for k (`topk_recipe`: the layers' lr,
    `head_lr`, `layer_lr_decay`, from benchmarks/sweep_recipes.py). `head_lr` (train_layers > 0): the
    head's own lr (None: lr); `layer_lr_decay`: the layer d below the top trains at lr x decay**d (None:
    the recipe's with lr=None, else 1); both follow the schedule (`lr_factors`). A given lr alone trains
    everything at it. `search_lr(...)` before fit picks the lr on a held-out slice of the training data.
    `warmup` is a fraction of all steps (< 1) or a step count (None: 0.1, or the recipe's); `epochs`
    None: 3, or the recipe's. The
    head remembers the features it was trained on (model, layer, positions): evaluating it on
    another encoder's cache raises CacheMismatchError.

    `train_layers=k` also trains the encoder's top k layers, from a cache of layer L - k
    (`trainer.cache_for(encoder, ...)`), with `pooling` "mean" or "cls" for the sequence heads (token
    and QA heads take every token's state); `layer_dropout` is their hidden and attention dropout
    (None: the checkpoint's), `embedding_dropout` (every layer trained) the first layer's input's, as
    transformers drops the embeddings' output (default 0; None: the checkpoint's), `dropout` the
    head's; `train_embeddings=True` (every layer trained) trains the embeddings too -- the word,
    position and type tables and their LayerNorm, as transformers' full fine-tuning does -- from the
    cache's token ids, in layer 0's lr group and gradient bucket; `tempo` switches Tempo's memory options and FlashAttention's recomputed probabilities (see fasttran.finetune.TopLayers; e.g.
    tempo={"recompute_attention_probs": True} for long sequences). `precision="bfloat16"` (with
    train_layers; on CUDA, or on a CPU with AVX512_BF16 or AMX) trains the layers in mixed precision:
    float32 storage, master weights and sums, the projections' products in bf16 on tensor cores /
    AMX tiles / vdpbf16ps; evaluation and predict multiply in float32, as the export does
    (about 0.5% relative error per product, like PyTorch's AMP; attention's products too, as its
    bf16 FlashAttention: softmax and its statistics stay float32);
    "float16" (CUDA) the same with fp16 products (11
    significant bits, range 65504) and dynamic loss scaling: the layers' backward runs on the loss
    gradient times `loss_scale[0]` (from 2**16), an overflowing step is skipped and halves it, 2000
    clean steps double it (PyTorch's GradScaler rule; `skipped_steps` counts the skips).
    `reduction`: the gradient reduction hook (see Reduction; fasttran.distributed's for several
    processes). "auto" (the default): data-parallel (fasttran.distributed.DataParallel()) when this
    process is one of several ranks (torchrun, accelerate, Slurm + torchrun: WORLD_SIZE > 1), with
    one line from rank 0 saying so, else one process; None: this process alone, whatever launched it.
    """

    def __init__(self, head="classification", optimizer="lamb", lr=None, weight_decay=0.01, schedule="linear",
                 warmup=None, epochs=None, batch_size=32, seed=0, device="cpu", max_grad_norm=1.0, betas=(0.9, 0.999),
                 eps=1e-6, dropout=None, num_labels=None, show_progress=None, train_layers=0, pooling="mean",
                 tempo=None, layer_dropout=None, precision="float32", pooler=None, label_names=None, reduction="auto",
                 head_lr=None, layer_lr_decay=None, embedding_dropout=0.0, train_embeddings=False):
        if isinstance(head, str):
            if head not in TASKS:
                raise InputError(f"unknown head {head!r}; choose one of {sorted(TASKS)} or pass a head object")
        elif not isinstance(head, Head):
            raise InputTypeError(f"head must be a head object or a task name, got {type(head).__name__}")
        if not isinstance(optimizer, str) or optimizer.lower() not in ("lamb", "adamw"):
            raise InputError(f"unknown optimizer {optimizer!r}; choose 'lamb' or 'adamw'")
        if isinstance(train_layers, bool) or not isinstance(train_layers, (int, np.integer)) or train_layers < 0:
            raise InputError(f"train_layers must be an int >= 0 (how many of the top encoder layers to train), "
                             f"got {train_layers!r}")
        if pooling not in ("mean", "cls"):
            raise InputError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        for name, p, whose in (("layer_dropout", layer_dropout, "hidden/attention"),
                               ("embedding_dropout", embedding_dropout, "embeddings'")):
            if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0):
                raise InputError(f"{name} must be a probability in [0, 1) (or None for the checkpoint's {whose} "
                                 f"dropout), got {p!r}")
        tempo = dict(tempo or {})
        unknown = set(tempo) - set(_TEMPO)
        if unknown:
            raise InputError(f"unknown tempo option(s) {sorted(unknown)}; known: {list(_TEMPO)}")
        for name, v in (("head_lr", head_lr), ("layer_lr_decay", layer_lr_decay)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v))):
                raise InputError(f"{name} must be a finite number > 0 (or None for the default), got {v!r}")
        if train_embeddings and not train_layers:
            raise InputError("train_embeddings trains the embeddings under every encoder layer: it needs "
                             "train_layers = the encoder's layer count")
        if not train_layers and head_lr is not None:
            raise InputError("head_lr is the head's learning rate beside the trained layers' (train_layers > 0); with "
                             "train_layers=0 the head is all that trains: give its rate as lr")
        recipe = {}
        if lr is None and train_layers:   # the recipe: the layers' lr, the head's, the layer-wise decay
            recipe = topk_recipe(optimizer, int(train_layers))
            lr = recipe["lr"]
            head_lr = recipe["head_lr"] if head_lr is None else head_lr
        if lr is None:
            lr = (head_class(head).class_default_lr(optimizer, pooler=bool(pooler or TASKS[head][1].get("pooler")))
                  if isinstance(head, str) else head.default_lr(optimizer))
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
            raise InputError(f"lr must be a finite number > 0 (or None for the default), got {lr!r}")
        if layer_lr_decay is None:
            layer_lr_decay = recipe.get("layer_lr_decay", 1.0)
        warmup = recipe.get("warmup", _DEFAULT_WARMUP) if warmup is None else warmup
        epochs = recipe.get("epochs", _DEFAULT_EPOCHS) if epochs is None else epochs
        if schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        for name, v in (("epochs", epochs), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InputError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(warmup, (int, float)) or warmup < 0:
            raise InputError(f"warmup must be a fraction in [0, 1) or a step count, got {warmup!r}")
        device = parse_device(device)
        if precision not in ("float32", "bfloat16", "float16"):
            raise InputError(f"precision must be 'float32', 'bfloat16' or 'float16', got {precision!r}")
        if precision != "float32":
            if not train_layers:
                raise InputError(f"precision={precision!r} (mixed precision: the trained encoder layers' products "
                                 "in half precision) needs train_layers >= 1: a head alone trains in float32")
            if not device.is_cuda and (precision != "bfloat16" or not native_bf16(device)):
                raise InputError(f"precision={precision!r} on the CPU needs bfloat16 and a CPU with bf16 dot products "
                                 f"(avx512_bf16: Intel Cooper Lake, Sapphire Rapids (AMX) or later, AMD Zen 4 or later; "
                                 f"this one runs the {_cpu_isa()!r} kernels without it): elsewhere half-precision "
                                 "products are no faster than float32. Train in float32 here, or on device='cuda'")
        if device.is_cuda:
            from ._info import no_gpu_reason
            reason = no_gpu_reason()
            if reason:
                raise NoGPUError(f"Trainer(device={device!r}): there is no usable GPU: {reason}. Use device='cpu' "
                                 "(the default; a checkpoint trained on CUDA loads with Trainer.load(path, "
                                 "device='cpu'))")
        if isinstance(reduction, str) and reduction == "auto":
            reduction = _auto_reduction()
        if reduction is not None and not all(hasattr(reduction, a) for a in ("ready", "start", "begin", "finish", "sum",
                                                                             "rank", "world_size")):
            raise InputTypeError("reduction must be a fasttran.trainer.Reduction (rank, world_size, start, begin, ready, "
                                 "finish, sum), e.g. fasttran.distributed.DataParallel()")
        self.head = head if isinstance(head, Head) else None
        self._head_name = head if isinstance(head, str) else None
        self.optimizer_name = optimizer.lower()
        self.lr, self.weight_decay, self.schedule, self.warmup = float(lr), float(weight_decay), schedule, warmup
        # the head's lr (None: lr's) and the layer-wise decay: each tensor's factor of the schedule (lr_factors)
        self.head_lr = None if head_lr is None or float(head_lr) == self.lr else float(head_lr)
        self.layer_lr_decay = float(layer_lr_decay)
        self.epochs, self.batch_size, self.seed, self.device = int(epochs), int(batch_size), int(seed), device
        self.max_grad_norm, self.betas, self.eps = max_grad_norm, tuple(betas), float(eps)
        self.dropout, self.num_labels = dropout, num_labels
        self.pooler, self.label_names = pooler, label_names
        self.show_progress = True if show_progress is None else bool(show_progress)
        self.train_layers, self.pooling, self.tempo = int(train_layers), pooling, tempo
        self.layer_dropout = None if layer_dropout is None else float(layer_dropout)
        self.embedding_dropout = None if embedding_dropout is None else float(embedding_dropout)
        self.train_embeddings = bool(train_embeddings)
        self.precision = precision
        self.reduction = reduction or Reduction()
        # float16 products: dynamic loss scaling (PyTorch GradScaler's rule): [scale, steps since the
        # last overflow]; an overflowing step is skipped and halves the scale, 2000 clean steps double it
        self.loss_scale = [2.0 ** 16, 0] if precision == "float16" else None
        # the parts, built once by _build (head -> top layers -> model -> optimizer)
        self.top = None              # TopLayers: the trained encoder layers (train_layers > 0)
        self.model = None            # Model: [cache] -> [top] -> head, on `device`; holds the head's parameters
        self.optimizer = None
        self._encoder = None         # the encoder the top layers come from (the cache's)
        self._resume_from = None     # a checkpoint's layers and optimizer state, for _build to put in place
        self.history = []            # one dict per finished epoch (train_loss, seconds, eval_* ...)
        self.best_epoch = None       # fit(keep_best=...): the epoch whose weights were kept
        self.lr_search_tries = None  # search_lr(): each lr tried and its held-out score
        self.loss_curve = []         # (step, loss) of every step of this process's fit() calls
        self.features = None         # what the head was trained on: fingerprint, layer, positions, hidden
        self.global_step = 0
        self.skipped_steps = 0       # float16: steps skipped for an overflow (this process)
        self._pos = (0, 0)           # (epoch, batch within it) of the next step
        self._interrupt = False
        self._py_loop = False        # True: fit() keeps its per-step Python loop (see _c_loop_refusal)

    # ---- set-up ---------------------------------------------------------------------------------
    @property
    def task(self):
        return self.head.task if self.head is not None else TASKS[self._head_name][0].task

    def _head_class(self):
        return type(self.head) if self.head is not None else TASKS[self._head_name][0]

    def _new_head(self, cache, targets):
        pooling = cache.positions if cache.positions in ("mean", "cls") else self.pooling
        return make_head(self._head_name, cache.hidden, targets, num_labels=self.num_labels, dropout=self.dropout,
                         seed=self.seed, pooling=pooling, pooler=self.pooler, label_names=self.label_names,
                         examples=len(cache), encoder=self._encoder or cache.encoder)

    def _build(self, encoder, cache=None, targets=None):
        """The trainer's parts, built once, here, in this order: the head (given, the checkpoint's, or
        one sized from `cache` and `targets`, starting from them), the top layers (train_layers > 0:
        `encoder`'s, with the checkpoint's weights), the model over both (the head's parameters move
        into its table: their one home from now on), the optimizer (with the checkpoint's state).
        Returns the new head's prepared targets, or None when the head existed."""
        prep = None
        self._encoder = self._encoder or encoder
        if self.head is None:
            self.head = self._new_head(cache, targets)
            self._check_source(cache)
            prep = self.head.prepare(cache, targets)
            self.head.start_from(prep)
        if self.model is not None and self.model.head is self.head:
            return prep
        ckpt, self._resume_from = self._resume_from or {}, None
        if self.train_layers:
            from .finetune import TopLayers
            drop = {} if self.layer_dropout is None else dict(hidden_dropout=self.layer_dropout,
                                                              attention_dropout=self.layer_dropout)
            self.top = TopLayers(self._encoder, self.train_layers, device=self.device, **drop, **self.tempo,
                                 embedding_dropout=self.embedding_dropout, train_embeddings=self.train_embeddings,
                                 matmul_precision=self.precision, extra=self.head.num_parameters,
                                 shared_grads=getattr(self.reduction, "shared_grads", False))
            if ckpt.get("layers") is not None:
                self.top.load_state(ckpt["layers"], "the checkpoint's trained layers")
        self.model = Model(self.head, self.top, self.device,
                           shared_grads=getattr(self.reduction, "shared_grads", False))
        self.optimizer = make_optimizer(self.optimizer_name, self._param_groups(), lr=self.lr,
                                        betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                        max_grad_norm=self.max_grad_norm)
        if ckpt.get("optimizer") is not None:
            load_flat_state(self.optimizer, *ckpt["optimizer"])
        return prep

    def _param_groups(self):
        """The optimizer's parameters: the model's named tensors in table order, one group per run of
        tensors with the same factor of the lr (lr_factors), each carrying it as its lr_scale; all of
        them in one plain group when every factor is 1."""
        named = self.model.named_parameters()
        factors = lr_factors(self.model, self.lr, self.head_lr, self.layer_lr_decay)
        if all(f == 1.0 for f in factors):
            return named
        groups = []
        for (name, t), f in zip(named, factors):
            if not groups or groups[-1]["lr_scale"] != f:
                groups.append({"params": [], "lr_scale": f})
            groups[-1]["params"].append((name, t))
        return groups

    def _unbuild(self):
        """let the built parts go (the head keeps its parameters): a checkpoint is read into a new set"""
        if self.head is not None:
            self.head._unbind()
        self.model = self.top = self.optimizer = None

    def _check_source(self, cache, what="features"):
        if not isinstance(cache, ActivationCache):
            raise _not_a_cache(cache, what)
        if self.train_layers:
            return self._check_topk_source(cache, what)
        if self._head_class().takes_tokens and cache.positions != "all":
            raise InputError(f"a {self.task} head needs every token's state: a cache with positions='all', this one "
                             f"has positions={cache.positions!r}")
        if self.head is not None:
            self.head.check_features(cache)

    def _check_topk_source(self, cache, what):
        """Top-layer training reads every token's state at layer L - k, computed by the encoder
        whose top layers it trains."""
        enc = cache.encoder if self.top is None else self._encoder
        if enc is None:
            raise InputError(f"{what}: training the top {self.train_layers} layers needs the cache's encoder: open "
                             "the cache with ActivationCache.open(path, encoder=...)")
        L = enc.num_layers
        if self.train_layers > L:
            raise InputError(f"train_layers={self.train_layers} but the encoder has {L} layers")
        if cache.positions != "all" or cache.layer != L - self.train_layers:
            raise InputError(
                f"{what}: training the top {self.train_layers} layers needs every token's state at layer "
                f"{L - self.train_layers} (positions='all'); this cache holds positions={cache.positions!r} at layer "
                f"{cache.layer}. Build it with trainer.cache_for(encoder, input_ids, attention_mask, token_type_ids)")
        if cache.encoder is not None and self._encoder is not None and cache.encoder is not self._encoder:
            from .cache.layout import model_fingerprint
            if model_fingerprint(cache.encoder) != model_fingerprint(self._encoder):
                raise CacheMismatchError(f"{what} comes from another encoder than the layers being trained")
        if self.head is not None and cache.hidden != self.head.hidden_size:
            raise InputError(f"the cache holds width {cache.hidden}, the head expects {self.head.hidden_size}")

    #: search_lr's tries when none are given: these factors of the trainer's lr (its recipe's, or the one given)
    LR_SEARCH_FACTORS = (0.5, 1.0, 2.0)

    def search_lr(self, cache, targets, holdout, lrs=None, metric=None, epochs=1):
        """Pick the learning rate on data held out of the training split, before fit(): a cached epoch is
        cheap. `cache`, `targets`: the training split less a held-out slice; `holdout`: (cache, targets) of
        the slice (fasttran finetune --search cuts the split's last 10%). Each lr of `lrs` (default: the
        trainer's lr times LR_SEARCH_FACTORS) trains a fresh copy of this trainer for `epochs` (its schedule
        over them, same seed and start) and is scored on the slice by `metric` (default the head's main
        one; loss and mse: lower is better); the best (ties: the earlier try) becomes this trainer's lr,
        the head's own lr keeping its ratio to it. Then fit() on the whole training split. Returns the
        tries, also `lr_search_tries`: [{"lr", "head_lr", metric, "seconds"}] (NaN for a diverged try)."""
        if self.model is not None or self.global_step:
            raise InputError("search_lr() picks the lr before training: call it before fit() (this trainer has "
                             "been built or trained already)")
        if not (isinstance(holdout, (tuple, list)) and len(holdout) == 2):
            raise InputError("holdout must be a pair (cache, targets): the slice held out of the training split")
        if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
            raise InputError(f"epochs must be a positive int, got {epochs!r}")
        if lrs is None:
            lrs = [self.lr * f for f in self.LR_SEARCH_FACTORS]
        lrs = list(lrs)
        if not lrs or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not (x > 0 and math.isfinite(x))
                          for x in lrs):
            raise InputError(f"lrs must be finite numbers > 0, got {lrs!r}")
        ratio = None if self.head_lr is None else self.head_lr / self.lr
        tries = []
        for lr in lrs:
            cfg = dict(self._config(), lr=float(lr), head_lr=None if ratio is None else float(lr) * ratio,
                       epochs=int(epochs), show_progress=False, dropout=self.dropout, num_labels=self.num_labels,
                       pooler=self.pooler, label_names=self.label_names)
            head = self._head_name if self.head is None else Head.from_config(self.head.config())
            if self.head is not None:
                head.params[...] = self.head.params
            scratch = Trainer(head, **cfg, reduction=None)
            name = metric or scratch._head_class().main_metric
            t0 = time.perf_counter()
            try:
                rec = scratch.fit(cache, targets, eval=holdout)[-1]
                value = self._metric_of(rec, name)
            except FloatingPointError:   # diverged: never the pick
                value = float("nan")
            tries.append({"lr": float(lr), "head_lr": scratch.head_lr, name: value,
                          "seconds": time.perf_counter() - t0})
            if self.show_progress:
                print(f"search_lr: lr {lr:g}{'' if ratio is None else f' (head {scratch.head_lr:g})'}: held-out "
                      f"{name} {value:.4f} in {tries[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
        best = None
        for t in tries:
            if best is None or _better(name, t[name], best[name]):
                best = t
        if math.isnan(best[name]):
            raise FloatingPointError(f"search_lr: every try diverged ({lrs}); try lower learning rates")
        self.lr, self.head_lr = best["lr"], best["head_lr"]
        self.lr_search_tries = tries
        return tries

    def cache_for(self, encoder, input_ids, attention_mask=None, token_type_ids=None, **cache_kwargs):
        """The ActivationCache top-layer training reads: every real token's state at layer
        L - train_layers (positions='all'), built once, or reused from `disk_dir` when it holds it.
        With train_layers=0, the frozen encoder's last layer as the head reads it: every token for
        token and span heads, else pooled with the Trainer's `pooling`."""
        if not self.train_layers:
            return ActivationCache.build(encoder, input_ids, attention_mask, token_type_ids,
                                         positions="all" if self._head_class().takes_tokens else self.pooling,
                                         **cache_kwargs)
        L = encoder.num_layers
        if self.train_layers > L:
            raise InputError(f"train_layers={self.train_layers} but the encoder has {L} layers")
        return ActivationCache.build(encoder, input_ids, attention_mask, token_type_ids,
                                     layer=L - self.train_layers, positions="all", **cache_kwargs)

    @staticmethod
    def _describe(features):
        return (f"layer {features['layer']}, positions={features['positions']!r} of the model with fingerprint "
                f"{str(features.get('model') or '?')[:12]}")

    def _features_of(self, cache):
        fp = getattr(cache, "fingerprint", None)
        return {"fingerprint": fp, "model": getattr(cache, "model_fingerprint", None), "layer": int(cache.layer),
                "positions": cache.positions, "hidden": int(cache.hidden)}

    def _check_features(self, cache, doing):
        """Refuse features of another model, layer or pooling than the head was trained on."""
        if not self.features or not self.features.get("fingerprint"):
            return
        got = self._features_of(cache)
        if got["fingerprint"] and got["fingerprint"] != self.features["fingerprint"]:
            raise CacheMismatchError(
                f"cannot {doing}: this head was trained on features of {self._describe(self.features)}, but this "
                f"cache holds {self._describe(got)} (another encoder, checkpoint, layer or pooling). Build the cache "
                "with the encoder and settings the head was trained with, or train a new head on these features")

    def _prepare(self, cache, targets):
        """Checks in the order a user's mistake shows up, then head, layers and model: the head's
        prepared targets."""
        self._check_source(cache)
        prep = self._build(self._encoder or cache.encoder, cache, targets)
        self._check_source(cache)
        return prep if prep is not None else self.head.prepare(cache, targets)

    @property
    def _group(self):
        """examples the head scores together (multiple choice: a question's choices), 1 before it exists"""
        return self.head.group_size if self.head is not None else 1

    @property
    def _batch_examples(self):
        """cache examples in a global batch: `batch_size` items of the head's group size"""
        return self.batch_size * self._group

    # ---- one step ---------------------------------------------------------------------------------
    def _batches(self, cache, sliced=True, **kw):
        """the cache's batches as the model reads them: on its device, ragged when per token; sliced:
        this process's slice of every global batch (all of it in one process), with its place"""
        if sliced:
            kw.update(rank=self.reduction.rank, world_size=self.reduction.world_size)
        return cache.batches(ragged=cache.positions == "all", output="device", device=self.device, **kw)

    def _step(self, cache, prep, order, ids, batch, where, total, warm):
        """One training step on this process's slice of a global batch (`where`: its place; `order`:
        the epoch's order, whose global batch gives the loss's denominator and the dropout masks'
        place): (examples, global loss, (right, counted) or None)."""
        g0 = where.step * self._batch_examples
        glob = order[g0:g0 + where.size]   # the global batch's examples
        place, denominator = self._slice_terms(prep, glob, where.offset, where.row_offset,
                                               cache.lengths if cache.positions == "all" else None)
        self.reduction.begin(self.global_step)
        if len(ids):
            idx = cache.index_of(ids)
            x, lengths = rows_of(batch)
            targets, valid = self.head.batch(prep, idx, lengths)
            x, tokens = self._rows_or_tokens(cache, ids, x)
            loss, logits = self.model.step(x, lengths, targets, valid, denominator=denominator,
                                           seed=self.seed, step=self.global_step, place=place,
                                           loss_scale=self._scale(), ready=self.reduction.ready, **tokens)
            correct = self.head.correct(logits, targets)
        else:   # an empty slice of an uneven last batch: no gradient, but every reduction still happens
            loss, correct = self.model.idle(self.reduction.ready), None
        loss = self.reduction.finish(loss)
        if not math.isfinite(loss):
            self._diverged(cache, ids, loss)
        refused = self._optimizer_step(total, warm)
        if refused is not None:
            self._diverged(cache, ids, loss, refused)
        return len(ids), loss, correct

    def _rows_or_tokens(self, cache, ids, x):
        """(x, {}), or (None, {"tokens": (token ids, types)}) of examples `ids` for layers that train
        the embeddings -- their input is the tokens the cache was built from, not its rows: the
        keywords Model.step / forward take them by (none otherwise, so a wrapped step or forward
        with the earlier signature still works)"""
        if self.top is None or not self.top.train_embeddings:
            return x, {}
        tok, types, _ = cache.inputs(ids, ragged=True)
        return None, {"tokens": (tok, types)}

    def _slice_terms(self, prep, glob, offset, row_offset, lengths):
        """A rank's slice of the global batch `glob` (after its first `offset` examples, `row_offset`
        rows): its place -- (rows, examples, attention scores) before it, which the dropout masks are
        numbered from -- and the global batch's loss denominator. `lengths`: every example's length
        where the attention is ragged, else None. The per-step loop and the C loop's reads both call it."""
        before = glob[:offset]
        scores = int((np.asarray(lengths)[before].astype(np.int64) ** 2).sum()) if lengths is not None else offset
        return (row_offset, offset, scores), self.head.denominator(self.head.batch(prep, glob, None)[0])

    def _diverged(self, cache, ids, loss, refused=None):
        """A non-finite loss or gradient (the optimizer's refusal): features with NaN or Inf are named
        by example, else the step is."""
        x = np.zeros((0, 1), np.float32) if not len(ids) else np.asarray(
            rows_of(cache.get(ids, ragged=cache.positions == "all"))[0])
        if not np.isfinite(x).all():
            lengths = rows_of(cache.get(ids, ragged=cache.positions == "all"))[1]
            row = int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(1))[0])
            bad = int(np.searchsorted(np.cumsum(lengths), row, side="right"))
            raise InputError(f"features of example {int(ids[bad])} contain NaN or Inf")
        epoch, b = self._pos
        if refused is not None:
            raise FloatingPointError(f"training diverged at step {self.global_step + 1} (epoch {epoch + 1}, batch "
                                     f"{b + 1}): {refused}; try a lower learning rate than lr={self.lr:g}")
        hint = (": float16 products overflowed in the forward pass (beyond 65504); precision='bfloat16' has "
                "float32's range" if self.precision == "float16" else "")
        raise FloatingPointError(f"the loss is {loss} at step {self.global_step + 1} (epoch {epoch + 1}, "
                                 f"batch {b + 1}); training stopped before applying it{hint}")

    def _lr_at(self, step, total, warm):
        """the learning rate of global step `step` (the schedule's; never 0, which the optimizer refuses)"""
        return max(self.lr * schedule_factor(self.schedule, step, total, warm), 1e-30)

    def _optimizer_step(self, total, warm):
        """The optimizer's step with the schedule's lr and float16's loss scaling; returns None, or the
        optimizer's refusal of non-finite gradients (nothing updated) outside loss scaling."""
        try:
            self.optimizer.step(self._gviews, lr=self._lr_at(self.global_step, total, warm))
            if self.loss_scale is not None:
                self.loss_scale[1] += 1
                if self.loss_scale[1] >= _SCALE_GROWTH_STEPS:
                    self.loss_scale = [min(self.loss_scale[0] * 2.0, _SCALE_MAX), 0]
        except InputError as e:
            if "not finite" not in str(e):
                raise
            if self.loss_scale is not None and self.loss_scale[0] > 1.0:   # fp16 overflow: skip, scale down
                self.loss_scale = [self.loss_scale[0] / 2.0, 0]
                self.skipped_steps += 1
                self.global_step += 1
                return None
            return str(e)
        self.global_step += 1
        return None

    def _scale(self):
        return 1.0 if self.loss_scale is None else self.loss_scale[0]

    def _loop_setup(self, cache):
        """The optimizer and the model's buffers for the largest batch; (steps per epoch, total
        steps, warmup steps)."""
        self._gviews = [g for _, g in self.model.named_gradients()]
        N, bs = len(cache), self._batch_examples
        steps_per_epoch = (N + bs - 1) // bs
        total = steps_per_epoch * self.epochs
        warm = int(self.warmup * total) if self.warmup < 1 else int(self.warmup)
        local = -(-bs // self.reduction.world_size)   # a slice's share (a longer one grows the buffers)
        rows = np.sort(rows_of_lengths(cache))[::-1][:local]
        self.model.reserve(min(local, N), int(rows.sum()))
        return steps_per_epoch, total, warm

    # ---- training -------------------------------------------------------------------------------
    def fit(self, cache, targets, eval=None, checkpoint_dir=None, resume=False, stop_at_step=None,
            checkpoint_every=None, keep_best=False):
        """Train for `epochs` over `cache` (targets in the cache's example order: class labels,
        scores, 0/1 label columns, token labels, or (starts, ends) for QA -- what the head takes).
        `eval`: (cache, targets) evaluated after every epoch ((cache, squad_features) for QA). With
        `checkpoint_dir` the state is saved after every epoch and on Ctrl-C, and `resume=True`
        continues from it exactly (at any number of processes); `checkpoint_every=n` also saves
        every n steps (a killed job loses at most n steps). `stop_at_step` stops like Ctrl-C once
        that many steps are done (the schedule stays the full run's). Progress: one bar per epoch, left on screen with its
        loss, accuracy and eval metric. `keep_best` (with `eval`): True (the head's main metric:
        accuracy, Pearson, entity F1, exact match ...) or the name of an eval metric ("f1",
        "matthews_corrcoef", "loss" ...; loss and mse: lower is better): after the last epoch the
        weights (head and trained layers) of the epoch that scored best go back in place (ties keep
        the earlier epoch; an interrupted run keeps its last weights), `best_epoch` says which, and
        the checkpoint is written again with them; the optimizer state stays the last epoch's.
        Returns the history (one dict per epoch, also `self.history`)."""
        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(
                checkpoint_every, (int, np.integer)) or checkpoint_every < 1 or not checkpoint_dir):
            raise InputError(f"checkpoint_every must be a positive int of steps, with checkpoint_dir; got "
                             f"{checkpoint_every!r}")
        if keep_best is not False and keep_best is not None and not (keep_best is True or isinstance(keep_best, str)):
            raise InputError(f"keep_best must be True, False or the name of an eval metric, got {keep_best!r}")
        if keep_best and eval is None:
            raise InputError("keep_best needs eval=(cache, targets): the best epoch is the one scoring best on it")
        prep = self._prepare(cache, targets)
        if eval is not None:
            if not (isinstance(eval, (tuple, list)) and len(eval) == 2):
                raise InputError("eval must be a pair (cache, targets), or (cache, squad_features) for QA")
            self._check_source(eval[0], "eval features")
        best_metric = (self.head.main_metric if keep_best is True else keep_best) if keep_best else None
        best = None   # (epoch, value, weights) of the best epoch so far
        self.best_epoch = None
        if resume:
            if checkpoint_dir is None:
                raise InputError("resume=True needs checkpoint_dir")
            if os.path.exists(os.path.join(checkpoint_dir, "trainer.json")):
                self._load_into(checkpoint_dir)
        feats = self._features_of(cache)
        self._check_features(cache, "continue training on this cache")
        self.features = feats
        if eval is not None:
            self._check_features(eval[0], "evaluate on the eval cache")
            eval_prep = self.head.prepare_eval(eval[0], eval[1])
        steps_per_epoch, total, warm = self._loop_setup(cache)
        self.reduction.start(self.model, {"examples": len(cache), "features": feats["fingerprint"],
                                          "batch_size": self.batch_size, "seed": self.seed, "epochs": self.epochs,
                                          "head": self.head.config(), "train_layers": self.train_layers,
                                          "parameters": self.model.params.shape[0], "position": list(self._pos)})
        c_loop = self._c_loop_refusal(cache) is None
        old_handler = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame):   # finish the step in flight, then stop cleanly
                if self._interrupt:
                    raise KeyboardInterrupt
                self._interrupt = True
            old_handler = signal.signal(signal.SIGINT, on_sigint)
        self._interrupt = False
        stack = contextlib.ExitStack()
        try:
            first_epoch, first_batch = self._pos
            for epoch in range(first_epoch, self.epochs):
                t0 = time.perf_counter()
                start = first_batch if epoch == first_epoch else 0
                order = cache.epoch_order(_epoch_seed(self.seed, epoch), group=self._group)   # every rank's
                bar = stack.enter_context(progress(total=steps_per_epoch, initial=start, unit="step",
                                                   desc=f"epoch {epoch + 1}/{self.epochs}",
                                                   disable=not self.show_progress, leave=True))
                loss_sum, right, counted, seen, b = 0.0, 0, 0, 0, start
                if c_loop:
                    loss_sum, right, counted, seen, b = self._c_epoch(
                        cache, prep, order, epoch, start, steps_per_epoch, total, warm, bar, checkpoint_dir,
                        checkpoint_every, stop_at_step)
                    it = ()
                else:
                    it = self._batches(cache, batch_size=self._batch_examples, shuffle=True,
                                       seed=_epoch_seed(self.seed, epoch), start=start, group=self._group)
                    stack.callback(it.close)   # an early stop (Ctrl-C, error) joins the reader thread
                for ids, batch, where in it:
                    self._pos = (epoch, b)
                    n, loss, c = self._step(cache, prep, order, ids, batch, where, total, warm)
                    del batch   # its buffer goes back to the reader before the next is asked for
                    b += 1
                    self._pos = (epoch, b)
                    self.loss_curve.append((self.global_step, float(loss)))
                    loss_sum += loss * n
                    seen += n
                    if c is not None:
                        right, counted = right + c[0], counted + c[1]
                    bar.update(1)
                    if b % 20 == 0:
                        bar.set_postfix(self._postfix(loss_sum, right, counted, seen), refresh=False)
                    if checkpoint_every and self.global_step % checkpoint_every == 0:
                        self.save(checkpoint_dir)
                    if stop_at_step is not None and self.global_step >= stop_at_step:
                        self._interrupt = True
                    if self._interrupt:
                        break
                if self._interrupt:
                    bar.close()
                    if checkpoint_dir:
                        self.save(checkpoint_dir)
                    where = f"; state saved to {checkpoint_dir}" if checkpoint_dir else ""
                    print(f"interrupted after step {self.global_step} (epoch {epoch + 1}, batch {b}){where}",
                          file=sys.stderr)
                    break
                self._pos = (epoch + 1, 0)
                mine = int(seen)   # this process's examples (a rank's slices)
                loss_sum, right, counted, seen = self.reduction.sum([loss_sum, right, counted, seen])   # all ranks'
                rec = {"epoch": epoch + 1, "steps": self.global_step, "train_loss": loss_sum / max(seen, 1),
                       "seconds": time.perf_counter() - t0, "lr": self.optimizer.lr, "examples": int(seen)}
                if self.reduction.world_size > 1:
                    rec["examples_this_rank"] = mine
                if counted:
                    rec["train_accuracy"] = right / counted
                if eval is not None:
                    t1 = time.perf_counter()
                    rec.update({f"eval_{k}": v for k, v in self._evaluate(eval[0], eval[1], eval_prep).items()})
                    rec["eval_seconds"] = time.perf_counter() - t1
                bar.set_postfix(self._postfix(loss_sum, right, counted, seen, rec), refresh=False)
                bar.close()   # leaves the epoch's line: steps, time, loss, accuracy, eval metric
                self.history.append(rec)
                if best_metric is not None:
                    value = self._metric_of(rec, best_metric)
                    if best is None or _better(best_metric, value, best[1]):
                        best = (epoch + 1, value, self._weights())
                if checkpoint_dir:
                    self.save(checkpoint_dir)
                first_batch = 0
        finally:
            stack.close()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
        if best is not None and not self._interrupt:
            self.best_epoch = best[0]
            if best[0] != self.history[-1]["epoch"]:
                self._set_weights(best[2])
                if checkpoint_dir:
                    self.save(checkpoint_dir)
        return self.history

    @staticmethod
    def _metric_of(rec, metric):
        key = f"eval_{metric}"
        if key not in rec:
            have = sorted(k[5:] for k, v in rec.items() if k.startswith("eval_") and k != "eval_seconds"
                          and isinstance(v, (int, float)))
            raise InputError(f"keep_best={metric!r}: the evaluation gives no such metric; it gives {have}")
        return float(rec[key])

    def _weights(self):
        """a copy of the trained weights: the head's, and the top layers' (train_layers > 0)"""
        layers = None if self.top is None else {n: np.array(t, dtype=np.float32, copy=True)
                                                for n, t in self.top.named_parameters()}
        return self.head.state_dict(), layers

    def _set_weights(self, weights):
        head, layers = weights
        self.head.load_state_dict(head)
        if layers is not None:
            self.top.load_state(layers, "the best epoch's layers")

    # ---- many steps per C call --------------------------------------------------------------------
    def _c_loop_refusal(self, cache):
        """Why fit() keeps its per-step Python loop for this run, or None: the C loop
        (Model.train_steps over csrc/train/loop.c) then runs the epoch's steps, the same steps
        bit for bit. Every condition is here."""
        if os.environ.get("FASTTRAN_PY_LOOP", "") not in ("", "0") or self._py_loop:
            return "asked for (FASTTRAN_PY_LOOP=1)"
        for name in ("_step", "_optimizer_step"):   # a hook on each step (a subclass's, or set on the trainer)
            if name in self.__dict__ or getattr(type(self), name) is not getattr(Trainer, name):
                return f"the per-step method {name} is replaced on this trainer"
        red = self.reduction
        if type(red) is not Reduction:
            from .distributed import DataParallel
            if not isinstance(red, DataParallel) or any(
                    name in red.__dict__ or getattr(type(red), name) is not getattr(DataParallel, name)
                    for name in ("begin", "ready", "finish", "in_loop")):
                return ("a gradient reduction other than fasttran.distributed.DataParallel's runs between the backward "
                        "and the optimizer step")
            if red.world_size > 1 and self._group > 1:
                return "groups of examples (multiple choice) are not sliced over ranks"
        if self.head is None or self.optimizer is None:
            return "the trainer is not built yet (fit() builds it)"
        opt = self.optimizer
        if type(opt)._torch_mode or not hasattr(opt, "_new_states"):
            return "the optimizer is not fasttran's fused one over the model's table"
        st = cache.stats()
        if st["cached"] != st["examples"]:
            return "some features are computed by the encoder as their batch is read"
        return None

    def _c_loop_reads(self, cache):
        """True: the C loop reads each step's rows from the cache itself, straight into the model's
        memory -- every row is where the model computes (the CPU: host memory or files, no device
        tier; a GPU: the cache's device tier on the model's device, gathered and decoded there);
        False: the epoch's features are read in chunks (_C_LOOP_CHUNK_BYTES, copied up once on a
        GPU) that the C loop steps through."""
        tiers = cache.stats()["tiers"]
        if not self.device.is_cuda:
            return not tiers["device"]["entries"]
        return cache.device == self.device and tiers["device"]["entries"] == len(cache)

    def _c_epoch(self, cache, prep, order, epoch, start, spe, total, warm, bar, checkpoint_dir, checkpoint_every,
                 stop_at_step):
        """One epoch's steps [start, spe) through Model.train_steps, in calls of up to
        _C_LOOP_CHUNK_BYTES of features (or one batch) that end at a checkpoint step and at
        stop_at_step: where the C loop reads the cache itself (_c_loop_reads), as many steps as
        that holds (the calls' targets and logits stay small); else up to _C_LOOP_STEPS batches,
        their features read per call (on the CPU while the call before trains).
        Every 20 steps (the bar's postfix) a call calls back for the bookkeeping the per-step loop
        does (loss curve, progress, Ctrl-C). Returns (loss_sum, right, counted, seen, batches done)."""
        bs, N = self._batch_examples, len(cache)
        ragged = cache.positions == "all"
        reads = self._c_loop_reads(cache)
        lengths_of = rows_of_lengths(cache)
        counts = np.add.reduceat(lengths_of[order], np.arange(0, N, bs))   # rows per global batch
        red = self.reduction
        # data-parallel: each step is this rank's slice of its global batch (the reader's slices)
        slices = None if red.world_size == 1 else cache._store.slices(np.ascontiguousarray(order, np.int64), bs,
                                                                      red.rank, red.world_size)
        reduction = None if type(red) is Reduction else red.in_loop()
        opt, head = self.optimizer, self.head
        if opt._table is None:
            opt._build()
        groups, grads = opt.param_groups, self._gviews
        row_bytes = 4 * int(cache.hidden)
        known = {}

        def count_of(B, rows):   # (logits, loss terms, targets, float targets) of a batch
            if B == 0:   # an empty slice of a global batch
                return (0, 0, 0, 0)
            c = known.get((B, rows))
            if c is None:
                c = known[(B, rows)] = _C.head_counts(head._cfg, B, rows)
            return c
        # the calls: (first batch, batches), each ending at a checkpoint step and at stop_at_step
        calls, b, g = [], start, self.global_step
        while b < spe and (stop_at_step is None or g < stop_at_step or not calls):
            n = int(np.searchsorted(np.cumsum(counts[b:spe]), max(_C_LOOP_CHUNK_BYTES // row_bytes, 1), "right"))
            n = max(1, min(n, spe - b, spe if reads else _C_LOOP_STEPS))
            if checkpoint_every:
                n = min(n, checkpoint_every - g % checkpoint_every)
            if stop_at_step is not None:
                n = min(n, max(1, stop_at_step - g))
            calls.append((b, n))
            b, g = b + n, g + n

        def read(i):
            """a call's examples and their features: (glob, x or None, lengths, steps); steps: (each step's
            first example in glob, rows, place in its global batch or None, denominator or None)"""
            b0, n = calls[i]
            if slices is None:
                glob = np.ascontiguousarray(order[b0 * bs:min((b0 + n) * bs, N)], np.int64)
                steps = (np.minimum(np.arange(n + 1, dtype=np.int64) * bs, len(glob)), counts[b0:b0 + n], None, None)
            else:   # as the per-step loop's _step: the slice's place, the global batch's loss terms
                parts, examples, rows = [], np.zeros(n + 1, np.int64), np.zeros(n, np.int64)
                place, denominators = np.zeros((n, 3), np.int64), np.zeros(n, np.float64)
                for k in range(n):
                    g = order[(b0 + k) * bs:min((b0 + k + 1) * bs, N)]
                    lo, hi = (int(v) for v in slices[b0 + k])
                    parts.append(g[lo:hi])
                    examples[k + 1] = examples[k] + hi - lo
                    rows[k] = int(lengths_of[g[lo:hi]].sum())
                    place[k], denominators[k] = self._slice_terms(prep, g, lo, int(lengths_of[g[:lo]].sum()),
                                                                  lengths_of if ragged else None)
                glob = np.ascontiguousarray(np.concatenate(parts), np.int64)
                steps = (examples, rows, place, denominators)
            if self.top is not None and self.top.train_embeddings:   # the layers' input: the examples' tokens
                tok = cache.inputs_at(glob, ragged=True)[:2] if len(glob) else None
                return glob, tok, lengths_of[glob].astype(np.int32), steps
            if reads or not len(glob):   # the cache's index of an example is its place in example_ids
                return glob, None, lengths_of[glob].astype(np.int32), steps
            return (glob,) + rows_of(cache.get(cache.example_ids[glob], output="device", ragged=ragged,
                                               device=self.device)) + (steps,)
        # on the CPU the next call's features are read while this one trains (as the reader thread of
        # the per-step loop reads ahead); a CUDA backend's stream is the training step's alone
        ahead = None if self.device.is_cuda or reads else ThreadPoolExecutor(1, thread_name_prefix="fasttran-read")
        try:
            return self._c_calls(cache, prep, epoch, start, total, warm, bar, checkpoint_dir, checkpoint_every,
                                 stop_at_step, calls, read, ahead, count_of, groups, grads, reduction)
        finally:
            if ahead is not None:
                ahead.shutdown(wait=True)

    def _c_calls(self, cache, prep, epoch, start, total, warm, bar, checkpoint_dir, checkpoint_every, stop_at_step,
                 calls, read, ahead, count_of, groups, grads, reduction):
        opt, head, model = self.optimizer, self.head, self.model
        acc = {"loss_sum": 0.0, "right": 0, "counted": 0, "seen": 0, "b": start}
        pending = ahead.submit(read, 0) if ahead is not None and calls else None
        for i, (b0, n) in enumerate(calls):
            if self._interrupt:
                break
            self._pos = (epoch, b0)
            glob, x, lengths, (examples, rows, place, denominators) = (pending.result() if pending is not None
                                                                       else read(i))
            pending = ahead.submit(read, i + 1) if ahead is not None and i + 1 < len(calls) else None
            targets, valid = head.steps_batch(prep, glob, lengths, examples)
            targets = np.ascontiguousarray(targets)
            sizes = [count_of(int(examples[k + 1] - examples[k]), int(rows[k])) for k in range(n)]
            tcount = np.array([c[2] for c in sizes], np.int64)
            lcount = np.array([c[0] for c in sizes], np.int64)
            if denominators is None:
                denominators = head.denominators(targets, tcount)
            g0 = self.global_step
            lrs = np.array([self._lr_at(g0 + k, total, warm) for k in range(n)], np.float64)
            losses = np.zeros(n, np.float64)
            scaler = None if self.loss_scale is None else np.array(   # float16: _optimizer_step's rule, in C
                [self.loss_scale[0], self.loss_scale[1], _SCALE_GROWTH_STEPS, _SCALE_MAX, 0], np.float64)
            logits = np.empty(int(lcount.sum()), np.float32)
            lsplit = np.cumsum(lcount)
            done_py = [0]

            def account(done):   # the per-step loop's bookkeeping for steps [done_py, done)
                k0 = done_py[0]
                if done <= k0:
                    return
                for k in range(k0, done):
                    self.global_step += 1
                    acc["b"] += 1
                    loss = float(losses[k])
                    self.loss_curve.append((self.global_step, loss))
                    size = int(examples[k + 1] - examples[k])
                    acc["loss_sum"] += loss * size
                    acc["seen"] += size
                self._pos = (epoch, acc["b"])
                a, z = (int(lsplit[k0 - 1]) if k0 else 0), int(lsplit[done - 1])
                t0 = int(np.sum(tcount[:k0]))
                c = None if examples[done] == examples[k0] else head.correct(   # (empty slices: None)
                    logits[a:z], targets.reshape(-1)[t0:t0 + int(tcount[k0:done].sum())].reshape(
                        (-1,) + targets.shape[1:]))
                if c is not None:
                    acc["right"] += c[0]
                    acc["counted"] += c[1]
                bar.update(done - k0)
                if acc["b"] % 20 == 0:
                    bar.set_postfix(self._postfix(acc["loss_sum"], acc["right"], acc["counted"], acc["seen"]),
                                    refresh=False)
                done_py[0] = done

            def callback(done):
                account(done)
                return self._interrupt

            tokens = {}
            if isinstance(x, tuple):   # layers that train the embeddings: the steps' rows as tokens
                tokens = {"ids": np.ascontiguousarray(x[0], np.int32), "types": np.ascontiguousarray(x[1], np.int32)}
                x = None
            done, stop, message = model._core.train_steps(
                opt._table, groups, grads, float(opt.max_grad_norm or 0.0), opt.check_finite, x, lengths, examples,
                targets, denominators, lrs, self.seed, g0, losses, logits, every=20, phase=b0, callback=callback,
                cache=None if x is not None or tokens else cache._store, index=None if x is not None or tokens else glob,
                valid=valid, scaler=scaler, place=place, reduction=reduction, **tokens)
            del x
            if scaler is not None:
                self.loss_scale = [float(scaler[0]), int(scaler[1])]
                self.skipped_steps += int(scaler[4])
            account(done)
            if done:
                opt.lr = float(lrs[done - 1])
            opt._new_states()
            opt._mark_updated(opt._table)
            opt.last_grad_norm = opt._table.grad_norm
            opt.last_kernel_launches = opt._table.kernel_launches
            if stop in (1, 2):   # the step after the last one applied: as the per-step loop reports it
                ids = cache.example_ids[glob[examples[done]:examples[done + 1]]]
                if stop == 2:
                    opt.lr = float(lrs[done])
                    if "not finite" not in message:
                        raise InputError(message)
                    self._diverged(cache, ids, float(losses[done]), message)
                self._diverged(cache, ids, float(losses[done]))
            if checkpoint_every and self.global_step % checkpoint_every == 0:
                self.save(checkpoint_dir)
            if stop_at_step is not None and self.global_step >= stop_at_step:
                self._interrupt = True
        return acc["loss_sum"], acc["right"], acc["counted"], acc["seen"], acc["b"]

    _SHORT = {"accuracy": "dev_acc", "exact_match": "dev_em", "pearson": "dev_pearson", "micro_f1": "dev_micro_f1",
              "f1": "dev_f1", "token_accuracy": "dev_token_acc"}

    def _postfix(self, loss_sum, right, counted, seen, rec=None):
        out = {"loss": f"{loss_sum / max(seen, 1):.4f}"}
        if counted:
            out["acc"] = f"{right / counted:.4f}"
        if rec:
            main = self.head.main_metric
            key = f"eval_{main}" if f"eval_{main}" in rec else ("eval_token_accuracy" if "eval_token_accuracy" in rec
                                                                else None)
            if key is not None:
                v = rec[key]
                out[self._SHORT.get(key[5:], "dev_" + key[5:])] = f"{v:.2f}" if v > 1.0 else f"{v:.4f}"
        return out

    # ---- inference --------------------------------------------------------------------------------
    def _ready_for(self, cache, what):
        if self.head is None:
            raise InputError("the trainer has no head yet: fit() or load() first")
        self._check_source(cache)
        self._check_features(cache, what)
        self._build(self._encoder or cache.encoder)

    def _outputs(self, cache, prep=None, batch_size=256):
        """The head's outputs for every example of `cache` (its example order), computed on the
        model's device, `batch_size` examples a batch (fewer where the cache's longest example has more
        than 128 tokens: _EVAL_TOKEN_PAIRS)."""
        self._ready_for(cache, "evaluate or predict on this cache")
        prep = prep if prep is not None else self.head.prepare_eval(cache, None)
        chunks = []
        lengths = getattr(cache, "lengths", None) if cache.positions == "all" else None
        if lengths is not None and len(lengths):   # long sequences: fewer per batch (attention holds n^2 per head)
            T = int(np.max(lengths))
            batch_size = min(batch_size, max(1, _EVAL_TOKEN_PAIRS // (T * T)))
        batch_size = max(1, batch_size // self._group) * self._group   # whole groups
        steps = (len(cache) + batch_size - 1) // batch_size
        # a bar appears when the pass is slow (an uncached source runs the encoder)
        with progress(total=steps, desc="evaluate", unit="batch", leave=False, delay=1.0,
                      disable=not self.show_progress) as bar:
            for ids, batch in self._batches(cache, sliced=False, batch_size=batch_size, shuffle=False,
                                            group=self._group):
                x, lengths = rows_of(batch)
                _, valid = self.head.batch(prep, cache.index_of(ids), lengths)
                x, tokens = self._rows_or_tokens(cache, ids, x)
                chunks.append(self.head.outputs(self.model.forward(x, lengths, valid, **tokens), lengths, valid))
                del batch
                bar.update(1)
        return self.head.collect(chunks)

    def predict(self, cache, squad=None, output="labels", words=None):
        """The head's predictions in the cache's example order.

        output="labels": class ids (classification, multiple choice), scores (regression), 0/1
        columns (multi-label), token label ids (token classification: (examples, longest), -100
        past each example's tokens); QA: with `squad` (the SquadFeatures the cache was built from)
        the answer text per question id, without it the per-example (start, end) logits.
        output="logits": the scores -- (examples, classes); token heads (examples, longest,
        labels), NaN past the tokens; QA (start_logits, end_logits), -inf outside the context.
        output="probabilities": softmax (classification, multiple choice, each token, QA's spans) or
        each label's sigmoid (multi-label); regression has none.
        words: a token head's predictions per word instead of per token -- the WordTokens the cache
        was built from (Encoder.tokenize_words); with output="labels" the label names where the head
        has them."""
        if output not in ("labels", "logits", "probabilities"):
            raise InputError(f"output must be 'labels', 'logits' or 'probabilities', got {output!r}")
        # (the SquadFeatures say which tokens are context; _outputs refuses a trainer without a head)
        prep = self.head.prepare_eval(cache, squad) if squad is not None and self.head is not None else None
        outs = self._outputs(cache, prep)
        res = (self.head.predict(outs, squad) if output == "labels" else getattr(self.head, output)(outs))
        return res if words is None else self.head.per_word(res, words, output)

    def evaluate(self, cache, targets):
        """The head's metrics against targets (see the head's evaluate: classification accuracy /
        F1 / Matthews / loss; regression MSE / Pearson / Spearman; multi-label micro / macro F1;
        token classification entity precision / recall / F1; QA SQuAD exact match / F1 with
        `targets` the SquadFeatures the cache was built from)."""
        if self.head is None:
            raise InputError("the trainer has no head yet: fit() or load() first")
        self._check_source(cache)
        return self._evaluate(cache, targets, self.head.prepare_eval(cache, targets))

    def _evaluate(self, cache, targets, prep):
        return self.head.evaluate(self._outputs(cache, prep), targets, prep)

    # ---- profiling ------------------------------------------------------------------------------
    def profile(self, cache, targets, steps=20, epoch=None, forward=True):
        """Where the time of training goes, per backend op kind (GEMM, attention, row ops,
        optimizer, cache reads, copies) and the rest ("other": Python, binding), for
        - "forward": the encoder's forward pass over one batch (when the cache has its encoder),
        - "training step": the mean of `steps` steps as fit() runs them (read or encode the
          batch, head forward/backward, fused optimizer step),
        - "epoch": one whole epoch (epoch=None: when the steps measured predict under a minute).
        Runs on a copy of the head and optimizer: this trainer is left as it was. Batches are
        read on the calling thread, so the op times add up to at most the wall time. The copy
        trains on the CPU, also for a device="cuda" trainer (profile CUDA training with
        fasttran.profile around fit()). Returns a fasttran.Profile (print it, or .plot())."""
        from .profiling import Profile
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise InputError(f"steps must be a positive int, got {steps!r}")
        self._check_source(cache)
        cfg = dict(self._config(), show_progress=False, dropout=self.dropout, num_labels=self.num_labels)
        cfg.pop("device")
        cfg.pop("precision")   # the CPU copy trains in float32
        head = self.head
        if head is not None:
            head = Head.from_config(head.config())
            head.params[...] = self.head.params
        else:
            head = self._head_name
        scratch = Trainer(head, **cfg, reduction=None)   # (a copy on this process alone)
        prep = scratch._prepare(cache, targets)
        if self.top is not None:   # the trained layers too (host copies of a CUDA trainer's)
            for (_, mine), (_, theirs) in zip(self.top.named_parameters(), scratch.top.named_parameters()):
                theirs[...] = np.asarray(mine)
        N = len(cache)
        spe, total, warm = scratch._loop_setup(cache)
        order = cache.epoch_order(_epoch_seed(scratch.seed, 0), group=scratch._group)
        bs = scratch._batch_examples
        batches = [order[a:a + bs] for a in range(0, N, bs)]
        rows = lambda k: cache.example_ids[batches[k % len(batches)]]
        ragged = cache.positions == "all"

        def run(k0, n):
            from types import SimpleNamespace
            for k in range(k0, k0 + n):
                ex = rows(k)
                where = SimpleNamespace(step=k % len(batches), size=len(ex), offset=0, row_offset=0)
                scratch._step(cache, prep, order, ex, cache.get(ex, ragged=ragged), where, total, warm)

        top = f"top {self.train_layers} layer{'s' if self.train_layers > 1 else ''} + " if self.train_layers else ""
        title = (f"{top}{type(scratch.head).__name__} + {scratch.optimizer_name.upper()}, batch {scratch.batch_size}, "
                 f"{'cached' if getattr(cache, 'stats', None) and cache.stats()['cached'] else 'uncached'} "
                 f"features of {N} examples")
        prof = Profile(title)
        enc = getattr(cache, "encoder", None)
        if forward and enc is not None and hasattr(cache, "inputs"):
            inputs = cache.inputs(rows(0))
            pooling = None if cache.positions == "all" else cache.positions

            def encode():
                enc.forward(*inputs, output_layers=cache.layer, pooling=pooling)
            encode()   # warm-up: workspace allocation
            with prof.phase("forward", per=3, device=enc.device):
                for _ in range(3):
                    encode()
        run(0, 2)   # warm-up
        with prof.phase("training step", per=steps):
            run(2, int(steps))
        est = prof["training step"].wall * spe
        if epoch or (epoch is None and est <= 60.0):
            with prof.phase("epoch"):
                run(0, spe)
        return prof

    # ---- plots ------------------------------------------------------------------------------------
    def plot(self, axes=None):
        """Loss and the head's metrics per epoch from `history` (training accuracy where the head has
        one, and the eval metric), with the loss of every step behind them. Needs matplotlib.
        Returns the matplotlib Figure."""
        if not self.history and not self.loss_curve:
            raise InputError("nothing to plot yet: fit() first")
        from .profiling import _pyplot
        plt = _pyplot()
        if axes is None:
            fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        else:
            fig = axes[0].figure
        ax_l, ax_m = axes
        N = None
        if self.history and self.history[0].get("steps"):
            N = self.history[0]["steps"] / max(self.history[0]["epoch"], 1)   # steps per epoch
        if self.loss_curve and N:
            st, lo = zip(*self.loss_curve)
            ax_l.plot(np.asarray(st) / N, lo, color="0.8", lw=0.6, label="train (per step)")
        ep = [r["epoch"] for r in self.history]
        ax_l.plot(ep, [r["train_loss"] for r in self.history], "o-", label="train (epoch mean)")
        if any("eval_loss" in r for r in self.history):
            ax_l.plot(ep, [r.get("eval_loss", np.nan) for r in self.history], "s-", label="eval")
        ax_l.set_xlabel("epoch")
        ax_l.set_ylabel("loss")
        ax_l.legend(fontsize=8)
        main = self.head.main_metric if self.head is not None else "accuracy"
        if main == "accuracy":
            ax_m.plot(ep, [r.get("train_accuracy", np.nan) for r in self.history], "o-", label="train")
            if any("eval_accuracy" in r for r in self.history):
                ax_m.plot(ep, [r.get("eval_accuracy", np.nan) for r in self.history], "s-", label="eval")
            ax_m.set_ylabel("accuracy")
        else:
            keys = [k for k in (f"eval_{main}", "eval_f1", "eval_spearman", "eval_token_accuracy")
                    if any(k in r for r in self.history)]
            for k in dict.fromkeys(keys):
                ax_m.plot(ep, [r.get(k, np.nan) for r in self.history], "o-", label=k[5:].replace("_", " "))
            ax_m.set_ylabel("score (0-100)" if main == "exact_match" else "score")
        ax_m.set_xlabel("epoch")
        ax_m.legend(fontsize=8)
        fig.suptitle(f"{type(self.head).__name__ if self.head is not None else self._head_name} + "
                     f"{self.optimizer_name.upper()} (lr {self.lr:g})", fontsize=10)
        fig.tight_layout()
        return fig

    # ---- persistence ------------------------------------------------------------------------------
    def _config(self):
        return {"optimizer": self.optimizer_name, "lr": self.lr, "weight_decay": self.weight_decay,
                "schedule": self.schedule, "warmup": self.warmup, "epochs": self.epochs,
                "batch_size": self.batch_size, "seed": self.seed, "device": self.device,
                "max_grad_norm": self.max_grad_norm, "betas": list(self.betas), "eps": self.eps,
                "train_layers": self.train_layers, "pooling": self.pooling, "tempo": self.tempo,
                "layer_dropout": self.layer_dropout, "precision": self.precision, "head_lr": self.head_lr,
                "layer_lr_decay": self.layer_lr_decay, "embedding_dropout": self.embedding_dropout,
                "train_embeddings": self.train_embeddings}

    def save(self, path):
        """Write head weights and optimizer state (safetensors) and the trainer state (JSON),
        each atomically; trainer.json, written last, holds the CRC-32C of the others. In
        data-parallel training every process calls it and the first one (rank 0) writes."""
        if self.head is None:
            raise InputError("nothing to save: the trainer has no head yet")
        ckpt = self._resume_from or {}   # (a loaded checkpoint whose parts are not built yet)
        opt = m = v = None
        if self.optimizer is not None:
            opt, m, v = flat_state(self.optimizer)
        elif ckpt.get("optimizer") is not None:
            opt, m, v = ckpt["optimizer"]
        if self.reduction.rank != 0:   # every rank has the same state (the reduction makes it so)
            return path
        os.makedirs(path, exist_ok=True)
        files = {"head.safetensors": write_safetensors(os.path.join(path, "head.safetensors"),
                                                       self.head.state_dict(), {"format": "fasttran-head"})}
        layers = ({n: np.array(t) for n, t in self.top.named_parameters()} if self.top is not None
                  else ckpt.get("layers"))
        if layers is not None:
            files["layers.safetensors"] = write_safetensors(os.path.join(path, "layers.safetensors"), layers,
                                                            {"format": "fasttran-layers"})
        if opt is not None:
            files["optimizer.safetensors"] = write_safetensors(
                os.path.join(path, "optimizer.safetensors"), {"exp_avg": m, "exp_avg_sq": v},
                {"format": "fasttran-optimizer"})
        state = {"format": "fasttran-trainer", "version": 1, "config": self._config(), "head": self.head.config(),
                 "optimizer_state": opt, "global_step": self.global_step, "position": list(self._pos),
                 "history": self.history, "features": self.features, "files": files, "loss_scale": self.loss_scale}
        _C.atomic_write(os.path.join(path, "trainer.json"), [json.dumps(state, indent=1).encode()])
        return path

    @staticmethod
    def _read_state(path):
        """trainer.json of a checkpoint directory, checked to be one."""
        tj = os.path.join(path, "trainer.json")
        if not os.path.isdir(path):
            from .errors import CheckpointNotFoundError
            raise CheckpointNotFoundError(f"trainer checkpoint {path} does not exist (Trainer.save(path) or "
                                          "`fasttran train --output` writes one)")
        try:
            with open(tj, "rb") as f:
                state = json.loads(f.read())
        except FileNotFoundError:
            raise CheckpointError(f"{path} has no trainer.json: not a fasttran trainer checkpoint") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{tj} is corrupt: {e}") from None
        if not isinstance(state, dict) or state.get("format") != "fasttran-trainer" or "config" not in state:
            raise CheckpointError(f"{tj} is not a fasttran trainer checkpoint")
        return state

    def _load_into(self, path, state=None):
        """A checkpoint into this trainer: its head's parameters, then the parts built anew from it
        (_build: now, or once the encoder its top layers need is known)."""
        state = state or self._read_state(path)
        files = state["files"]
        head_t = read_safetensors(os.path.join(path, "head.safetensors"), files["head.safetensors"])
        head = Head.from_config(state["head"])
        if self.head is not None and self.head.config() != head.config():
            raise CheckpointError(f"the checkpoint's head {state['head']} differs from this trainer's {self.head.config()}")
        ckpt = {"layers": None, "optimizer": None}
        if state.get("optimizer_state"):
            opt_t = read_safetensors(os.path.join(path, "optimizer.safetensors"), files["optimizer.safetensors"])
            ckpt["optimizer"] = (state["optimizer_state"], opt_t["exp_avg"], opt_t["exp_avg_sq"])
        if "layers.safetensors" in files:
            ckpt["layers"] = read_safetensors(os.path.join(path, "layers.safetensors"), files["layers.safetensors"])
        self._unbuild()
        self.head = self.head or head
        self.head.load_state_dict(head_t)
        self._resume_from = ckpt
        if not self.train_layers or self._encoder is not None:   # a head alone needs no cache to exist
            self._build(self._encoder)
        self.global_step = int(state["global_step"])
        self._pos = tuple(state["position"])
        if self.precision == "float16" and state.get("loss_scale"):
            self.loss_scale = [float(state["loss_scale"][0]), int(state["loss_scale"][1])]
        self.history = state["history"]
        self.features = state.get("features")   # None in checkpoints written before fingerprints

    @classmethod
    def load(cls, path, **overrides):
        """A Trainer restored from save(): head, optimizer state, step, position and history."""
        state = cls._read_state(path)
        cfg = dict(state["config"], **overrides)
        device = cfg.get("device", "cpu")
        if (not parse_device(device).is_cuda and "precision" not in overrides
                and not (cfg.get("precision") == "bfloat16" and native_bf16(device))):
            cfg["precision"] = "float32"   # what this CPU cannot run in half precision continues in float32
        self = cls(Head.from_config(state["head"]), **cfg)
        self._load_into(path, state)
        return self

    def export(self, path, encoder=None):
        """Write the fine-tuned model -- the encoder with its trained top layers, and the head -- in a
        layout the Hugging Face tools load (fasttran.export): AutoModelForSequenceClassification for a
        classification, regression or multi-label head with BERT's pooler on CLS, AutoModelForToken-
        Classification, AutoModelForQuestionAnswering, and for any other sequence head (mean pooling,
        no pooler) a sentence-transformers model whose encode() gives the logits. The tokenizer files
        and fasttran's head.json / head.safetensors go beside them. `encoder`: the encoder the
        features came from, when the cache did not carry it. Returns `path`."""
        from .export import check_exportable, export, fine_tuned_encoder
        if self.head is None:
            raise InputError("nothing to export: fit() or load() first")
        src = encoder or self._encoder
        check_exportable(src)
        self._build(src)   # (a loaded checkpoint's layers go into the encoder given)
        export(path, fine_tuned_encoder(src, self.top), self.head, self.pooling)
        return path

    def memory_report(self, batch_size=None, seq_len=128, budget_bytes=None):
        """Bytes a top-layer training step holds, by category (weights, gradients, optimizer state,
        saved activations by kind, workspace, total), for `batch_size` examples of `seq_len` tokens;
        with `budget_bytes` also the largest batch that fits it. Tempo's options change the activations
        (see fasttran.finetune.TopLayers): "options" gives, for each of them set on and off (the
        others as this trainer has them), the total at this batch and the largest batch in the budget
        (None where the model cannot take it: in-place activation needs GELU or ReLU)."""
        if self.top is None:
            raise InputError("memory_report() is for top-layer training: fit() with train_layers > 0 first")
        bs = batch_size or self.batch_size
        rep = self.top.memory_report(bs, seq_len)
        rep["options"] = {}
        for name in _TEMPO:
            rep["options"][name] = {}
            for state in (False, True):
                try:
                    other = self.top.memory_report(bs, seq_len, **{name: state})
                except UnsupportedError:
                    rep["options"][name]["on" if state else "off"] = None
                    continue
                row = {"total": other["total"], "activations": sum(other["activations"].values())}
                if budget_bytes is not None:
                    row["largest_batch"] = self.top.largest_batch(seq_len, budget_bytes, **{name: state})
                rep["options"][name]["on" if state else "off"] = row
        if budget_bytes is not None:
            rep["largest_batch"] = self.top.largest_batch(seq_len, budget_bytes)
        return rep

    # ---- display ----------------------------------------------------------------------------------
    def __repr__(self):
        if "global_step" not in self.__dict__:   # __init__ refused its arguments (a traceback shows this)
            return "Trainer(<not initialised>)"
        head = repr(self.head) if self.head is not None else repr(self._head_name)
        return (f"Trainer(head={head}, optimizer={self.optimizer_name!r}, lr={self.lr:g}, schedule={self.schedule!r}, "
                f"epochs={self.epochs}, batch_size={self.batch_size}, seed={self.seed}, step={self.global_step}"
                + (f", train_layers={self.train_layers}" if self.train_layers else "")
                + (", train_embeddings=True" if self.train_embeddings else "")
                + (f", head_lr={self.head_lr:g}" if self.head_lr is not None else "")
                + (f", layer_lr_decay={self.layer_lr_decay:g}" if self.layer_lr_decay != 1.0 else "")
                + (f", precision={self.precision!r}" if self.precision != "float32" else "")
                + (f", device={str(self.device)!r}" if self.device.is_cuda else "") + ")")

    def _repr_html_(self):
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}</td>"
                                        for v in r.values()) + "</tr>" for r in self.history)
        head = "".join(f"<th>{html.escape(k)}</th>" for k in (self.history[0] if self.history else {}))
        return f"<b>{html.escape(repr(self))}</b><table><tr>{head}</tr>{rows}</table>"


#: eval metrics where lower is better (keep_best); every other metric: higher is better
_LOWER_IS_BETTER = ("loss", "mse")


def _better(metric, value, than):
    """`value` of an eval metric beats `than` (NaN never does; anything beats NaN)"""
    if math.isnan(value):
        return False
    if math.isnan(than):
        return True
    return value < than if metric in _LOWER_IS_BETTER else value > than


def rows_of_lengths(cache):
    """rows per example as the model reads the cache: its tokens when per token, else one"""
    return np.asarray(cache.lengths, np.int64) if cache.positions == "all" else np.ones(len(cache), np.int64)
