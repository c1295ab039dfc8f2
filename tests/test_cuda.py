"""The CUDA backend, run on a GPU machine (skipped with the reason elsewhere).

On the lent device: build the extension with its python3, then
    FASTTRAN_MINILM_BF16=<dir with config.json + model.safetensors in bf16> python3 -m pytest tests/test_cuda.py
The MiniLM case is skipped when that directory is not given (the device has no MiniLM package);
random-weight models are built there with transformers."""
import gc

import numpy as np
import pytest

import fasttran

pytestmark = pytest.mark.skipif(not fasttran.cuda_available(),
                                reason="no usable CUDA device: " + str(fasttran.build_info()["cuda"]["unavailable_reason"]))

torch = pytest.importorskip("torch")

from conftest import hf_hidden_states, make_checkpoint  # noqa: E402
from test_random_models import AWKWARD, batch  # noqa: E402


def hf_cuda(path, ids, mask, types, dtype=torch.float32):
    from transformers import BertModel
    model = BertModel.from_pretrained(path, torch_dtype=dtype).cuda().eval()
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
    ref32 = hf_cuda(path, ids, mask, types)
    for layer, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        assert np.all(np.isfinite(a))
        assert np.abs(a - b)[valid].max() <= 1e-4, f"layer {layer} vs transformers fp32 (cuda)"
        assert np.abs(a - c).max() <= 1e-4, f"layer {layer} vs transformers float64"


def test_cpu_and_cuda_agree_and_to(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    cpu = fasttran.Encoder.from_pretrained(path)
    ids, mask, types = batch(np.random.default_rng(1), 4, 33, pad_frac=0.5)
    ref = cpu.forward(ids, mask, types, pooling="mean")
    cpu.to("cuda")
    assert cpu.device == "cuda:0"
    assert np.abs(cpu.forward(ids, mask, types, pooling="mean") - ref).max() <= 1e-4


def test_minilm_bf16_weights(tmp_path):
    import os
    d = os.environ.get("FASTTRAN_MINILM_BF16")
    if not d:
        pytest.skip("set FASTTRAN_MINILM_BF16 to a MiniLM directory saved in bf16")
    enc = fasttran.Encoder.from_pretrained(d, device="cuda")
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (8, 64))
    mask = np.ones_like(ids)
    mask[3, 20:] = 0
    types = np.zeros_like(ids)
    ours = enc.forward(ids, mask, types, output_layers=list(range(enc.num_layers + 1)))
    ref = hf_cuda(d, ids, mask, types)
    for layer, (a, b) in enumerate(zip(ours, ref)):
        assert np.abs(a - b)[mask.astype(bool)].max() <= 1e-4, f"layer {layer}"


def test_device_output_is_zero_copy_stream_correct_and_outlives_encoder(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda")
    ids, mask, types = batch(np.random.default_rng(2), 8, 64, pad_frac=0.3)
    ref = enc.forward(ids, mask, types)
    t = enc.forward(ids, mask, types, output="device")
    assert t.device == "cuda:0" and t.__dlpack_device__() == (2, 0)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.from_dlpack(t)
        assert a.data_ptr() == t.data_ptr and a.is_cuda
        total = (a * 2).sum()
    s.synchronize()
    assert np.allclose(total.item(), 2 * ref.sum(dtype=np.float64), rtol=1e-5)
    assert np.array_equal(t.numpy(), ref)
    # inputs as torch CUDA tensors, produced on a side stream
    with torch.cuda.stream(s):
        ids_c = torch.as_tensor(ids).cuda(non_blocking=True)
    assert np.array_equal(enc.forward(ids_c, mask, types), ref)
    del enc, t
    gc.collect()
    torch.cuda.synchronize()
    junk = torch.full((1 << 26,), 3.0, device="cuda")   # reuse freed memory if any
    assert np.array_equal(a.cpu().numpy(), ref)
    del junk


def test_cupy_round_trip(tmp_path):
    cp = pytest.importorskip("cupy")
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
        enc.forward(torch.ones((1, 4), dtype=torch.long, device="cuda"))


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


# ---- training on CUDA (issue 6): fused optimizer and heads --------------------------------------
@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_cuda_optimizer_matches_reference_with_fixed_launches(kind):
    """Torch CUDA parameters driven in place by fasttran's multi-tensor kernels: the float64
    reference of tests/test_optim.py over 100 steps, and the same kernel count for 7 and 300
    tensors (counted by the backend: ft_optim_info.kernel_launches)."""
    torch = pytest.importorskip("torch")
    import test_optim as ref
    from fasttran.optim import AdamW, LAMB
    cls = LAMB if kind == "lamb" else AdamW
    rng = np.random.default_rng(0)
    launches = {}
    for shapes in (ref.SHAPES, [(13, 5)] * 300):
        w64 = [rng.standard_normal(s) for s in shapes]
        params = [torch.tensor(x, dtype=torch.float32, device="cuda") for x in w64]
        w64 = [p.double().cpu().numpy() for p in params]
        m64 = [np.zeros(s) for s in shapes]
        v64 = [np.zeros(s) for s in shapes]
        opt = cls(params, lr=2e-3, weight_decay=0.05, max_grad_norm=5.0)
        for t in range(1, 101 if len(shapes) < 50 else 6):
            g = [torch.randn(s, device="cuda") * (0.1 + t % 7) for s in shapes]
            opt.step(g)
            ref.ref_step(kind, w64, [x.double().cpu().numpy() for x in g], m64, v64, t, 2e-3, 0.9, 0.999, opt.eps,
                         opt.decays, 5.0)
        torch.cuda.synchronize()
        assert ref.rel_err([p.cpu().numpy() for p in params], w64) <= 1e-5
        launches[len(shapes)] = opt.last_kernel_launches
    assert len(set(launches.values())) == 1 and launches[300] == (5 if kind == "lamb" else 3), launches


def test_cuda_head_matches_cpu():
    torch = pytest.importorskip("torch")
    from fasttran.heads import ClassificationHead
    head = ClassificationHead(64, 3, pooler=True, dropout=0.2, init_std=0.3)
    x = np.random.default_rng(0).standard_normal((9, 64)).astype(np.float32)
    y = np.array([0, 1, 2, 1, 0, 2, 2, 1, 0], np.int32)
    g_cpu = np.zeros_like(head.params)
    lg_cpu, loss_cpu = head.step(x, y, grads=g_cpu, training=True, seed=3, step=2)
    dev = lambda a: fasttran.from_dlpack(torch.from_numpy(a).cuda())
    params, xd, yd = dev(head.params), dev(x), dev(y)
    lg = torch.empty((9, 3), device="cuda")
    g = torch.zeros(head.params.size, device="cuda")
    loss = fasttran._C.head_step(head._cfg, params, xd, 9, 1, None, yd, fasttran.from_dlpack(lg),
                                 fasttran.from_dlpack(g), None, True, 3, 2)
    assert abs(loss - loss_cpu) <= 1e-5 * abs(loss_cpu)
    assert np.allclose(lg.cpu().numpy(), lg_cpu, rtol=1e-5, atol=1e-6)
    assert np.allclose(g.cpu().numpy(), g_cpu, rtol=1e-4, atol=1e-6)
