"""ActivationCache on real MiniLM + real SST-2 sentences: exactness, codecs, tiers, partial
caching, sampling, persistence, corruption, bad input, and a torch training loop."""
import errno
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache
from fasttran.errors import (CacheCorruptError, CacheMismatchError, FastTranIOError, InputError,
                             InputRangeError)

N = 240


@pytest.fixture(scope="module")
def enc(minilm_dir):
    return fasttran.Encoder.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def data(enc, sst2_sentences):
    from fasttran.data import load_sst2
    import conftest
    labels = load_sst2(conftest.sst2_file("dev"))[1][:N]
    ids, mask, types = enc.tokenize(sst2_sentences[:N])
    return ids, mask, types, np.asarray(labels)


@pytest.fixture(scope="module")
def full_mean(enc, data):
    ids, mask, types, _ = data
    return ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32)


def planned_forward(cache, enc, data, idx, **kw):
    """The encoder run on examples idx padded to the length the cache's build used."""
    ids, mask, types, _ = data
    T = int(cache._pad_to[idx[0]])
    assert (cache._pad_to[idx] == T).all()
    return enc.forward(ids[idx, :T], mask[idx, :T], types[idx, :T], output_layers=cache.layer, **kw)


def test_float32_is_bitwise_the_encoder(enc, data, full_mean):
    c = full_mean
    for b in range(c._n_plan_batches):
        idx = c._order[b * c.batch_size:(b + 1) * c.batch_size]
        ref = planned_forward(c, enc, data, idx, pooling="mean")
        assert np.array_equal(c.get(c.example_ids[idx]), ref)
    # and equal to a plain forward of the padded batch up to float rounding
    ids, mask, types, _ = data
    assert np.abs(c.get(np.arange(N)) - enc.forward(ids, mask, types, pooling="mean")).max() < 1e-5
    assert c.stats()["error"]["max_abs"] == 0.0


def test_all_positions_ragged_and_padded(enc, data):
    ids, mask, types, _ = data
    c = ActivationCache.build(enc, ids, mask, types, positions="all", layer=3, batch_size=32)
    lengths = mask.sum(1)
    assert c.stats()["rows"] == lengths.sum()
    pick = np.array([3, 100, 7, 200])
    vals, m = c.get(pick)
    assert vals.shape == (4, lengths[pick].max(), enc.hidden_size)
    assert np.array_equal(m.sum(1), lengths[pick])
    assert not vals[~m.astype(bool)].any()                       # padding is zero
    flat, off = c.get(pick, ragged=True)
    assert np.array_equal(np.diff(off), lengths[pick])
    for j, i in enumerate(pick):
        ref = planned_forward(c, enc, data, np.array([i]))[0, :lengths[i]]
        assert np.array_equal(vals[j, :lengths[i]], ref)
        assert np.array_equal(flat[off[j]:off[j + 1]], ref)
    st = c.stats()
    assert st["padded_float32_bytes"] > st["tiers"]["host"]["bytes"]


@pytest.mark.parametrize("codec,bound", [("float16", 1e-3), ("bfloat16", 8e-3), ("int8", 2e-2)])
def test_codecs_error_bounds(enc, data, full_mean, codec, bound):
    ids, mask, types, _ = data
    c = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, dtype=codec)
    ref = full_mean.get(np.arange(N))
    got = c.get(np.arange(N))
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel <= bound
    st = c.stats()["error"]
    assert abs(st["relative"] - rel) <= 1e-6 and np.isclose(st["max_abs"], np.abs(got - ref).max(), rtol=1e-5)
    if codec == "int8":   # per-vector scale: |err| <= max|x| / 254 per element
        assert (np.abs(got - ref) <= np.abs(ref).max(1, keepdims=True) / 254 * (1 + 1e-5)).all()
    assert c.stats()["tiers"]["host"]["bytes"] < full_mean.stats()["tiers"]["host"]["bytes"]


def test_tier_spill_partial_and_chunked(enc, data, full_mean, tmp_path):
    ids, mask, types, _ = data
    ref = full_mean.get(np.arange(N))
    c = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, host_bytes=3 * 32 * 384 * 4,
                              disk_dir=tmp_path / "c")
    t = c.stats()["tiers"]
    assert t["host"]["entries"] == 96 and t["disk"]["entries"] == N - 96 and t["uncached"]["entries"] == 0
    assert np.array_equal(c.get(np.arange(N)), ref)
    p = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, max_fraction=0.3)
    assert p.stats()["cached"] == int(0.3 * N)
    assert np.array_equal(p.get(np.arange(N)), ref)          # misses recomputed, bitwise the same
    assert 0 < p.stats()["hit_rate"] < 1
    nobudget = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, host_bytes=10000)
    assert nobudget.stats()["tiers"]["uncached"]["entries"] == N
    assert np.array_equal(nobudget.get(np.arange(N)), ref)
    for kw in (dict(sampling="random"), dict(sampling="chunked", chunk_bytes=20000)):
        seen = []
        for ex, batch in c.batches(50, seed=0, **kw):
            assert np.array_equal(batch, ref[ex])
            seen.extend(ex.tolist())
        assert sorted(seen) == list(range(N))                  # every example exactly once
    twice = [e for ex, _ in c.batches(64, sampling="chunked", chunk_bytes=20000, passes_per_chunk=2) for e in ex]
    assert np.array_equal(np.bincount(twice), np.full(N, 2))


def test_persistence_across_processes_and_refusals(enc, data, full_mean, tmp_path, checkpoint):
    ids, mask, types, _ = data
    d = tmp_path / "p"
    ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, disk_dir=d, example_ids=np.arange(N) * 3)
    code = ("import sys, numpy as np, fasttran; c = fasttran.ActivationCache.open(sys.argv[1]); "
            "np.save(sys.argv[2], c.get(np.arange(%d) * 3))" % N)
    out = tmp_path / "x.npy"
    subprocess.run([sys.executable, "-c", code, str(d), str(out)], check=True, cwd=str(tmp_path))
    assert np.array_equal(np.load(out), full_mean.get(np.arange(N)))
    # another model, other inputs
    other = fasttran.Encoder.from_pretrained(checkpoint(vocab_size=31000, hidden_size=384, num_attention_heads=4,
                                                        intermediate_size=64, num_hidden_layers=1))
    with pytest.raises(CacheMismatchError, match="another model"):
        ActivationCache.open(d, encoder=other)
    ids2 = ids.copy()
    ids2[5, 1] += 1
    with pytest.raises(CacheMismatchError, match="other inputs"):
        ActivationCache.open(d, input_ids=ids2, attention_mask=mask, token_type_ids=types)
    with pytest.raises(CacheMismatchError, match="differ"):
        ActivationCache.build(enc, ids2, mask, types, positions="mean", batch_size=32, disk_dir=d, example_ids=np.arange(N) * 3)
    r = ActivationCache.build(enc, ids2, mask, types, positions="mean", batch_size=32, disk_dir=d,
                              example_ids=np.arange(N) * 3, rebuild=True)
    assert np.array_equal(r.get([15]), enc.forward(ids2[5:6, :r._pad_to[5]], mask[5:6, :r._pad_to[5]],
                                                   types[5:6, :r._pad_to[5]], pooling="mean"))


KILL_SCRIPT = r"""
import os, signal, sys, numpy as np, fasttran, fasttran.cache.persist as fc
ids, mask, types = (np.load(sys.argv[2] + n) for n in ("ids.npy", "mask.npy", "types.npy"))
enc = fasttran.Encoder.from_pretrained(sys.argv[3])
real = fc._atomic_write
count = [0]
def write(path, chunks):
    r = real(path, chunks)
    if "shard-" in path:
        count[0] += 1
        if count[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    return r
fc._atomic_write = write
fasttran.ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, disk_dir=sys.argv[1])
"""


def test_resume_after_sigkill(enc, data, full_mean, tmp_path, minilm_dir):
    ids, mask, types, _ = data
    for n, a in (("ids.npy", ids), ("mask.npy", mask), ("types.npy", types)):
        np.save(tmp_path / n, a)
    d = tmp_path / "k"
    p = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(d), str(tmp_path) + "/", minilm_dir], cwd=str(tmp_path))
    assert p.returncode == -signal.SIGKILL
    man = json.load(open(d / "manifest.json"))
    # killed after the 3rd shard file, before the manifest named it: 2 shards count as done
    assert len(man["shards"]) == 2 and not man["complete"]
    calls = []
    real = enc.forward
    enc.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        c = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, disk_dir=d)
    finally:
        del enc.forward
    assert len(calls) == c._n_plan_batches - 2                 # only the missing batches ran
    assert np.array_equal(c.get(np.arange(N)), full_mean.get(np.arange(N)))
    assert json.load(open(d / "manifest.json"))["complete"]


def test_corruption_is_detected(enc, data, tmp_path):
    ids, mask, types, _ = data
    d = tmp_path / "z"
    ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, disk_dir=d)
    shards = sorted(f for f in os.listdir(d) if f.startswith("shard-"))
    victim = d / shards[2]
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x10                                            # one flipped bit in the values
    victim.write_bytes(bytes(raw))
    with pytest.raises(CacheCorruptError, match="checksum"):    # host tier: verified on open
        ActivationCache.open(d)
    c = ActivationCache.open(d, host_bytes=0)                    # disk tier: verified on first read
    with pytest.raises(CacheCorruptError, match="checksum"):
        c.get(np.arange(N))
    victim.write_bytes(bytes(raw[:-5000]))
    with pytest.raises(CacheCorruptError, match="truncated"):
        ActivationCache.open(d)
    victim.unlink()
    with pytest.raises(CacheCorruptError, match="missing"):
        ActivationCache.open(d)
    m = (d / "manifest.json").read_text().replace('"layer": 6', '"layer": 5')
    (d / "manifest.json").write_text(m)
    with pytest.raises(CacheCorruptError, match="manifest"):
        ActivationCache.open(d)


def test_bad_input_and_disk_full(enc, data, tmp_path, monkeypatch):
    ids, mask, types, _ = data
    c = ActivationCache.build(enc, ids[:40], mask[:40], types[:40], positions="cls", batch_size=16)
    with pytest.raises(InputRangeError, match="unknown example id 40"):
        c.get([1, 40])
    with pytest.raises(InputError, match="duplicate example id 3"):
        ActivationCache.build(enc, ids[:4], mask[:4], example_ids=[1, 3, 3, 5])
    with pytest.raises(InputError, match="shape"):
        ActivationCache.build(enc, ids[:4], mask[:3])
    with pytest.raises(InputError, match="host_bytes"):
        ActivationCache.build(enc, ids[:4], mask[:4], host_bytes=-1)
    with pytest.raises(InputError, match="max_fraction"):
        ActivationCache.build(enc, ids[:4], mask[:4], max_fraction=1.5)
    with pytest.raises(InputError, match="positions"):
        ActivationCache.build(enc, ids[:4], mask[:4], positions="first")
    with pytest.raises(InputError, match="right-padded"):
        m = mask[:4].copy(); m[0, 1] = 0
        ActivationCache.build(enc, ids[:4], m, positions="all")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FastTranIOError, match="not writable"):
        ActivationCache.build(enc, ids[:4], mask[:4], disk_dir=tmp_path / "file" / "sub")
    # disk full on the 3rd shard: a clear error, and the first two shards stay usable
    import fasttran.cache.persist as fc
    real, n = fc._atomic_write, [0]

    def full(path, chunks):
        if "shard-" in path:
            n[0] += 1
            if n[0] == 3:
                raise FastTranIOError(errno.ENOSPC, f"cannot write cache file {path}: No space left on device")
        return real(path, chunks)
    monkeypatch.setattr(fc, "_atomic_write", full)
    d = tmp_path / "full"
    with pytest.raises(FastTranIOError, match="No space left"):
        ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=32, disk_dir=d)
    monkeypatch.setattr(fc, "_atomic_write", real)
    kept = ActivationCache.open(d, encoder=enc)
    assert kept.stats()["cached"] == 64
    assert not [f for f in os.listdir(d) if ".tmp." in f]      # no half-written files left


def test_torch_training_loop_and_dlpack(data, full_mean):
    torch = pytest.importorskip("torch")
    _, _, _, labels = data
    ds = full_mean.torch_dataset(labels)
    loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, collate_fn=ds.collate,
                                         generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    head = torch.nn.Linear(384, 2)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for epoch in range(15):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(head(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    x, y = ds.__getitems__(list(range(N)))
    acc = (head(x).argmax(1) == y).float().mean().item()
    assert np.mean(losses[-8:]) < np.mean(losses[:8]) and acc > 0.8
    t = full_mean.get([1, 2, 3], output="device")
    a = torch.from_dlpack(t)
    assert a.data_ptr() == t.data_ptr and torch.equal(a, torch.from_numpy(full_mean.get([1, 2, 3])))
    assert "ActivationCache(examples=240" in repr(full_mean) and "<table>" in full_mean._repr_html_()
