"""LAMB and AdamW against an independent float64 reference written here from the equations of
the papers (You et al. 2019; Loshchilov & Hutter), over 100 steps on a mix of shapes including
size-1 and all-zero-gradient tensors, with and without clipping; in place over a torch model;
and bad input."""
import math

import numpy as np
import pytest

import fasttran
from fasttran.optim import LAMB, AdamW, make_optimizer, schedule_factor

SHAPES = [(37, 53), (1,), (64,), (5, 3, 7), (300, 129), (1, 1), (2000,)]
ZERO_GRAD = {2}          # this tensor always gets an all-zero gradient
NO_DECAY = {1, 2, 6}     # 1-D tensors


def ref_step(kind, w, g, m, v, t, lr, b1, b2, eps, wds, max_norm, bias_correction=True):
    """One step in float64 on lists of arrays (modified in place)."""
    if max_norm:
        gn = math.sqrt(sum(float(np.sum(x * x)) for x in g))
        c = min(1.0, max_norm / gn) if gn > 0 else 1.0
        g = [x * c for x in g]
    bc1 = 1 - b1 ** t if bias_correction else 1.0
    bc2 = 1 - b2 ** t if bias_correction else 1.0
    for i in range(len(w)):
        m[i][:] = b1 * m[i] + (1 - b1) * g[i]
        v[i][:] = b2 * v[i] + (1 - b2) * g[i] * g[i]
        mh, vh = m[i] / bc1, v[i] / bc2
        if kind == "lamb":
            u = mh / (np.sqrt(vh) + eps) + wds[i] * w[i]
            wn, un = np.linalg.norm(w[i]), np.linalg.norm(u)
            phi = wn / un if wn > 0 and un > 0 else 1.0
            w[i][:] = w[i] - lr * phi * u
        else:
            w[i][:] = w[i] - lr * wds[i] * w[i] - lr * mh / (np.sqrt(vh) + eps)


def run_both(kind, max_norm, steps=100, lr=2e-3, wd=0.05, eps=1e-6, bias_correction=True, seed=0):
    rng = np.random.default_rng(seed)
    w32 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    w64 = [x.astype(np.float64) for x in w32]
    m64 = [np.zeros(s) for s in SHAPES]
    v64 = [np.zeros(s) for s in SHAPES]
    wds = [0.0 if i in NO_DECAY else wd for i in range(len(SHAPES))]
    cls = LAMB if kind == "lamb" else AdamW
    opt = cls(w32, lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=wd, max_grad_norm=max_norm,
              bias_correction=bias_correction, no_decay=lambda name, shape: len(shape) <= 1)
    assert opt.decays == wds
    for t in range(1, steps + 1):
        g32 = [np.zeros(s, np.float32) if i in ZERO_GRAD else
               (rng.standard_normal(s) * (0.1 + t % 7)).astype(np.float32) for i, s in enumerate(SHAPES)]
        opt.step(g32)
        ref_step(kind, w64, [x.astype(np.float64) for x in g32], m64, v64, t, lr, 0.9, 0.999, eps, wds, max_norm,
                 bias_correction)
    return w32, w64, opt, (m64, v64)


def rel_err(a, b):
    return max(np.linalg.norm(x.astype(np.float64) - y) / max(np.linalg.norm(y), 1e-30) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
@pytest.mark.parametrize("max_norm", [None, 5.0])
def test_matches_float64_reference_over_100_steps(kind, max_norm):
    w32, w64, opt, (m64, v64) = run_both(kind, max_norm)
    err = rel_err(w32, w64)
    assert err <= 1e-5, f"{kind} max_grad_norm={max_norm}: relative error {err:.2e}"
    # the moment estimates agree too
    st = opt.state_dict()["state"]
    for k, ref in (("exp_avg", m64), ("exp_avg_sq", v64)):
        got = [np.asarray(st[i][k]).ravel() for i in range(len(ref))]
        assert rel_err(got, [x.ravel() for x in ref]) <= 1e-5, k
    # clipping did engage in the clipped runs (gradients have norm >> 5)
    if max_norm:
        assert opt.last_grad_norm > max_norm


def test_without_bias_correction():
    w32, w64, _, _ = run_both("lamb", None, steps=30, bias_correction=False)
    assert rel_err(w32, w64) <= 1e-5


def test_zero_weights_and_zero_gradient_use_trust_ratio_one():
    w = [np.zeros(10, np.float32), np.ones(3, np.float32)]
    opt = LAMB(w, lr=0.1, weight_decay=0.0)
    opt.step([np.ones(10, np.float32), np.zeros(3, np.float32)])
    # ||w|| = 0 -> phi = 1: the first step moves by lr * m^/(sqrt(v^)+eps) = lr * 1/(1+eps)
    assert np.allclose(w[0], -0.1 / (1 + 1e-6), rtol=1e-6)
    assert np.array_equal(w[1], np.ones(3, np.float32))   # zero gradient, no decay: unchanged


def test_steps_are_deterministic_across_thread_counts():
    out = []
    n0 = fasttran.get_num_threads()
    try:
        for nt in (1, max(2, n0)):
            fasttran.set_num_threads(nt)
            w32, _, _, _ = run_both("lamb", 5.0, steps=5)
            out.append(w32)
    finally:
        fasttran.set_num_threads(n0)
    for a, b in zip(*out):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_parallel_steps_are_bitwise_independent_of_thread_count(kind):
    """Above the size where the CPU kernel goes parallel (64K elements): 1 thread, 2 threads,
    the same bits (block sums reduced in a fixed order)."""
    shapes = [(300, 400), (1000,), (257, 129), (1,)]
    rng = np.random.default_rng(7)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    out = []
    n0 = fasttran.get_num_threads()
    try:
        for nt in (1, max(2, n0)):
            fasttran.set_num_threads(nt)
            w = [x.copy() for x in w0]
            opt = make_optimizer(kind, w, lr=1e-3, max_grad_norm=1.0)
            for g in grads:
                opt.step(g)
            out.append(w)
    finally:
        fasttran.set_num_threads(n0)
    assert sum(x.size for x in w0) > 1 << 16
    for a, b in zip(*out):
        assert np.array_equal(a, b)


def test_drives_a_torch_model_in_place():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))
    names = [n for n, _ in model.named_parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    w64 = [p.detach().double().numpy().copy() for p in model.parameters()]
    m64 = [np.zeros_like(x) for x in w64]
    v64 = [np.zeros_like(x) for x in w64]
    opt = LAMB(model.named_parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=1.0,
               no_decay=("bias", "1.weight"))   # LayerNorm is module "1"
    wds = [0.0 if ("bias" in n or "1.weight" in n) else 0.1 for n in names]
    assert opt.decays == wds
    x = torch.randn(64, 16)
    y = torch.randint(0, 3, (64,))
    for t in range(1, 21):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.double().numpy().copy() for p in model.parameters()]
        opt.step()                          # reads p.grad, writes p in place
        ref_step("lamb", w64, grads, m64, v64, t, 1e-2, 0.9, 0.999, 1e-6, wds, 1.0)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    err = rel_err([p.detach().numpy() for p in model.parameters()], w64)
    assert err <= 1e-5, err


def test_state_dict_round_trip_resumes_identically():
    rng = np.random.default_rng(1)
    shapes = [(8, 4), (4,)]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(6)]
    wa = [np.ones(s, np.float32) for s in shapes]
    a = LAMB(wa, lr=0.01)
    for g in grads:
        a.step(g)
    wb = [np.ones(s, np.float32) for s in shapes]
    b = LAMB(wb, lr=0.01)
    for g in grads[:3]:
        b.step(g)
    state = b.state_dict()
    wc = [x.copy() for x in wb]
    c = LAMB(wc, lr=0.5).load_state_dict(state)
    assert c.step_count == 3 and c.lr == 0.01
    for g in grads[3:]:
        c.step(g)
    for x, y in zip(wa, wc):
        assert np.array_equal(x, y)


def test_bad_input():
    w = [np.ones((3, 4), np.float32), np.ones(4, np.float32)]
    with pytest.raises(fasttran.InputError, match="lr"):
        LAMB(w, lr=0.0)
    with pytest.raises(fasttran.InputError, match="lr"):
        LAMB(w, lr=-1e-3)
    with pytest.raises(fasttran.InputError, match="beta1"):
        LAMB(w, betas=(1.0, 0.9))
    with pytest.raises(fasttran.InputError, match="unknown optimizer 'sgd'"):
        make_optimizer("sgd", w)
    with pytest.raises(fasttran.InputTypeError, match="float32"):
        LAMB([np.ones(3, np.float64)])
    with pytest.raises(fasttran.InputError, match="empty"):
        LAMB([])
    opt = LAMB(w)
    with pytest.raises(fasttran.InputError, match=r"gradient of 'param0' has shape \(4, 3\), the parameter \(3, 4\)"):
        opt.step([np.ones((4, 3), np.float32), np.ones(4, np.float32)])
    with pytest.raises(fasttran.InputError, match="2 parameters"):
        opt.step([np.ones((3, 4), np.float32)])
    with pytest.raises(fasttran.InputTypeError, match="float32"):
        opt.step([np.ones((3, 4), np.float16), np.ones(4, np.float32)])
    with pytest.raises(fasttran.InputError, match=".grad"):
        opt.step()
    before = [x.copy() for x in w]
    bad = np.ones((3, 4), np.float32)
    bad[1, 2] = np.nan
    with pytest.raises(fasttran.InputError, match="tensor 0 is not finite.*step 1; nothing was updated"):
        opt.step([bad, np.ones(4, np.float32)])
    assert all(np.array_equal(a, b) for a, b in zip(w, before))
    assert opt.step_count == 0
    with pytest.raises(fasttran.InputError, match="lr"):
        opt.step([np.ones((3, 4), np.float32), np.ones(4, np.float32)], lr=float("nan"))


def test_schedules():
    assert schedule_factor("constant", 5, 100, 10) == pytest.approx(0.6)
    assert schedule_factor("constant", 50, 100, 10) == 1.0
    assert schedule_factor("linear", 10, 110, 10) == 1.0
    assert schedule_factor("linear", 60, 110, 10) == pytest.approx(0.5)
    assert schedule_factor("cosine", 60, 110, 10) == pytest.approx(0.5)
    assert schedule_factor("cosine", 109, 110, 10) > 0
    with pytest.raises(fasttran.InputError, match="schedule"):
        schedule_factor("step", 0, 10)


# ---- parameter groups, tensors without gradients, state files (NumPy flavour) -------------------
def test_groups_and_missing_gradients_follow_the_reference_per_tensor():
    """Two groups with their own lr / weight decay; a tensor without a gradient every other step
    keeps its own update count (bias correction), like torch; names drive no_decay."""
    rng = np.random.default_rng(2)
    shapes = {"a.weight": (8, 4), "a.bias": (4,), "b.weight": (3, 3)}
    w32 = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    w64 = {n: x.astype(np.float64) for n, x in w32.items()}
    m64 = {n: np.zeros(s) for n, s in shapes.items()}
    v64 = {n: np.zeros(s) for n, s in shapes.items()}
    lr = {"a.weight": 1e-2, "a.bias": 1e-2, "b.weight": 3e-3}
    wd = {"a.weight": 0.05, "a.bias": 0.0, "b.weight": 0.1}    # a.bias: no_decay by name
    opt = AdamW([{"params": [("a.weight", w32["a.weight"]), ("a.bias", w32["a.bias"])], "lr": 1e-2,
                  "weight_decay": 0.05},
                 {"params": [("b.weight", w32["b.weight"])], "lr": 3e-3, "weight_decay": 0.1}])
    assert opt.decays == [0.05, 0.0, 0.1] and opt.names == list(shapes)
    steps = dict.fromkeys(shapes, 0)
    for t in range(1, 31):
        g = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        if t % 2:
            g["b.weight"] = None
        opt.step([g[n] for n in shapes])
        for n in shapes:
            if g[n] is not None:
                steps[n] += 1
                ref_step("adamw", [w64[n]], [g[n].astype(np.float64)], [m64[n]], [v64[n]], steps[n], lr[n], 0.9,
                         0.999, 1e-8, [wd[n]], None)
    assert rel_err([w32[n] for n in shapes], [w64[n] for n in shapes]) <= 1e-5
    assert [int(opt.state[i]["step"]) for i in range(3)] == [30, 30, 15]


def test_flat_state_and_legacy_state_resume_bit_identically():
    from fasttran.optim import flat_state, load_flat_state
    rng = np.random.default_rng(4)
    shapes = [(6, 5), (5,), (7,)]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(8)]
    full = [np.ones(s, np.float32) for s in shapes]
    a = LAMB(full, lr=0.01, max_grad_norm=1.0)
    for g in grads:
        a.step(g)
    half = [np.ones(s, np.float32) for s in shapes]
    b = LAMB(half, lr=0.01, max_grad_norm=1.0)
    for g in grads[:4]:
        b.step(g)
    meta, m, v = flat_state(b)
    import json
    meta = json.loads(json.dumps(meta))                   # as the Trainer stores it
    legacy = {"optimizer": "lamb", "step": 4, "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01,
              "bias_correction": True, "max_grad_norm": 1.0, "names": b.names, "shapes": [list(s) for s in shapes],
              "exp_avg": m.copy(), "exp_avg_sq": v.copy()}   # fasttran 0.1's state_dict
    for restore in (lambda o: load_flat_state(o, meta, m, v), lambda o: o.load_state_dict(legacy)):
        ws = [x.copy() for x in half]
        c = LAMB(ws, lr=0.5, max_grad_norm=1.0)
        restore(c)
        assert c.step_count == 4 and c.lr == 0.01
        for g in grads[4:]:
            c.step(g)
        for x, y in zip(full, ws):
            assert np.array_equal(x, y)


def test_deepcopy_and_pickle_continue_identically():
    import copy
    import pickle
    rng = np.random.default_rng(5)
    shapes = [(5, 3), (3,)]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(6)]
    w = [np.ones(s, np.float32) for s in shapes]
    opt = AdamW(w, lr=0.01, max_grad_norm=2.0)
    for g in grads[:3]:
        opt.step(g)
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    for g in grads[3:]:
        opt.step(g)
    for c in copies:
        assert c.step_count == 3 and c.max_grad_norm == 2.0
        for g in grads[3:]:
            c.step(g)
        for a, b in zip(w, c.param_groups[0]["params"]):
            assert np.array_equal(a, b)


def test_fasttran_tensors_and_added_groups():
    w = [np.ones((4, 3), np.float32), np.zeros(3, np.float32)]
    t = fasttran.Tensor.from_dlpack(w[0])              # a fasttran.Tensor over w[0]'s memory
    opt = AdamW([t], lr=0.1, weight_decay=0.0)
    opt.step([np.ones((4, 3), np.float32)])
    assert np.allclose(w[0], 1 - 0.1 / (1 + 1e-8))     # first Adam step: lr * sign
    opt.add_param_group({"params": [w[1]], "lr": 0.2})
    opt.step([np.ones((4, 3), np.float32), np.ones(3, np.float32)])
    assert [int(opt.state[i]["step"]) for i in range(2)] == [2, 1]
    assert np.allclose(w[1], -0.2 / (1 + 1e-8))
    with pytest.raises(fasttran.InputError, match="more than one parameter group"):
        opt.add_param_group({"params": [w[1]]})


def test_numpy_use_never_imports_torch():
    import subprocess
    import sys
    code = ("import sys, numpy as np, fasttran\n"
            "o = fasttran.optim.AdamW({'w': np.ones((2, 3), np.float32)}, lr=0.1)\n"
            "o.step([np.ones((2, 3), np.float32)]); o.state_dict()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert not isinstance(o, type) and o.step_count == 1\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
