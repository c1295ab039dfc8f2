"""The top layers of an encoder as trainable weights: the part of the model that fine-tuning with
the activation cache trains (the layers below run once, into the cache).

    >>> top = TopLayers(encoder, k=2)                     # encoder layers L-2 and L-1, fp32 master copy
    >>> out = top.forward(x, lengths, training=True, seed=0, step=7)   # x: packed rows (N, C)
    >>> top.backward(d_out)                               # gradients into top.grads
    >>> top.memory_report(batch_size=32, seq_len=128)     # bytes by category, and what fits

The work runs in C (csrc/model/layer.c) on the encoder's backend; Tempo's three memory savings are
options (see `TopLayers.__init__`)."""
import numpy as np

from . import _C
from .device import parse_device
from .errors import InputError

_MiB = 1 << 20


def mean_rows(out, offsets):
    """(B, C) means of the row ranges [offsets[b], offsets[b + 1]) of out (N, C): mean pooling of
    packed sequences. One contiguous column sum per sequence (np.add.reduceat over axis 0 runs
    element by element: 22 ms against 0.6 ms for 32 x 128 rows of 768)."""
    C = out.shape[1]
    pooled = np.empty((len(offsets) - 1, C), np.float32)
    for b in range(len(offsets) - 1):
        a, e = int(offsets[b]), int(offsets[b + 1])
        pooled[b] = out[a:e].sum(axis=0) / max(e - a, 1)
    return pooled


def _int32_rows(a, N, what):
    """a host int32 (N,) array of token ids or types (a check here; their ranges are checked in C)"""
    a = np.asarray(a)
    if a.shape != (N,) or not np.issubdtype(a.dtype, np.integer):
        raise InputError(f"{what} must be {N} integers (one per row), got shape {a.shape} dtype {a.dtype}")
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise InputError(f"{what} holds values out of int32's range")
    return np.ascontiguousarray(a, dtype=np.int32)


_MATMUL_PRECISIONS = ("float32", "bfloat16", "float16")
#: the options that change what a training step keeps (Tempo's three and FlashAttention's)
MEMORY_OPTIONS = ("inplace_gelu", "inplace_layernorm", "recompute_attention_dropout", "recompute_attention_probs")


class TopLayers:
    """Encoder layers [L - k, L) as one trainable stack: parameters and gradients in one flat buffer
    each, with named views (`named_parameters()`, `named_gradients()`)."""

    def __init__(self, encoder, k, device=None, hidden_dropout=None, attention_dropout=None, inplace_gelu=None,
                 inplace_layernorm=None, recompute_attention_dropout=True, matmul_precision="float32",
                 recompute_attention_probs=False, extra=0, shared_grads=False, embedding_dropout=0.0,
                 train_embeddings=False):
        """k: how many of the top layers to train (1..L). device: where to train ('cpu', 'cuda:N';
        default the encoder's). Dropout defaults to the checkpoint's (hidden_dropout_prob,
        attention_probs_dropout_prob). Tempo's options (each leaves the gradients unchanged up to fp32
        rounding): inplace_layernorm (LayerNorm backward from its output: saves 2 N C floats per layer),
        recompute_attention_dropout (the attention-dropout mask regenerated, never stored: saves one
        byte per attention probability), inplace_gelu (keep GELU's output and one bit per element,
        not its input: saves about N I floats per layer; default on for CUDA only, because inverting
        GELU costs more CPU time than the memory is worth there). Pre-LN layers (ModernBERT) have
        neither in-place option (off by default there; asking for one is refused) and no dropout
        (their checkpoints' default 0; asking for more is refused).
        embedding_dropout: when every layer trains (k = L), the layers' input is the embeddings' output,
        which transformers drops before the first layer (hidden_dropout_prob; DistilBERT's dropout,
        ModernBERT's embedding_dropout): the stack drops its input with this probability in training
        steps; None: the checkpoint's. Default 0, the embeddings' output undropped: with the
        checkpoint's 0.1, fine-tuning every layer of all-MiniLM-L6-v2 scored no better on MRPC or
        CoLA (three seeds each; benchmarks/RESULTS.md section 12). Below k = L the input comes from
        frozen layers, which run without dropout, and it is 0; so it is for ELECTRA, whose dropout
        comes before the embeddings' projection and so before the rows fasttran keeps.
        recompute_attention_probs (FlashAttention's: the attention probabilities, NH n^2 floats per
        sequence of n tokens, are not kept; each row's softmax maximum and 1/sum are, 2 floats per
        row and head, and the backward recomputes the probabilities from Q and K: at 512 tokens a
        quarter or more of a layer's saved bytes, for one more Q K^T and exp per layer in the
        backward; the gradients are unchanged up to fp32 rounding. Default off).
        matmul_precision: the products, forward and backward, of the projections and of attention
        (Q K^T, P V and their four backward products): 'float32', or mixed precision, 'bfloat16' /
        'float16' (float32 storage, master weights and sums; products on half-precision tensor
        cores -- the projections' inputs rounded to copies, then cuBLAS on 16-bit inputs, the fused
        attention kernels' WMMA -- each product's inputs rounded to nearest with 8 / 11 significant
        bits; softmax, its statistics,
        dropout and the kept probabilities stay float32, as in FlashAttention). Training steps only:
        forward(training=False) -- evaluation, predictions -- multiplies in float32, as the exported
        float32 model does. On the CPU bf16 runs natively with AVX512_BF16 (vdpbf16ps) or AMX;
        elsewhere the half-precision modes are a slow reference of the GPU's arithmetic, for tests.
        extra: floats of room after the layers in the parameter and gradient buffers, for a task head
        (fasttran.model.Model keeps layers and head in one flat table). shared_grads: the gradient
        buffer in memory the other processes of this machine can map (a data-parallel rank's, whose
        reduction sums the ranks' tables in place: fasttran.distributed.DataParallel).
        train_embeddings (k = L only): the embeddings train too -- the word, position and token-type
        tables and their LayerNorm, first in `params` / `named_parameters()` -- as transformers trains
        them when it fine-tunes every layer; the layers' input is then the rows' token ids
        (`forward(None, lengths, ids=..., types=...)`), not the embeddings' output. The tables'
        gradients are dense (every row, 0 where no token of the batch reads it), as torch's
        nn.Embedding gives them to AdamW. Not for an embeddings' projection (ELECTRA-small)."""
        L = encoder.num_layers
        arch = getattr(encoder, "architecture", None)
        if arch is not None:
            arch.require("train_layers")
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= L:
            raise InputError(f"k (the number of top layers to train) must be an integer in [1, {L}], got {k!r}")
        device = parse_device(encoder.device if device is None else device)
        raw = getattr(encoder, "_raw_config", {}) or {}
        keys, default = (arch.dropout_keys, arch.dropout_default) if arch is not None else \
            (("hidden_dropout_prob", "attention_probs_dropout_prob"), 0.1)
        hidden_dropout = float(raw.get(keys[0], default) if hidden_dropout is None else hidden_dropout)
        attention_dropout = float(raw.get(keys[1], default) if attention_dropout is None else attention_dropout)
        emb_key = arch.embedding_dropout_key if arch is not None else "hidden_dropout_prob"
        if embedding_dropout is None:
            embedding_dropout = raw.get(emb_key, default) if emb_key else 0.0
        embedding_dropout = float(embedding_dropout) if int(k) == L and emb_key else 0.0
        if train_embeddings and int(k) != L:
            raise InputError(f"train_embeddings needs every layer trained (k = {L}), got k = {k}: the embeddings "
                             f"feed layer 0, and below it the cache holds frozen layers' output")
        pre_ln = arch is not None and arch.norm == "pre"   # Tempo's in-place options are post-LN layers'
        if inplace_gelu is None:
            inplace_gelu = device.is_cuda and not pre_ln
        if inplace_layernorm is None:
            inplace_layernorm = not pre_ln
        if matmul_precision not in _MATMUL_PRECISIONS:
            raise InputError(f"matmul_precision must be one of {', '.join(map(repr, _MATMUL_PRECISIONS))}, "
                             f"got {matmul_precision!r}")
        self.matmul_precision = matmul_precision
        self.k, self.first_layer, self.num_layers = int(k), L - int(k), L
        self.device = device
        self.options = dict(hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                            inplace_gelu=bool(inplace_gelu), inplace_layernorm=bool(inplace_layernorm),
                            recompute_attention_dropout=bool(recompute_attention_dropout),
                            recompute_attention_probs=bool(recompute_attention_probs),
                            embedding_dropout=embedding_dropout, train_embeddings=bool(train_embeddings))
        self.hidden_size = encoder.config["hidden_size"]
        stack_opts = dict(self.options)   # (the C stack's name: it drops its input, whatever that is)
        stack_opts["input_dropout"] = stack_opts.pop("embedding_dropout")
        self.train_embeddings = bool(train_embeddings)
        self._stack = _C.LayerStack(encoder._core, self.first_layer, self.k, device.index, **stack_opts,
                                    matmul_precision=dict(_C.DTYPES)[matmul_precision], extra=int(extra),
                                    shared_grads=bool(shared_grads))
        self._table, self.num_params = self._stack.tensors()
        self.params = self._stack.params   # flat Tensors over the stack's memory
        self.grads = self._stack.grads

    def _views(self, flat):
        return self.device.views(flat, self._table)

    def named_parameters(self):
        """[(Hugging Face name, view)]: NumPy views on the CPU, fasttran Tensors on CUDA."""
        return self._views(self.params)

    def named_gradients(self):
        return self._views(self.grads)

    def load_state(self, tensors, what="the trained layers"):
        """Copy {name: array} (a checkpoint's layers.safetensors) into the layers' weights."""
        from .errors import CheckpointError
        for name, view in self.named_parameters():
            if name not in tensors or tuple(np.shape(tensors[name])) != tuple(view.shape):
                raise CheckpointError(f"{what} do not match this encoder ({name})")
            self.device.write(view, np.ascontiguousarray(tensors[name], np.float32))

    def _buffer(self, a, what):
        return self.device.array(a)

    def _empty(self, shape):
        """an uninitialised float32 buffer on the layers' device"""
        return self.device.empty(shape)

    def forward(self, x, lengths, training=False, seed=0, step=0, out=None, row_base=0, sq_base=0, ids=None,
                types=None):
        """out (N, C) = the layers on x (N, C): the rows of len(lengths) sequences packed one after
        another (lengths[b] rows each). training=True keeps what backward() needs (x must not change
        until then) and applies dropout with masks from (seed, step, layer, site). `out`: a buffer
        on the layers' device to write into (default: a new one). row_base, sq_base: where the batch
        starts in its global batch (rows, and the sum of n^2 of the sequences before it), so that a
        slice of a global batch draws its dropout masks (data-parallel training). With
        train_embeddings: x None and the rows' token ids and types (N each, packed as x would be;
        types None: 0) instead."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        if lengths.ndim != 1 or len(lengths) == 0:
            raise InputError("lengths must be a non-empty 1-d array of sequence lengths")
        N = int(lengths.sum())
        if self.train_embeddings != (ids is not None) or (ids is not None and x is not None):
            raise InputError("these layers train the embeddings: give the rows' token ids (x None), not x"
                             if self.train_embeddings else
                             "these layers take the embeddings' output x; token ids are for train_embeddings=True")
        tokens = {}
        if ids is not None:
            tokens["ids"] = _int32_rows(ids, N, "ids")
            tokens["types"] = None if types is None else _int32_rows(types, N, "types")
        else:
            x = self._buffer(x, "x")
        out = self._empty((N, self.hidden_size)) if out is None else out
        self._stack.forward(x, lengths, out, training=bool(training), seed=int(seed), step=int(step),
                            row_base=int(row_base), sq_base=int(sq_base), **tokens)
        # the backward reads x: keep it alive (a NumPy x for CUDA layers is a temporary device copy)
        self._saved_x = x if training else None
        return out

    def pool(self, out, cls=False, pooled=None):
        """(B, C) for the B sequences of the last forward: the mean of each one's rows of `out`
        (N, C), or its first row with cls=True; in C on the layers' device (`pooled`: a buffer to
        write into)."""
        B, N = self._last_batch()
        pooled = self._empty((B, self.hidden_size)) if pooled is None else pooled
        self._stack.pool(self._buffer(out, "out"), pooled, cls=bool(cls))
        return pooled

    def pool_backward(self, dpooled, cls=False, dout=None):
        """d out (N, C) from d pooled (B, C): pool()'s backward for the last forward's sequences."""
        B, N = self._last_batch()
        dout = self._empty((N, self.hidden_size)) if dout is None else dout
        self._stack.pool_backward(self._buffer(dpooled, "dpooled"), dout, cls=bool(cls))
        return dout

    def _last_batch(self):
        return self._stack.last_batch()

    def backward(self, d_out, want_dx=False, loss_scale=1.0):
        """Gradients of the last training forward into `grads` from d_out (N, C); returns d x when
        asked. loss_scale (float16 products' loss scaling, a power of two): the backward runs on
        d_out * loss_scale and the gradients come back divided by it; an overflow leaves
        non-finite gradients."""
        d_out = self._buffer(d_out, "d_out")
        dx = None
        if want_dx:
            dx = self.device.empty(d_out.shape)
        self._stack.backward(d_out, dx, loss_scale=float(loss_scale))
        self._saved_x = None   # the stack is done with it
        return dx

    def record_significance(self, ffn_group):
        """From the next training forward on, each backward also records first-order significance
        (fasttran.compress): per sequence, the gradient x activation of every head, FFN group of
        `ffn_group` neurons and layer's residual branch (0: stop recording)."""
        self._stack.set_significance(int(ffn_group))

    def significance(self):
        """After a backward that recorded it: (heads (B, heads), ffn (B, groups), layers (B, k)) float32
        NumPy arrays, per sequence of the batch, the layers' parts in order (see record_significance)."""
        return self._stack.significance()

    def memory_report(self, batch_size, seq_len, optimizer_states=2, **options):
        """Bytes a training step over `batch_size` sequences of `seq_len` tokens holds, by category:
        weights, gradients, optimizer state (`optimizer_states` floats per parameter: 2 for Adam
        and LAMB; the `extra` floats after the layers, a Trainer's head, counted with them), saved
        activations by kind, workspace, and the total. `options` (any of
        MEMORY_OPTIONS = True / False) report another configuration of these layers instead of this
        one (nothing is allocated), e.g. memory_report(32, 512, recompute_attention_probs=True)."""
        unknown = sorted(set(options) - set(MEMORY_OPTIONS))
        if unknown:
            raise InputError(f"unknown memory option(s) {unknown}; known: {list(MEMORY_OPTIONS)}")
        m = self._stack.memory(int(batch_size), int(seq_len), **{k: int(bool(v)) for k, v in options.items()})
        m["optimizer_state"] = optimizer_states * m["weights"]
        m["total"] = (m["weights"] + m["gradients"] + m["optimizer_state"] + sum(m["activations"].values()) +
                      m["workspace"])
        return m

    def largest_batch(self, seq_len, budget_bytes, optimizer_states=2, **options):
        """The largest batch of `seq_len`-token sequences whose training step fits `budget_bytes`
        (under this stack's options, or those given: see memory_report)."""
        lo, hi = 0, 1
        while self.memory_report(hi, seq_len, optimizer_states, **options)["total"] <= budget_bytes:
            lo, hi = hi, hi * 2
            if hi > 1 << 24:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.memory_report(mid, seq_len, optimizer_states, **options)["total"] <= budget_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    def allocated(self):
        """(bytes the stack holds now, its peak)"""
        return self._stack.allocated()

    def export_to(self, encoder):
        """Write the trained weights into `encoder`'s layers [L - k, L) (same configuration)."""
        self._stack.export(encoder._core)

    def __repr__(self):
        opts = ", ".join(k for k in MEMORY_OPTIONS if self.options[k])
        return (f"TopLayers(layers {self.first_layer}..{self.num_layers - 1} of {self.num_layers}, "
                f"{self.num_params / 1e6:.1f}M params, {self.device}, dropout {self.options['hidden_dropout']}/"
                f"{self.options['attention_dropout']}"
                + (f" (embeddings' {self.options['embedding_dropout']})" if self.options['embedding_dropout'] else "")
                + (", embeddings trained" if self.train_embeddings else "")
                + f", tempo: {opts or 'off'}"
                + (f", {self.matmul_precision} products" if self.matmul_precision != "float32" else "") + ")")
