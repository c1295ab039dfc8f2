"""fasttran.Tensor and DLPack on the CPU: device outputs of the encoder are zero-copy for
torch and NumPy, both capsule kinds work, memory outlives the Encoder, imports are in place."""
import gc

import numpy as np
import pytest

import fasttran
from fasttran.errors import InputError, InputTypeError, UnsupportedError

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def enc(minilm_dir):
    return fasttran.Encoder.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 5000, (3, 9))
    mask = np.ones((3, 9), np.int64)
    mask[1, 5:] = 0
    return ids, mask


def test_device_output_matches_numpy_and_is_zero_copy(enc, batch):
    ids, mask = batch
    ref = enc.forward(ids, mask, output_layers=[0, 3, 6])
    outs = enc.forward(ids, mask, output_layers=[0, 3, 6], output="device")
    for r, t in zip(ref, outs):
        assert isinstance(t, fasttran.Tensor)
        assert t.shape == r.shape and t.dtype == "float32" and t.device == "cpu" and t.ndim == 3
        assert t.__dlpack_device__() == (1, 0)
        a = torch.from_dlpack(t)
        assert a.data_ptr() == t.data_ptr                      # zero-copy
        assert np.array_equal(a.numpy(), r)                    # bitwise the same numbers
        n = np.from_dlpack(t)
        assert n.ctypes.data == t.data_ptr
        assert np.shares_memory(t.numpy(), n)
    pooled = enc.forward(ids, mask, pooling="mean", output="device")
    assert pooled.shape == (3, enc.hidden_size)
    assert np.array_equal(pooled.numpy(), enc.forward(ids, mask, pooling="mean"))
    assert "fasttran.Tensor(shape=(3, 384), dtype=float32, device='cpu')" == repr(pooled)


def test_numpy_array_protocol_copies_when_asked(enc, batch):
    """np.array(t) is a snapshot of its own (NumPy 2 passes copy=True); np.asarray(t) and
    copy=False are views; a dtype change without a copy is refused as NumPy refuses it."""
    ids, mask = batch
    t = enc.forward(ids, mask, pooling="mean", output="device")
    snap, view, same = np.array(t), np.asarray(t), np.array(t, copy=False)
    assert not np.shares_memory(snap, view) and np.shares_memory(view, same)
    before = snap.copy()
    view += 1.0                                         # writes the tensor's memory
    assert np.array_equal(snap, before) and np.array_equal(t.numpy(), before + 1.0)
    assert np.array(t, dtype=np.float64).dtype == np.float64
    assert np.array(t, dtype=np.float32, copy=False).ctypes.data == t.data_ptr
    with pytest.raises(ValueError, match="copy"):
        np.array(t, dtype=np.float64, copy=False)


def test_memory_outlives_the_encoder(minilm_dir, batch):
    ids, mask = batch
    e = fasttran.Encoder.from_pretrained(minilm_dir)
    ref = e.forward(ids, mask)
    t = e.forward(ids, mask, output="device")
    a = torch.from_dlpack(t)
    del e, t
    gc.collect()
    junk = [np.full((3, 9, 384), 7.0, np.float32) for _ in range(20)]   # reuse freed memory if any
    assert np.array_equal(a.numpy(), ref)
    del junk


def test_capsule_kinds_and_consumption(enc, batch):
    ids, mask = batch
    t = enc.forward(ids, mask, output="device")
    legacy = t.__dlpack__()
    versioned = t.__dlpack__(max_version=(1, 0))
    old = t.__dlpack__(max_version=(0, 8))
    assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)
    assert "dltensor_versioned" in repr(versioned)
    assert "versioned" not in repr(old)
    del legacy, versioned, old       # unconsumed capsules free their reference
    gc.collect()
    a = torch.utils.dlpack.from_dlpack(t.__dlpack__())   # consumes a legacy capsule
    assert a.data_ptr() == t.data_ptr
    c = t.__dlpack__(copy=True, max_version=(1, 0))
    b = torch.from_dlpack(t.__dlpack__(copy=True))
    assert b.data_ptr() != t.data_ptr and torch.equal(a, b)
    del c
    with pytest.raises(BufferError, match="stream must be None"):
        t.__dlpack__(stream=1)
    with pytest.raises(BufferError, match="cannot be exported"):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(InputTypeError, match="max_version"):
        t.__dlpack__(max_version="1.0")


def test_import_in_place(enc):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::3]
    f = fasttran.from_dlpack(x)
    assert f.shape == (4, 2) and f.strides == (6, 3) and f.data_ptr == x.data_ptr()
    assert np.array_equal(f.numpy(), x.numpy())
    x[0, 0] = 42.0
    assert f.numpy()[0, 0] == 42.0                     # a view, not a copy
    y = torch.from_dlpack(f)                           # and back out again
    assert y.data_ptr() == x.data_ptr() and y.stride() == (6, 3)
    h = fasttran.from_dlpack(torch.ones(3, dtype=torch.bfloat16))
    assert h.dtype == "bfloat16" and torch.equal(torch.from_dlpack(h), torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(InputTypeError, match="no NumPy dtype"):
        h.numpy()
    f16 = fasttran.from_dlpack(np.arange(5, dtype=np.float16))
    assert f16.dtype == "float16" and np.array_equal(f16.numpy(), np.arange(5, dtype=np.float16))
    with pytest.raises(InputTypeError, match="DLPack"):
        fasttran.from_dlpack([1, 2, 3])
    with pytest.raises(InputTypeError, match="unsupported dtype"):
        fasttran.from_dlpack(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError):
        fasttran.Tensor()


def test_forward_reads_a_fasttran_tensor_and_checks_output(enc, batch):
    ids, mask = batch
    t_ids = fasttran.from_dlpack(torch.as_tensor(ids))
    assert np.array_equal(enc.forward(t_ids, mask), enc.forward(ids, mask))
    with pytest.raises(InputError, match="output must be"):
        enc.forward(ids, mask, output="cuda")
    twice = enc.forward(ids, mask, output_layers=[2, 2], output="device")
    assert twice[0] is twice[1]


def test_device_and_dtype_options(minilm_dir):
    e = fasttran.Encoder.from_pretrained(minilm_dir)
    assert e.to("cpu") is e and e.device == "cpu"
    with pytest.raises(InputError, match="dtype must be"):
        fasttran.Encoder.from_pretrained(minilm_dir, dtype="float8")
    # float16 is CUDA's; the CPU says so and what to do. bfloat16 runs on CPUs with AVX512_BF16 (tests/test_lowp.py)
    with pytest.raises(UnsupportedError, match="dtype='float16' runs on CUDA only.*dtype='float32'"):
        fasttran.Encoder.from_pretrained(minilm_dir, dtype="float16")
    with pytest.raises(InputError, match="unknown device"):
        e.to("tpu")
    if not fasttran.cuda_available():
        # built without CUDA: UnsupportedError; built with it but no device: BackendError
        with pytest.raises((UnsupportedError, fasttran.BackendError), match="CUDA|cuda"):
            e.to("cuda")
        assert e.device == "cpu"
