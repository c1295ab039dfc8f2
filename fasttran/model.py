"""The training model: [frozen features] -> [top layers, optional] -> task head.

    >>> model = Model(head, layers=top, device="cpu")      # top: a fasttran.finetune.TopLayers or None
    >>> loss, logits = model.step(x, lengths, targets, valid, denominator=..., seed=0, step=7)
    >>> model.named_parameters()                           # one flat table: the layers', then the head's

One forward / backward over a batch and one flat parameter and gradient table whatever the task
(the head knows it) and whatever the device (the backend knows it): the work is one C call
(csrc/train/model.c), which hands each gradient bucket -- the head, then the top layer down to the
bottom one -- to `ready` as soon as it is final, for a data-parallel reduction to overlap with the
rest of the backward. Batches are packed rows (x (N, C) with `lengths` rows per example; features
pooled by the cache are one row each), in the model's device memory or host memory on the CPU.
"""
import numpy as np

from . import _C
from .device import parse_device
from .errors import InputError


def device_index(device):
    """'cpu' -> -1, 'cuda:N' -> N"""
    return parse_device(device).index


def rows_of(batch):
    """(x, lengths int32) of a batch as the cache's reader gives it: pooled features (B, C) are one
    row per example; ragged ones come with their offsets (B + 1)."""
    if isinstance(batch, tuple):
        x, offsets = batch
        return x, np.diff(np.asarray(offsets, np.int64)).astype(np.int32)
    return batch, np.ones(batch.shape[0], np.int32)


def _tokens(tokens):
    """step / forward's keywords for the rows as tokens: (ids, types) -> host int32 arrays"""
    if tokens is None:
        return {}
    ids, types = tokens
    return {"ids": np.ascontiguousarray(ids, np.int32),
            "types": None if types is None else np.ascontiguousarray(types, np.int32)}


class Model:
    """A task head on frozen features, or on top layers trained with it (`layers`: a TopLayers made
    with `extra=head.num_parameters`, on the same device). shared_grads: the gradient table in
    memory the other processes of this machine can map (a data-parallel rank's); with layers, their
    table is the model's (TopLayers(shared_grads=))."""

    def __init__(self, head, layers=None, device="cpu", shared_grads=False):
        device = parse_device(device)
        self.head, self.layers, self.device = head, layers, device
        if layers is not None and layers.device != device:
            raise InputError(f"the layers are on {layers.device}, the model on {device}")
        self._core = _C.Model(head._cfg, None if layers is None else layers._stack, device.index,
                              shared_grads=bool(shared_grads))
        self.head_offset = self._core.head_offset
        self.params, self.grads = self._core.params, self._core.grads
        table = [] if layers is None else list(layers._table)
        table += [(name, shape, self.head_offset + off) for name, shape, off in head._table]
        self._table = table
        self._head_n = sum(int(np.prod(shape)) for _, shape, _ in head._table)
        head._bind(self)   # the head's parameters live in this table from now on

    # ---- the flat table -----------------------------------------------------------------------
    def _views(self, flat):
        return [(name, flat.view(off, tuple(shape))) for name, shape, off in self._table]

    def named_parameters(self):
        """[(Hugging Face name, view)] of the flat table (fasttran Tensors on the model's device)"""
        return self._views(self.params)

    def named_gradients(self):
        return self._views(self.grads)

    def buckets(self):
        """[(name, gradient view)]: the head's gradients, then each layer's from the top one down, in
        the order the backward finishes them (the reduction's buckets)"""
        names = ["head"] + ([f"layer {self.layers.first_layer + k}" for k in range(self.layers.k - 1, -1, -1)]
                            if self.layers is not None else [])
        return [(n, self.grads.view(int(off), (int(count),))) for n, (off, count) in zip(names, self._core.buckets())]

    def head_params(self):
        """the head's part of the table in host memory: a view (CPU), a read-only copy (GPU memory)"""
        return self.device.host(self.params.view(self.head_offset, (self._head_n,)))

    def write_head_params(self, values):
        """host float32 values (the head's size) into the head's part of the table"""
        self._core.write_params(self.head_offset, np.ascontiguousarray(values, np.float32))

    def reserve(self, batch_size, rows):
        """the per-batch buffers for batches of up to batch_size examples and `rows` rows, now"""
        self._core.reserve(int(batch_size), int(rows))

    # ---- steps ----------------------------------------------------------------------------------
    def _logits(self, lengths):
        n, _, _, _ = _C.head_counts(self.head._cfg, len(lengths), int(lengths.sum()))
        return np.empty(n, np.float32)

    def step(self, x, lengths, targets, valid=None, denominator=0.0, seed=0, step=0, place=(0, 0, 0), loss_scale=1.0,
             ready=None, tokens=None):
        """Forward with dropout, loss and every gradient (into `grads`) for one batch. `denominator`:
        the loss terms of the global batch (0: this batch's); `place`: (rows, examples, sum of n^2) of
        the global batch before this slice (dropout masks); `ready(bucket)` is called as each gradient
        bucket is final. Layers that train the embeddings take the rows as `tokens` = (ids, types),
        host int32 (N,) each, and x None. Returns (loss, logits (host, the head's layout))."""
        logits = self._logits(lengths)
        loss = self._core.step(x, lengths, targets, valid, denominator=float(denominator), seed=int(seed),
                               step=int(step), row_base=int(place[0]), seq_base=int(place[1]), sq_base=int(place[2]),
                               loss_scale=float(loss_scale), logits=logits, ready=ready, **_tokens(tokens))
        return loss, logits

    def idle(self, ready=None):
        """A step without examples (a process's empty slice of an uneven last global batch): the
        gradients are zero, and every bucket is still handed to `ready`, so the reductions of all
        processes pair up. Returns the loss's share, 0."""
        return self._core.idle(ready)

    def forward(self, x, lengths, valid=None, tokens=None):
        """the logits (host) of one batch, no dropout (tokens: as step's)"""
        logits = self._logits(lengths)
        self._core.forward(x, lengths, logits, valid, **_tokens(tokens))
        return logits

    def allocated(self):
        return self._core.allocated()

    def __repr__(self):
        top = f"{self.layers!r} -> " if self.layers is not None else "frozen features -> "
        return f"Model({top}{self.head!r}, {len(self._table)} tensors, {int(self.params.shape[0]):,} parameters, {self.device})"
