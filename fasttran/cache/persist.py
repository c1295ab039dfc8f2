"""Persistence of an activation cache, and the checks that make a reader trust nothing.

A cache directory holds
  manifest.json      format, version, settings, model sha256, the index and shard files with
                     their sizes and CRC-32C, and its own checksum; rewritten after each shard
  index.bin          example ids, input fingerprints, every example's real tokens (to recompute)
  shard-NNNNNN.bin   build batch N: example positions and ids, the encoded rows (and int8 scales)
Files are containers (MAGIC, u64 header length, JSON header, arrays 64-byte aligned), all
written with the one atomic writer (_C.atomic_write: temp file, fsync, rename, fsync dir).

Reading checks every file against the manifest *and* against itself: the manifest's fields
(types, sane bounds, shard names that are plain file names of this directory), each container's
exact array list, dtypes, shapes and byte layout, each shard's own header (codec, width,
positions, layer, model, batch) against the manifest, its examples against the build plan, the
index's contents against its fingerprints, and all before anything is allocated from a size
they claim. Every inconsistency is a CacheCorruptError naming the file and the field.
"""
import json
import math
import os
import re
import stat
import struct

import numpy as np

from .. import _C
from ..errors import CacheCorruptError, FastTranIOError
from .layout import CODECS, POSITIONS, input_fingerprints, storage_dtype

FORMAT = "fasttran-activation-cache"
VERSION = 2
_MAGIC = b"FTCACHE2"
_MAX_HEADER = 1 << 20          # container headers are a few hundred bytes
_MAX_MANIFEST = 256 << 20
_SHARD_NAME = re.compile(r"shard-([0-9]{6,9})\.bin")
_atomic_write = _C.atomic_write   # (path, chunks) -> (bytes, crc32c); a module global so tests can fail it


def shard_name(b):
    return f"shard-{b:06d}.bin"


# ---- containers ----------------------------------------------------------------------------------

def pack_arrays(arrays, meta):
    """Chunks of a container: MAGIC, u64 header length, JSON header, then each array 64-byte
    aligned, in the given order."""
    entries, off, blobs = {}, 0, []
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


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def open_arrays(path, expect_bytes, expect_crc, spec):
    """Memory-map the container `path` and check it: its size (expect_bytes), with expect_crc
    its CRC-32C, its magic and header, and that it holds exactly the arrays of `spec`
    ({name: (dtype str, shape)}, shape entries None = any), in that order, laid out exactly as
    pack_arrays lays them out. Returns ({name: read-only view}, meta, whole-file uint8 map)."""
    name = os.path.basename(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CacheCorruptError(f"cache file {path} is missing") from None
    except OSError as e:
        raise FastTranIOError(e.errno, f"cannot read cache file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CacheCorruptError(f"cache file {path} is not a regular file")
    size = st.st_size
    if size != expect_bytes:
        raise CacheCorruptError(f"cache file {path} has {size} bytes, the manifest says {expect_bytes} (truncated or replaced)")
    if size < 16 + 64:
        raise CacheCorruptError(f"cache file {path} is too short ({size} bytes) to be a fasttran cache file")
    try:
        mm = np.memmap(path, np.uint8, "r")
    except OSError as e:
        raise FastTranIOError(e.errno, f"cannot map cache file {path}: {e.strerror}") from None
    if expect_crc is not None and _C.crc32c(mm) != expect_crc:
        raise CacheCorruptError(f"cache file {path} fails its checksum: the data was altered or damaged")

    def bad(what):
        return CacheCorruptError(f"cache file {path}: {what}")

    if bytes(mm[:8]) != _MAGIC:
        raise bad("bad magic: not a version-2 fasttran cache file")
    (hlen,) = struct.unpack("<Q", bytes(mm[8:16]))
    if hlen > _MAX_HEADER or 16 + hlen > size or (16 + hlen) % 64:
        raise bad(f"header length {hlen} is impossible for a {size}-byte file")
    try:
        head = json.loads(bytes(mm[16:16 + hlen]))
    except (ValueError, RecursionError) as e:
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(head, dict) or set(head) != {"arrays", "meta"} or not isinstance(head["arrays"], dict) \
            or not isinstance(head["meta"], dict):
        raise bad("header must be an object with 'arrays' and 'meta'")
    arrays = head["arrays"]
    if list(arrays) != list(spec):
        raise bad(f"holds arrays {list(arrays)[:8]}, expected {list(spec)}")
    base, pos, out = 16 + hlen, 0, {}
    for key, (dt, shape) in spec.items():
        e = arrays[key]
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[1], list)
                and all(_is_int(d) and 0 <= d < 2 ** 48 for d in e[1]) and _is_int(e[2]) and _is_int(e[3])):
            raise bad(f"field arrays.{key} is malformed")
        got_dt, got_shape, off, nbytes = e
        if got_dt != dt:
            raise bad(f"field arrays.{key}.dtype is {got_dt!r}, expected {dt!r}")
        if len(got_shape) != len(shape) or any(w is not None and g != w for g, w in zip(got_shape, shape)):
            raise bad(f"field arrays.{key}.shape is {got_shape}, expected {[('any' if w is None else w) for w in shape]}")
        pos = (pos + 63) & ~63
        itemsize = np.dtype(dt).itemsize
        if off != pos or nbytes != math.prod(got_shape) * itemsize or base + off + nbytes > size:
            raise bad(f"field arrays.{key} has offset {off} and {nbytes} bytes; its shape and the layout say "
                      f"{pos} and {math.prod(got_shape) * itemsize} inside {size - base} data bytes")
        out[key] = mm[base + off:base + off + nbytes].view(np.dtype(dt)).reshape(got_shape)
        pos = off + nbytes
    if base + pos != size:
        raise bad(f"{size - base - pos} bytes after the last array")
    return out, head["meta"], mm


# ---- manifest --------------------------------------------------------------------------------------

def _manifest_text(body):
    return json.dumps(body, sort_keys=True)


def _checked_json(body):
    """File bytes of a JSON object with its checksum: the CRC-32C of its sorted compact text."""
    body = dict(body)
    body.pop("checksum", None)
    body["checksum"] = _C.crc32c(_manifest_text(body).encode())
    return json.dumps(body, sort_keys=True, indent=1).encode()


def write_manifest(d, man):
    _atomic_write(os.path.join(d, "manifest.json"), [_checked_json(man)])


def read_manifest(d):
    """manifest.json of directory d: checksum verified, every field checked (check_manifest)."""
    p = os.path.join(d, "manifest.json")
    try:
        size = os.stat(p).st_size
        if size > _MAX_MANIFEST:
            raise CacheCorruptError(f"{p} has {size} bytes: not a manifest")
        with open(p, "rb") as f:
            raw = f.read(_MAX_MANIFEST + 1)
    except FileNotFoundError:
        from ..errors import CacheNotFoundError
        what = "does not exist" if not os.path.exists(d) else "is not an activation cache (no manifest.json)"
        raise CacheNotFoundError(2, f"{d} {what}: build one with ActivationCache.build(..., disk_dir={d!r}) "
                                    "or `fasttran cache --output DIR`") from None
    except IsADirectoryError:
        raise CacheCorruptError(f"{p} is not a file") from None
    except OSError as e:
        raise FastTranIOError(e.errno, f"cannot read {p}: {e.strerror}") from None
    try:
        man = json.loads(raw)
        if not isinstance(man, dict):
            raise ValueError("not a JSON object")
        want = man.pop("checksum", None)
        ok = _is_int(want) and want == _C.crc32c(_manifest_text(man).encode())
    except (ValueError, RecursionError) as e:
        raise CacheCorruptError(f"{p} is damaged: {e}") from None
    if not ok:
        raise CacheCorruptError(f"{p} fails its checksum: edited or damaged")
    check_manifest(man, p)
    return man


def check_manifest(man, p):
    """Every field of a manifest, by type and sane bounds (nothing is allocated from it yet)."""
    def bad(field, what):
        return CacheCorruptError(f"{p}: field {field} {what}")

    def need_int(obj, key, lo, hi, where):
        v = obj.get(key) if isinstance(obj, dict) else None
        if not _is_int(v) or not lo <= v <= hi:
            raise bad(f"{where}{key}", f"is {v!r}, expected an integer in [{lo}, {hi}]")
        return v

    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise CacheCorruptError(f"{p}: not a version-{VERSION} {FORMAT} manifest (format {man.get('format')!r}, "
                                f"version {man.get('version')!r}); rebuild the cache (build(..., rebuild=True))")
    want = {"format", "version", "model", "config", "settings", "index", "shards", "complete", "error", "build_seconds"}
    if set(man) != want:
        raise bad("set", f"has keys {sorted(man)[:12]}, expected {sorted(want)}")
    if not (isinstance(man["model"], str) and re.fullmatch(r"[0-9a-f]{64}", man["model"])):
        raise bad("model", "is not a sha256 hex digest")
    s = man["settings"]
    keys = {"layer", "positions", "dtype", "batch_size", "hidden", "examples", "max_fraction"}
    if not isinstance(s, dict) or set(s) != keys:
        raise bad("settings", f"must hold exactly {sorted(keys)}")
    need_int(s, "layer", 0, 1000, "settings.")
    need_int(s, "batch_size", 1, 1 << 24, "settings.")
    need_int(s, "hidden", 1, 1 << 16, "settings.")
    need_int(s, "examples", 1, 1 << 40, "settings.")
    if not isinstance(s["positions"], str) or s["positions"] not in POSITIONS:
        raise bad("settings.positions", f"is {s['positions']!r}, expected one of {POSITIONS}")
    if not isinstance(s["dtype"], str) or s["dtype"] not in CODECS:
        raise bad("settings.dtype", f"is {s['dtype']!r}, expected one of {tuple(CODECS)}")
    mf = s["max_fraction"]
    if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not 0.0 <= mf <= 1.0:
        raise bad("settings.max_fraction", f"is {mf!r}, expected a number in [0, 1]")
    c = man["config"]
    if not isinstance(c, dict):
        raise bad("config", "is not an object")
    for k in ("vocab_size", "type_vocab_size", "max_position_embeddings"):
        need_int(c, k, 0 if k == "type_vocab_size" else 1, 1 << 40, "config.")   # 0: no token types (DistilBERT)
    if need_int(c, "hidden_size", 1, 1 << 16, "config.") != s["hidden"]:
        raise bad("settings.hidden", f"is {s['hidden']} but config.hidden_size is {c['hidden_size']}")
    if need_int(c, "num_hidden_layers", 0, 1000, "config.") < s["layer"]:
        raise bad("settings.layer", f"is {s['layer']} but the model has {c['num_hidden_layers']} layers")
    need_int(man["index"], "bytes", 80, 1 << 48, "index.")
    need_int(man["index"], "crc32c", 0, 2 ** 32 - 1, "index.")
    if set(man["index"]) != {"bytes", "crc32c"}:
        raise bad("index", "must hold exactly bytes and crc32c")
    if not isinstance(man["complete"], bool):
        raise bad("complete", "is not true or false")
    err = man["error"]
    if not (isinstance(err, list) and len(err) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                              and math.isfinite(x) and x >= 0 for x in err)):
        raise bad("error", "must be 3 finite numbers >= 0")
    bs = man["build_seconds"]
    if isinstance(bs, bool) or not isinstance(bs, (int, float)) or not (math.isfinite(bs) and bs >= 0):
        raise bad("build_seconds", "must be a finite number >= 0")
    if not isinstance(man["shards"], list):
        raise bad("shards", "is not a list")
    n_batches = (s["examples"] + s["batch_size"] - 1) // s["batch_size"]
    seen = set()
    for k, e in enumerate(man["shards"]):
        where = f"shards[{k}]"
        if not isinstance(e, dict) or set(e) != {"file", "bytes", "crc32c", "rows"}:
            raise bad(where, "must be an object with file, bytes, crc32c and rows")
        f = e["file"]
        m = _SHARD_NAME.fullmatch(f) if isinstance(f, str) else None
        if m is None or f != shard_name(int(m.group(1))):
            raise bad(f"{where}.file", f"{f!r} is not a plain shard file name of this directory (shard-NNNNNN.bin)")
        if int(m.group(1)) >= n_batches:
            raise bad(f"{where}.file", f"{f!r} names batch {int(m.group(1))}, the plan has {n_batches}")
        if f in seen:
            raise bad(f"{where}.file", f"{f!r} is listed twice")
        seen.add(f)
        need_int(e, "bytes", 80, 1 << 48, where + ".")
        need_int(e, "crc32c", 0, 2 ** 32 - 1, where + ".")
        need_int(e, "rows", 0, 1 << 40, where + ".")


def shard_batch(entry):
    return int(_SHARD_NAME.fullmatch(entry["file"]).group(1))


# ---- journals of a build split over ranks ----------------------------------------------------------
# A rank of a split build (cache/parallel.py) lists the shards it has written in its own journal,
# rewritten atomically after each one: the manifest is rank 0's alone, and is written once the
# build is complete. The manifest's identity (model, index, settings) is repeated, so a journal of
# another cache that once lived in the directory is ignored. Each entry is a manifest entry plus
# the codec's error on that shard (to sum the errors in plan order at the end).
JOURNAL_FORMAT = "fasttran-activation-cache-journal"
_JOURNAL_NAME = re.compile(r"build-journal-[0-9a-f]{12}-r[0-9]{1,7}\.json")


def journal_name(run, rank):
    return f"build-journal-{run}-r{rank}.json"


def journal_names(d):
    try:
        return sorted(n for n in os.listdir(d) if _JOURNAL_NAME.fullmatch(n))
    except OSError:
        return []


def write_journal(d, name, man, entries):
    body = {"format": JOURNAL_FORMAT, "version": VERSION, "model": man["model"], "index": man["index"],
            "settings": man["settings"], "shards": entries}
    _atomic_write(os.path.join(d, name), [_checked_json(body)])


def read_journal_entries(d, man):
    """Shard entries (with "error") of the journals in d that belong to the cache of manifest
    `man`; a damaged or foreign journal, or a malformed entry, is skipped (its shards are built
    again). The entries' files are not checked here."""
    out = []
    for name in journal_names(d):
        try:
            with open(os.path.join(d, name), "rb") as f:
                body = json.loads(f.read(_MAX_MANIFEST + 1))
            want = body.pop("checksum", None)
            if not (_is_int(want) and want == _C.crc32c(_manifest_text(body).encode())):
                continue
        except (OSError, ValueError, RecursionError, AttributeError):
            continue
        if (body.get("format") != JOURNAL_FORMAT or body.get("version") != VERSION or not isinstance(body.get("shards"), list)
                or [body.get(k) for k in ("model", "index", "settings")] != [man[k] for k in ("model", "index", "settings")]):
            continue
        for e in body["shards"]:
            ok = (isinstance(e, dict) and set(e) == {"file", "bytes", "crc32c", "rows", "error"}
                  and isinstance(e["file"], str) and _SHARD_NAME.fullmatch(e["file"])
                  and all(_is_int(e[k]) and e[k] >= 0 for k in ("bytes", "crc32c", "rows"))
                  and isinstance(e["error"], list) and len(e["error"]) == 3
                  and all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in e["error"]))
            if ok:
                out.append(e)
    return out


def remove_journals(d):
    for name in journal_names(d):
        try:
            os.unlink(os.path.join(d, name))
        except FileNotFoundError:
            pass


# ---- index ---------------------------------------------------------------------------------------

def write_index(d, example_ids, fingerprints, tokens, types, offsets):
    arrays = {"example_ids": example_ids, "fingerprints": fingerprints, "tokens": tokens, "types": types,
              "offsets": offsets}
    return _atomic_write(os.path.join(d, "index.bin"), pack_arrays(arrays, {"examples": int(len(example_ids))}))


def read_index(d, man):
    """index.bin checked against the manifest and against itself: (example_ids, fingerprints,
    tokens, types, offsets) as arrays in memory."""
    p = os.path.join(d, "index.bin")
    s, c = man["settings"], man["config"]
    N = s["examples"]
    spec = {"example_ids": ("<i8", [N]), "fingerprints": ("<u8", [N]), "tokens": ("<i4", [None]),
            "types": ("<i4", [None]), "offsets": ("<i8", [N + 1])}
    a, meta, _ = open_arrays(p, man["index"]["bytes"], man["index"]["crc32c"], spec)

    def bad(field, what):
        return CacheCorruptError(f"cache file {p}: field {field} {what}")

    if meta != {"examples": N}:
        raise bad("meta", f"is {meta!r}, expected {{'examples': {N}}}")
    T = a["tokens"].shape[0]
    if a["types"].shape[0] != T:
        raise bad("types", f"has {a['types'].shape[0]} entries, tokens {T}")
    out = {k: np.array(v) for k, v in a.items()}
    off = out["offsets"]
    lengths = np.diff(off)
    if off[0] != 0 or off[-1] != T or (lengths < 0).any():
        raise bad("offsets", f"must rise from 0 to the {T} tokens")
    if lengths.max(initial=0) > c["max_position_embeddings"]:
        raise bad("offsets", f"give an example of {int(lengths.max())} tokens, over the model's "
                             f"max_position_embeddings {c['max_position_embeddings']}")
    tok, typ = out["tokens"], out["types"]
    if T and (tok.min() < 0 or tok.max() >= c["vocab_size"]):
        raise bad("tokens", f"hold ids outside [0, {c['vocab_size']})")
    if T and (typ.min() < 0 or typ.max() >= max(c["type_vocab_size"], 1)):   # no token types: zeros
        raise bad("types", f"hold type ids outside [0, {max(c['type_vocab_size'], 1)})")
    if len(np.unique(out["example_ids"])) != N:
        raise bad("example_ids", "are not distinct")
    if not np.array_equal(input_fingerprints(tok, typ, off), out["fingerprints"]):
        raise bad("fingerprints", "disagree with the tokens stored beside them")
    return out


# ---- shards --------------------------------------------------------------------------------------

def shard_meta(b, man):
    s = man["settings"]
    return {"batch": b, "codec": s["dtype"], "positions": s["positions"], "layer": s["layer"], "hidden": s["hidden"],
            "model": man["model"]}


def write_shard(d, b, man, examples, ids, values, scales):
    arrays = {"examples": examples, "ids": ids, "values": values}
    if scales is not None:
        arrays["scales"] = scales
    return _atomic_write(os.path.join(d, shard_name(b)), pack_arrays(arrays, shard_meta(b, man)))


def open_shard(d, entry, man, examples, ids, rows, verify):
    """The shard file of a manifest entry, checked against the manifest (size, and with verify
    its CRC-32C), its own header (codec, width, positions, layer, model, batch, rows) and the
    build plan (examples, their ids). Returns ({examples, ids, values[, scales]}, file map)."""
    s = man["settings"]
    p = os.path.join(d, entry["file"])
    spec = {"examples": ("<i8", [len(examples)]), "ids": ("<i8", [len(examples)]),
            "values": (storage_dtype(s["dtype"]).str, [rows, s["hidden"]])}
    if CODECS[s["dtype"]][2]:   # a scaled codec (int8): a scale per row
        spec["scales"] = ("<f4", [rows])
    a, meta, mm = open_arrays(p, entry["bytes"], entry["crc32c"] if verify else None, spec)
    want = shard_meta(shard_batch(entry), man)
    if meta != want:
        diff = sorted(k for k in set(meta) | set(want) if meta.get(k) != want.get(k))
        raise CacheCorruptError(f"cache file {p}: field meta.{diff[0]} is {meta.get(diff[0])!r}, the manifest says "
                                f"{want.get(diff[0])!r}")
    if not np.array_equal(a["examples"], examples):
        raise CacheCorruptError(f"cache file {p}: field examples differs from the build plan of batch {want['batch']}")
    if not np.array_equal(a["ids"], ids):
        raise CacheCorruptError(f"cache file {p}: field ids differs from the example ids in index.bin")
    if "scales" in a and not (np.isfinite(a["scales"]).all() and (a["scales"] >= 0).all()):
        raise CacheCorruptError(f"cache file {p}: field scales holds negative or non-finite int8 scales")
    return a, mm
