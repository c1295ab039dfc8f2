"""ActivationCache: outputs of frozen layers computed once, read every epoch.

Storage is a list of *shards*, one per build batch (examples sorted by length, so a shard holds
similar lengths). A shard holds, per example, its rows (1 pooled vector, or one row per real
token with positions="all": ragged, no padding) encoded with the cache codec (csrc/cache/codec.c).
Shards live in a tier: "host" (memory) or "disk" (a memory-mapped file). With disk_dir, every
shard is also a checksummed file there, written atomically, and manifest.json lists the
completed ones: the cache reopens in another process, and a build that was killed resumes.

Reading a batch is one C gather over row addresses in whatever tiers hold them. Examples not
cached (max_fraction < 1, or over budget) are recomputed through the encoder padded exactly as
the build would have padded them, so partial and full caches return identical batches.
"""
import hashlib
import json
import os
import queue
import struct
import threading
import time

import numpy as np

from . import _C
from .errors import (CacheCorruptError, CacheMismatchError, FastTranIOError, InputError, InputRangeError,
                     InputTypeError, UnsupportedError)

FORMAT = "fasttran-activation-cache"
VERSION = 1
_MAGIC = b"FTCACHE1"
_CODEC_DTYPE = {"float32": np.float32, "float16": np.uint16, "bfloat16": np.uint16, "int8": np.int8}
_POSITIONS = ("cls", "mean", "all")


# ---- files: atomic writes, checksummed array containers -----------------------------------------

def _fsync_dir(d):
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path, chunks):
    """Write byte chunks to `path` via a temp file + fsync + rename; returns (bytes, crc32c)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    crc, size = 0, 0
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                mv = memoryview(c).cast("B")
                f.write(mv)
                crc = _C.crc32c(mv, crc)
                size += len(mv)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise FastTranIOError(e.errno, f"cannot write {path}: {os.strerror(e.errno or 0) or e}") from e
    return size, crc


def _pack_arrays(arrays, meta):
    """MAGIC, u64 header length, JSON header, then each array 64-byte aligned."""
    entries, off = {}, 0
    blobs = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        off = (off + 63) & ~63
        entries[name] = [a.dtype.str, list(a.shape), off, a.nbytes]
        blobs.append((off, a))
        off += a.nbytes
    head = json.dumps({"arrays": entries, "meta": meta}).encode()
    hlen = (len(_MAGIC) + 8 + len(head) + 63) & ~63
    head = head + b" " * (hlen - len(_MAGIC) - 8 - len(head))
    out = [_MAGIC, struct.pack("<Q", len(head)), head]
    pos = 0
    for o, a in blobs:
        if o > pos:
            out.append(b"\0" * (o - pos))
        out.append(a.reshape(-1).view(np.uint8) if a.nbytes else b"")
        pos = o + a.nbytes
    return out


def _open_arrays(path, expect_bytes, expect_crc=None):
    """Memory-map a container; checks size (truncation), header, bounds; with expect_crc the
    whole file's checksum. Returns ({name: array view}, meta)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        raise CacheCorruptError(f"cache file {path} is missing") from None
    if size != expect_bytes:
        raise CacheCorruptError(f"cache file {path} has {size} bytes, the manifest says {expect_bytes} (truncated or replaced)")
    mm = np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)
    if expect_crc is not None and _C.crc32c(mm) != expect_crc:
        raise CacheCorruptError(f"cache file {path} fails its checksum: the data was altered or damaged")
    try:
        if bytes(mm[:8]) != _MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack("<Q", bytes(mm[8:16]))
        head = json.loads(bytes(mm[16:16 + hlen]))
        base = 16 + hlen
        out = {}
        for name, (dt, shape, off, nbytes) in head["arrays"].items():
            dt = np.dtype(dt)
            if off < 0 or base + off + nbytes > size or int(np.prod(shape)) * dt.itemsize != nbytes:
                raise ValueError(f"array {name} out of bounds")
            out[name] = mm[base + off: base + off + nbytes].view(dt).reshape(shape)
        return out, head["meta"]
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CacheCorruptError(f"cache file {path} is not a valid fasttran cache file ({e})") from None


def _manifest_write(d, man):
    body = dict(man)
    body.pop("checksum", None)
    text = json.dumps(body, sort_keys=True)
    body["checksum"] = _C.crc32c(text.encode())
    _atomic_write(os.path.join(d, "manifest.json"), [json.dumps(body, sort_keys=True, indent=1).encode()])


def _manifest_read(d):
    p = os.path.join(d, "manifest.json")
    try:
        with open(p, "rb") as f:
            man = json.loads(f.read())
    except FileNotFoundError:
        from .errors import CacheNotFoundError
        what = "does not exist" if not os.path.exists(d) else "is not an activation cache (no manifest.json)"
        raise CacheNotFoundError(2, f"{d} {what}: build one with ActivationCache.build(..., disk_dir={d!r}) "
                                    "or `fasttran cache --output DIR`") from None
    except ValueError as e:
        raise CacheCorruptError(f"{p} is damaged: {e}") from None
    want = man.pop("checksum", None)
    if not isinstance(man, dict) or want != _C.crc32c(json.dumps(man, sort_keys=True).encode()):
        raise CacheCorruptError(f"{p} fails its checksum: edited or damaged")
    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise CacheCorruptError(f"{p}: not a version-{VERSION} {FORMAT} manifest")
    return man


# ---- fingerprints --------------------------------------------------------------------------------

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


def _input_fingerprints(tokens, types, offsets):
    fps = np.empty(len(offsets) - 1, np.uint64)
    for i in range(len(fps)):
        a, b = offsets[i], offsets[i + 1]
        fps[i] = (_C.crc32c(tokens[a:b], 0x9E37) << 32) | _C.crc32c(types[a:b], int(b - a))
    return fps


# ---- the cache -----------------------------------------------------------------------------------

class _Shard:
    __slots__ = ("file", "bytes", "crc", "nbytes", "tier", "values", "scales", "examples", "row_start", "row_len",
                 "verified", "row_base")


class ActivationCache:
    """Frozen-layer outputs keyed by example id. Build with :meth:`build`, reopen with
    :meth:`open`; read with :meth:`get` or :meth:`batches`."""

    # ---- construction ------------------------------------------------------------------------
    def __init__(self):
        raise TypeError("use ActivationCache.build(...) or ActivationCache.open(path)")

    @classmethod
    def _blank(cls):
        self = object.__new__(cls)
        self._shards = []
        self._tier_bytes = {}
        self._tables = None
        self._unverified = 0
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self.encoder = None
        self.path = None
        return self

    @staticmethod
    def _inputs(input_ids, attention_mask, token_type_ids):
        from .encoder import _as_index_array
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
        tokens = np.asarray(ids)[keep].astype(np.int32)
        tys = (np.zeros_like(tokens) if types is None else np.asarray(types)[keep].astype(np.int32))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return tokens, tys, offsets, lengths

    @classmethod
    def build(cls, encoder, input_ids, attention_mask=None, token_type_ids=None, example_ids=None, layer=-1,
              positions="cls", dtype="float32", batch_size=64, device_bytes=None, host_bytes=None,
              disk_dir=None, max_fraction=1.0, show_progress=None, rebuild=False):
        """Run `encoder` over the examples (sorted by length, in batches) and store, per
        example, the pooled vector ("cls"/"mean") or every real token's state ("all") of
        `layer` (0..L, negatives from the end), encoded as float32/float16/bfloat16/int8.

        Tiers fill in order under the budgets: host memory (`host_bytes`, None = no limit),
        then disk (`disk_dir`); what fits nowhere, and examples beyond `max_fraction`, are
        recomputed when read. With `disk_dir` the cache persists there and a killed build
        resumes; a directory holding another model's or other inputs' cache is refused unless
        `rebuild=True`."""
        self = cls._blank()
        if positions not in _POSITIONS:
            raise InputError(f"positions must be one of {_POSITIONS}, got {positions!r}")
        if dtype not in _CODEC_DTYPE:
            raise InputError(f"dtype must be one of {tuple(_CODEC_DTYPE)}, got {dtype!r}")
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
        for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
            if v is not None and (not isinstance(v, (int, np.integer)) or v < 0):
                raise InputError(f"{name} must be None or a byte count >= 0, got {v!r}")
        if not (isinstance(max_fraction, (int, float)) and 0.0 <= max_fraction <= 1.0):
            raise InputError(f"max_fraction must be in [0, 1], got {max_fraction!r}")
        if device_bytes:
            if encoder.device == "cpu":
                raise InputError("device_bytes needs an encoder on a CUDA device; this one runs on the CPU")
            raise UnsupportedError("the device-memory tier is not available in this version; use host_bytes/disk_dir")
        L = encoder.num_layers
        if not isinstance(layer, (int, np.integer)) or not -(L + 1) <= layer <= L:
            raise InputError(f"layer must be an int in 0..{L} (or -1..-{L + 1}), got {layer!r}")
        tokens, types, offsets, lengths = cls._inputs(input_ids, attention_mask, token_type_ids)
        N = len(lengths)
        if example_ids is None:
            ex = np.arange(N, dtype=np.int64)
        else:
            ex = np.asarray(example_ids)
            if ex.shape != (N,) or ex.dtype.kind not in "iu":
                raise InputError(f"example_ids must be {N} integers (one per row of input_ids), got shape {ex.shape} dtype {ex.dtype}")
            ex = ex.astype(np.int64)
            u, c = np.unique(ex, return_counts=True)
            if (c > 1).any():
                raise InputError(f"duplicate example id {int(u[c > 1][0])} ({int((c > 1).sum())} duplicated ids)")
        self.encoder = encoder
        self.layer = int(layer) % (L + 1)
        self.positions, self.dtype, self.batch_size = positions, dtype, int(batch_size)
        self.hidden = encoder.hidden_size
        self.example_ids = ex
        self._tokens, self._types, self._offsets, self._lengths = tokens, types, offsets, lengths
        self._fps = _input_fingerprints(tokens, types, offsets)
        self._plan()
        n_cached = int(np.floor(max_fraction * N + 1e-9))
        self.max_fraction = float(max_fraction)
        self.host_bytes = host_bytes
        self._n_cached_planned = n_cached
        self._err = [0.0, 0.0, 0.0]
        self._build_seconds = 0.0
        manifest = None
        if disk_dir is not None:
            self.path = os.path.abspath(os.fspath(disk_dir))
            try:
                os.makedirs(self.path, exist_ok=True)
                probe = os.path.join(self.path, f".write-test.{os.getpid()}")
                with open(probe, "wb"):
                    pass
                os.unlink(probe)
            except OSError as e:
                raise FastTranIOError(e.errno, f"disk_dir {self.path} is not writable: {e.strerror}") from None
            if os.path.exists(os.path.join(self.path, "manifest.json")):
                old = _manifest_read(self.path)
                problem = self._compare(old, model_fingerprint(encoder))
                if problem and not rebuild:
                    raise CacheMismatchError(f"{self.path} holds a different cache: {problem}; "
                                             "pass rebuild=True to replace it, or use another disk_dir")
                manifest = None if problem else old
            if manifest is None:
                self._write_index()
                manifest = self._new_manifest(model_fingerprint(encoder))
                _manifest_write(self.path, manifest)
            else:
                self._err = manifest["error"]
                self._build_seconds = manifest["build_seconds"]
            self._manifest = manifest
        self._load_shards(manifest["shards"] if manifest else [])
        self._run_build(n_cached, show_progress)
        return self

    @classmethod
    def uncached(cls, encoder, input_ids, attention_mask=None, token_type_ids=None, example_ids=None, layer=-1,
                 positions="cls", batch_size=64):
        """The no-cache baseline behind the same interface: nothing is stored, every get()
        runs the encoder on that batch (build(..., max_fraction=0))."""
        return cls.build(encoder, input_ids, attention_mask, token_type_ids, example_ids=example_ids, layer=layer,
                         positions=positions, batch_size=batch_size, max_fraction=0.0, show_progress=False)

    def _plan(self):
        """Length-sorted batches over all examples (the build order: little padding); pad_to[i]
        = the length example i's build batch is padded to."""
        order = np.argsort(self._lengths, kind="stable")
        self._order = order
        nb = (len(order) + self.batch_size - 1) // self.batch_size
        self._pad_to = np.zeros(len(order), np.int64)
        self._batch_of = np.zeros(len(order), np.int64)
        for b in range(nb):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            self._pad_to[idx] = max(1, int(self._lengths[idx].max()))
            self._batch_of[idx] = b
        self._n_plan_batches = nb
        self._sorted_ids = np.argsort(self.example_ids, kind="stable")
        self._loc = np.full(len(order), -1, np.int64)        # shard of each example, -1 = not cached
        self._row = np.zeros(len(order), np.int64)           # row within its shard

    def _settings(self):
        return {"layer": self.layer, "positions": self.positions, "dtype": self.dtype,
                "batch_size": self.batch_size, "hidden": self.hidden, "examples": int(len(self._lengths)),
                "max_fraction": self.max_fraction}

    def _compare(self, man, model_fp):
        if man["model"] != model_fp:
            return "it was built with another model (weights or config differ)"
        for k, v in self._settings().items():
            if man["settings"].get(k) != v:
                return f"{k} is {man['settings'].get(k)!r} there, {v!r} here"
        idx, _ = _open_arrays(os.path.join(self.path, "index.bin"), man["index"]["bytes"], man["index"]["crc32c"])
        if not np.array_equal(idx["example_ids"], self.example_ids):
            return "its example ids differ"
        diff = np.flatnonzero(idx["fingerprints"] != self._fps)
        if len(diff):
            return f"the inputs of {len(diff)} examples differ (first: id {int(self.example_ids[diff[0]])})"
        return None

    def _write_index(self):
        arrays = {"example_ids": self.example_ids, "fingerprints": self._fps, "tokens": self._tokens,
                  "types": self._types, "offsets": self._offsets}
        self._index_file = _atomic_write(os.path.join(self.path, "index.bin"), _pack_arrays(arrays, {}))

    def _new_manifest(self, model_fp):
        size, crc = self._index_file
        return {"format": FORMAT, "version": VERSION, "model": model_fp, "config": self.encoder.config,
                "settings": self._settings(), "index": {"bytes": size, "crc32c": crc}, "shards": [],
                "complete": False, "error": [0.0, 0.0, 0.0], "build_seconds": 0.0}

    # ---- shards ----------------------------------------------------------------------------
    def _shard_bytes(self, rows):
        return rows * self.hidden * np.dtype(_CODEC_DTYPE[self.dtype]).itemsize + (rows * 4 if self.dtype == "int8" else 0)

    def _used(self, tier):
        return self._tier_bytes.get(tier, 0)

    def _add_shard(self, examples, values, scales, file_info=None):
        s = _Shard()
        s.examples = examples
        s.row_len = self._rows_of(examples)
        s.row_start = np.concatenate([[0], np.cumsum(s.row_len)[:-1]]).astype(np.int64)
        s.values, s.scales = values, scales
        s.file, s.bytes, s.crc = (file_info or (None, 0, None))
        s.nbytes = self._shard_bytes(len(values))   # data bytes: what budgets and stats count
        s.verified = True
        fits_host = self.host_bytes is None or self._used("host") + s.nbytes <= self.host_bytes
        if fits_host:
            s.tier = "host"
            if isinstance(values, np.memmap):   # reopened: bring it into memory
                s.values = np.array(values)
                s.scales = None if scales is None else np.array(scales)
        elif s.file is not None:
            s.tier = "disk"
            if not isinstance(values, np.memmap):   # just built: serve it from the file, free the memory
                arrs, _ = _open_arrays(os.path.join(self.path, s.file), s.bytes)
                s.values, s.scales = arrs["values"], arrs.get("scales")
        else:
            return None   # fits nowhere: these examples are recomputed when read
        k = len(self._shards)
        self._shards.append(s)
        self._tier_bytes[s.tier] = self._used(s.tier) + s.nbytes
        self._tables = None
        self._loc[examples] = k
        self._row[examples] = s.row_start
        return s

    def _rows_of(self, examples):
        return self._lengths[examples] if self.positions == "all" else np.ones(len(examples), np.int64)

    def _load_shards(self, entries):
        for e in entries:
            path = os.path.join(self.path, e["file"])
            to_host = self.host_bytes is None or self._used("host") + self._shard_bytes(e["rows"]) <= self.host_bytes
            # a shard copied into memory is checked now; one served from disk before its first read
            arrs, _ = _open_arrays(path, e["bytes"], e["crc32c"] if to_host else None)
            s = self._add_shard(np.asarray(arrs["examples"]), arrs["values"], arrs.get("scales"),
                                (e["file"], e["bytes"], e["crc32c"]))
            if s is not None and s.tier == "disk":
                s.verified = False
                self._unverified += 1

    def _encode_batch(self, idx):
        """Run the encoder on examples idx, padded to the longest of them; returns float32 rows
        (pooled, or real tokens only)."""
        T = max(1, int(self._lengths[idx].max()))
        B = len(idx)
        ids = np.zeros((B, T), np.int32)
        tys = np.zeros((B, T), np.int32)
        mask = np.zeros((B, T), np.int32)
        for j, i in enumerate(idx):
            a, b = self._offsets[i], self._offsets[i + 1]
            ids[j, :b - a] = self._tokens[a:b]
            tys[j, :b - a] = self._types[a:b]
            mask[j, :b - a] = 1
        if self.positions == "all":
            h = self.encoder.forward(ids, mask, tys, output_layers=self.layer)
            return h[mask.astype(bool)]
        return self.encoder.forward(ids, mask, tys, output_layers=self.layer, pooling=self.positions)

    def _encode_rows(self, rows):
        vals = np.empty(rows.shape, _CODEC_DTYPE[self.dtype])
        sc = np.empty(len(rows), np.float32) if self.dtype == "int8" else None
        err = _C.cache_encode(np.ascontiguousarray(rows, np.float32), self.dtype, vals, sc)
        return vals, sc, err

    def _run_build(self, n_cached, show_progress):
        cached = np.zeros(len(self._lengths), bool)
        cached[:n_cached] = True
        done = self._loc >= 0
        # shards already on disk (a resumed build) are done, whatever tier they went to
        done_files = set(e["file"] for e in self._manifest["shards"]) if self.path is not None else set()
        todo = []
        for b in range(self._n_plan_batches):
            idx = self._order[b * self.batch_size:(b + 1) * self.batch_size]
            idx = idx[cached[idx]]
            if len(idx) and f"shard-{b:06d}.bin" not in done_files and not done[idx].all():
                todo.append((b, idx))
        if not todo:
            self._finish()
            return
        it = todo
        if show_progress is not False:   # None: a bar for any build that lasts over 2 s
            from ._progress import progress
            it = progress(todo, desc="build cache", unit="batch", delay=0 if show_progress else 2.0)
        t0 = time.perf_counter()
        for b, idx in it:
            rows = self._encode_batch(idx)
            vals, sc, err = self._encode_rows(rows)
            self._err = [max(self._err[0], err[0]), self._err[1] + err[1], self._err[2] + err[2]]
            info = None
            if self.path is not None:
                name = f"shard-{b:06d}.bin"
                arrays = {"examples": idx.astype(np.int64), "values": vals}
                if sc is not None:
                    arrays["scales"] = sc
                size, crc = _atomic_write(os.path.join(self.path, name), _pack_arrays(arrays, {"batch": b}))
                info = (name, size, crc)
                self._manifest["shards"].append({"file": name, "bytes": size, "crc32c": crc, "rows": len(vals)})
                self._manifest["error"] = self._err
                self._manifest["build_seconds"] = self._build_seconds + time.perf_counter() - t0
                _manifest_write(self.path, self._manifest)
            self._add_shard(idx, vals, sc, info)
        self._build_seconds += time.perf_counter() - t0
        self._finish()

    def _finish(self):
        if self.path is not None and not self._manifest["complete"]:
            self._manifest["complete"] = True
            self._manifest["build_seconds"] = self._build_seconds
            _manifest_write(self.path, self._manifest)

    @classmethod
    def open(cls, path, encoder=None, input_ids=None, attention_mask=None, token_type_ids=None, host_bytes=None):
        """Reopen a cache directory. With `encoder`, refuses a cache built with another model
        and recomputes uncached examples; with inputs, refuses a cache of other inputs.
        Shards are checked against the manifest's sizes now and checksums before first use."""
        self = cls._blank()
        self.path = os.path.abspath(os.fspath(path))
        man = _manifest_read(self.path)
        st = man["settings"]
        idx, _ = _open_arrays(os.path.join(self.path, "index.bin"), man["index"]["bytes"], man["index"]["crc32c"])
        self.layer, self.positions, self.dtype = st["layer"], st["positions"], st["dtype"]
        self.batch_size, self.hidden, self.max_fraction = st["batch_size"], st["hidden"], st["max_fraction"]
        self.example_ids = np.array(idx["example_ids"])
        self._fps = np.array(idx["fingerprints"])
        self._tokens, self._types, self._offsets = np.array(idx["tokens"]), np.array(idx["types"]), np.array(idx["offsets"])
        self._lengths = np.diff(self._offsets)
        self.host_bytes = host_bytes
        self._manifest = man
        self._err, self._build_seconds = man["error"], man["build_seconds"]
        self._n_cached_planned = int(np.floor(self.max_fraction * len(self._lengths) + 1e-9))
        if encoder is not None:
            if model_fingerprint(encoder) != man["model"]:
                raise CacheMismatchError(f"{self.path} was built with another model (weights or config differ)")
            self.encoder = encoder
        if input_ids is not None:
            tokens, types, offsets, _ = cls._inputs(input_ids, attention_mask, token_type_ids)
            fps = _input_fingerprints(tokens, types, offsets)
            if len(fps) != len(self._fps) or (fps != self._fps).any():
                raise CacheMismatchError(f"{self.path} was built from other inputs")
        missing = [e["file"] for e in man["shards"] if not os.path.exists(os.path.join(self.path, e["file"]))]
        if missing:
            raise CacheCorruptError(f"{self.path}: {len(missing)} shard file(s) are missing, e.g. {missing[0]}")
        self._plan()
        self._load_shards(man["shards"])
        return self

    # ---- reading ---------------------------------------------------------------------------
    def _index_of(self, example_ids):
        q = np.asarray(example_ids)
        if q.ndim != 1 or (q.size and q.dtype.kind not in "iu"):
            raise InputError(f"example_ids must be a 1-D sequence of ints, got shape {q.shape} dtype {q.dtype}")
        q = q.astype(np.int64)
        sid = self.example_ids[self._sorted_ids]
        pos = np.searchsorted(sid, q)
        pos = np.minimum(pos, len(sid) - 1)
        bad = sid[pos] != q
        if bad.any():
            raise InputRangeError(f"unknown example id {int(q[bad][0])} ({int(bad.sum())} unknown in this request)")
        return self._sorted_ids[pos]

    def _address_tables(self):
        """(values base address per shard, all int8 scales concatenated, offset per shard);
        rebuilt when shards change."""
        if self._tables is None:
            bases = np.array([s.values.ctypes.data for s in self._shards] or [0], np.uint64)
            if self.dtype == "int8" and self._shards:
                flat = np.concatenate([np.asarray(s.scales, np.float32) for s in self._shards])
                off = np.concatenate([[0], np.cumsum([len(s.values) for s in self._shards])[:-1]]).astype(np.int64)
            else:
                flat, off = np.zeros(1, np.float32), np.zeros(max(1, len(self._shards)), np.int64)
            self._tables = (bases, flat, off)
        return self._tables

    def _verify(self, shard):
        if not shard.verified:
            with self._lock:
                if not shard.verified:
                    _open_arrays(os.path.join(self.path, shard.file), shard.bytes, shard.crc)
                    shard.verified = True
                    self._unverified -= 1

    def get(self, example_ids, output="numpy", ragged=False):
        """A batch for `example_ids`: pooled caches give (batch, hidden); positions="all" gives
        (values (batch, longest, hidden), attention_mask (batch, longest)), or with
        ragged=True (values (total_tokens, hidden), offsets (batch + 1)). float32 NumPy, or
        fasttran.Tensor with output="device"."""
        if output not in ("numpy", "device"):
            raise InputError(f"output must be 'numpy' or 'device', got {output!r}")
        idx = self._index_of(example_ids)
        C = self.hidden
        rows = self._rows_of(idx)
        loc = self._loc[idx]
        hit = loc >= 0
        with self._lock:
            self._hits += int(hit.sum())
            self._misses += int((~hit).sum())
        # row addresses: shard values base + row * row_bytes (vectorised over the batch)
        rb = C * np.dtype(_CODEC_DTYPE[self.dtype]).itemsize
        bases, flat_scales, scale_off = self._address_tables()
        if self._unverified:
            for k in np.unique(loc[hit]):
                self._verify(self._shards[k])
        safe_loc = np.maximum(loc, 0)
        base = np.where(hit, bases[safe_loc], np.uint64(0))
        miss_vals = self._recompute(idx[~hit]) if (~hit).any() else None
        if self.positions == "all" and not ragged:
            T = int(rows.max()) if len(rows) else 0
            t = np.arange(T)[None, :]
            valid = t < rows[:, None]
            first = self._row[idx][:, None] + t
            use = valid & hit[:, None]
            ptr = np.where(use, base[:, None] + first.astype(np.uint64) * np.uint64(rb), np.uint64(0))
            srow = scale_off[safe_loc][:, None] + first
        else:
            valid = None
            if self.positions == "all":
                rep = np.repeat(np.arange(len(idx)), rows)
                first = self._row[idx][rep] + (np.arange(len(rep)) - np.repeat(np.cumsum(rows) - rows, rows))
            else:
                rep = np.arange(len(idx))
                first = self._row[idx]
            use = hit[rep]
            ptr = np.where(use, base[rep] + first.astype(np.uint64) * np.uint64(rb), np.uint64(0))
            srow = scale_off[safe_loc][rep] + first
        ptr = np.ascontiguousarray(ptr.reshape(-1), np.uint64)
        out_rows = len(ptr)
        sc = None
        if self.dtype == "int8":
            sc = np.where(use.reshape(-1), flat_scales[np.where(use, srow, 0).reshape(-1)], 0).astype(np.float32)
        out = np.empty((out_rows, C), np.float32)
        _C.cache_gather(out, ptr, sc if sc is not None else np.zeros(0, np.float32), self.dtype)
        # recomputed misses fill their places
        if miss_vals is not None:
            mi = np.flatnonzero(~hit)
            if valid is not None:
                out3 = out.reshape(len(idx), -1, C)
                for j, (i, v) in enumerate(zip(mi, miss_vals)):
                    out3[i, :len(v)] = v
            else:
                starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
                for i, v in zip(mi, miss_vals):
                    out[starts[i]:starts[i] + len(v)] = v
        wrap = (lambda a: _C.Tensor.from_dlpack(a)) if output == "device" else (lambda a: a)
        if self.positions != "all":
            return wrap(out)
        if ragged:
            return wrap(out), np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        return wrap(out.reshape(len(idx), -1, C)), valid.astype(np.int64)

    def _recompute(self, idx):
        """Values of uncached examples through the encoder and the codec, so they equal what the
        cache would have stored: the CPU encoder gives every example the same bits whatever
        batch it is in and whatever length that batch is padded to (tested), so misses run as
        ordinary batches padded to their longest. With max_fraction=0 this is the encoder in
        the loop: the no-cache baseline."""
        if self.encoder is None:
            raise InputError(f"example id {int(self.example_ids[idx[0]])} is not cached and this cache has no "
                             "encoder to compute it: open it with ActivationCache.open(path, encoder=...)")
        out = [None] * len(idx)
        for a in range(0, len(idx), self.batch_size):
            part = np.arange(a, min(a + self.batch_size, len(idx)))
            rows = self._encode_batch(idx[part])
            if self.dtype == "float32":
                dec = rows
            else:
                vals, sc, _ = self._encode_rows(rows)
                dec = np.empty(rows.shape, np.float32)
                rb = vals.strides[0]
                ptr = (np.uint64(vals.ctypes.data) + np.arange(len(vals), dtype=np.uint64) * np.uint64(rb))
                _C.cache_gather(dec, ptr, sc if sc is not None else np.zeros(0, np.float32), self.dtype)
            r = self._rows_of(idx[part])
            starts = np.concatenate([[0], np.cumsum(r)])
            for j, p in enumerate(part):
                out[p] = dec[starts[j]:starts[j + 1]]
        return out

    def batches(self, batch_size, shuffle=True, seed=None, drop_last=False, sampling="random", chunk_bytes=None,
                passes_per_chunk=1, prefetch=2, output="numpy", ragged=False, start=0):
        """Iterate one epoch: yields (example_ids, batch) with batch as from :meth:`get`. The
        next batches are prepared on a background thread while the caller computes.
        sampling="chunked" (FastTran's improved sampling): examples are grouped into chunks of
        at most `chunk_bytes` in storage order; chunks come in random order and each is
        shuffled and read `passes_per_chunk` times before moving on. `start` skips the first
        batches of the epoch (resuming an interrupted one: the order depends only on `seed`)."""
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
        if sampling not in ("random", "chunked"):
            raise InputError(f"sampling must be 'random' or 'chunked', got {sampling!r}")
        if not isinstance(passes_per_chunk, int) or passes_per_chunk < 1:
            raise InputError(f"passes_per_chunk must be an int >= 1, got {passes_per_chunk!r}")
        skip = int(start)
        if skip < 0:
            raise InputError(f"start must be >= 0, got {start!r}")
        rng = np.random.default_rng(seed)
        N = len(self.example_ids)
        if sampling == "random":
            order = rng.permutation(N) if shuffle else np.arange(N)
            groups = [order]
        else:
            storage = self._order   # plan order = shard order
            per = self._shard_bytes(1) * np.maximum(self._rows_of(storage), 1)
            limit = chunk_bytes or (self.host_bytes or 256 << 20)
            groups, start, acc = [], 0, 0
            for k, b in enumerate(per):
                if acc + b > limit and k > start:
                    groups.append(storage[start:k])
                    start, acc = k, 0
                acc += b
            groups.append(storage[start:])
            if shuffle:
                groups = [groups[i] for i in rng.permutation(len(groups))]
            groups = [np.concatenate([rng.permutation(g) if shuffle else g for _ in range(passes_per_chunk)])
                      for g in groups]
        order = np.concatenate(groups)
        steps = [order[a:a + batch_size] for a in range(0, len(order), batch_size)]
        if drop_last and steps and len(steps[-1]) < batch_size:
            steps.pop()
        return _Prefetcher(self, steps[skip:], prefetch, output, ragged)

    # ---- information -------------------------------------------------------------------------
    def __len__(self):
        return len(self.example_ids)

    @property
    def model_fingerprint(self):
        """sha256 of the config and weights of the encoder that computed these features (from
        the manifest of a persistent cache, else from the encoder)."""
        man = getattr(self, "_manifest", None)
        if man:
            return man["model"]
        return model_fingerprint(self.encoder) if self.encoder is not None else None

    @property
    def fingerprint(self):
        """What the features are: a hash of the model fingerprint, the layer and the positions
        (not the storage dtype). Two caches with the same fingerprint hold features a head
        trained on one can be applied to."""
        m = self.model_fingerprint
        if m is None:
            return None
        return hashlib.sha256(f"{m}|layer={self.layer}|positions={self.positions}".encode()).hexdigest()[:32]

    def stats(self):
        """Bytes and entries per tier, hit rate so far, build time, and the measured error of
        the stored values against float32 (max abs, and ||err|| / ||ref||)."""
        tiers = {}
        for t in ("device", "host", "disk"):
            sh = [s for s in self._shards if s.tier == t]
            tiers[t] = {"bytes": int(sum(s.nbytes for s in sh)), "entries": int(sum(len(s.examples) for s in sh))}
        cached = int((self._loc >= 0).sum())
        tiers["uncached"] = {"bytes": 0, "entries": len(self.example_ids) - cached}
        total = self._hits + self._misses
        rows = int(self._lengths.sum()) if self.positions == "all" else len(self._lengths)
        return {"examples": len(self.example_ids), "cached": cached, "tiers": tiers,
                "hit_rate": self._hits / total if total else None, "hits": self._hits, "misses": self._misses,
                "build_seconds": self._build_seconds, "dtype": self.dtype, "positions": self.positions,
                "layer": self.layer, "rows": rows,
                "error": {"max_abs": self._err[0],
                          "relative": (self._err[1] / self._err[2]) ** 0.5 if self._err[2] else 0.0},
                "padded_float32_bytes": int(len(self._lengths) * (int(self._lengths.max()) if self.positions == "all" else 1)
                                            * self.hidden * 4)}

    def __repr__(self):
        s = self.stats()
        t = s["tiers"]
        files = ""
        if self.path:   # every shard has its file, whichever tier serves it
            nbytes = sum(s_.bytes for s_ in self._shards if s_.file) + self._manifest["index"]["bytes"]
            files = f", files on disk={nbytes / 2**20:.1f} MiB, path={self.path!r}"
        return (f"ActivationCache(examples={s['examples']}, layer={self.layer}, positions={self.positions!r}, "
                f"dtype={self.dtype!r}, host={t['host']['bytes'] / 2**20:.1f} MiB, disk tier={t['disk']['bytes'] / 2**20:.1f} MiB, "
                f"uncached={t['uncached']['entries']}{files})")

    def _repr_html_(self):
        s = self.stats()
        rows = "".join(f"<tr><td>{k}</td><td>{v['entries']}</td><td>{v['bytes'] / 2**20:.2f} MiB</td></tr>"
                       for k, v in s["tiers"].items())
        return (f"<b>ActivationCache</b> {s['examples']} examples, layer {self.layer}, {self.positions}, {self.dtype}"
                f"<table><tr><th>tier</th><th>entries</th><th>bytes</th></tr>{rows}</table>")

    def torch_dataset(self, labels=None):
        """A map-style torch Dataset over this cache (batched reads through __getitems__):
        DataLoader(ds, batch_size=..., shuffle=True, collate_fn=ds.collate)."""
        return CacheDataset(self, labels)


class _Prefetcher:
    """Runs get() for upcoming steps on a background thread (the C gather releases the GIL)."""

    def __init__(self, cache, steps, depth, output, ragged):
        self.cache, self.steps, self.output, self.ragged = cache, steps, output, ragged
        self.q = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self):
        for ids_idx in self.steps:
            if self.stop.is_set():
                return
            try:
                ex = self.cache.example_ids[ids_idx]
                item = (ex, self.cache.get(ex, output=self.output, ragged=self.ragged))
            except BaseException as e:   # handed to the consumer
                item = e
            while not self.stop.is_set():
                try:
                    self.q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
        while not self.stop.is_set():
            try:
                self.q.put(None, timeout=0.1)
                return
            except queue.Full:
                continue

    def __len__(self):
        return len(self.steps)

    def __iter__(self):
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self):
        """Stop the reader and wait for it: a batch in flight (a C gather or an encoder forward)
        must not outlive its consumer, or run into interpreter shutdown."""
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


class CacheDataset:
    """torch map-style dataset over an ActivationCache; items are (features, label)."""

    def __init__(self, cache, labels=None):
        import torch  # noqa: F401  (only needed here)
        self.cache = cache
        self.labels = None if labels is None else np.asarray(labels)
        if self.labels is not None and len(self.labels) != len(cache):
            raise InputError(f"labels has {len(self.labels)} entries, the cache {len(cache)} examples")

    def __len__(self):
        return len(self.cache)

    def __getitems__(self, indices):
        import torch
        idx = np.asarray(indices, np.int64)
        x = self.cache.get(self.cache.example_ids[idx])
        feats = torch.from_numpy(x) if not isinstance(x, tuple) else tuple(torch.from_numpy(a) for a in x)
        if self.labels is None:
            return feats
        return feats, torch.from_numpy(self.labels[idx])

    def __getitem__(self, i):
        return self.__getitems__([i])

    @staticmethod
    def collate(batch):
        return batch
