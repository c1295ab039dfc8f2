"""The CPU backend's guarantees on every kernel path it can take (AMX, AVX-512, AVX2+FMA,
portable C): a token's result depends only on its own sequence and the weights, never on the batch it
is in, the padding around it or the thread count; every path stays within 1e-4 of
transformers; and the thread count comes from the environment and this process's CPUs.

Each path runs in a subprocess (FASTTRAN_CPU_ISA is read once per process)."""
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_hidden_states, make_checkpoint

CFG = dict(vocab_size=99, hidden_size=72, num_attention_heads=3, intermediate_size=150,
           num_hidden_layers=3, type_vocab_size=2, max_position_embeddings=64)

# runs in the subprocess: every check that compares bits is made there, inside one process
CHILD = r"""
import json, sys
import numpy as np
import fasttran
path, out, isa = sys.argv[1], sys.argv[2], sys.argv[3]
dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"   # int8 / bfloat16: tests/test_lowp.py
assert fasttran.build_info()["cpu_kernels"] == isa, fasttran.build_info()["cpu_kernels"]
enc = fasttran.Encoder.from_pretrained(path, dtype=dtype)
print(json.dumps({"weights": enc.memory_report()["weights"]}))
rng = np.random.default_rng(0)
B, T = 7, 37
ids = rng.integers(1, 99, (B, T)); types = rng.integers(0, 2, (B, T))
lens = [37, 1, 12, 30, 5, 36, 17]
mask = np.zeros((B, T), np.int64)
for b, n in enumerate(lens):
    mask[b, :n] = 1
mask[3, 4] = mask[3, 9] = 0                      # holes inside a sequence, not only right padding
L = list(range(4))
ref = None
for threads in (1, 2, 3):
    fasttran.set_num_threads(threads)
    hidden = enc.forward(ids, mask, types, output_layers=L)
    pooled = enc.forward(ids, mask, types, pooling="mean")
    cls = enc.forward(ids, mask, types, pooling="cls")
    if ref is None:
        ref = hidden, pooled, cls
        np.savez(out, *hidden, pooled=pooled, ids=ids, mask=mask, types=types)
        continue
    for a, b in zip(hidden, ref[0]):
        assert np.array_equal(a, b), f"{threads} threads changed the hidden states"
    assert np.array_equal(pooled, ref[1]) and np.array_equal(cls, ref[2]), f"{threads} threads changed pooling"
hidden, pooled, cls = ref
for b, n in enumerate(lens):
    real = mask[b].astype(bool)
    # alone, cut to its own length, and padded far more, at another position in another batch
    alone = enc.forward(ids[b:b + 1, :n], mask[b:b + 1, :n], types[b:b + 1, :n], output_layers=L)
    pad = np.zeros((3, 60), np.int64); pm = np.zeros_like(pad); pt = np.zeros_like(pad)
    pad[2, :T], pm[2, :T], pt[2, :T] = ids[b], mask[b], types[b]
    pad[0, :5], pm[0, :5] = 7, 1
    other = enc.forward(pad, pm, pt, output_layers=L)
    for l in L:
        assert np.array_equal(alone[l][0][real[:n]], hidden[l][b][real]), (b, l, "alone")
        assert np.array_equal(other[l][2][:T][real], hidden[l][b][real]), (b, l, "other batch")
    assert np.array_equal(enc.forward(pad, pm, pt, pooling="mean")[2], pooled[b]), (b, "pooled")
    assert np.array_equal(enc.forward(ids[b:b + 1, :n], mask[b:b + 1, :n], types[b:b + 1, :n],
                                      pooling="mean")[0], pooled[b]), (b, "pooled alone")
print(json.dumps({"ok": True}))
"""


def _supported_isas():
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((l for l in f if l.startswith("flags")), "")
    except OSError:
        pass
    isas = ["generic"]
    if " avx2" in flags and " fma" in flags:
        isas.append("avx2")
    if " avx512f" in flags:
        isas.append("avx512")
        if " amx_bf16" in flags and " amx_tile" in flags and " avx512_bf16" in flags and _os_allows_amx():
            isas.append("amx")
    return isas


@functools.lru_cache(maxsize=None)
def _os_allows_amx():
    """The CPU has AMX, but the kernel must also grant this process the tile state (Linux >= 5.16,
    arch_prctl): fasttran falls back to avx512 when it does not, so ask a fresh process."""
    r = subprocess.run([sys.executable, "-c", "import fasttran; print(fasttran.build_info()['cpu_kernels'])"],
                       env={**os.environ, "FASTTRAN_CPU_ISA": "amx", "PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=120)
    return r.returncode == 0 and r.stdout.strip().endswith("amx")


def _run(code, *args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code, *args], env=e, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("kern")), **CFG)


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
def test_every_kernel_path_is_invariant_and_accurate(ckpt, tmp_path, isa):
    if isa not in _supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    out = str(tmp_path / "out.npz")
    r = _run(CHILD, ckpt, out, isa, env={"FASTTRAN_CPU_ISA": isa})
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(out)
    ids, mask, types = got["ids"], got["mask"], got["types"]
    ref64 = hf_hidden_states(ckpt, ids, mask, types, double=True)
    for l, ref in enumerate(ref64):
        err = np.abs(got[f"arr_{l}"] - ref).max()   # every position, padding included
        assert err <= 1e-4, f"{isa}: layer {l} differs from transformers (float64) by {err:.2e}"
    m = mask[..., None].astype(np.float64)
    pooled64 = (ref64[-1] * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    assert np.abs(got["pooled"] - pooled64).max() <= 1e-4


THREADS = r"""
import json, os, sys
if len(sys.argv) > 1:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
import threading
import fasttran
seen = {"default": fasttran.get_num_threads()}
fasttran.set_num_threads(3)
t = threading.Thread(target=lambda: seen.__setitem__("other_thread", fasttran.get_num_threads()))
t.start(); t.join()
print(json.dumps(seen))
"""


def test_thread_count_from_environment_and_affinity():
    def run(env, *args):
        clean = {k: v for k, v in os.environ.items() if k not in ("FASTTRAN_NUM_THREADS", "OMP_NUM_THREADS")}
        clean.update(env)
        clean["PYTHONPATH"] = ROOT
        r = subprocess.run([sys.executable, "-c", THREADS, *args], env=clean, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert run({"FASTTRAN_NUM_THREADS": "5", "OMP_NUM_THREADS": "2"}) == {"default": 5, "other_thread": 3}
    assert run({"OMP_NUM_THREADS": "2"})["default"] == 2
    assert run({}, "pin")["default"] == 1   # one CPU in the affinity mask: one thread
    n = len(os.sched_getaffinity(0))
    assert 1 <= run({})["default"] <= n


# runs in the subprocess: the linear layer of one kernel path against float64
ACCURACY = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import fasttran
import test_backend_ops as T
isa = sys.argv[1]
assert fasttran.build_info()["cpu_kernels"] == isa, fasttran.build_info()["cpu_kernels"]
be = T.Backend(-1)

def linear(x, w, bias, act):
    M, K = x.shape
    N = w.shape[0]
    px, pw, pb = be.upload(x), be.upload(w), be.upload(bias)
    out = be.alloc(M * N * 4)
    wp = be.alloc(be.fn["packed_weight_bytes"](be.addr, N, K))
    be.check(be.fn["pack_weight"](be.addr, wp, pw, N, K), "pack_weight")
    be.check(be.fn["linear_forward"](be.addr, 0, out, px, pw, wp, pb, M, K, N, act), "linear_forward")
    return be.download(out, (M, N), np.float32)

report = {}
# the epilogue's activations: K = 1 and w = 1, so the GEMM is exact and only the activation errs
x = np.concatenate([np.linspace(-6, 12, 40001), [0.0, 1e-30, -1e-30, 1e-8, -1e-8]]).astype(np.float32)
x64 = x.astype(np.float64)
from math import erf, tanh
refs = {0: 0.5 * x64 * (1 + np.vectorize(erf)(x64 / np.sqrt(2))),
        1: 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))),
        2: np.maximum(x64, 0), 3: np.tanh(x64)}
for act, ref in refs.items():
    got = linear(x[:, None], np.ones((1, 1), np.float32), np.zeros(1, np.float32), act)[:, 0].astype(np.float64)
    err = np.abs(got - ref) / (np.abs(ref) + 1e-30)
    report[f"act{act}"] = float(np.max(np.where(np.abs(ref) > 1e-6, err, np.abs(got - ref) / 1e-6)))
# the activations' derivatives (bias_act_backward with df = 1: the training backward's
# ft_cpu_act_grad_row), against float64, absolute (the derivatives are O(1) and GELU's crosses 0)
xg = np.concatenate([np.linspace(-10, 10, 40001), [0.0, 1e-30, -1e-30]]).astype(np.float32)
g64 = xg.astype(np.float64)
Phi = 0.5 * (1 + np.vectorize(erf)(g64 / np.sqrt(2)))
u = np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)
grads = {0: Phi + g64 * np.exp(-g64 ** 2 / 2) / np.sqrt(2 * np.pi),
         1: 0.5 * (1 + np.tanh(u)) + 0.5 * g64 * (1 - np.tanh(u) ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * g64 ** 2),
         2: (g64 > 0).astype(np.float64), 3: 1 - np.tanh(g64) ** 2}
for act, ref in grads.items():
    px, pd, ph = be.upload(xg), be.upload(np.ones_like(xg)), be.alloc(xg.nbytes)
    be.check(be.fn["bias_act_backward"](be.addr, ph, pd, px, None, None, None, None, 1, len(xg), 1, act), "bias_act_backward")
    report[f"grad{act}"] = float(np.abs(be.download(ph, (len(xg),), np.float32) - ref).max())
# the GEMM: a short row block, K and N off every tile size; the bar is a float32 GEMM's own error
rng = np.random.default_rng(1)
for M, K, N, name in ((50, 1000, 70, "gemm"), (50, 1700, 70, "gemm_long_k")):   # 1700: AMX's K blocks
    a = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    ref = a.astype(np.float64) @ w.astype(np.float64).T
    seq = np.zeros((M, N), np.float32)        # one float32 chain per element, multiply then add
    for k in range(K):
        seq = seq + np.outer(a[:, k], w[:, k]).astype(np.float32)
    got = linear(a, w, np.zeros(N, np.float32), -1)
    report[name] = float(np.abs(got - ref).max())
    report[name + "_float32_chain"] = float(np.abs(seq - ref).max())

# the backend's gemm op (AMX: ft_cpu_amx_gemm, transposed operands read k-major in place), every
# transpose, alpha and beta, leading dimensions past the row: against float64, the same bar; K = 1700
# runs AMX's K in blocks (more than FT_AMX_WHOLE_K steps, the last one short), M < N the
# transposed orientation
for M, N, K in ((97, 75, 700), (40, 72, 1700)):
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    seq = np.zeros((M, N), np.float32)
    for k in range(K):
        seq = seq + np.outer(a[:, k], b[k]).astype(np.float32)
    prod = a.astype(np.float64) @ b.astype(np.float64)
    chain = float(np.abs(seq - prod).max())
    for ta in (0, 1):
        for tb in (0, 1):
            alpha, beta, pad = (1.0, 0.0, 0) if ta == tb else (-0.5, 1.5, 3)
            A = np.ascontiguousarray(a.T if ta else a); B = np.ascontiguousarray(b.T if tb else b)
            A = np.pad(A, ((0, 0), (0, pad))); B = np.pad(B, ((0, 0), (0, pad)))
            C0 = rng.standard_normal((M, N + pad)).astype(np.float32)
            pa, pb, pc = be.upload(A), be.upload(B), be.upload(C0)
            be.check(be.fn["gemm"](be.addr, ta, tb, M, N, K, alpha, pa, A.shape[1], pb, B.shape[1], beta, pc, N + pad),
                     "gemm")
            got = be.download(pc, (M, N + pad), np.float32)
            want = alpha * prod + beta * C0[:, :N].astype(np.float64)
            beta_rounding = 2 * float(np.finfo(np.float32).eps) * float(np.abs(want).max())
            key = f"gemm_op_{ta}{tb}_K{K}"
            report[key] = float(np.abs(got[:, :N] - want).max()) / (abs(alpha) * chain + beta_rounding)
            report[key + "_pad_untouched"] = bool(np.array_equal(got[:, N:], C0[:, N:]))
# a tall product (AMX: row-block tasks that split their rows once for every chunk of weights) gives
# each row the bits it has in a short one (chunk tasks), and float32 accuracy
M, N, K = 1250, 75, 333
a, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
tall, short = linear(a, w, np.zeros(N, np.float32), -1), linear(a[:40], w, np.zeros(N, np.float32), -1)
seq = np.zeros((M, N), np.float32)
for k in range(K):
    seq = seq + np.outer(a[:, k], w[:, k]).astype(np.float32)
ref = a.astype(np.float64) @ w.astype(np.float64).T
report["tall_rows_equal_short"] = bool(np.array_equal(tall[:40], short))
report["tall_vs_chain"] = float(np.abs(tall - ref).max()) / float(np.abs(seq - ref).max())
print(json.dumps(report))
"""


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
def test_every_kernel_path_computes_at_float32_accuracy(isa):
    """The linear layer of each path: its activations within 3e-6 relative of float64 wherever
    |act(x)| > 1e-6 (the float32 input's own rounding, amplified by exp(-x^2 / 2), costs up to
    ~2e-6 at x = -5), and its GEMM (AMX: bf16x6, amx.h) no less accurate than a float32
    multiply-add chain; so is the backend's gemm op (AMX's own, or OpenBLAS) for every transpose,
    alpha, beta and leading dimension. The activations' derivatives of the training backward
    within 3e-6 of float64."""
    if isa not in _supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    r = _run(ACCURACY, isa, os.path.dirname(os.path.abspath(__file__)), env={"FASTTRAN_CPU_ISA": isa})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    for act in range(4):
        assert rep[f"act{act}"] <= 3e-6, (isa, act, rep)
        assert rep[f"grad{act}"] <= 3e-6, (isa, act, rep)   # measured 2e-6 (tanh form), 2.2e-7 (erf)
    assert rep["gemm"] <= 1.5 * rep["gemm_float32_chain"], rep
    assert rep["gemm_long_k"] <= 1.5 * rep["gemm_long_k_float32_chain"], rep
    assert rep["tall_rows_equal_short"] and rep["tall_vs_chain"] <= 1.5, rep
    ops = [k for k in rep if k.startswith("gemm_op_") and not k.endswith("_pad_untouched")]
    assert len(ops) == 8, rep
    for k in ops:
        assert rep[k] <= 1.5 and rep[k + "_pad_untouched"], (k, rep)


FORK = r"""
import json, os, sys, warnings
import numpy as np
import fasttran
enc = fasttran.Encoder.from_pretrained(sys.argv[1])
fasttran.set_num_threads(2)
ids = np.random.default_rng(0).integers(1, 99, (5, 30)); mask = np.ones_like(ids)
before = enc.forward(ids, mask, pooling="mean")         # the parent's thread team now exists
pid = os.fork()
if pid == 0:
    code = 0 if np.array_equal(enc.forward(ids, mask, pooling="mean"), before) else 3
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fasttran.set_num_threads(4)
    if fasttran.get_num_threads() != 1 or not any("spawn" in str(x.message) for x in w):
        code = 4
    os._exit(code)
_, status = os.waitpid(pid, 0)
after = enc.forward(ids, mask, pooling="mean")            # the parent keeps its threads
print(json.dumps({"child": os.waitstatus_to_exitcode(status), "parent_same": bool(np.array_equal(after, before)),
                  "parent_threads": fasttran.get_num_threads()}))
"""


def test_a_forked_child_computes_on_one_thread_instead_of_hanging(ckpt):
    """GNU OpenMP's team does not survive fork(): before the fix the child's first forward
    waited forever. Now it runs on one thread, gives the same bits, and says why it will not
    take more (the timeout turns a hang into a failure)."""
    r = subprocess.run([sys.executable, "-c", FORK, ckpt], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep == {"child": 0, "parent_same": True, "parent_threads": 2}, rep
