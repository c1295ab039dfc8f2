"""Issue 14 on CUDA: the cache's device tier, and the Trainer on device="cuda".

Runs on a GPU, and without one on the CUDA emulator (FASTTRAN_CUDA=emu build, FASTTRAN_CUDA_EMU=1),
unchanged. The references are the same encoder's host-tier cache (the device tier must return
the same bits) and the CPU Trainer (a head trained on CUDA equals it within fp32 rounding: the
emulated cuBLAS and the CPU GEMMs add in different orders). What the emulator cannot check --
stream overlap, real copy speed -- is left to a GPU run (docs/architecture.md)."""
import gc
import os

import numpy as np
import pytest

import fasttran
from fasttran import _C

pytestmark = pytest.mark.skipif(not fasttran.cuda_available(),
                                reason="no usable CUDA device: " + str(fasttran.build_info()["cuda"]["unavailable_reason"]))

from conftest import make_checkpoint  # noqa: E402
from test_random_models import AWKWARD, batch  # noqa: E402

CODECS = ("float32", "float16", "bfloat16", "int8")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("m") / "m"), **AWKWARD)


@pytest.fixture(scope="module")
def enc_cuda(model):
    return fasttran.Encoder.from_pretrained(model, device="cuda")


@pytest.fixture(scope="module")
def inputs():
    return batch(np.random.default_rng(0), 26, 19, pad_frac=0.6)


def values(b, positions):
    return b[0] if positions == "all" else b


def host(x):
    return x.numpy() if isinstance(x, fasttran.Tensor) else x


# ---- the device tier -------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["mean", "all"])
@pytest.mark.parametrize("dtype", CODECS)
def test_device_tier_returns_the_host_tiers_bits(enc_cuda, inputs, positions, dtype, tmp_path):
    """Shards spread over the device, host memory and disk; every read path (get into host or
    device memory, padded and ragged, the prefetching reader) returns exactly what an all-host
    cache of the same encoder returns: the device decodes f16/bf16/int8 as the CPU does. (Not
    uncached examples: the CUDA encoder's bits depend on the batch an example is recomputed in.)"""
    ids, mask, types = inputs
    kw = dict(positions=positions, dtype=dtype, batch_size=4, show_progress=False)
    ref = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, **kw)
    row = ref._row_bytes * (1 if positions == "mean" else 12)
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, device_bytes=8 * row, host_bytes=6 * row,
                                       disk_dir=tmp_path / "c", **kw)
    t = c.stats()["tiers"]
    assert t["device"]["entries"] and t["host"]["entries"] and t["disk"]["entries"], t
    assert c.device == "cuda:0" and "device (cuda:0)" in repr(c)
    order = np.random.default_rng(1).permutation(len(ids))
    for ragged in ((False, True) if positions == "all" else (False,)):
        a = ref.get(order, ragged=ragged)
        for got in (c.get(order, ragged=ragged), c.get(order, ragged=ragged, output="device")):
            v = values(got, positions)
            assert np.array_equal(host(v), values(a, positions))
            if positions == "all":
                assert np.array_equal(got[1], a[1])
        assert values(c.get(order, ragged=ragged, output="device"), positions).device == "cuda:0"
        got = list(c.batches(5, seed=3, output="device", ragged=ragged))
        want = list(ref.batches(5, seed=3, ragged=ragged))
        assert len(got) == len(want)
        for (i1, b1), (i2, b2) in zip(got, want):
            assert np.array_equal(i1, i2)
            assert values(b1, positions).device == "cuda:0"
            assert np.array_equal(values(b1, positions).numpy(), values(b2, positions))


def test_fp32_device_cache_is_the_encoders_output(enc_cuda, inputs):
    """fp32 device tier, pooled: each example's row is bit for bit what the CUDA encoder gives for
    its build batch (the plan pads a batch to its longest, and the CUDA encoder's output for an
    example is read at that padding)."""
    ids, mask, types = inputs
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="mean", batch_size=5,
                                       device_bytes=1 << 20, show_progress=False)
    assert c.stats()["tiers"]["device"]["entries"] == len(ids)
    for b in range(c._plan.n_batches):
        idx = c._plan.shard_examples(b, len(ids))
        ex_ids, ex_mask, ex_types = c.inputs(c.example_ids[idx])
        want = enc_cuda.forward(ex_ids, ex_mask, ex_types, output_layers=c.layer, pooling="mean")
        assert np.array_equal(c.get(c.example_ids[idx], output="device").numpy(), want)


def test_device_tier_out_buffer_and_uncached_on_device(enc_cuda, inputs):
    ids, mask, types = inputs
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="all", batch_size=4,
                                       device_bytes=1 << 20, show_progress=False)
    u = fasttran.ActivationCache.uncached(enc_cuda, ids, mask, types, positions="all", batch_size=4)
    ex = np.arange(7)
    want, offs = c.get(ex, ragged=True)
    out = fasttran.from_dlpack(np.full(want.size + 100, np.nan, np.float32)).to("cuda")
    v, o = c.get(ex, ragged=True, output="device", out=out)
    assert v.data_ptr == out.data_ptr and np.array_equal(v.numpy(), want) and np.array_equal(o, offs)
    # recomputed on the host side, then copied up (CUDA bits depend on the batch: fp32 rounding)
    assert np.allclose(u.get(ex, ragged=True, output="device")[0].numpy(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(fasttran.InputError, match="room for"):
        c.get(ex, ragged=True, output="device", out=fasttran.from_dlpack(np.zeros(5, np.float32)).to("cuda"))
    with pytest.raises(fasttran.InputTypeError, match="cuda:0"):
        c.get(ex, ragged=True, output="device", out=np.zeros(want.size, np.float32))


def test_device_tier_persists_and_reopens(enc_cuda, inputs, tmp_path):
    ids, mask, types = inputs
    kw = dict(positions="mean", dtype="int8", batch_size=4, show_progress=False)
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, device_bytes=1 << 20, disk_dir=tmp_path / "c", **kw)
    want = c.get(np.arange(len(ids)))
    r = fasttran.ActivationCache.open(tmp_path / "c", encoder=enc_cuda, device_bytes=300)
    t = r.stats()["tiers"]
    assert t["device"]["entries"] and t["host"]["entries"]
    assert np.array_equal(r.get(np.arange(len(ids)), output="device").numpy(), want)
    with pytest.raises(fasttran.InputError, match="device_bytes needs an encoder on a CUDA device"):
        fasttran.ActivationCache.open(tmp_path / "c", device_bytes=300)


def test_device_tier_refused_on_the_cpu(model, inputs):
    ids, mask, types = inputs
    cpu = fasttran.Encoder.from_pretrained(model)
    with pytest.raises(fasttran.InputError, match="device_bytes needs an encoder on a CUDA device"):
        fasttran.ActivationCache.build(cpu, ids, mask, types, device_bytes=1 << 20)
    c = fasttran.ActivationCache.build(cpu, ids, mask, types, positions="mean", show_progress=False)
    assert c.device == "cpu"
    assert c.get([0, 1], output="device").device == "cpu"            # as before: a CPU Tensor
    t = c.get([0, 1], output="device", device="cuda")                  # a CPU cache read into CUDA memory
    assert t.device == "cuda:0" and np.array_equal(t.numpy(), c.get([0, 1]))
    with pytest.raises(fasttran.InputError, match="device= goes with output='device'"):
        c.get([0, 1], device="cuda")


def test_device_tier_frees_its_memory(model, inputs):
    """Shards, batches and staging are released with the cache and the reader (the emulator poisons and
    tracks every allocation: a device buffer read after it was freed would fail a later read)."""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model, device="cuda")
    for _ in range(2):
        c = fasttran.ActivationCache.build(enc, ids, mask, types, positions="all", batch_size=4, device_bytes=1 << 20,
                                           show_progress=False)
        it = c.batches(4, output="device", ragged=True)
        first = next(it)
        it.close()
        want = c.get(first[0], ragged=True)[0]
        del c, it
        gc.collect()
        assert np.array_equal(first[1][0].numpy(), want)   # a batch handed out outlives its reader and cache
        del first
        gc.collect()
