"""ActivationCache: outputs of frozen layers computed once, read every epoch.

Storage is a list of *shards*, one per build batch (examples sorted by length, so a shard holds
similar lengths). A shard holds, per example, its rows (1 pooled vector, or one row per real
token with positions="all": ragged, no padding) encoded with the cache codec. Shards live in a
tier (tiers.py); with disk_dir every shard is also a checksummed file, and manifest.json lists
the completed ones (persist.py): the cache reopens in another process, and a killed build
resumes.

Reading is C (csrc/cache/store.c, reader.c): get() is one call that gathers a batch from
whatever tiers hold its rows, decoding with fasttran's threads, and recomputes the examples that
are not cached through the encoder padded as the build would have padded them (so partial and
full caches return identical batches); batches() reads an epoch ahead on a C thread.
"""
import hashlib
import json
import os
import time
import uuid

import numpy as np

from .. import _C
from ..device import CPU, parse_device
from ..errors import (CacheCorruptError, CacheMismatchError, FastTranIOError, InputError, InputRangeError,
                      UnsupportedError)
from . import parallel, persist
from .layout import (CODECS, POSITIONS, Plan, codec_code, input_fingerprints, model_fingerprint, parse_inputs, row_bytes,
                     rows_of)
from .tiers import Tiers

_READER_THREADS = 1   # the prefetch thread decodes alone: the consumer keeps the other cores


def _seed64(seed):
    """An epoch's seed as the reader takes it: an int mod 2**64 (None: a fresh random one)."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputError(f"seed must be an int or None, got {seed!r}")
    return int(seed) % 2 ** 64


def _check_bytes(name, v):
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
        raise InputError(f"{name} must be None or a byte count >= 0, got {v!r}")


def _check_device_tier(encoder, device_bytes):
    if device_bytes and (encoder is None or not encoder.device.is_cuda):
        where = "no encoder was given" if encoder is None else "this one runs on the CPU"
        raise InputError(f"device_bytes needs an encoder on a CUDA device ({where}): create it with "
                         "Encoder.from_pretrained(..., device='cuda'), or keep the features in host_bytes / disk_dir")


def _device_index(device, what):
    """'cuda' / 'cuda:N' -> N, 'cpu' -> -1"""
    return parse_device(device, what).index


def add_error(acc, err):
    """A build's running measure of the codec's error, after one more shard's: (max abs error,
    sum of squared errors, sum of squared values); added in plan order on every path, so the
    sums are the same bits however the build was split or resumed."""
    return [max(acc[0], err[0]), acc[1] + err[1], acc[2] + err[2]]


def _slice_of(rank, world_size):
    """(rank, world_size) of batches(rank=, world_size=), checked; None for whole batches. A
    group (fasttran.distributed) passed as rank gives both."""
    if rank is None and world_size is None:
        return None
    if hasattr(rank, "world_size") and hasattr(rank, "rank") and world_size is None:
        rank, world_size = rank.rank, rank.world_size
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InputError(f"{name} must be an int (rank and world_size go together), got {v!r}")
    if not 0 <= rank < world_size:
        raise InputError(f"need 0 <= rank < world_size, got rank {rank} and world_size {world_size}")
    return int(rank), int(world_size)


class ActivationCache:
    """Frozen-layer outputs keyed by example id. Build with :meth:`build`, reopen with
    :meth:`open`; read with :meth:`get` or :meth:`batches`."""

    # ---- construction ------------------------------------------------------------------------
    def __init__(self):
        raise TypeError("use ActivationCache.build(...) or ActivationCache.open(path)")

    @classmethod
    def _blank(cls):
        self = object.__new__(cls)
        self.encoder = None
        self.path = None
        self._manifest = None
        self._err = [0.0, 0.0, 0.0]
        self._build_seconds = 0.0
        return self

    def _setup(self, encoder, layer, positions, dtype, batch_size, hidden, example_ids, tokens, types, offsets,
               max_fraction, host_bytes, fingerprints=None, device_bytes=None):
        """Settings, the plan, the C store and the tiers; no shard yet."""
        self.encoder = encoder
        self.layer, self.positions, self.dtype = int(layer), positions, dtype
        self.batch_size, self.hidden, self.max_fraction = int(batch_size), int(hidden), float(max_fraction)
        self.host_bytes = host_bytes
        self.device_bytes = device_bytes
        # the CUDA device of the encoder: the device tier's, and where output="device" batches go
        self.device = encoder.device if encoder is not None else CPU
        self.example_ids = example_ids
        self._tokens, self._types, self._offsets = tokens, types, offsets
        self._lengths = np.diff(offsets)
        self._longest = int(self._lengths.max(initial=1))
        self._fps = input_fingerprints(tokens, types, offsets) if fingerprints is None else fingerprints
        self._plan = Plan(self._lengths, self.batch_size)
        self._order, self._pad_to, self._n_plan_batches = self._plan.order, self._plan.pad_to, self._plan.n_batches
        self._n_cached_planned = int(np.floor(self.max_fraction * len(self._lengths) + 1e-9))
        self._row_bytes = row_bytes(dtype, self.hidden)
        self._store = _C.CacheStore(example_ids=example_ids, tokens=tokens, types=types, offsets=offsets,
                                    hidden=self.hidden, codec=codec_code(dtype), all_tokens=positions == "all",
                                    layer=self.layer, pooling=_C.POOLINGS["none" if positions == "all" else positions],
                                    recompute_batch=self.batch_size)
        self._tiers = Tiers(self._store, host_bytes, device_bytes, self.device if self.device.is_cuda else None)

    @classmethod
    def build(cls, encoder, input_ids, attention_mask=None, token_type_ids=None, example_ids=None, layer=-1,
              positions="cls", dtype="float32", batch_size=64, device_bytes=None, host_bytes=None,
              disk_dir=None, max_fraction=1.0, show_progress=None, rebuild=False, group=None):
        """Run `encoder` over the examples (sorted by length, in batches) and store, per
        example, the pooled vector ("cls"/"mean") or every real token's state ("all") of
        `layer` (0..L, negatives from the end), encoded as float32/float16/bfloat16/int8.

        Tiers fill in order under the budgets: the encoder's CUDA device (`device_bytes`, None or
        0 = none; needs an encoder on CUDA), host memory (`host_bytes`, None = no limit), then
        disk (`disk_dir`); what fits nowhere, and examples beyond `max_fraction`, are
        recomputed when read. Device-tier rows are decoded on the device: batches read with
        output="device" are gathered there without a host round trip. With `disk_dir` the cache persists there and a killed build
        resumes; a directory holding another model's or other inputs' cache is refused unless
        `rebuild=True`.

        In a process group of several ranks (torchrun; fasttran.distributed) every rank calls
        build with the same inputs and the same `disk_dir`, a directory they all see: each
        encodes its contiguous part of the plan and writes its shards, rank 0 writes the
        manifest, and every rank returns the whole cache. The files are a one-process build's,
        byte for byte (the manifest's build_seconds aside); a build interrupted at one world
        size resumes at another, and a complete cache is opened, not rebuilt. `group`: None
        joins the process group when this process was launched as one of several ranks;
        False builds in this process alone (each rank its own cache); or a
        fasttran.distributed group. Without `disk_dir` each rank builds every shard itself."""
        self = cls._blank()
        if positions not in POSITIONS:
            raise InputError(f"positions must be one of {POSITIONS}, got {positions!r}")
        if dtype not in CODECS:
            raise InputError(f"dtype must be one of {tuple(CODECS)}, got {dtype!r}")
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
        _check_bytes("device_bytes", device_bytes)
        _check_bytes("host_bytes", host_bytes)
        if not (isinstance(max_fraction, (int, float)) and 0.0 <= max_fraction <= 1.0):
            raise InputError(f"max_fraction must be in [0, 1], got {max_fraction!r}")
        _check_device_tier(encoder, device_bytes)
        L = encoder.num_layers
        if not isinstance(layer, (int, np.integer)) or not -(L + 1) <= layer <= L:
            raise InputError(f"layer must be an int in 0..{L} (or -1..-{L + 1}), got {layer!r}")
        tokens, types, offsets, lengths = parse_inputs(input_ids, attention_mask, token_type_ids)
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
        g = parallel.build_group(group, disk_dir)
        self._setup(encoder, int(layer) % (L + 1), positions, dtype, batch_size, encoder.hidden_size, ex, tokens, types,
                    offsets, max_fraction, host_bytes, device_bytes=device_bytes)
        if g is not None:
            self._build_split(g, disk_dir, rebuild, show_progress)
            return self
        entries = []
        if disk_dir is not None:
            entries = self._open_dir_for_build(disk_dir, rebuild)
        self._load_shards(entries)
        self._run_build(show_progress)
        return self

    @classmethod
    def uncached(cls, encoder, input_ids, attention_mask=None, token_type_ids=None, example_ids=None, layer=-1,
                 positions="cls", batch_size=64):
        """The no-cache baseline behind the same interface: nothing is stored, every get()
        runs the encoder on that batch (build(..., max_fraction=0))."""
        return cls.build(encoder, input_ids, attention_mask, token_type_ids, example_ids=example_ids, layer=layer,
                         positions=positions, batch_size=batch_size, max_fraction=0.0, show_progress=False)

    def _settings(self):
        return {"layer": self.layer, "positions": self.positions, "dtype": self.dtype,
                "batch_size": self.batch_size, "hidden": self.hidden, "examples": int(len(self._lengths)),
                "max_fraction": self.max_fraction}

    def _open_dir_for_build(self, disk_dir, rebuild):
        """Create or reuse the cache directory; returns the manifest entries of the shards a
        previous (killed) build of the same cache completed."""
        self.path = os.path.abspath(os.fspath(disk_dir))
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, f".write-test.{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise FastTranIOError(e.errno, f"disk_dir {self.path} is not writable: {e.strerror}") from None
        model_fp = model_fingerprint(self.encoder)
        manifest = None
        if os.path.exists(os.path.join(self.path, "manifest.json")):
            try:
                old = persist.read_manifest(self.path)
                problem = self._compare(old, model_fp)
            except CacheCorruptError as e:
                if not rebuild:
                    raise CacheCorruptError(f"{e}; pass rebuild=True to replace it") from None
                old, problem = None, "it is damaged"
            if problem and not rebuild:
                raise CacheMismatchError(f"{self.path} holds a different cache: {problem}; "
                                         "pass rebuild=True to replace it, or use another disk_dir")
            manifest = None if problem else old
        if manifest is None:
            size, crc = persist.write_index(self.path, self.example_ids, self._fps, self._tokens, self._types,
                                            self._offsets)
            manifest = {"format": persist.FORMAT, "version": persist.VERSION, "model": model_fp,
                        "config": self.encoder.config, "settings": self._settings(),
                        "index": {"bytes": size, "crc32c": crc}, "shards": [], "complete": False,
                        "error": [0.0, 0.0, 0.0], "build_seconds": 0.0}
            persist.write_manifest(self.path, manifest)
        else:
            self._err = manifest["error"]
            self._build_seconds = manifest["build_seconds"]
        self._manifest = manifest
        return manifest["shards"]

    def _compare(self, man, model_fp):
        if man["model"] != model_fp:
            return "it was built with another model (weights or config differ)"
        for k, v in self._settings().items():
            if man["settings"].get(k) != v:
                return f"{k} is {man['settings'].get(k)!r} there, {v!r} here"
        idx = persist.read_index(self.path, man)
        if not np.array_equal(idx["example_ids"], self.example_ids):
            return "its example ids differ"
        diff = np.flatnonzero(idx["fingerprints"] != self._fps)
        if len(diff):
            return f"the inputs of {len(diff)} examples differ (first: id {int(self.example_ids[diff[0]])})"
        return None

    @classmethod
    def open(cls, path, encoder=None, input_ids=None, attention_mask=None, token_type_ids=None, host_bytes=None,
             device_bytes=None):
        """Reopen a cache directory. With `encoder`, refuses a cache built with another model
        and recomputes uncached examples; with inputs, refuses a cache of other inputs.
        Every file is checked against the manifest and itself now (sizes, headers, contents;
        checksums of shards copied to memory), and disk shards' checksums before first use.
        `device_bytes` (with an encoder on CUDA): shards copied to the device tier first."""
        _check_bytes("host_bytes", host_bytes)
        _check_bytes("device_bytes", device_bytes)
        _check_device_tier(encoder, device_bytes)
        self = cls._blank()
        self.path = os.path.abspath(os.fspath(path))
        man = persist.read_manifest(self.path)
        st = man["settings"]
        idx = persist.read_index(self.path, man)
        if encoder is not None:
            if model_fingerprint(encoder) != man["model"]:
                raise CacheMismatchError(f"{self.path} was built with another model (weights or config differ)")
        if input_ids is not None:
            tokens, types, offsets, _ = parse_inputs(input_ids, attention_mask, token_type_ids)
            fps = input_fingerprints(tokens, types, offsets)
            if len(fps) != len(idx["fingerprints"]) or (fps != idx["fingerprints"]).any():
                raise CacheMismatchError(f"{self.path} was built from other inputs")
        missing = [e["file"] for e in man["shards"] if not os.path.exists(os.path.join(self.path, e["file"]))]
        if missing:
            raise CacheCorruptError(f"{self.path}: {len(missing)} shard file(s) are missing, e.g. {missing[0]}")
        self._setup(encoder, st["layer"], st["positions"], st["dtype"], st["batch_size"], st["hidden"],
                    idx["example_ids"], idx["tokens"], idx["types"], idx["offsets"], st["max_fraction"], host_bytes,
                    fingerprints=idx["fingerprints"], device_bytes=device_bytes)
        self._manifest = man
        self._err, self._build_seconds = man["error"], man["build_seconds"]
        self._load_shards(man["shards"])
        return self

    # ---- shards ----------------------------------------------------------------------------
    def _load_shards(self, entries):
        """Shards listed in a manifest, each checked (persist.open_shard) before it is placed:
        a shard copied into memory is checksummed now, one served from disk before its first
        read."""
        for e in entries:
            b = persist.shard_batch(e)
            ex, rows = self._shard_plan(b)
            where = f"{os.path.join(self.path, 'manifest.json')}: field shards[{e['file']}]"
            if not len(ex):
                raise CacheCorruptError(f"{where}: batch {b} has no cached example in the build plan")
            if e["rows"] != rows:
                raise CacheCorruptError(f"{where}.rows is {e['rows']}, the build plan's batch {b} has {rows} rows")
            nbytes = rows * self._row_bytes
            to_memory = self._tiers.fits_memory(nbytes)   # copied to the device or the host: checked now
            arrs, mm = persist.open_shard(self.path, e, self._manifest, ex, self.example_ids[ex], rows,
                                          verify=to_memory)
            self._tiers.place(ex, arrs["values"], arrs.get("scales"), nbytes, (e["file"], e["bytes"], e["crc32c"]),
                              mapped=mm, verified=to_memory)

    def _shard_plan(self, b):
        """(examples, rows) that shard b holds in the build plan."""
        ex = self._plan.shard_examples(b, self._n_cached_planned)
        return ex, int(rows_of(self._lengths, self.positions, ex).sum())

    def _encode_batch(self, idx):
        """Run the encoder on examples idx, padded to the longest of them; returns float32 rows
        (pooled, or real tokens only)."""
        ids, mask, tys = self.inputs(self.example_ids[idx])
        if ids.shape[1] == 0:   # only empty examples: the encoder still needs one position
            ids, mask, tys = (np.zeros((len(idx), 1), np.int32) for _ in range(3))
        if self.positions == "all":
            h = self.encoder.forward(ids, mask, tys, output_layers=self.layer)
            return h[mask.astype(bool)]
        return self.encoder.forward(ids, mask, tys, output_layers=self.layer, pooling=self.positions)

    def _todo(self, done):
        """(plan batch, its cached examples) of every shard still to build: batches with cached
        examples whose file is not in `done`, in plan order."""
        todo = []
        for b in range(self._n_plan_batches):
            idx = self._plan.shard_examples(b, self._n_cached_planned)
            if len(idx) and persist.shard_name(b) not in done:
                todo.append((b, idx))
        return todo

    def _encode_shard(self, idx):
        """The stored rows of examples idx: (values, int8 scales or None, (max abs error, sum of
        squared errors, sum of squared values))."""
        rows = np.ascontiguousarray(self._encode_batch(idx), np.float32)
        return _C.cache_encode(src=rows, codec=codec_code(self.dtype))

    def _write_shard(self, b, idx, vals, sc):
        """Shard file of plan batch b; returns its manifest entry."""
        size, crc = persist.write_shard(self.path, b, self._manifest, idx.astype(np.int64), self.example_ids[idx],
                                        vals, sc)
        return {"file": persist.shard_name(b), "bytes": size, "crc32c": crc, "rows": len(vals)}

    def _run_build(self, show_progress):
        todo = self._todo(set(e["file"] for e in self._manifest["shards"]) if self.path is not None else set())
        it = todo
        if show_progress is not False:   # None: a bar for any build that lasts over 2 s
            from .._progress import progress
            it = progress(todo, desc="build cache", unit="batch", delay=0 if show_progress else 2.0)
        t0 = time.perf_counter()
        for b, idx in it:
            vals, sc, err = self._encode_shard(idx)
            self._err = add_error(self._err, err)
            nbytes = len(vals) * self._row_bytes
            if self.path is None:
                self._tiers.place(idx, vals, sc, nbytes)
                continue
            entry = self._write_shard(b, idx, vals, sc)
            self._manifest["shards"].append(entry)
            self._manifest["error"] = self._err
            self._manifest["build_seconds"] = self._build_seconds + time.perf_counter() - t0
            persist.write_manifest(self.path, self._manifest)
            mm = None
            if not self._tiers.fits_memory(nbytes):   # served from the file just written: free the memory
                arrs, mm = persist.open_shard(self.path, entry, self._manifest, idx, self.example_ids[idx], len(vals),
                                              verify=False)
                vals, sc = arrs["values"], arrs.get("scales")
            self._tiers.place(idx, vals, sc, nbytes, (entry["file"], entry["bytes"], entry["crc32c"]), mapped=mm,
                              verified=True)
        self._build_seconds += time.perf_counter() - t0
        if self.path is not None and not self._manifest["complete"]:
            self._manifest["complete"] = True
            self._manifest["build_seconds"] = self._build_seconds
            persist.write_manifest(self.path, self._manifest)

    # ---- the build split over the ranks of a process group (parallel.py: group, split, checks) ------
    def _digest(self):
        """What a rank of a split build builds: model, settings, example ids and input fingerprints."""
        h = hashlib.sha256(model_fingerprint(self.encoder).encode())
        h.update(json.dumps(self._settings(), sort_keys=True).encode())
        h.update(np.ascontiguousarray(self.example_ids).tobytes())
        h.update(np.ascontiguousarray(self._fps).tobytes())
        return h.hexdigest()

    def _open_as_main(self, path, rebuild, run):
        """Phase 1 on rank 0: the directory opened as a one-process build opens it, the verified
        shards of earlier journals, and the token the other ranks look for."""
        self._open_dir_for_build(path, rebuild)
        man = self._manifest
        listed = {e["file"] for e in man["shards"]}
        journal, seen = [], set(listed)
        if not man["complete"]:
            for e in persist.read_journal_entries(path, man):
                b = persist.shard_batch(e)
                if e["file"] in seen or b >= self._n_plan_batches:
                    continue
                ex, rows = self._shard_plan(b)
                if not len(ex) or e["rows"] != rows:
                    continue
                entry = {k: e[k] for k in ("file", "bytes", "crc32c", "rows")}
                try:   # the whole file: size, checksum, header, examples
                    persist.open_shard(path, entry, man, ex, self.example_ids[ex], rows, verify=True)
                except (CacheCorruptError, FastTranIOError):
                    continue
                journal.append(e)
                seen.add(e["file"])
        token = f".fasttran-shared-{run}"
        with open(os.path.join(path, token), "w"):
            pass
        return {"manifest": man, "journal": journal, "token": token, "run": run}

    def _build_split(self, g, disk_dir, rebuild, show_progress):
        """Build this cache (set up, no shard yet) into disk_dir, split over group `g`: the phases of
        parallel.py's docstring, each ended by the group's wait_all."""
        t0 = time.perf_counter()
        path = os.path.abspath(os.fspath(disk_dir))
        # 1. open
        opened, err = None, None
        if g.is_main:
            try:
                opened = self._open_as_main(path, rebuild, uuid.uuid4().hex[:12])
            except BaseException as e:
                err = e
        got = g.wait_all("cache build: open the directory", {"path": path, "digest": self._digest(), "opened": opened,
                                                              "kernels": parallel.kernels(self.encoder)}, failed=err)
        if err is not None:
            raise err
        main = got[0]["opened"]
        kinds = sorted({x["kernels"] for x in got})
        if len(kinds) > 1 and g.is_main:
            import warnings
            warnings.warn("the ranks compute with different kernels (" + "; ".join(
                f"{k}: ranks {[r for r, x in enumerate(got) if x['kernels'] == k]}" for k in kinds) + "): the cache is "
                "correct, but its rows differ in the last bits from a build on one kind of machine", RuntimeWarning,
                stacklevel=3)
        # 2. check
        problem = None
        if any(x["path"] != path for x in got):
            problem = ("the ranks passed different disk_dir paths (" + ", ".join(f"rank {r}: {x['path']}" for r, x in
                                                                                enumerate(got)) + ")")
        elif got[0]["digest"] != self._digest():
            problem = (f"rank {g.rank} builds another cache than rank 0 (other inputs, model or settings); every rank must "
                       "call build with the same arguments")
        elif not g.is_main and not parallel.sees(path, main["token"]):
            problem = (f"rank {g.rank} does not see the files rank 0 wrote into {path}: the directory is not shared "
                       "between the ranks (another machine's local disk?)")
        problems = g.wait_all("cache build: check the directory", problem)
        if g.is_main:
            try:
                os.unlink(os.path.join(path, main["token"]))
            except OSError:
                pass
        problems = [p for p in problems if p]
        if problems:
            cls = CacheMismatchError if "another cache" in problems[0] else InputError
            raise cls(f"a cache build split over {g.world_size} ranks: {problems[0]}. A split build writes one cache "
                      "into one directory that every rank sees; pass group=False to build one cache per rank")
        self.path, man = path, main["manifest"]
        self._manifest, self._err, self._build_seconds = man, man["error"], man["build_seconds"]
        if man["complete"]:   # built already: open it
            self._load_shards(man["shards"])
            return
        # 3. build this rank's part
        done = {e["file"] for e in man["shards"]} | {e["file"] for e in main["journal"]}
        todo = self._todo(done)
        part = parallel.split(self._lengths, self.hidden, todo, g.world_size)[g.rank]
        counter = f"cache build {main['run']}"
        bar = None
        if show_progress is not False and todo:
            from .._progress import progress
            bar = progress(total=len(todo), desc="build cache", unit="batch", delay=0 if show_progress else 2.0)

        def show():
            if bar is not None:
                n = g.count(counter, 0)
                if n != bar.n:
                    bar.update(n - bar.n)

        mine, err = [], None
        journal = persist.journal_name(main["run"], g.rank)
        try:
            for b, idx in part:
                vals, sc, e = self._encode_shard(idx)
                entry = self._write_shard(b, idx, vals, sc)
                entry["error"] = [float(x) for x in e]
                mine.append(entry)
                persist.write_journal(path, journal, man, mine)
                g.count(counter, 1)
                show()
        except BaseException as e:   # Ctrl-C too: the other ranks stop at the next phase, naming it
            err = e
        try:
            got = g.wait_all("cache build: shards", mine, failed=err, poll=show)
        finally:
            if bar is not None:
                bar.close()
        if err is not None:
            raise err
        # 4. the manifest
        final = None
        if g.is_main:
            try:
                extra = sorted(main["journal"] + [e for entries in got for e in entries], key=persist.shard_batch)
                final = dict(man)
                final["shards"] = sorted(man["shards"] + [{k: e[k] for k in ("file", "bytes", "crc32c", "rows")}
                                                          for e in extra], key=persist.shard_batch)
                error = man["error"]
                for e in extra:   # plan order: the sums a one-process build makes, to the bit
                    error = add_error(error, e["error"])
                final.update(error=error, complete=True, build_seconds=man["build_seconds"] + time.perf_counter() - t0)
                persist.write_manifest(path, final)
                persist.remove_journals(path)
            except BaseException as e:
                err = e
        final = g.wait_all("cache build: manifest", final, failed=err)
        if err is not None:
            raise err
        final = final[0]
        self._manifest, self._err, self._build_seconds = final, final["error"], final["build_seconds"]
        self._load_shards(final["shards"])

    # ---- reading ---------------------------------------------------------------------------
    def _encoder_core(self):
        return None if self.encoder is None else self.encoder._core

    @property
    def lengths(self):
        """(N,) int64: real tokens of each example, in example order."""
        out = self._lengths.view()
        out.flags.writeable = False
        return out

    def index_of(self, example_ids):
        """Positions (0..N-1, the example order) of `example_ids`; an unknown id raises
        InputRangeError."""
        return self._store.index_of(example_ids)

    def inputs(self, example_ids=None, ragged=False):
        """The inputs the cache was built from, for `example_ids` (None: all, in example order):
        (input_ids, attention_mask, token_type_ids), int32 (batch, longest) right-padded with
        zeros; with ragged=True (input_ids, token_type_ids, offsets): real tokens one example
        after another, offsets (batch + 1)."""
        return self.inputs_at(np.arange(len(self._lengths)) if example_ids is None else self.index_of(example_ids),
                              ragged)

    def inputs_at(self, index, ragged=False):
        """:meth:`inputs` of the examples at positions `index` (0..N-1, the example order: what
        :meth:`epoch_order` gives), without looking the ids up."""
        idx = np.asarray(index)
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise InputError(f"index must be a 1-D array of example positions, got shape {idx.shape} {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= len(self._lengths)):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise InputRangeError(f"index holds {bad}: the cache's positions are 0..{len(self._lengths) - 1}")
        L = self._lengths[idx]
        if ragged:
            first = np.repeat(self._offsets[idx], L) + (np.arange(int(L.sum())) - np.repeat(np.cumsum(L) - L, L))
            return self._tokens[first], self._types[first], np.concatenate([[0], np.cumsum(L)]).astype(np.int64)
        T = int(L.max()) if len(L) else 0
        mask = np.arange(T)[None, :] < L[:, None]
        pos = (self._offsets[idx][:, None] + np.arange(T)[None, :])[mask]
        ids = np.zeros((len(idx), T), np.int32)
        tys = np.zeros((len(idx), T), np.int32)
        ids[mask], tys[mask] = self._tokens[pos], self._types[pos]
        return ids, mask.astype(np.int32), tys

    def _output_index(self, output, device):
        if output not in ("numpy", "device"):
            raise InputError(f"output must be 'numpy' or 'device', got {output!r}")
        if device is not None and output != "device":
            raise InputError("device= goes with output='device'")
        return _device_index(self.device if device is None else device, "device")

    def get(self, example_ids, output="numpy", ragged=False, out=None, device=None):
        """A batch for `example_ids`: pooled caches give (batch, hidden); positions="all" gives
        (values (batch, longest, hidden), attention_mask (batch, longest)), or with
        ragged=True (values (total_tokens, hidden), offsets (batch + 1)). float32 NumPy, or
        with output="device" a fasttran.Tensor in the memory of `device` (None: the cache's
        `device`, the encoder's: a CUDA device, or the CPU): rows of the device tier are
        decoded there, the others copied up. `out`: a float32 buffer with room for the batch
        (a NumPy array, or a CUDA fasttran.Tensor for a CUDA output), written from its start
        (the values returned are a view of it): one C call gathers into it from every tier."""
        index = self._output_index(output, device)
        return self._store.read(example_ids=example_ids, ragged=bool(ragged), out=out, encoder=self._encoder_core(),
                                device=output == "device", device_index=index)

    def epoch_order(self, seed=None, shuffle=True, sampling="random", chunk_bytes=None, passes_per_chunk=1, group=1):
        """The example positions of one epoch, in the order :meth:`batches` reads them with the
        same arguments (a pure function of them: the same on every machine)."""
        if sampling not in ("random", "chunked"):
            raise InputError(f"sampling must be 'random' or 'chunked', got {sampling!r}")
        if self._check_group(group, sampling) > 1:
            return self._group_order(shuffle, _seed64(seed), group)
        return self._epoch_order(shuffle, _seed64(seed), sampling, chunk_bytes, passes_per_chunk)

    def _check_group(self, group, sampling, world_size=None):
        """`group` examples that stay together (consecutive in the cache, in order, in one batch):
        multiple choice's choices of one question"""
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
            raise InputError(f"group must be a positive int (examples kept together), got {group!r}")
        if group > 1:
            N = len(self.example_ids)
            if N % group:
                raise InputError(f"the cache holds {N} examples, not whole groups of {group} (e.g. {group} choices "
                                 "per question, one after another)")
            if sampling != "random":
                raise UnsupportedError(f"sampling={sampling!r} does not keep groups of examples together; use "
                                       "sampling='random'")
            if world_size not in (None, 1):
                raise UnsupportedError("groups of examples (multiple choice) are read by one process: slicing a "
                                       "global batch over several ranks could split a group")
        return int(group)

    def _group_order(self, shuffle, seed, group):
        n = len(self.example_ids) // group
        first = (_C.epoch_order(seed, n) if shuffle else np.arange(n, dtype=np.int64)) * group
        return (first[:, None] + np.arange(group, dtype=np.int64)).reshape(-1)

    def _epoch_order(self, shuffle, seed, sampling, chunk_bytes, passes_per_chunk):
        N = len(self.example_ids)
        if sampling == "random":
            return _C.epoch_order(seed, N) if shuffle else np.arange(N)
        rng = np.random.default_rng(seed)
        storage = self._order   # plan order = shard order
        per = self._row_bytes * np.maximum(rows_of(self._lengths, self.positions, storage), 1)
        limit = chunk_bytes or (self.host_bytes or 256 << 20)
        groups, first, acc = [], 0, 0
        for k, b in enumerate(per.tolist()):
            if acc + b > limit and k > first:
                groups.append(storage[first:k])
                first, acc = k, 0
            acc += b
        groups.append(storage[first:])
        if shuffle:
            groups = [groups[i] for i in rng.permutation(len(groups))]
        groups = [np.concatenate([rng.permutation(g) if shuffle else g for _ in range(passes_per_chunk)])
                  for g in groups]
        return np.concatenate(groups)

    def batches(self, batch_size, shuffle=True, seed=None, drop_last=False, sampling="random", chunk_bytes=None,
                passes_per_chunk=1, prefetch=None, output="numpy", ragged=False, start=0, device=None, rank=None,
                world_size=None, group=1):
        """Iterate one epoch: yields (example_ids, batch) with batch as from :meth:`get`. The
        next `prefetch` batches are read ahead on a C thread while the caller computes (None:
        as many as fit in 64 MiB, 2 to 8, so that a reader thread the OS schedules late
        catches up without making the consumer wait).
        sampling="chunked" (FastTran's improved sampling): examples are grouped into chunks of
        at most `chunk_bytes` in storage order; chunks come in random order and each is
        shuffled and read `passes_per_chunk` times before moving on. `start` skips the first
        batches of the epoch (resuming an interrupted one: the order depends only on `seed`).
        output="device" (and `device`) as in :meth:`get`: each batch is a fasttran.Tensor over one
        of the reader's device buffers, given back when the Tensor dies. The reader holds
        `prefetch` batches plus the one being used; a loop that keeps the previous batch alive
        while it asks for the next (`for ids, batch in ...` without `del batch`, or zip() and
        enumerate(), which keep their last item) can make it take one buffer more.
        The iterator's close() stops the reader (also done when it is exhausted or freed).

        Data parallelism: with `rank` and `world_size` (or `rank=` a fasttran.distributed group),
        `batch_size` is the *global* batch: every rank reads the same epoch order (same `seed`)
        and takes, from each global batch, its contiguous slice of positions -- balanced by cost,
        an example of n rows costing n (6 hidden + n), so each slice's cost is within one
        example's of its share (sizes within one of each other when every example is one row) --
        the slices together the global batch in order. It yields (example_ids, batch, where) for *every*
        global batch, so all ranks take the same number of steps: a slice may be empty (an
        uneven last batch smaller than world_size; its batch has 0 examples), and `where` (a
        GlobalBatch) says what a step needs to equal one process: `step` (the global batch's
        number in the epoch, `start` included), `size` (its examples: divide a gradient sum by
        it), `offset` (this slice's first position in it), `rows` / `row_offset` (its real
        rows: tokens with positions="all", else examples; and those before this slice) and
        `longest` (its longest example, in rows).
        `group=g`: the cache holds groups of g consecutive examples that stay together, in order
        (multiple choice: the choices of one question); the order shuffles whole groups and
        `batch_size` must be a multiple of g (one process only)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
        if sampling not in ("random", "chunked"):
            raise InputError(f"sampling must be 'random' or 'chunked', got {sampling!r}")
        if isinstance(passes_per_chunk, bool) or not isinstance(passes_per_chunk, int) or passes_per_chunk < 1:
            raise InputError(f"passes_per_chunk must be an int >= 1, got {passes_per_chunk!r}")
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer))
                                     or prefetch < 1):
            raise InputError(f"prefetch must be None or an int >= 1, got {prefetch!r}")
        index = self._output_index(output, device)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise InputError(f"start must be an int >= 0, got {start!r}")
        part = _slice_of(rank, world_size)
        bs, seed = int(batch_size), _seed64(seed)
        if prefetch is None:   # float32 bytes of a batch: a pooled row, or the longest example's rows
            per = 4 * self.hidden * (self._longest if self.positions == "all" else 1)
            prefetch = min(8, max(2, (64 << 20) // max(1, bs * per)))
        kw = dict(batch_size=bs, ragged=bool(ragged), depth=int(prefetch), encoder=self._encoder_core(),
                  device=output == "device", threads=_READER_THREADS, device_index=index)
        if part is not None:
            kw.update(part=part[0], parts=part[1], first_step=int(start))
        N = len(self.example_ids)
        group = self._check_group(group, sampling, part[1] if part is not None else None)
        if group > 1:
            if bs % group:
                raise InputError(f"batch_size {bs} is not a whole number of groups of {group} examples")
            order = self._group_order(shuffle, seed, group)
            if drop_last:
                order = order[:len(order) // bs * bs]
            return self._store.reader(order=np.ascontiguousarray(order[int(start) * bs:], np.int64), **kw)
        if shuffle and sampling == "random":   # the permutation is drawn on the reader's thread
            return self._store.reader(order=None, seed=seed, keep=N // bs * bs if drop_last else N,
                                      skip=min(int(start) * bs, N), **kw)
        order = self._epoch_order(shuffle, seed, sampling, chunk_bytes, passes_per_chunk)
        if drop_last:
            order = order[:len(order) // bs * bs]
        return self._store.reader(order=np.ascontiguousarray(order[int(start) * bs:], np.int64), **kw)

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
        tiers = self._tiers.stats()
        cached = sum(t["entries"] for t in tiers.values())
        tiers["uncached"] = {"bytes": 0, "entries": len(self.example_ids) - cached}
        hits, misses = self._store.counters()
        total = hits + misses
        rows = int(self._lengths.sum()) if self.positions == "all" else len(self._lengths)
        return {"examples": len(self.example_ids), "cached": cached, "tiers": tiers,
                "hit_rate": hits / total if total else None, "hits": hits, "misses": misses,
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
            nbytes = sum(e["bytes"] for e in self._manifest["shards"]) + self._manifest["index"]["bytes"]
            files = f", files on disk={nbytes / 2**20:.1f} MiB, path={self.path!r}"
        return (f"ActivationCache(examples={s['examples']}, layer={self.layer}, positions={self.positions!r}, "
                f"dtype={self.dtype!r}, "
                + (f"device ({self.device})={t['device']['bytes'] / 2**20:.1f} MiB, " if t["device"]["entries"] else "")
                + f"host={t['host']['bytes'] / 2**20:.1f} MiB, "
                f"disk tier={t['disk']['bytes'] / 2**20:.1f} MiB, uncached={t['uncached']['entries']}{files})")

    def _repr_html_(self):
        s = self.stats()
        rows = "".join(f"<tr><td>{k}</td><td>{v['entries']}</td><td>{v['bytes'] / 2**20:.2f} MiB</td></tr>"
                       for k, v in s["tiers"].items())
        return (f"<b>ActivationCache</b> {s['examples']} examples, layer {self.layer}, {self.positions}, {self.dtype}"
                f"<table><tr><th>tier</th><th>entries</th><th>bytes</th></tr>{rows}</table>")

    def torch_dataset(self, labels=None):
        """A map-style torch Dataset over this cache (batched reads through __getitems__):
        DataLoader(ds, batch_size=..., shuffle=True, collate_fn=ds.collate)."""
        from .torch_adapter import CacheDataset
        return CacheDataset(self, labels)
