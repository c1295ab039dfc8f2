"""Layout and index of an activation cache: what each example keeps (its real tokens, for
recomputing it), the build plan (examples sorted by length, cut into batches: one shard per
batch), how many rows and bytes a shard takes, and the fingerprints of inputs and model."""
import hashlib
import json

import numpy as np

from .. import _C
from ..errors import InputError

POSITIONS = ("cls", "mean", "all")
CODECS = dict(_C.CACHE_CODECS)   # name -> (ft_dtype code, NumPy storage dtype, scaled), from the C codec list


def codec_code(name):
    return CODECS[name][0]


def storage_dtype(name):
    """NumPy dtype a codec's values are stored as (float16 and bfloat16 both as uint16)."""
    return np.dtype(CODECS[name][1])


def row_bytes(codec, hidden):
    """Stored bytes of one row: the values, plus a scaled codec's (int8's) float32 scale."""
    return hidden * storage_dtype(codec).itemsize + (4 if CODECS[codec][2] else 0)


def parse_inputs(input_ids, attention_mask, token_type_ids):
    """Right-padded (examples, seq) inputs -> (tokens, types, offsets, lengths): every example's
    real tokens one after another (int32), offsets (N + 1) and lengths (N) int64."""
    from ..encoder import _as_index_array
    ids = _as_index_array(input_ids, "input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(f"input_ids must be a non-empty 2-D (examples, seq) array, got shape {getattr(ids, 'shape', None)}")
    mask = _as_index_array(attention_mask, "attention_mask")
    types = _as_index_array(token_type_ids, "token_type_ids")
    N, T = ids.shape
    for name, a in (("attention_mask", mask), ("token_type_ids", types)):
        if a is not None and a.shape != ids.shape:
            raise InputError(f"{name} has shape {a.shape} but input_ids has shape {ids.shape}")
    m = np.ones((N, T), bool) if mask is None else np.asarray(mask) != 0
    if mask is not None and not np.isin(np.asarray(mask), (0, 1)).all():
        raise InputError("attention_mask must hold only 0 and 1")
    lengths = np.where(m.any(1), T - np.argmax(m[:, ::-1], axis=1), 0).astype(np.int64)
    if (m.sum(1) != lengths).any():
        bad = int(np.flatnonzero(m.sum(1) != lengths)[0])
        raise InputError(f"attention_mask row {bad} is not right-padded (ones, then zeros); the cache needs right padding")
    keep = np.arange(T)[None, :] < lengths[:, None]
    tokens = np.ascontiguousarray(np.asarray(ids)[keep], np.int32)
    tys = (np.zeros_like(tokens) if types is None else np.ascontiguousarray(np.asarray(types)[keep], np.int32))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return tokens, tys, offsets, lengths


def input_fingerprints(tokens, types, offsets):
    """(N,) uint64: CRC-32C of each example's token ids and type ids (csrc/cache/codec.c)."""
    return _C.input_fingerprints(tokens=tokens, types=types, offsets=offsets)


def model_fingerprint(encoder):
    """sha256 of the encoder's config and every weight (cached on the encoder object)."""
    fp = getattr(encoder, "_ft_fingerprint", None)
    if fp is None:
        h = hashlib.sha256(json.dumps(encoder.config, sort_keys=True).encode())
        for name, w in sorted(encoder.state_dict().items()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(w, np.float32).tobytes())
        fp = encoder._ft_fingerprint = h.hexdigest()
    return fp


def rows_of(lengths, positions, idx):
    """Rows each example of idx takes: its length (positions="all") or 1 (pooled)."""
    return lengths[idx] if positions == "all" else np.ones(len(idx), np.int64)


class Plan:
    """The build plan: examples sorted by length (stable), cut into batches of batch_size over
    *all* examples; batch b is shard b. pad_to[i] is the length example i's batch is padded to
    (its longest, at least 1). The examples cached are those with index < n_cached."""

    def __init__(self, lengths, batch_size):
        N = len(lengths)
        self.batch_size = batch_size
        self.order = np.argsort(lengths, kind="stable")
        self.n_batches = (N + batch_size - 1) // batch_size
        starts = np.arange(0, N, batch_size)
        longest = np.maximum(np.maximum.reduceat(lengths[self.order], starts), 1)
        self.batch_of = np.empty(N, np.int64)
        self.batch_of[self.order] = np.arange(N) // batch_size
        self.pad_to = longest[self.batch_of].astype(np.int64)

    def examples(self, b):
        return self.order[b * self.batch_size:(b + 1) * self.batch_size]

    def shard_examples(self, b, n_cached):
        """The examples shard b holds (in its row order) when the first n_cached are cached."""
        idx = self.examples(b)
        return idx[idx < n_cached]
