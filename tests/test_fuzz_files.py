"""Files that lie: a few hundred mutated activation caches and safetensors files, each opened and
read in a subprocess (cases batched per subprocess; one that dies is counted as a crash and the
rest go on in a new one).

Caches: manifests edited and re-signed with a valid checksum (every field: wrong types, values
out of range, other codecs and positions, shard names that leave the directory, duplicated,
dropped or swapped shards), shard and index files damaged (byte flips, truncation: the
checksums must catch them) or edited and re-signed (headers, example and id arrays, the index's
ids, fingerprints, tokens, types and offsets: the cross-checks must catch them). A case passes
when opening and reading it raises CacheCorruptError / CacheMismatchError, or returns exactly
the original data; a few cases may only be refused (a shard name outside the directory).
Reading examples the mutated cache no longer holds, or has no encoder for, may raise the
documented InputRangeError / InputError for those reads.

safetensors: the encoder's checkpoint and a trainer-style file with mutated headers (JSON edits,
non-UTF-8 names, lying lengths) and damaged bytes, through Encoder.from_pretrained and
read_safetensors: loaded, or a CheckpointError.

Bars: 0 crashes, 0 raw exceptions, 0 silently wrong results."""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import fasttran
from fasttran.cache import persist
from test_bad_input import SMALL, make_dir

HERE = os.path.dirname(os.path.abspath(__file__))
N_CACHE_CASES = 320
N_ST_CASES = 400

# ---- the runner (in the subprocess) ---------------------------------------------------------------


def _read_all(c, ids):
    """Everything a reader sees: padded and ragged get() of every id, and one prefetched epoch."""
    out = []
    for ragged in (False, True):
        r = c.get(ids, ragged=ragged)
        out.extend(r if isinstance(r, tuple) else (r,))
    for ex, batch in c.batches(4, shuffle=False, ragged=True):
        out.append(ex)
        out.extend(batch if isinstance(batch, tuple) else (batch,))
    return out


def _run_case(case, encoders):
    from fasttran import ActivationCache
    from fasttran.errors import CacheCorruptError, CacheMismatchError, CheckpointError, FastTranError, InputError
    from fasttran.safetensors_io import read_safetensors
    kind = case["kind"]
    try:
        if kind == "cache":
            enc = encoders[case["model"]] if case["encoder"] else None
            c = ActivationCache.open(case["dir"], encoder=enc, host_bytes=case["host_bytes"])
            got = _read_all(c, np.load(case["ids"]))
            want = np.load(case["want"])
            want = [want[k] for k in sorted(want.files, key=lambda s: int(s[4:]))]
            same = len(got) == len(want) and all(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
                                                 for a, b in zip(got, want))
            if case.get("must_refuse"):
                return "WRONG (opened a cache that must be refused)"
            return "equal" if same else "WRONG (different data)"
        if kind == "st-encoder":
            fasttran.Encoder.from_pretrained(case["dir"], load_tokenizer=False)
            return "loaded"
        read_safetensors(case["file"])
        return "loaded"
    except (CacheCorruptError, CacheMismatchError) as e:
        return "refused" if kind == "cache" else f"RAW {type(e).__name__}: {e}"
    except CheckpointError as e:
        return "refused" if kind != "cache" else f"RAW {type(e).__name__}: {e}"
    except InputError as e:
        msg = str(e)
        if kind == "cache" and ("unknown example id" in msg or "no encoder to compute it" in msg):
            return "refused-read"
        return f"RAW {type(e).__name__}: {msg}"
    except FastTranError as e:
        return f"RAW {type(e).__name__}: {e}"
    except Exception as e:   # noqa: BLE001 -- exactly what the test counts
        return f"RAW {type(e).__name__}: {e}"


def _runner(cases_file, start):
    cases = json.load(open(cases_file))
    encoders = {}
    for c in cases:
        if c["kind"] == "cache" and c["model"] not in encoders:
            encoders[c["model"]] = fasttran.Encoder.from_pretrained(c["model"], load_tokenizer=False)
    for k in range(start, len(cases)):
        r = _run_case(cases[k], encoders)
        sys.stdout.write(json.dumps([k, r]) + "\n")
        sys.stdout.flush()


RUNNER = "import sys; sys.path.insert(0, sys.argv[1]); import test_fuzz_files as t; t._runner(sys.argv[2], int(sys.argv[3]))"


def run_cases(cases, tmp_path):
    """Results of every case, in order; a case that killed its subprocess is 'CRASH'."""
    f = tmp_path / "cases.json"
    f.write_text(json.dumps(cases))
    results, start = {}, 0
    while start < len(cases):
        p = subprocess.run([sys.executable, "-c", RUNNER, HERE, str(f), str(start)], capture_output=True, text=True,
                           timeout=600, cwd=str(tmp_path))
        for line in p.stdout.splitlines():
            if line.startswith("["):
                k, r = json.loads(line)
                results[k] = r
        done = max(results, default=-1) + 1
        if p.returncode != 0:
            results[done] = f"CRASH (exit {p.returncode}): {p.stderr[-400:]}"
            done += 1
        start = done
    return [results[k] for k in range(len(cases))]


def summarize(cases, results, title):
    counts = {}
    for r in results:
        key = r.split(" ")[0]
        counts[key] = counts.get(key, 0) + 1
    print(f"\n{title}: {len(results)} cases: {counts}")
    bad = [(c.get("what"), r) for c, r in zip(cases, results) if r.startswith(("RAW", "WRONG", "CRASH"))]
    for what, r in bad[:20]:
        print("  ", what, "->", r[:300])
    return counts, bad


# ---- caches ------------------------------------------------------------------------------------------

BASES = {   # name: build settings
    "mean_f16": dict(positions="mean", dtype="float16", batch_size=4, n=14),
    "all_i8_partial": dict(positions="all", dtype="int8", batch_size=4, n=13, max_fraction=0.6),
    "cls_bf16": dict(positions="cls", dtype="bfloat16", batch_size=5, n=11),
    "all_f32": dict(positions="all", dtype="float32", batch_size=3, n=10, layer=1),
}


def build_bases(root, model_dir):
    enc = fasttran.Encoder.from_pretrained(model_dir, load_tokenizer=False)
    rng = np.random.default_rng(0)
    out = {}
    for name, kw in BASES.items():
        kw = dict(kw)
        n = kw.pop("n")
        T = SMALL["max_position_embeddings"]
        lengths = rng.integers(1, T + 1, n)
        ids = rng.integers(1, SMALL["vocab_size"], (n, T))
        mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
        types = (rng.random((n, T)) < 0.5).astype(np.int64) * mask
        ex = rng.permutation(1000)[:n]
        d = root / name
        c = fasttran.ActivationCache.build(enc, ids * mask, mask, types, example_ids=ex, disk_dir=d, **kw)
        want = _read_all(c, ex)
        np.save(root / f"{name}_ids.npy", ex)
        np.savez(root / f"{name}_want.npz", **{f"arr_{k}": a for k, a in enumerate(want)})
        out[name] = dict(dir=str(d), ids=str(root / f"{name}_ids.npy"), want=str(root / f"{name}_want.npz"),
                         partial="max_fraction" in kw)
    return out


def _manifest(d):
    man = json.loads((d / "manifest.json").read_text())
    man.pop("checksum")
    return man


def _container(raw):
    """(header length, header dict, {array: (start, end)} absolute byte ranges)."""
    (hlen,) = struct.unpack("<Q", raw[8:16])
    head = json.loads(bytes(raw[16:16 + hlen]))
    base = 16 + hlen
    return hlen, head, {k: (base + v[2], base + v[2] + v[3]) for k, v in head["arrays"].items()}


def _resign_file(d, name, man):
    """Record file `name`'s current size and CRC in the manifest and re-sign it."""
    raw = (d / name).read_bytes()
    rec = man["index"] if name == "index.bin" else next(e for e in man["shards"] if e["file"] == name)
    rec["bytes"], rec["crc32c"] = len(raw), fasttran._C.crc32c(raw)
    persist.write_manifest(str(d), man)


VALUES = [None, True, False, 0, 1, -1, 2, 3, 7, 64, 2 ** 31, 2 ** 62, -2 ** 62, 10 ** 30, 0.5, 1.5, float("nan"),
          float("inf"), "", "x", "float16", "bfloat16", "int8", "float32", "cls", "mean", "all", [], {}, [1, 2, 3],
          {"a": 1}, "0" * 64]
NAMES = ["../outside.bin", "ABS", "shard-000000.bin/", "./shard-000000.bin", "sub/shard-000000.bin", "shard-00000.bin",
         "shard-0000000.bin", "index.bin", "manifest.json", "SHARD-000000.bin", "shard-000000.bin\x00",
         " shard-000000.bin", "shard-000999.bin", "..", "", "shard-000001.bin"]


def _pick_value(rng, old):
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.5:
        return int(rng.choice([old + 1, old - 1, old * 2, old // 2, -old, old + 64]))
    return VALUES[rng.integers(len(VALUES))]


def mutate_manifest(d, rng, outside):
    man = _manifest(d)
    op = rng.integers(9)
    must_refuse = False
    if op <= 3:   # one field gets another value
        paths = [("format",), ("version",), ("model",), ("complete",), ("error",), ("build_seconds",),
                 ("index", "bytes"), ("index", "crc32c")]
        paths += [("settings", k) for k in man["settings"]] * 3
        paths += [("config", k) for k in ("hidden_size", "num_hidden_layers", "vocab_size", "type_vocab_size",
                                          "max_position_embeddings")]
        paths += [("shards", i, k) for i in range(len(man["shards"])) for k in ("bytes", "crc32c", "rows")]
        path = paths[rng.integers(len(paths))]
        obj = man
        for p in path[:-1]:
            obj = obj[p]
        obj[path[-1]] = _pick_value(rng, obj[path[-1]])
        what = f"manifest {'.'.join(map(str, path))} = {obj[path[-1]]!r}"
    elif op <= 5 and man["shards"]:   # a shard's file name
        i = int(rng.integers(len(man["shards"])))
        name = NAMES[rng.integers(len(NAMES))]
        if name == "ABS":
            name = outside
        man["shards"][i]["file"] = name
        must_refuse = name in (outside, "../outside.bin")
        what = f"manifest shards[{i}].file = {name!r}"
    elif op == 6:   # a key deleted or added
        obj = [man, man["settings"], man["index"]] + man["shards"]
        obj = obj[rng.integers(len(obj))]
        if rng.random() < 0.5 and obj:
            k = list(obj)[rng.integers(len(obj))]
            del obj[k]
            what = f"manifest: key {k} deleted"
        else:
            obj["extra"] = 1
            what = "manifest: key added"
    elif op == 7 and man["shards"]:   # shard list edits
        sh = man["shards"]
        e = rng.integers(4)
        if e == 0:
            sh.append(dict(sh[rng.integers(len(sh))]))
            what = "manifest: shard listed twice"
        elif e == 1:
            sh.pop(rng.integers(len(sh)))
            what = "manifest: shard dropped (valid: recomputed)"
        elif e == 2 and len(sh) > 1:
            i, j = rng.choice(len(sh), 2, replace=False)
            sh[i]["file"], sh[j]["file"] = sh[j]["file"], sh[i]["file"]
            what = "manifest: two shard names swapped"
        else:
            sh.reverse()
            what = "manifest: shards reordered (valid)"
    else:
        man["settings"]["dtype"] = {"float16": "bfloat16", "bfloat16": "float16", "int8": "float32",
                                    "float32": "int8"}[man["settings"]["dtype"]]
        what = "manifest: dtype disagrees with the shards"
    persist.write_manifest(str(d), man)
    return what, must_refuse


def _flip(raw, rng, lo, hi, k):
    for _ in range(k):
        if hi > lo:
            raw[int(rng.integers(lo, hi))] ^= int(rng.integers(1, 256))


def _header_edit(head, rng):
    arrays, meta = head["arrays"], head["meta"]
    e = rng.integers(7)
    name = list(arrays)[rng.integers(len(arrays))]
    if e == 0:
        arrays[name][0] = ["<f4", "<u2", "|i1", "<i8", "<f2", ">f4", "<u8", "|u1"][rng.integers(8)]
    elif e == 1 and arrays[name][1]:
        dims = arrays[name][1]
        dims[rng.integers(len(dims))] += int(rng.choice([-1, 1, 2]))
    elif e == 2:
        arrays[name][2] += int(rng.choice([-64, 64, 1, -1]))
    elif e == 3:
        arrays[name][3] += int(rng.choice([-4, 4, 64]))
    elif e == 4 and meta:
        k = list(meta)[rng.integers(len(meta))]
        meta[k] = _pick_value(rng, meta[k])
    elif e == 5:
        head["arrays"] = dict(reversed(list(arrays.items())))
    else:
        arrays[name + "x"] = arrays.pop(name)
    return f"header edit {e} on {name}"


def mutate_file(d, name, rng, man):
    """Damage (not re-signed) or edit-and-re-sign the container `name` of cache dir d."""
    p = d / name
    raw = bytearray(p.read_bytes())
    hlen, head, regions = _container(raw)
    op = rng.integers(10)
    if op == 0:
        _flip(raw, rng, 0, len(raw), int(rng.integers(1, 4)))
        p.write_bytes(bytes(raw))
        return f"{name}: bytes flipped"
    if op == 1:
        p.write_bytes(bytes(raw[:int(rng.integers(0, len(raw)))]) if rng.random() < 0.7 else bytes(raw) + b"\0" * 64)
        return f"{name}: truncated or extended"
    if op == 2:
        p.unlink()
        return f"{name}: deleted"
    # edited and re-signed: a tool that writes a wrong file and records its checksum
    if op <= 4:
        what = _header_edit(head, rng)
        text = json.dumps(head).encode()
        if len(text) <= hlen:
            raw[16:16 + hlen] = text + b" " * (hlen - len(text))
        else:
            _flip(raw, rng, 16, 16 + hlen, 1)
            what = "header byte flipped"
    elif op == 5:
        _flip(raw, rng, 0, 16 + hlen, int(rng.integers(1, 3)))
        what = "header bytes flipped"
    elif op == 6:
        raw[8:16] = struct.pack("<Q", int(rng.choice([0, hlen - 64, hlen + 64, len(raw), 2 ** 62])))
        what = "header length edited"
    else:   # an array whose contents other files cross-check (never the values: those are data)
        keys = [k for k in regions if k not in ("values", "scales")]
        k = keys[rng.integers(len(keys))]
        a, b = regions[k]
        _flip(raw, rng, a, b, 1)
        what = f"array {k} edited"
    p.write_bytes(bytes(raw))
    _resign_file(d, name, man)
    return f"{name}: {what} (re-signed)"


def make_cache_cases(root, bases, model_dir, n):
    rng = np.random.default_rng(1)
    outside_src = root / "outside.bin"
    cases = []
    for k in range(n):
        base = list(bases)[k % len(bases)]
        b = bases[base]
        d = root / "cases" / f"c{k:04d}" / "cache"
        shutil.copytree(b["dir"], d)
        # a copy of a real shard outside the cache directory, for names that try to reach it
        shutil.copyfile(os.path.join(b["dir"], "shard-000000.bin"), d.parent / "outside.bin")
        outside = str(d.parent / "outside.bin")
        man = _manifest(d)
        r = rng.random()
        if r < 0.35:
            what, must_refuse = mutate_manifest(d, rng, outside)
        elif r < 0.7 and man["shards"]:
            what, must_refuse = mutate_file(d, man["shards"][rng.integers(len(man["shards"]))]["file"], rng, man), False
        else:
            what, must_refuse = mutate_file(d, "index.bin", rng, man), False
        cases.append(dict(kind="cache", dir=str(d), model=model_dir, ids=b["ids"], want=b["want"], what=what,
                          encoder=bool(b["partial"] or rng.random() < 0.5),
                          host_bytes=None if rng.random() < 0.5 else 0, must_refuse=must_refuse))
    assert outside_src  # (kept for clarity: every case has its own outside.bin)
    return cases


def test_mutated_caches_are_refused_or_exact(tmp_path):
    model_dir = make_dir(tmp_path)
    bases = build_bases(tmp_path, model_dir)
    # the unmutated bases read back exactly (the harness itself is right)
    clean = [dict(kind="cache", dir=b["dir"], model=model_dir, ids=b["ids"], want=b["want"], what=f"clean {n}",
                  encoder=True, host_bytes=h) for n, b in bases.items() for h in (None, 0)]
    cases = make_cache_cases(tmp_path, bases, model_dir, N_CACHE_CASES)
    results = run_cases(clean + cases, tmp_path)
    assert results[:len(clean)] == ["equal"] * len(clean), results[:len(clean)]
    counts, bad = summarize(cases, results[len(clean):], "mutated caches")
    assert not bad, bad[:5]
    assert counts.get("refused", 0) > N_CACHE_CASES // 2   # the mutations do bite


# ---- safetensors -------------------------------------------------------------------------------------

def _st_parts(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _st_pack(header_bytes, data):
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


def mutate_st(raw, rng):
    head, data = _st_parts(raw)
    op = rng.integers(10)
    names = [k for k in head if k != "__metadata__"]
    name = names[rng.integers(len(names))]
    if op == 0:
        out = bytearray(raw)
        _flip(out, rng, 0, min(len(out), 8 + len(raw) - len(data)), int(rng.integers(1, 4)))
        return bytes(out), "header bytes flipped"
    if op == 1:
        out = bytearray(raw)
        _flip(out, rng, 0, len(out), int(rng.integers(1, 4)))
        return bytes(out), "bytes flipped"
    if op == 2:
        return raw[:int(rng.integers(0, len(raw)))], "truncated"
    if op == 3:
        t = json.dumps(head).encode()
        i = t.find(name.encode())
        bad = bytes([int(rng.choice([0xff, 0xc0, 0x80, 0xed, 0xf5]))])
        return _st_pack(t[:i] + bad + t[i + 1:], data), "non-UTF-8 byte in a tensor name"
    if op == 4:
        return struct.pack("<Q", int(rng.choice([0, 1, len(raw), 2 ** 40, 2 ** 63]))) + raw[8:], "header length edited"
    e = head[name]
    if op == 5:
        e["dtype"] = ["F32", "F16", "BF16", "I64", "I8", "U16", "F8_E4M3", "X", 5][rng.integers(9)]
    elif op == 6:
        e["shape"] = [[], [0], [-1], [2 ** 62, 2 ** 62], e["shape"][::-1], e["shape"] + [1], "x"][rng.integers(7)]
    elif op == 7:
        e["data_offsets"] = [[0, 0], [-8, 0], [e["data_offsets"][0], 2 ** 63 - 1],
                             [e["data_offsets"][1], e["data_offsets"][0]], [0], "x", [0.5, 4]][rng.integers(7)]
    elif op == 8:
        head[name + "\u00e9"] = head.pop(name)
    else:
        t = json.dumps(head).encode()
        deep = b'"deep":' + b"[" * 200 + b"]" * 200 + b","
        return _st_pack(b"{" + deep + t[1:], data), "deeply nested header"
    t = json.dumps(head).encode()
    return _st_pack(t + b" " * (-len(t) % 8), data), f"header edit {op} on {name}"


def test_mutated_safetensors_are_refused_or_loaded(tmp_path):
    from fasttran.safetensors_io import write_safetensors
    model_dir = make_dir(tmp_path)
    raw_model = open(os.path.join(model_dir, "model.safetensors"), "rb").read()
    head_file = tmp_path / "head.safetensors"
    rng0 = np.random.default_rng(0)
    write_safetensors(head_file, {"classifier.weight": rng0.standard_normal((2, 8)).astype(np.float32),
                                  "classifier.bias": np.zeros(2, np.float32), "step": np.array([3], np.int64)},
                      {"format": "fasttran-head"})
    raw_head = head_file.read_bytes()
    rng = np.random.default_rng(2)
    cases = []
    for k in range(N_ST_CASES):
        d = tmp_path / "st" / f"s{k:04d}"
        d.mkdir(parents=True)
        if k % 2 == 0:
            raw, what = mutate_st(raw_model, rng)
            shutil.copyfile(os.path.join(model_dir, "config.json"), d / "config.json")
            (d / "model.safetensors").write_bytes(raw)
            cases.append(dict(kind="st-encoder", dir=str(d), what=what))
        else:
            raw, what = mutate_st(raw_head, rng)
            (d / "head.safetensors").write_bytes(raw)
            cases.append(dict(kind="st-read", file=str(d / "head.safetensors"), what=what))
    results = run_cases(cases, tmp_path)
    counts, bad = summarize(cases, results, "mutated safetensors")
    assert not bad, bad[:5]
    assert counts.get("refused", 0) > N_ST_CASES // 2
