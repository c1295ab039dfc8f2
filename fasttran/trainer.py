"""fasttran.Trainer: trains a task head on frozen features with a fused LAMB/AdamW.

Features come from an :class:`ActivationCache` (computed once, read every epoch), or from the
same object built with ``max_fraction=0`` (``ActivationCache.uncached``): then every batch runs
through the encoder -- the paper's baseline. Both give identical losses and weights for a seed:
the CPU encoder's output for an example does not depend on its batch or padding, batches come
in the same seeded order, and dropout masks are a pure function of (seed, step, element).

The loop is Python; each step is two C calls with the GIL released (head forward+backward,
then one fused optimizer step), while the next batch is gathered (or encoded) on a background
thread. With device="cuda" the head, its gradients, the optimizer state and every per-step
buffer live in CUDA memory, allocated once (_CudaHead); batches come from the cache straight
into device memory (its device tier gathered on the device, other tiers copied up).
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

import numpy as np

from . import _C
from ._progress import progress
from .cache import ActivationCache
from .errors import (CacheMismatchError, CheckpointError, InputError, InputTypeError, MissingDependencyError,
                     NoGPUError, UnsupportedError)
from .finetune import MEMORY_OPTIONS
from .heads import ClassificationHead, QAHead, _Head
from .optim import SCHEDULES, flat_state, load_flat_state, make_optimizer, schedule_factor
from .safetensors_io import read_safetensors, write_safetensors

_HEADS = {"classification": dict(pooler=False), "classification-pooler": dict(pooler=True), "qa": {}}

#: The learning rate a Trainer uses when none is given, per (optimizer, head kind). Chosen by the
#: sweep in benchmarks/sweep_defaults.py (frozen all-MiniLM-L6-v2; classification heads on all
#: 67,349 SST-2 train sentences and on the 4,000-sentence sample the demo ships, QA on a SQuAD
#: v1.1 subset; tables in benchmarks/defaults_sweep.md): the grid value with the best mean dev
#: score over seeds and training-set sizes (a diverged run scores 0), every other
#: hyper-parameter at its default. LAMB scales each step by the weight norm, so its rates are
#: far above AdamW's.
DEFAULT_LR = {
    ("lamb", "linear"): 0.02, ("lamb", "pooler"): 0.01, ("lamb", "qa"): 0.1,
    ("adamw", "linear"): 0.01, ("adamw", "pooler"): 1e-3, ("adamw", "qa"): 0.01,
}


def default_lr(optimizer, head="classification"):
    """The default learning rate for an optimizer ('lamb'/'adamw') and a head (a name or a head
    object): see DEFAULT_LR."""
    if isinstance(head, _Head):
        kind = head.kind
    else:
        kind = {"classification": "linear", "classification-pooler": "pooler", "qa": "qa"}.get(head)
    key = (str(optimizer).lower(), kind)
    if key not in DEFAULT_LR:
        raise InputError(f"no default learning rate for optimizer {optimizer!r} and head {head!r}")
    return DEFAULT_LR[key]


#: Top-layer fine-tuning (train_layers > 0): one learning rate for the layers and the head, the
#: rates usual for fine-tuning BERT-family encoders (benchmarks/topk_sst2.py measures them).
DEFAULT_TOPK_LR = {"adamw": 1e-4, "lamb": 2e-3}
_TEMPO = MEMORY_OPTIONS   # the Trainer's `tempo` keys: the layer stack's memory options


class TrainingInterrupted(Exception):
    pass


_SCALE_GROWTH_STEPS, _SCALE_MAX = 2000, 2.0 ** 24   # float16 loss scaling (as torch.amp.GradScaler)


def _cpu_isa():
    return _C.cpu_isa()


def _cuda_device(device):
    """'cuda' / 'cuda:N' -> 'cuda:N'; None for 'cpu'; anything else an InputError."""
    if device == "cpu":
        return None
    if isinstance(device, str) and (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        return f"cuda:{int(device[5:] or 0)}"
    raise InputError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class _CudaHead:
    """A head's training state in CUDA memory, made once and kept across steps and epochs: the
    parameters and gradients (one flat buffer each, with per-tensor views the fused optimizer
    updates in place), the logits, labels and QA context mask of a batch and the head's
    workspace (sized for the largest batch, grown only if a larger one comes). The host head
    (`head.params`) is brought up to date by pull() (after steps: `dirty`) and copied up by push()."""

    def __init__(self, head, device, want_dx=False):
        self.head, self.device, self.index, self.want_dx = head, device, int(device[5:]), bool(want_dx)
        P = head.params.size
        self.params = _C.device_zeros(P, self.index)
        self.grads = _C.device_zeros(P, self.index)
        self.named = [(name, self.params.view(off, shape)) for name, shape, off in head._table]
        self.gviews = [self.grads.view(off, shape) for _, shape, off in head._table]
        self.cap = (0, 0)
        self.dirty = False
        self.push()

    def ensure(self, B, T):
        """the per-batch buffers for batches of up to B examples of up to T tokens"""
        qa = self.head.kind == "qa"
        T = T if qa else 1
        if B <= self.cap[0] and T <= self.cap[1]:
            return
        B, T = max(B, self.cap[0]), max(T, self.cap[1])
        K = self.head.num_labels
        self.logits = _C.device_zeros(2 * B * T if qa else B * K, self.index)
        self.labels = _C.device_zeros(2 * B if qa else B, self.index, True)   # int32
        self.valid = _C.device_zeros(B * T, self.index) if qa else None
        self.ws = _C.device_zeros(_C.head_workspace(self.head._cfg, B, T, True, True, self.want_dx, True), self.index)
        self.cap = (B, T)

    def push(self):
        _C.device_write(self.params, self.head.params)
        self.dirty = False

    def pull(self):
        if self.dirty:
            self.head.params[...] = self.params.numpy()
            self.dirty = False

    def step(self, x, B, T, labels, valid, seed, step, dx=None):
        """head forward + loss + backward on a device batch x ((B, C), or (B, T, C) for QA);
        labels int32 (B,) or (2, B) and valid (B, T) come from the host; dx: a device buffer for
        the gradient of x (top-layer training). Returns (logits view, loss)."""
        qa = self.head.kind == "qa"
        self.ensure(B, T)
        lab = self.labels.view(0, (labels.size,))
        _C.device_write(lab, np.ascontiguousarray(labels, np.int32).reshape(-1))
        v = None
        if qa:
            v = self.valid.view(0, (B * T,))
            _C.device_write(v, np.ascontiguousarray(valid, np.float32).reshape(-1))
        lg = self.logits.view(0, (2 * B * T,) if qa else (B * self.head.num_labels,))
        # labels_checked: fit() checked every label and QA span against the context (_check_targets)
        loss = _C.head_step(self.head._cfg, self.params, x, B, T if qa else 1, v, lab, lg, self.grads,
                            dx, True, int(seed), int(step), self.ws, True)
        self.dirty = True
        return lg, loss


class _CudaTopBuffers:
    """The per-batch device buffers of top-layer training on CUDA, made for the largest batch and
    kept: the layers' output and its gradient (N, C), and what the head reads and gives back
    (pooled rows (B, C), or QA's zero-padded token states (B, T, C), and their gradient)."""

    def __init__(self, hidden, device):
        self.C, self.index = hidden, int(device[5:])
        self.rows = self.head_rows = 0

    def get(self, N, H):
        """views (out, dout) of (N, C) and (hx, dhx) of (H, C)"""
        C = self.C
        if N > self.rows:
            self.out, self.dout, self.rows = _C.device_zeros(N * C, self.index), _C.device_zeros(N * C, self.index), N
        if H > self.head_rows:
            self.hx, self.dhx, self.head_rows = _C.device_zeros(H * C, self.index), _C.device_zeros(H * C, self.index), H
        return (self.out.view(0, (N, C)), self.dout.view(0, (N, C)), self.hx.view(0, (H, C)),
                self.dhx.view(0, (H, C)))


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
    """Fine-tunes a task head on frozen features.

        >>> tr = fasttran.Trainer("classification")            # LAMB, its default lr, 3 epochs
        >>> tr.fit(cache, labels, eval=(dev_cache, dev_labels))
        >>> tr.evaluate(dev_cache, dev_labels)      # {'accuracy': ..., 'f1': ..., 'loss': ...}
        >>> tr.history                              # one dict per epoch; tr.plot() draws it

    `head` is a head object, or "classification" / "classification-pooler" / "qa" (sized from
    the cache at fit time). `lr=None` takes the measured default for the optimizer and head
    (`DEFAULT_LR`, from benchmarks/sweep_defaults.py). `warmup` is a fraction of all steps (< 1)
    or a step count. The head remembers the features it was trained on (model, layer,
    positions): evaluating it on another encoder's cache raises CacheMismatchError.

    `train_layers=k` also trains the encoder's top k layers, from a cache of layer L - k
    (`trainer.cache_for(encoder, ...)`), with `pooling` "mean" or "cls" (a QA head takes every
    token's state of the top layer, padded per batch, and returns its gradient); `layer_dropout` is their
    hidden and attention dropout (None: the checkpoint's), `dropout` the head's; `tempo` switches
    Tempo's memory options and FlashAttention's recomputed probabilities (see
    fasttran.finetune.TopLayers; e.g. tempo={"recompute_attention_probs": True} for long sequences). `precision="bfloat16"` (with
    train_layers; on CUDA, or on a CPU with AMX) trains the layers in mixed precision: float32
    storage, master weights and sums, the projections' products in bf16 on tensor cores / AMX tiles
    (about 0.5% relative error per product, like PyTorch's AMP; attention's products too, as its
    bf16 FlashAttention: softmax and its statistics stay float32);
    "float16" (CUDA) the same with fp16 products (11
    significant bits, range 65504) and dynamic loss scaling: the layers' backward runs on the loss
    gradient times `loss_scale[0]` (from 2**16), an overflowing step is skipped and halves it, 2000
    clean steps double it (PyTorch's GradScaler rule; `skipped_steps` counts the skips).
    """

    def __init__(self, head="classification", optimizer="lamb", lr=None, weight_decay=0.01, schedule="linear",
                 warmup=0.1, epochs=3, batch_size=32, seed=0, device="cpu", max_grad_norm=1.0, betas=(0.9, 0.999),
                 eps=1e-6, dropout=None, num_labels=None, show_progress=None, train_layers=0, pooling="mean",
                 tempo=None, layer_dropout=None, precision="float32"):
        if isinstance(head, str):
            if head not in _HEADS:
                raise InputError(f"unknown head {head!r}; choose one of {sorted(_HEADS)} or pass a head object")
        elif not isinstance(head, _Head):
            raise InputTypeError(f"head must be a head object or a name, got {type(head).__name__}")
        if not isinstance(optimizer, str) or optimizer.lower() not in ("lamb", "adamw"):
            raise InputError(f"unknown optimizer {optimizer!r}; choose 'lamb' or 'adamw'")
        if isinstance(train_layers, bool) or not isinstance(train_layers, (int, np.integer)) or train_layers < 0:
            raise InputError(f"train_layers must be an int >= 0 (how many of the top encoder layers to train), "
                             f"got {train_layers!r}")
        if pooling not in ("mean", "cls"):
            raise InputError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        if layer_dropout is not None and (isinstance(layer_dropout, bool) or not isinstance(layer_dropout, (int, float))
                                          or not 0.0 <= layer_dropout < 1.0):
            raise InputError(f"layer_dropout must be a probability in [0, 1) (or None for the checkpoint's "
                             f"hidden/attention dropout), got {layer_dropout!r}")
        tempo = dict(tempo or {})
        unknown = set(tempo) - set(_TEMPO)
        if unknown:
            raise InputError(f"unknown tempo option(s) {sorted(unknown)}; known: {list(_TEMPO)}")
        if lr is None:
            lr = DEFAULT_TOPK_LR[optimizer.lower()] if train_layers else default_lr(optimizer, head)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
            raise InputError(f"lr must be a finite number > 0 (or None for the default), got {lr!r}")
        if schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        for name, v in (("epochs", epochs), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InputError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(warmup, (int, float)) or warmup < 0:
            raise InputError(f"warmup must be a fraction in [0, 1) or a step count, got {warmup!r}")
        if precision not in ("float32", "bfloat16", "float16"):
            raise InputError(f"precision must be 'float32', 'bfloat16' or 'float16', got {precision!r}")
        if precision != "float32":
            if not train_layers:
                raise InputError(f"precision={precision!r} (mixed precision: the trained encoder layers' products "
                                 "in half precision) needs train_layers >= 1: a head alone trains in float32")
            if not _cuda_device(device) and (precision != "bfloat16" or not _C.cpu_features()[0]["avx512_bf16"]):
                raise InputError(f"precision={precision!r} on the CPU needs bfloat16 and a CPU with bf16 dot products "
                                 f"(avx512_bf16: Intel Cooper Lake, Sapphire Rapids (AMX) or later, AMD Zen 4 or later; "
                                 f"this one runs the {_cpu_isa()!r} kernels without it): elsewhere half-precision "
                                 "products are no faster than float32. Train in float32 here, or on device='cuda'")
        cuda = _cuda_device(device)
        if cuda:
            from ._info import no_gpu_reason
            reason = no_gpu_reason()
            if reason:
                raise NoGPUError(f"Trainer(device={device!r}): there is no usable GPU: {reason}. Use device='cpu' "
                                 "(the default; a checkpoint trained on CUDA loads with Trainer.load(path, "
                                 "device='cpu'))")
            device = cuda
        self.head = head if isinstance(head, _Head) else None
        self._head_name = head if isinstance(head, str) else None
        self.optimizer_name = optimizer.lower()
        self.lr, self.weight_decay, self.schedule, self.warmup = float(lr), float(weight_decay), schedule, warmup
        self.epochs, self.batch_size, self.seed, self.device = int(epochs), int(batch_size), int(seed), device
        self.max_grad_norm, self.betas, self.eps = max_grad_norm, tuple(betas), float(eps)
        self.dropout, self.num_labels = dropout, num_labels
        self.show_progress = True if show_progress is None else bool(show_progress)
        self.train_layers, self.pooling, self.tempo = int(train_layers), pooling, tempo
        self.layer_dropout = None if layer_dropout is None else float(layer_dropout)
        self.precision = precision
        # float16 products: dynamic loss scaling (PyTorch GradScaler's rule): [scale, steps since the
        # last overflow]; an overflowing step is skipped and halves the scale, 2000 clean steps double it
        self.loss_scale = [2.0 ** 16, 0] if precision == "float16" else None
        self._cuda = None            # _CudaHead: the head's state in CUDA memory (device="cuda")
        self._cuda_top = None        # _CudaTopBuffers: top-layer training's batch buffers on CUDA
        self.top = None              # TopLayers: the trained encoder layers (train_layers > 0)
        self._pending = None         # layer weights and optimizer state loaded before the layers exist
        self._encoder = None         # the encoder they come from (the cache's)
        self.optimizer = None
        self.history = []            # one dict per finished epoch (train_loss, seconds, eval_* ...)
        self.loss_curve = []         # (step, loss) of every step of this process's fit() calls
        self.features = None         # what the head was trained on: fingerprint, layer, positions, hidden
        self.global_step = 0
        self.skipped_steps = 0       # float16: steps skipped for an overflow (this process)
        self._pos = (0, 0)           # (epoch, batch within it) of the next step
        self._interrupt = False

    # ---- set-up ---------------------------------------------------------------------------------
    @property
    def task(self):
        h = self.head
        if h is not None:
            return "qa" if isinstance(h, QAHead) else "classification"
        return "qa" if self._head_name == "qa" else "classification"

    def _make_head(self, cache, labels):
        if self.head is not None:
            return
        if self._head_name == "qa":
            self.head = QAHead(cache.hidden, dropout=0.0 if self.dropout is None else self.dropout, seed=self.seed)
        else:
            k = self.num_labels or int(np.max(labels)) + 1
            self.head = ClassificationHead(cache.hidden, max(2, k), dropout=0.1 if self.dropout is None else self.dropout,
                                           seed=self.seed, **_HEADS[self._head_name])

    def _make_top(self, cache):
        """The trained top layers, from the cache's encoder (train_layers > 0)."""
        if not self.train_layers or self.top is not None:
            return
        from .finetune import TopLayers
        self._encoder = cache.encoder
        drop = {} if self.layer_dropout is None else dict(hidden_dropout=self.layer_dropout,
                                                          attention_dropout=self.layer_dropout)
        self.top = TopLayers(cache.encoder, self.train_layers, device=self.device, **drop, **self.tempo,
                             matmul_precision=self.precision)
        self._restore_pending()

    def _restore_pending(self):
        """A checkpoint's layer weights and optimizer state, into layers that exist now."""
        if self._pending is not None and self.top is not None:
            layers, opt = self._pending
            self._pending = None
            for name, view in self.top.named_parameters():
                if name not in layers or layers[name].shape != tuple(view.shape):
                    raise CheckpointError(f"the checkpoint's trained layers do not match this encoder ({name})")
                if self.device == "cpu":
                    view[...] = layers[name]
                else:
                    _C.device_write(view, np.ascontiguousarray(layers[name], np.float32))
            if opt is not None:
                self.optimizer = None
                self._make_optimizer()
                load_flat_state(self.optimizer, *opt)

    def _named_parameters(self):
        top = self.top.named_parameters() if self.top is not None else []
        if self.device != "cpu":   # the optimizer updates the device copies of layers and head in place
            return top + self._cuda_head().named
        return top + list(self.head.named_parameters())

    def _cuda_head(self):
        if self._cuda is None or self._cuda.head is not self.head:
            self._cuda = _CudaHead(self.head, self.device, want_dx=self.train_layers > 0)
        return self._cuda

    def _pull(self):
        """the host head up to date with the device copy (CUDA training)"""
        if self._cuda is not None:
            self._cuda.pull()

    def _make_optimizer(self):
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.optimizer_name, self._named_parameters(), lr=self.lr,
                                            betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                            max_grad_norm=self.max_grad_norm)

    def _check_source(self, cache, what="features"):
        if not isinstance(cache, ActivationCache):
            raise _not_a_cache(cache, what)
        if self.train_layers:
            return self._check_topk_source(cache, what)
        want = "all" if self.task == "qa" else ("cls", "mean")
        if (cache.positions == "all") != (self.task == "qa"):
            raise InputError(f"a {self.task} head needs a cache with positions={want!r}, this one has "
                             f"positions={cache.positions!r}")
        if self.head is not None and cache.hidden != self.head.hidden_size:
            raise InputError(f"the cache holds width {cache.hidden}, the head expects {self.head.hidden_size}")

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

    def cache_for(self, encoder, input_ids, attention_mask=None, token_type_ids=None, **cache_kwargs):
        """The ActivationCache top-layer training reads: every real token's state at layer
        L - train_layers (positions='all'), built once, or reused from `disk_dir` when it holds it."""
        if not self.train_layers:
            raise InputError("cache_for() is for train_layers > 0; frozen-encoder heads take pooled features")
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

    @staticmethod
    def _labels_array(targets):
        """Labels as an array, with the errors a user can act on (strings, floats, ragged)."""
        try:
            y = np.asarray(targets)
        except ValueError as e:
            raise InputError(f"labels could not be read as a 1-D array: {e}") from None
        if y.dtype.kind in "USO":
            vals = list(dict.fromkeys(str(v) for v in y.reshape(-1)[:1000]))[:3]
            what = "objects" if y.dtype.kind == "O" else "strings"
            raise InputTypeError(
                f"labels must be integer class ids 0..K-1, got {what} such as {vals}; map them to ids first, "
                "e.g. classes, y = numpy.unique(labels, return_inverse=True)")
        if y.dtype.kind == "f" and y.size and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            raise InputTypeError(f"labels must be integers, got {y.dtype} (whole numbers: pass labels.astype(int))")
        if y.dtype.kind not in "iu":
            raise InputTypeError(f"labels must be integers, got {y.dtype}")
        return y

    def _check_targets(self, cache, targets):
        N = len(cache)
        if self.task == "qa":
            if not (isinstance(targets, (tuple, list)) and len(targets) == 2):
                raise InputError("QA targets must be (start_positions, end_positions)")
            s, e = (np.asarray(t) for t in targets)
            for name, a in (("start_positions", s), ("end_positions", e)):
                if a.dtype.kind not in "iu":
                    raise InputTypeError(f"{name} must be integers, got {a.dtype}")
                if a.shape != (N,):
                    raise InputError(f"{name} has {a.shape[0] if a.ndim else 0} entries but the cache has {N} examples")
            lengths = cache.lengths
            bad = np.flatnonzero((s < 0) | (e < s) | (e >= lengths))
            if len(bad):
                i = int(bad[0])
                raise InputError(f"example {int(cache.example_ids[i])}: answer span ({int(s[i])}, {int(e[i])}) is not "
                                 f"inside its {int(lengths[i])} tokens with start <= end")
            ctx = self._context(cache, cache.example_ids, int(lengths.max()))
            rows = np.arange(N)
            bad = np.flatnonzero((ctx[rows, s] == 0) | (ctx[rows, e] == 0))
            if len(bad):
                i = int(bad[0])
                raise InputError(f"example {int(cache.example_ids[i])}: answer span ({int(s[i])}, {int(e[i])}) "
                                 "is not in the context (token type 1)")
            return np.stack([s, e]).astype(np.int32)
        y = self._labels_array(targets)
        if y.shape != (N,):
            raise InputError(f"labels has {y.shape[0] if y.ndim else 0} entries but the cache has {N} examples")
        k = self.head.num_labels if self.head is not None else (self.num_labels or int(y.max()) + 1)
        bad = np.flatnonzero((y < 0) | (y >= k))
        if len(bad):
            raise InputError(f"label {int(y[bad[0]])} of example {int(cache.example_ids[bad[0]])} is outside [0, {k})")
        return y.astype(np.int32)

    @staticmethod
    def _context(cache, example_ids, T):
        """(B, T) float mask of context positions: token type 1, but not the final [SEP]."""
        _, mask, types = cache.inputs(example_ids)
        m = ((types == 1) & (mask == 1)).astype(np.float32)
        L = mask.sum(1)
        some = np.flatnonzero(L > 0)
        m[some, L[some] - 1] = 0.0
        out = np.zeros((len(m), T), np.float32)
        w = min(T, m.shape[1])
        out[:, :w] = m[:, :w]
        return out

    def _top_batch(self, cache, idx, batch):
        """A ragged batch (rows (N, C), offsets (B + 1)) with the NaN check."""
        x, offsets = batch
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.isfinite(x).all():
            bad = np.searchsorted(offsets, np.flatnonzero(~np.isfinite(x).all(1))[0], side="right") - 1
            raise InputError(f"features of example {int(cache.example_ids[idx[bad]])} contain NaN or Inf")
        return x, np.asarray(offsets, np.int64)

    def _pool(self, out, offsets):
        """(B, C) from the top layer's rows: mean over each example's tokens, or its first ([CLS])."""
        if self.pooling == "cls":
            return np.ascontiguousarray(out[offsets[:-1]])
        from .finetune import mean_rows
        return mean_rows(out, offsets)

    def _qa_padded(self, cache, ids, out, offsets):
        """The top layer's rows as the QA head takes them: (B, T, C) zero-padded token states, T
        the longest example, and the (B, T) context mask; `where` (B, T) marks the real rows."""
        n = np.diff(offsets)
        T = int(n.max()) if len(n) else 0
        where = np.arange(T)[None, :] < n[:, None]
        x = np.zeros((len(n), T, out.shape[1]), np.float32)
        x[where] = out
        return x, self._context(cache, ids, T), where

    def _pool_backward(self, dpooled, offsets):
        n = np.diff(offsets)
        if self.pooling == "cls":
            d = np.zeros((int(offsets[-1]), dpooled.shape[1]), np.float32)
            d[offsets[:-1]] = dpooled
            return d
        return np.repeat(dpooled / n[:, None].astype(np.float32), n, axis=0)

    def _batch(self, cache, ids, idx, batch):
        """Features of a batch as the head wants them, with the NaN check."""
        if self.task == "qa":
            x, _mask = batch
            x = np.ascontiguousarray(x)
            valid = self._context(cache, ids, x.shape[1])
        else:
            x, valid = np.ascontiguousarray(batch), None
        if not np.isfinite(x).all():
            bad = np.flatnonzero(~np.isfinite(x.reshape(len(idx), -1)).all(1))
            raise InputError(f"features of example {int(cache.example_ids[idx[bad[0]]])} contain NaN or Inf")
        return x, valid

    def _prepare(self, cache, targets):
        """Checks in the order a user's mistake shows up, then the head: (labels array)."""
        self._check_source(cache)
        if self.task != "qa":
            self._labels_array(targets)
        self._make_top(cache)
        self._make_head(cache, targets if self.task != "qa" else None)
        self._check_source(cache)
        return self._check_targets(cache, targets)

    def _loop_setup(self, N):
        """The optimizer, and (steps per epoch, total steps, warmup steps, gradient buffer, its
        per-tensor views) for N examples."""
        self._make_optimizer()
        steps_per_epoch = (N + self.batch_size - 1) // self.batch_size
        total = steps_per_epoch * self.epochs
        warm = int(self.warmup * total) if self.warmup < 1 else int(self.warmup)
        if self.device != "cpu":
            dev = self._cuda_head()
            top = [g for _, g in self.top.named_gradients()] if self.top is not None else []
            return steps_per_epoch, total, warm, dev.grads, top + dev.gviews
        grads = np.zeros_like(self.head.params)
        gviews = list(self.head.views(grads).values())
        if self.top is not None:
            gviews = [g for _, g in self.top.named_gradients()] + gviews
        return steps_per_epoch, total, warm, grads, gviews

    def _step(self, cache, y, ids, batch, grads, gviews, total, warm):
        """One training step on a gathered batch: head forward + backward in C, NaN check, one
        fused optimizer step. Returns (batch size, loss, correct predictions or 0)."""
        idx = cache.index_of(ids)
        yb = y[:, idx] if self.task == "qa" else y[idx]
        correct = 0
        if self.device != "cpu" and self.top is not None:   # layers, pooling, head, loss, gradients on the device
            logits, loss, correct = self._cuda_top_step(cache, ids, idx, batch, yb)
        elif self.device != "cpu":   # batch, head, loss and gradients in device memory
            if self.task == "qa":
                x, _mask = batch
                B, T = x.shape[:2]
                logits, loss = self._cuda.step(x, B, T, yb, self._context(cache, ids, T), self.seed, self.global_step)
            else:
                x = batch
                logits, loss = self._cuda.step(x, x.shape[0], 1, yb, None, self.seed, self.global_step)
                correct = int((logits.numpy().reshape(len(idx), -1).argmax(1) == yb).sum())
        elif self.top is not None and self.task == "qa":   # token states -> span head, and back
            x, offsets = self._top_batch(cache, idx, batch)
            out = self.top.forward(x, np.diff(offsets), training=True, seed=self.seed, step=self.global_step)
            xp, valid, where = self._qa_padded(cache, ids, out, offsets)
            dxp = np.empty_like(xp)
            logits, loss = self.head.step(xp, valid, yb, grads=grads, dx=dxp, training=True, seed=self.seed,
                                          step=self.global_step)
            if math.isfinite(loss):
                self.top.backward(np.ascontiguousarray(dxp[where]))
        elif self.top is not None:
            x, offsets = self._top_batch(cache, idx, batch)
            out = self.top.forward(x, np.diff(offsets), training=True, seed=self.seed, step=self.global_step)
            dpooled = np.empty((len(idx), self.head.hidden_size), np.float32)
            logits, loss = self.head.step(self._pool(out, offsets), yb, grads=grads, dx=dpooled, training=True,
                                          seed=self.seed, step=self.global_step)
            correct = int((logits.argmax(1) == yb).sum())
            if math.isfinite(loss):
                self.top.backward(self._pool_backward(dpooled, offsets))
        elif self.task == "qa":
            x, valid = self._batch(cache, ids, idx, batch)
            logits, loss = self.head.step(x, valid, yb, grads=grads, training=True, seed=self.seed, step=self.global_step)
        else:
            x, _ = self._batch(cache, ids, idx, batch)
            logits, loss = self.head.step(x, yb, grads=grads, training=True, seed=self.seed, step=self.global_step)
            correct = int((logits.argmax(1) == yb).sum())
        if not math.isfinite(loss):
            epoch, b = self._pos
            hint = (": float16 products overflowed in the forward pass (beyond 65504); precision='bfloat16' has "
                    "float32's range" if self.precision == "float16" else "")
            raise FloatingPointError(f"the loss is {loss} at step {self.global_step + 1} (epoch {epoch + 1}, "
                                     f"batch {b + 1}); training stopped before applying it{hint}")
        lr = self.lr * schedule_factor(self.schedule, self.global_step, total, warm)
        try:
            self.optimizer.step(gviews, lr=max(lr, 1e-30))
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
                return len(idx), loss, correct
            epoch, b = self._pos
            raise FloatingPointError(f"training diverged at step {self.global_step + 1} (epoch {epoch + 1}, batch "
                                     f"{b + 1}): {e}; try a lower learning rate than lr={self.lr:g}") from None
        self.global_step += 1
        return len(idx), loss, correct

    def _cuda_top_step(self, cache, ids, idx, batch, yb):
        """The top layers, pooling (or QA's padding), head, loss and the backward on the device, from a
        ragged device batch. Returns (logits, loss, correct predictions or 0). QA pads the token
        states into (B, T, C) through host memory: its head and loss run on the device."""
        x, offsets = batch
        lengths = np.diff(offsets).astype(np.int32)
        B, N, C = len(lengths), int(offsets[-1]), self.top.hidden_size
        qa = self.task == "qa"
        T = int(lengths.max()) if qa else 1
        if self._cuda_top is None:
            self._cuda_top = _CudaTopBuffers(C, self.device)
        out, dout, hx, dhx = self._cuda_top.get(N, B * T)
        self.top.forward(x, lengths, training=True, seed=self.seed, step=self.global_step, out=out)
        if qa:
            xp, valid, where = self._qa_padded(cache, ids, out.numpy(), offsets)
            _C.device_write(hx, xp.reshape(B * T, C))
            logits, loss = self._cuda.step(hx, B, T, yb, valid, self.seed, self.global_step, dx=dhx)
            if math.isfinite(loss):
                d = dhx.numpy().reshape(B, T, C)[where]
                _C.device_write(dout, np.ascontiguousarray(d))
                self.top.backward(dout, loss_scale=self._scale())
            return logits, loss, 0
        cls = self.pooling == "cls"
        self.top.pool(out, cls=cls, pooled=hx)
        logits, loss = self._cuda.step(hx, B, 1, yb, None, self.seed, self.global_step, dx=dhx)
        correct = int((logits.numpy().reshape(B, -1).argmax(1) == yb).sum())
        if math.isfinite(loss):
            self.top.pool_backward(dhx, cls=cls, dout=dout)
            self.top.backward(dout, loss_scale=self._scale())
        return logits, loss, correct

    def _scale(self):
        return 1.0 if self.loss_scale is None else self.loss_scale[0]

    # ---- training -------------------------------------------------------------------------------
    def fit(self, cache, targets, eval=None, checkpoint_dir=None, resume=False, stop_at_step=None):
        """Train for `epochs` over `cache` (targets: class labels, or (starts, ends) for QA, in
        the cache's example order). `eval`: (cache, labels) for classification, or (cache,
        squad_features) for QA, evaluated after every epoch. With `checkpoint_dir` the state is
        saved after every epoch and on Ctrl-C, and `resume=True` continues from it exactly.
        `stop_at_step` stops like Ctrl-C once that many steps are done (the schedule stays the
        full run's). Progress: one bar per epoch, left on screen with its loss and accuracy
        (and the eval metric). Returns the history (one dict per epoch, also `self.history`)."""
        y = self._prepare(cache, targets)
        if eval is not None:
            if not (isinstance(eval, (tuple, list)) and len(eval) == 2):
                raise InputError("eval must be a pair (cache, labels), or (cache, squad_features) for QA")
            self._check_source(eval[0], "eval features")
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
        steps_per_epoch, total, warm, grads, gviews = self._loop_setup(len(cache))
        on_device = {}
        if self.device != "cpu":   # the host head (maybe loaded or edited since) up, buffers for the longest batch
            self._cuda.push()
            T = int(cache.lengths.max(initial=1))
            self._cuda.ensure(self.batch_size, T)
            if self.top is not None:   # the largest batch's buffers, made once
                if self._cuda_top is None:
                    self._cuda_top = _CudaTopBuffers(self.top.hidden_size, self.device)
                self._cuda_top.get(int(np.sort(cache.lengths)[::-1][:self.batch_size].sum()),
                                   self.batch_size * (T if self.task == "qa" else 1))
            on_device = dict(output="device", device=self.device)
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
                it = cache.batches(self.batch_size, shuffle=True, seed=_epoch_seed(self.seed, epoch), start=start,
                                   ragged=self.top is not None, **on_device)
                stack.callback(it.close)   # an early stop (Ctrl-C, error) joins the reader thread
                bar = stack.enter_context(progress(total=steps_per_epoch, initial=start, unit="step",
                                                   desc=f"epoch {epoch + 1}/{self.epochs}",
                                                   disable=not self.show_progress, leave=True))
                loss_sum, correct, seen, b = 0.0, 0, 0, start
                for ids, batch in it:
                    self._pos = (epoch, b)
                    n, loss, c = self._step(cache, y, ids, batch, grads, gviews, total, warm)
                    del batch   # its buffer goes back to the reader before the next is asked for
                    b += 1
                    self._pos = (epoch, b)
                    self.loss_curve.append((self.global_step, float(loss)))
                    loss_sum += loss * n
                    correct += c
                    seen += n
                    bar.update(1)
                    if b % 20 == 0:
                        bar.set_postfix(self._postfix(loss_sum, correct, seen), refresh=False)
                    if stop_at_step is not None and self.global_step >= stop_at_step:
                        self._interrupt = True
                    if self._interrupt:
                        break
                if self._interrupt:
                    bar.close()
                    self._pull()
                    if checkpoint_dir:
                        self.save(checkpoint_dir)
                    where = f"; state saved to {checkpoint_dir}" if checkpoint_dir else ""
                    print(f"interrupted after step {self.global_step} (epoch {epoch + 1}, batch {b}){where}",
                          file=sys.stderr)
                    break
                self._pos = (epoch + 1, 0)
                rec = {"epoch": epoch + 1, "steps": self.global_step, "train_loss": loss_sum / max(seen, 1),
                       "seconds": time.perf_counter() - t0, "lr": self.optimizer.lr}
                if self.task != "qa":
                    rec["train_accuracy"] = correct / max(seen, 1)
                self._pull()
                if eval is not None:
                    t1 = time.perf_counter()
                    rec.update({f"eval_{k}": v for k, v in self.evaluate(*eval).items()})
                    rec["eval_seconds"] = time.perf_counter() - t1
                bar.set_postfix(self._postfix(loss_sum, correct, seen, rec), refresh=False)
                bar.close()   # leaves the epoch's line: steps, time, loss, accuracy, eval metric
                self.history.append(rec)
                if checkpoint_dir:
                    self.save(checkpoint_dir)
                first_batch = 0
        finally:
            stack.close()
            self._pull()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
        return self.history

    def _postfix(self, loss_sum, correct, seen, rec=None):
        out = {"loss": f"{loss_sum / max(seen, 1):.4f}"}
        if self.task != "qa":
            out["acc"] = f"{correct / max(seen, 1):.4f}"
        if rec:
            for k, short in (("eval_accuracy", "dev_acc"), ("eval_f1", "dev_f1"), ("eval_exact_match", "dev_em")):
                if k in rec and not (k == "eval_f1" and self.task != "qa"):
                    out[short] = f"{rec[k]:.4f}" if self.task != "qa" else f"{rec[k]:.2f}"
        return out

    # ---- inference --------------------------------------------------------------------------------
    def _logits(self, cache, batch_size=256):
        """(runs the head on the CPU, with the host copy of its weights, also for a CUDA trainer)"""
        if self.head is None:
            raise InputError("the trainer has no head yet: fit() or load() first")
        self._pull()
        self._check_source(cache)
        self._check_features(cache, "evaluate or predict on this cache")
        outs = []
        steps = (len(cache) + batch_size - 1) // batch_size
        lengths = cache.lengths
        # a bar appears when the pass is slow (an uncached source runs the encoder)
        with progress(total=steps, desc="evaluate", unit="batch", leave=False, delay=1.0,
                      disable=not self.show_progress) as bar:
            for ids, batch in cache.batches(batch_size, shuffle=False, ragged=self.top is not None):
                idx = cache.index_of(ids)
                if self.top is not None:
                    x, offsets = self._top_batch(cache, idx, batch)
                    out = self.top.forward(x, np.diff(offsets), training=False)
                    if not isinstance(out, np.ndarray):   # layers on CUDA; the head runs on the host copy
                        out = out.numpy()
                    if self.task != "qa":
                        outs.append(self.head.step(self._pool(out, offsets))[0])
                        bar.update(1)
                        continue
                    x, valid, _ = self._qa_padded(cache, ids, out, offsets)
                else:
                    x, valid = self._batch(cache, ids, idx, batch)
                if self.task == "qa":
                    lg, _ = self.head.step(x, valid)
                    for j in range(len(idx)):   # per example: (2, its own length)
                        n = int(lengths[idx[j]])
                        outs.append(np.where(valid[j, :n] > 0, lg[:, j, :n], -np.inf))
                else:
                    outs.append(self.head.step(x)[0])
                bar.update(1)
        return outs if self.task == "qa" else np.concatenate(outs)

    def predict(self, cache, squad=None):
        """Classification: predicted labels in the cache's example order. QA: with `squad` (the
        SquadFeatures the cache was built from) the answer text per question id; without it the
        per-example (start, end) logits."""
        if self.task == "qa":
            logits = self._logits(cache)
            if squad is None:
                return logits
            return squad.postprocess(logits)
        return self._logits(cache).argmax(1)

    def evaluate(self, cache, targets):
        """Classification: accuracy, F1 (binary: of class 1; else macro) and loss against labels.
        QA: SQuAD exact match and F1 (official normalisation, best over all reference answers)
        with `targets` the SquadFeatures the cache was built from."""
        if self.head is None:
            raise InputError("the trainer has no head yet: fit() or load() first")
        self._check_source(cache)
        if self.task == "qa":
            from .squad import squad_metrics
            preds = self.predict(cache, squad=targets)
            return squad_metrics(preds, targets.examples)
        y = self._check_targets(cache, targets)
        logits = self._logits(cache)
        pred = logits.argmax(1)
        z = logits - logits.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        loss = float(-logp[np.arange(len(y)), y].mean())
        K = logits.shape[1]
        f1s = []
        for c in ([1] if K == 2 else range(K)):
            tp = int(((pred == c) & (y == c)).sum())
            fp = int(((pred == c) & (y != c)).sum())
            fn = int(((pred != c) & (y == c)).sum())
            f1s.append(2 * tp / max(2 * tp + fp + fn, 1))
        return {"accuracy": float((pred == y).mean()), "f1": float(np.mean(f1s)), "loss": loss}

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
        if self.task != "qa":
            self._labels_array(targets)
        cfg = dict(self._config(), show_progress=False, dropout=self.dropout, num_labels=self.num_labels)
        cfg.pop("device")
        cfg.pop("precision")   # the CPU copy trains in float32
        head = self.head
        self._pull()
        if head is not None:
            head = _Head.from_config(head.config())
            head.params[...] = self.head.params
        else:
            head = self._head_name
        scratch = Trainer(head, **cfg)
        y = scratch._prepare(cache, targets)
        if self.top is not None:   # the trained layers too (host copies of a CUDA trainer's)
            for (_, mine), (_, theirs) in zip(self.top.named_parameters(), scratch.top.named_parameters()):
                theirs[...] = np.asarray(mine)
        ragged = scratch.top is not None
        N = len(cache)
        spe, total, warm, grads, gviews = scratch._loop_setup(N)
        order = cache.epoch_order(_epoch_seed(scratch.seed, 0))
        batches = [order[a:a + scratch.batch_size] for a in range(0, N, scratch.batch_size)]
        rows = lambda k: cache.example_ids[batches[k % len(batches)]]

        def run(k0, n):
            for k in range(k0, k0 + n):
                ex = rows(k)
                scratch._step(cache, y, ex, cache.get(ex, ragged=ragged), grads, gviews, total, warm)

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
        """Loss and accuracy (QA: exact match / F1) per epoch from `history`, with the loss of
        every step behind them. Needs matplotlib. Returns the matplotlib Figure."""
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
        if self.task == "qa":
            for k, lab in (("eval_exact_match", "eval exact match"), ("eval_f1", "eval F1")):
                if any(k in r for r in self.history):
                    ax_m.plot(ep, [r.get(k, np.nan) for r in self.history], "o-", label=lab)
            ax_m.set_ylabel("score (0-100)")
        else:
            ax_m.plot(ep, [r.get("train_accuracy", np.nan) for r in self.history], "o-", label="train")
            if any("eval_accuracy" in r for r in self.history):
                ax_m.plot(ep, [r.get("eval_accuracy", np.nan) for r in self.history], "s-", label="eval")
            ax_m.set_ylabel("accuracy")
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
                "layer_dropout": self.layer_dropout, "precision": self.precision}

    def save(self, path):
        """Write head weights and optimizer state (safetensors) and the trainer state (JSON),
        each atomically; trainer.json, written last, holds the CRC-32C of the others."""
        if self.head is None:
            raise InputError("nothing to save: the trainer has no head yet")
        self._pull()
        os.makedirs(path, exist_ok=True)
        files = {"head.safetensors": write_safetensors(os.path.join(path, "head.safetensors"),
                                                       self.head.state_dict(), {"format": "fasttran-head"})}
        if self.top is not None:
            files["layers.safetensors"] = write_safetensors(
                os.path.join(path, "layers.safetensors"), {n: np.array(v) for n, v in self.top.named_parameters()},
                {"format": "fasttran-layers"})
        opt = None
        if self.optimizer is not None:
            opt, m, v = flat_state(self.optimizer)
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
        state = state or self._read_state(path)
        files = state["files"]
        head_t = read_safetensors(os.path.join(path, "head.safetensors"), files["head.safetensors"])
        head = _Head.from_config(state["head"])
        if self.head is not None and self.head.config() != head.config():
            raise CheckpointError(f"the checkpoint's head {state['head']} differs from this trainer's {self.head.config()}")
        self.head = self.head or head
        self.head.load_state_dict(head_t)
        opt = None
        if state.get("optimizer_state"):
            opt_t = read_safetensors(os.path.join(path, "optimizer.safetensors"), files["optimizer.safetensors"])
            opt = (state["optimizer_state"], opt_t["exp_avg"], opt_t["exp_avg_sq"])
        self.optimizer = None
        if "layers.safetensors" in files:   # the trained layers: restored when they exist (_make_top)
            layers = read_safetensors(os.path.join(path, "layers.safetensors"), files["layers.safetensors"])
            self._pending = (layers, opt)
            self._restore_pending()
        else:
            self._make_optimizer()
            if opt is not None:
                load_flat_state(self.optimizer, *opt)
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
        if (not _cuda_device(cfg.get("device", "cpu")) and "precision" not in overrides
                and not (cfg.get("precision") == "bfloat16" and _cpu_isa() == "amx")):
            cfg["precision"] = "float32"   # what this CPU cannot run in half precision continues in float32
        self = cls(_Head.from_config(state["head"]), **cfg)
        self._load_into(path, state)
        return self

    def export(self, path):
        """Write the fine-tuned encoder -- its frozen layers and the trained top layers -- in the
        Hugging Face layout (config.json, model.safetensors, and the tokenizer files of the encoder's
        checkpoint), loadable by Encoder.from_pretrained and transformers' BertModel; the head goes
        beside it (head.safetensors + head.json). Returns `path`."""
        if self.top is None or self._encoder is None:
            raise InputError("export() writes an encoder with trained layers: train with train_layers > 0 first")
        from .encoder import Encoder
        src = self._encoder
        clone = Encoder(src._raw_config, device="cpu")
        clone._core.copy_weights_from(src._core)
        self.top.export_to(clone)
        os.makedirs(path, exist_ok=True)
        clone.save_pretrained(path)
        if src.path:
            base = src.path if os.path.isdir(src.path) else os.path.dirname(src.path)
            for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
                f = os.path.join(base, name)
                if os.path.isfile(f):
                    with open(f, "rb") as fh:
                        _C.atomic_write(os.path.join(path, name), [fh.read()])
        write_safetensors(os.path.join(path, "head.safetensors"), self.head.state_dict(), {"format": "fasttran-head"})
        _C.atomic_write(os.path.join(path, "head.json"),
                        [json.dumps({"head": self.head.config(), "pooling": self.pooling}, indent=1).encode()])
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
                + (f", precision={self.precision!r}" if self.precision != "float32" else "") + ")")

    def _repr_html_(self):
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}</td>"
                                        for v in r.values()) + "</tr>" for r in self.history)
        head = "".join(f"<th>{html.escape(k)}</th>" for k in (self.history[0] if self.history else {}))
        return f"<b>{html.escape(repr(self))}</b><table><tr>{head}</tr>{rows}</table>"
