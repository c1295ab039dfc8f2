"""cuDNN attention (csrc/cuda/cudnn_att.cpp -> fasttran/libfasttran_cudnn.so) and how the CUDA
backend chooses between it and its own kernels (csrc/cuda/attention_cudnn.cu).

Without a GPU: the frontend's host-side check (graph.set_sm_version + validate, through
ft_cudnn_att_validate) accepts every shipped model's graphs and refuses bad head sizes; the C
interface refuses zero-length sequences before any cuDNN call; the emulator reports that it runs
fasttran's kernels, and why. On a GPU with cuDNN (.ci/gpu_session.sh's cudnn step): attention
through cuDNN against transformers, forward and backward."""
import ctypes
import os

import numpy as np
import pytest

import fasttran
from fasttran import _info

LIB = os.path.join(os.path.dirname(fasttran.__file__), "libfasttran_cudnn.so")
FWD, FWD_STATS, BWD = 0, 1, 2
BF16, F16 = 0, 1
OK, REFUSED, INVALID = 0, 1, 2


class Shape(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("type", ctypes.c_int), ("B", ctypes.c_int64), ("S", ctypes.c_int64),
                ("H", ctypes.c_int64), ("D", ctypes.c_int64), ("window", ctypes.c_int64)]


class Seqs(ctypes.Structure):
    _fields_ = [("q_len", ctypes.c_void_p), ("kv_len", ctypes.c_void_p), ("qkv_off", ctypes.c_void_p),
                ("o_off", ctypes.c_void_p), ("stats_off", ctypes.c_void_p), ("host_q_len", ctypes.c_void_p),
                ("host_kv_len", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def lib():
    if not os.path.exists(LIB):
        from fasttran._info import BUILD
        pytest.skip("libfasttran_cudnn.so not built: " + str(BUILD.get("cudnn_attention_build")))
    try:
        L = ctypes.CDLL(LIB)
    except OSError as e:   # built, but its libcudnn.so.9 / libnvrtc is not installed here
        pytest.skip(f"libfasttran_cudnn.so does not load here: {e}")
    L.ft_cudnn_att_validate.argtypes = [ctypes.c_int, ctypes.POINTER(Shape), ctypes.c_char_p, ctypes.c_size_t]
    L.ft_cudnn_att_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(Shape), ctypes.c_void_p, ctypes.POINTER(Seqs),
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_char_p, ctypes.c_size_t]
    L.ft_cudnn_att_backward.argtypes = [ctypes.c_void_p, ctypes.POINTER(Shape), ctypes.c_void_p, ctypes.POINTER(Seqs),
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    return L


def validate(L, kind, typ, B, S, H, D, sm=90, window=0):
    err = ctypes.create_string_buffer(4096)
    st = L.ft_cudnn_att_validate(sm, ctypes.byref(Shape(kind, typ, B, S, H, D, window)), err, len(err))
    return st, err.value.decode()


# (heads, head size) of the shipped models: MiniLM (all-MiniLM-L6-v2), BERT-base, BERT-large
SHIPPED = {"minilm": (12, 32), "bert-base": (12, 64), "bert-large": (16, 64)}


@pytest.mark.parametrize("typ", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", [FWD, FWD_STATS, BWD], ids=["forward", "forward-stats", "backward-deterministic"])
@pytest.mark.parametrize("model", sorted(SHIPPED))
def test_validate_accepts_every_shipped_shape_without_a_device(lib, model, kind, typ):
    """Hopper (sm 90) takes all three graphs of every shipped model at batch 64 x seq 512; Ampere
    (sm 80) the forwards, but not the deterministic ragged backward (the frontend says so: the
    backend then keeps its own backward there)."""
    H, D = SHIPPED[model]
    st, msg = validate(lib, kind, typ, 64, 512, H, D, 90)
    assert st == OK, msg
    st, msg = validate(lib, kind, typ, 64, 512, H, D, 80)
    if kind == BWD:
        assert st == REFUSED and "Deterministic algorithm is not supported" in msg, msg
    else:
        assert st == OK, msg


@pytest.mark.parametrize("typ", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", [FWD, FWD_STATS, BWD], ids=["forward", "forward-stats", "backward-deterministic"])
@pytest.mark.parametrize("S", [512, 4096, 8192])
def test_validate_accepts_modernberts_sliding_window_without_a_device(lib, S, kind, typ):
    """ModernBERT-base's local layers (12 heads of 64, |i - j| <= 64: window 128) as cuDNN's
    diagonal band on all three graphs at sm 90, up to its 8,192 tokens; the window is part of the
    graph (the same shape with another window is another graph, validated on its own)."""
    for window in (128, 2):
        st, msg = validate(lib, kind, typ, 1 if S > 512 else 64, S, 12, 64, 90, window)
        assert st == OK, msg


def test_a_negative_window_is_refused(lib):
    st, msg = validate(lib, FWD, BF16, 1, 512, 12, 64, 90, -2)
    assert st == INVALID and "window -2" in msg, msg


@pytest.mark.parametrize("kind", [FWD, FWD_STATS, BWD])
def test_validate_refuses_a_head_size_cudnn_does_not_take(lib, kind):
    st, msg = validate(lib, kind, BF16, 64, 512, 12, 36)
    assert st == REFUSED and "multiple of 8" in msg and "D 36" in msg, msg


def test_bad_shapes_are_refused_with_their_reason(lib):
    st, msg = validate(lib, 7, BF16, 64, 512, 12, 32)
    assert st == INVALID and "kind 7" in msg
    st, msg = validate(lib, FWD, 5, 64, 512, 12, 32)
    assert st == INVALID and "type 5" in msg
    st, msg = validate(lib, FWD, BF16, 0, 512, 12, 32)
    assert st == INVALID and "at least 1" in msg


@pytest.mark.parametrize("lens", [[3, 0, 5], [0]])
def test_zero_length_sequences_are_refused_before_any_cudnn_call(lib, lens):
    """No context, no device memory: the lengths are checked on the host first, so the refusal names
    the empty sequence whatever else is missing."""
    B = len(lens)
    q = np.asarray(lens, np.int32)
    kv = q.copy()
    dummy = np.zeros(4 * (B + 1), np.int64)
    seqs = Seqs(dummy.ctypes.data, dummy.ctypes.data, dummy.ctypes.data, dummy.ctypes.data, dummy.ctypes.data,
                q.ctypes.data, kv.ctypes.data)
    err = ctypes.create_string_buffer(1024)
    buf = ctypes.c_void_p(dummy.ctypes.data)
    for kind in (FWD, FWD_STATS):
        st = lib.ft_cudnn_att_forward(None, ctypes.byref(Shape(kind, BF16, B, 64, 2, 32)), None, ctypes.byref(seqs),
                                      buf, buf, buf, buf, err, len(err))
        assert st == INVALID and f"sequence {lens.index(0)} has 0 query rows" in err.value.decode(), err.value
        assert "zero-length" in err.value.decode()
    st = lib.ft_cudnn_att_backward(None, ctypes.byref(Shape(BWD, BF16, B, 64, 2, 32)), None, ctypes.byref(seqs),
                                   buf, buf, buf, buf, buf, buf, err, len(err))
    assert st == INVALID and "zero-length" in err.value.decode(), err.value


def test_keys_beyond_the_queries_or_the_graph_are_refused(lib):
    q, kv = np.asarray([4, 4], np.int32), np.asarray([4, 5], np.int32)
    dummy = np.zeros(12, np.int64)
    seqs = Seqs(*(dummy.ctypes.data,) * 5, q.ctypes.data, kv.ctypes.data)
    err = ctypes.create_string_buffer(1024)
    buf = ctypes.c_void_p(dummy.ctypes.data)
    st = lib.ft_cudnn_att_forward(None, ctypes.byref(Shape(FWD, BF16, 2, 64, 2, 32)), None, ctypes.byref(seqs),
                                  buf, buf, buf, buf, err, len(err))
    assert st == INVALID and "sequence 1 has 4 query rows and 5 keys" in err.value.decode(), err.value


# ---- the backend's choice ----------------------------------------------------------------------

EMULATED = os.environ.get("FASTTRAN_CUDA_EMU") == "1"


@pytest.mark.skipif(not EMULATED, reason="the emulator's report (FASTTRAN_CUDA_EMU=1)")
def test_the_emulator_runs_fasttrans_attention_and_says_why():
    if not _info.cuda_available():
        pytest.skip("no emulated CUDA backend in this build")
    att = fasttran.build_info()["cuda"]["attention"]
    assert att["runs"] == "wmma" and att["reason"] == "cuDNN: not on the emulator", att
    assert att["cudnn_calls"] == {"forward": 0, "forward_stats": 0, "backward": 0}


@pytest.mark.skipif(not EMULATED, reason="the emulator's report (FASTTRAN_CUDA_EMU=1)")
def test_memory_report_names_the_attention_on_cuda(tmp_path):
    if not _info.cuda_available():
        pytest.skip("no emulated CUDA backend in this build")
    from test_cuda import make_checkpoint   # noqa: E402  (the tests' tiny checkpoints)
    enc = fasttran.Encoder.from_pretrained(make_checkpoint(str(tmp_path / "m")), device="cuda", dtype="bfloat16")
    ids = np.array([[101, 7, 8, 102]], np.int64)
    enc.forward(ids, np.ones_like(ids), np.zeros_like(ids))
    rep = enc.memory_report()
    assert rep["attention"]["runs"] == "wmma" and "emulator" in rep["attention"]["reason"]
    assert fasttran.Encoder.from_pretrained(make_checkpoint(str(tmp_path / "c"))).memory_report().get("attention") is None


# ---- on a GPU: against transformers ------------------------------------------------------------

def _cudnn_on_gpu():
    if EMULATED:
        return "the CUDA emulator: cuDNN runs on a GPU only"
    if not _info.cuda_available():
        return "no CUDA device"
    att = _info.cuda_attention(0)
    if not att or att["runs"] != "cudnn":
        return f"cuDNN attention does not run here: {att and att['reason']}"
    return None


def _lengths():
    # seq % 128 == 64 (where bias-mask attention gave NaN in dQ on H100/H200), a length-1 sequence,
    # and ordinary ones
    return [192, 1, 64, 37]


def test_cudnn_forward_and_backward_against_transformers(tmp_path, monkeypatch):
    """cuDNN's attention op by op against torch's float64 SDPA over the same bf16-rounded inputs:
    head sizes 32 and 64, bf16 and fp16, sequences of 192 (seq % 128 == 64), 1, 64 and 37 rows packed back to back;
    forward (inference, half storage) and, with FASTTRAN_CUDA_ATTENTION=cudnn in a child process, the
    training forward and the deterministic backward (twice: the same bits)."""
    why = _cudnn_on_gpu()
    if why:
        pytest.skip(why)
    import subprocess
    import sys
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_cudnn_att as t; t._device_check()"
    env = dict(os.environ, FASTTRAN_CUDA_ATTENTION="cudnn")
    r = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    print(r.stdout)


@pytest.mark.skipif(not EMULATED, reason="the harness's rehearsal on the emulator (FASTTRAN_CUDA_EMU=1)")
def test_the_device_check_runs_on_the_emulator_against_fasttrans_kernels():
    """The device check's own code, on the emulator, where the same ops run fasttran's kernels: the
    harness, the reference and the bounds are exercised before a GPU sees them."""
    if not _info.cuda_available():
        pytest.skip("no emulated CUDA backend in this build")
    if os.environ.get("FASTTRAN_EMU_SEED") or os.environ.get("FASTTRAN_EMU_CHECK", "none") != "none":
        pytest.skip("rehearsed in the emulator's plain mode only (its kernels are checked op by op in every mode)")
    pytest.importorskip("torch")
    _device_check(expect_cudnn=False)


def _device_check(expect_cudnn=True):
    """Run in a child with FASTTRAN_CUDA_ATTENTION=cudnn (read once per process by the backend);
    expect_cudnn False: the rehearsal on the emulator (the calls go to fasttran's kernels). Head
    sizes 32 (MiniLM) and 64 (BERT), bf16 and fp16; then ModernBERT's local attention (head size 64,
    |i - j| <= 64: window 128; and a window of 16 on the same sequences) as cuDNN's diagonal band."""
    for NH, hs in ((4, 32), (12, 64)):
        for dt in ("bfloat16", "float16"):
            _device_case(NH, hs, dt, expect_cudnn)
    # (the emulator's rehearsal: one of them, its kernels being slow there)
    for window, dt in ((128, "bfloat16"), (128, "float16"), (16, "bfloat16"))[0 if expect_cudnn else 2:]:
        _device_case(12, 64, dt, expect_cudnn, window)


def _device_case(NH, hs, dt, expect_cudnn, window=0):
    import torch
    from test_backend_ops import Backend, Host, In, Out, Scratch, ScratchSize, run_case, DTYPE_CODES

    lens = np.asarray(_lengths(), np.int32)
    C, N = NH * hs, int(lens.sum())
    first = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    rng = np.random.default_rng(3 + hs)
    qkv = rng.standard_normal((N, 3 * C)).astype(np.float32)
    dctx = rng.standard_normal((N, C)).astype(np.float32)
    tdt = getattr(torch, dt)
    half = lambda x: torch.tensor(x).to(tdt).to(torch.float64)

    def reference(x, dout):
        """float64 SDPA per sequence on the half-rounded operands (transformers' attention is
        torch's SDPA) and its gradients"""
        outs, grads = [], []
        for f, n in zip(first, lens):
            rows = half(x[f:f + n]).requires_grad_(True)
            q, k, v = (rows[:, i * C:(i + 1) * C].reshape(n, NH, hs).transpose(0, 1) for i in range(3))
            i = torch.arange(int(n))
            band = (i[:, None] - i[None, :]).abs() <= window // 2 if window else None
            o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=band)[0]
            o = o.transpose(0, 1).reshape(n, C)
            (o * half(dout[f:f + n])).sum().backward()
            outs.append(o.detach().numpy())
            grads.append(rows.grad.numpy())
        return np.concatenate(outs), np.concatenate(grads)

    ref_o, ref_d = reference(qkv, dctx)
    gpu = Backend(0)
    before = _info.cuda_attention(0)["cudnn_calls"]
    seqs = np.stack([first, lens, lens], axis=1).astype(np.int32)
    tag = f"{dt} head size {hs}" + (f" window {window}:" if window else ":")
    # inference forward in half storage
    x16 = torch.tensor(qkv).to(tdt).view(torch.int16).numpy()
    got = run_case(gpu, "attention_forward", dict(dt=DTYPE_CODES[dt], ctx=Out((N, C), np.int16),
                                                  qkv=In(x16), seqs=Host(seqs), seqs_dev=None, B=len(lens), C=C,
                                                  NH=NH, window=window,
                                                  scratch=Scratch(len(lens), int(lens.max()), NH)))
    o = torch.tensor(got["ctx"]).view(tdt).to(torch.float64).numpy()
    err = np.abs(o - ref_o).max()
    print(tag, "forward max abs error", err)
    assert np.isfinite(o).all() and err < 2e-2, (tag, err)
    # training forward (statistics) and the deterministic backward
    common = dict(prec=DTYPE_CODES[dt], seqs=Host(seqs), B=len(lens), C=C, NH=NH, window=window, p=0.0, key=1,
                  scratch=Scratch(len(lens), int(lens.max()), NH, "attention_train_scratch_bytes"),
                  scratch_bytes=ScratchSize("scratch"))
    fwd = run_case(gpu, "attention_train_forward", dict(common, ctx=Out((N, C)), probs=None, stats=Out((N, NH, 2)),
                                                        dmask=None, qkv=In(qkv)))
    assert np.abs(fwd["ctx"] - ref_o).max() < 2e-2, tag
    runs = [run_case(gpu, "attention_backward", dict(common, dqkv=Out((N, 3 * C)), dctx=In(dctx), qkv=In(qkv),
                                                     probs=None, stats=In(fwd["stats"]), dmask=None))["dqkv"]
            for _ in range(2)]
    assert np.array_equal(runs[0], runs[1]), tag + " the deterministic backward gave other bits the second time"
    d = runs[0]
    scale = np.abs(ref_d).max()
    print(tag, "backward max abs error / max", np.abs(d - ref_d).max() / scale)
    assert np.isfinite(d).all() and np.abs(d - ref_d).max() <= 3e-2 * scale, tag
    after = _info.cuda_attention(0)["cudnn_calls"]
    if not expect_cudnn:
        assert after == before, (before, after)
        return
    assert after["forward"] > before["forward"] and after["forward_stats"] > before["forward_stats"], tag
    assert after["backward"] >= before["backward"] + 2, (tag, before, after)
