"""The cache's C read path and its Python<->C contract, on a small random model: get() into a
caller's buffer, the prefetching reader's lifetime (batches outlive it, close mid-epoch, errors
from the thread), the public methods the Trainer uses, keyword-only binding functions and the C
enums, and the one atomic writer."""
import errno
import gc
import os

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, _C
from fasttran.errors import CacheCorruptError, FastTranIOError, InputError, InputRangeError, InputTypeError
from test_bad_input import SMALL, make_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    enc = fasttran.Encoder.from_pretrained(make_dir(d), load_tokenizer=False)
    rng = np.random.default_rng(0)
    n, T = 40, SMALL["max_position_embeddings"]
    lengths = rng.integers(1, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1, SMALL["vocab_size"], (n, T)) * mask
    types = (rng.random((n, T)) < 0.5).astype(np.int64) * mask
    return enc, ids, mask, types, lengths


@pytest.mark.parametrize("positions,dtype", [("mean", "float32"), ("all", "float16"), ("all", "int8")])
def test_get_into_a_callers_buffer(setup, positions, dtype):
    enc, ids, mask, types, lengths = setup
    c = ActivationCache.build(enc, ids, mask, types, positions=positions, dtype=dtype, batch_size=8, max_fraction=0.5)
    pick = np.array([3, 30, 7, 1, 22])
    for ragged in (False, True):
        ref = c.get(pick, ragged=ragged)
        buf = np.full(10000, np.nan, np.float32)
        got = c.get(pick, ragged=ragged, out=buf)
        ref_v, got_v = (ref[0], got[0]) if positions == "all" else (ref, got)
        assert np.shares_memory(got_v, buf) and np.array_equal(got_v, ref_v)
        assert np.isnan(buf[got_v.size:]).all()                      # nothing written past the batch
        if positions == "all":
            assert np.array_equal(got[1], ref[1])
    with pytest.raises(InputError, match="room for 3 floats"):
        c.get(pick, out=np.empty(3, np.float32))
    with pytest.raises(InputTypeError, match="float32"):
        c.get(pick, out=np.empty(10000, np.float64))
    with pytest.raises(InputRangeError, match="unknown example id 99"):
        c.get([1, 99])
    with pytest.raises(InputError, match="1-D sequence of ints"):
        c.get([[1, 2]])
    # the inputs the Trainer reads through public methods
    assert np.array_equal(c.index_of(np.array([30, 3])), [30, 3]) and np.array_equal(c.lengths, lengths)
    i, m, t = c.inputs(pick)
    assert np.array_equal(m.sum(1), lengths[pick]) and np.array_equal(i * m, ids[pick][:, :i.shape[1]] * m)
    fi, ft, off = c.inputs(pick, ragged=True)
    assert np.array_equal(np.diff(off), lengths[pick]) and np.array_equal(fi, i[m.astype(bool)])
    at = c.index_of(pick)   # by position in the example order, as epoch_order gives them
    for got, want in zip(c.inputs_at(at, ragged=True) + c.inputs_at(at), (fi, ft, off, i, m, t)):
        assert np.array_equal(got, want)
    with pytest.raises(InputRangeError, match=f"index holds {len(ids)}: the cache's positions are 0..{len(ids) - 1}"):
        c.inputs_at([0, len(ids)])
    with pytest.raises(InputError, match="1-D array of example positions"):
        c.inputs_at([[0]])


def test_reader_lifetime_and_close(setup):
    enc, ids, mask, types, lengths = setup
    c = ActivationCache.build(enc, ids, mask, types, positions="all", batch_size=8, max_fraction=0.7)
    kept = list(c.batches(6, seed=1, ragged=True))   # every batch kept: buffers must not be reused
    gc.collect()
    for ex, (vals, off) in kept:
        ref, roff = c.get(ex, ragged=True)
        assert np.array_equal(vals, ref) and np.array_equal(off, roff)
    assert sorted(np.concatenate([ex for ex, _ in kept]).tolist()) == sorted(range(len(ids)))
    it = c.batches(4, seed=2, prefetch=3)
    ex, first = next(it)
    it.close()                                        # mid-epoch: the thread stops, the batch stays valid
    assert list(it) == []
    assert np.array_equal(first[0], c.get(ex)[0])
    del it
    gc.collect()
    assert np.isfinite(first[0]).all()
    it = c.batches(5, seed=3, start=2, drop_last=True)
    assert len(it) == len(ids) // 5 - 2 and len(list(it)) == len(ids) // 5 - 2
    with pytest.raises(InputError, match="prefetch"):
        c.batches(4, prefetch=0)
    # closed from another thread while one iterates (or waits in next()): the iteration ends
    import threading
    errors = []

    def consume(it, got):
        try:
            got.extend(it)
        except BaseException as e:   # noqa: BLE001 -- the test asserts there is none
            errors.append(e)
    for k in range(20):
        it, got = c.batches(3, seed=k, ragged=True), []
        t = threading.Thread(target=consume, args=(it, got))
        t.start()
        it.close()
        t.join()
        assert not errors, errors
        for ex, (vals, off) in got:
            assert np.array_equal(vals, c.get(ex, ragged=True)[0])


def test_epoch_order_is_a_uniform_permutation_drawn_by_the_reader(setup):
    """The shuffled epoch's order: a permutation, a pure function of (seed, n), uniform (chi-square
    over every permutation of 4 and over (position, value) pairs of 50), and what batches() reads,
    with start and drop_last, the shuffle running on the reader's thread."""
    assert sorted(_C.epoch_order(7, 1000).tolist()) == list(range(1000))
    assert np.array_equal(_C.epoch_order(7, 1000), _C.epoch_order(7, 1000))
    assert not np.array_equal(_C.epoch_order(7, 1000), _C.epoch_order(8, 1000))
    assert _C.epoch_order(3, 0).shape == (0,) and _C.epoch_order(3, 1).tolist() == [0]
    # fixed values: the order of a seed must never change between machines or versions of this code
    assert _C.epoch_order(5, 10).tolist() == [7, 6, 5, 8, 2, 1, 0, 9, 4, 3]
    import itertools
    perms = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.bincount([perms[tuple(_C.epoch_order(s, 4))] for s in range(12000)], minlength=24)
    assert ((counts - 500) ** 2 / 500).sum() < 49.7           # chi-square, 23 dof, p = 0.001
    pos = np.zeros((50, 50))
    for s in range(4000):
        pos[np.arange(50), _C.epoch_order(s, 50)] += 1
    assert ((pos - 80) ** 2 / 80).sum() < 2401 + 3.1 * np.sqrt(2 * 2401)   # 2401 dof, p ~ 0.001
    with pytest.raises(InputError, match="seed"):
        _C.epoch_order(-1, 3)
    with pytest.raises(InputError, match=">= 0"):
        _C.epoch_order(1, -3)
    enc, ids, mask, types, lengths = setup
    c = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=8)
    N = len(ids)
    for seed in (0, 11, 2 ** 64 - 1, -5):
        order = c.epoch_order(seed)
        assert np.array_equal(order, _C.epoch_order(seed % 2 ** 64, N))
        for bs, start, drop in ((7, 0, False), (7, 2, True), (40, 0, False), (3, 5, False), (6, 99, False)):
            want = order[:N // bs * bs] if drop else order
            want = want[start * bs:]
            got = [ex for ex, _ in c.batches(bs, seed=seed, start=start, drop_last=drop)]
            assert len(got) == -(-len(want) // bs)
            flat = np.concatenate(got) if got else np.zeros(0, np.int64)
            assert np.array_equal(flat, c.example_ids[want]), (seed, bs, start, drop)
    assert np.array_equal(c.epoch_order(shuffle=False), np.arange(N))
    chunked = c.epoch_order(4, sampling="chunked", chunk_bytes=1000)
    assert sorted(chunked.tolist()) == list(range(N))
    got = np.concatenate([ex for ex, _ in c.batches(5, seed=4, sampling="chunked", chunk_bytes=1000)])
    assert np.array_equal(got, c.example_ids[chunked])
    a, b = c.epoch_order(), c.epoch_order()                   # seed=None: a fresh one each time
    assert sorted(a.tolist()) == list(range(N)) and not np.array_equal(a, b)
    with pytest.raises(InputError, match="seed must be an int"):
        c.batches(4, seed="x")
    with pytest.raises(InputError, match="sampling"):
        c.epoch_order(1, sampling="bogus")


def test_reader_reports_a_damaged_disk_shard(setup, tmp_path):
    enc, ids, mask, types, lengths = setup
    ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=8, disk_dir=tmp_path / "c")
    shard = sorted(p for p in os.listdir(tmp_path / "c") if p.startswith("shard-"))[-1]
    raw = bytearray((tmp_path / "c" / shard).read_bytes())
    raw[-7] ^= 0x20
    (tmp_path / "c" / shard).write_bytes(bytes(raw))
    c = ActivationCache.open(tmp_path / "c", host_bytes=0)   # disk tier: checked before the first read
    with pytest.raises(CacheCorruptError, match=f"{shard} fails its checksum"):
        for _ in c.batches(8, shuffle=False):
            pass
    with pytest.raises(CacheCorruptError, match="checksum"):
        c.get(np.arange(len(ids)))
    partial = ActivationCache.build(enc, ids, mask, types, positions="mean", batch_size=8, max_fraction=0.5,
                                    disk_dir=tmp_path / "p")
    assert partial.stats()["cached"] == 20
    reopened = ActivationCache.open(tmp_path / "p")          # no encoder: uncached examples cannot be read
    with pytest.raises(InputError, match="no encoder to compute it"):
        reopened.batches(8)
    assert np.array_equal(reopened.get(np.arange(20)), partial.get(np.arange(20)))


def test_binding_contract():
    # the C enums, exported, not copied by hand
    assert _C.CACHE_CODECS["int8"][0] == _C.DTYPES["int8"] and _C.CACHE_CODECS["bfloat16"][1] == "<u2"
    assert _C.POOLINGS == {"none": 0, "cls": 1, "mean": 2} and set(_C.DEVICE_KINDS) == {"cpu", "cuda"}
    assert _C.CACHE_LAYOUTS == {"padded": 0, "ragged": 1}
    # functions with several arguments take keywords only, checked at the boundary
    with pytest.raises(TypeError, match="keyword arguments only"):
        _C.CacheStore(np.arange(2), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(3, np.int64), 4, 0, False, 0,
                      1, 2)
    with pytest.raises(TypeError, match="keyword arguments only"):
        _C.cache_encode(np.zeros((1, 4), np.float32), 0)
    with pytest.raises(ValueError, match="not one of _C.CACHE_CODECS"):
        _C.cache_encode(src=np.zeros((1, 4), np.float32), codec=_C.DTYPES["int64"])
    with pytest.raises(TypeError, match="src must be a C-contiguous"):
        _C.cache_encode(src=np.zeros((4, 4), np.float32).T, codec=0)
    with pytest.raises(ValueError, match="duplicate example id 1"):
        _C.CacheStore(example_ids=np.array([1, 1]), tokens=np.zeros(0, np.int32), types=np.zeros(0, np.int32),
                      offsets=np.zeros(3, np.int64), hidden=4, codec=0, all_tokens=False, layer=0, pooling=1,
                      recompute_batch=2)


def test_one_atomic_writer(tmp_path):
    p = tmp_path / "f.bin"
    size, crc = _C.atomic_write(str(p), [b"abc", np.arange(4, dtype=np.int32), memoryview(b"xy")])
    data = p.read_bytes()
    assert size == len(data) == 3 + 16 + 2 and crc == _C.crc32c(data) and not list(tmp_path.glob("*.tmp.*"))
    with pytest.raises(FastTranIOError) as e:
        _C.atomic_write(str(tmp_path / "missing" / "f.bin"), [b"x"])
    assert e.value.errno == errno.ENOENT and "No such file" in str(e.value)
    # save_pretrained's config.json and model.safetensors go through it too
    d = make_dir(tmp_path)
    enc = fasttran.Encoder.from_pretrained(d, load_tokenizer=False)
    enc.save_pretrained(tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    again = fasttran.Encoder.from_pretrained(tmp_path / "out", load_tokenizer=False)
    assert all(np.array_equal(a, again.state_dict()[k]) for k, a in enc.state_dict().items())
