"""A learning rate per parameter group as a factor of the schedule's: the optimizer's `lr_scale`
(fasttran.optim), and the Trainer's head_lr / layer_lr_decay built on it (fasttran.trainer.lr_factors)
-- which tensor gets which factor, checked against a float64 reference of the update each one
receives; the neutral values give the run without groups bit for bit; the recipes' defaults; the
refusals. (The C loop's per-group lr against the per-step loop's: tests/test_train_loop.py.)"""
import math
import re

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.optim import AdamW, LAMB
from fasttran.trainer import DEFAULT_TOPK_RECIPES, lr_factors, topk_recipe

N = 40


def _tokens(enc, seed=11):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 9, N)
    ids = rng.integers(1000, 5000, (N, 8))
    mask = (np.arange(8)[None, :] < lengths[:, None]).astype(np.int64)
    return ids * mask, mask


@pytest.fixture(scope="module")
def data(enc):
    ids, mask = _tokens(enc)
    L = enc.num_layers
    top3 = ActivationCache.build(enc, ids, mask, positions="all", layer=L - 3, show_progress=False)
    mean = ActivationCache.build(enc, ids, mask, positions="mean", show_progress=False)
    return top3, mean, np.random.default_rng(5).integers(0, 2, N)


def _reference_factor(name, L, lr, head_lr, decay):
    """what a tensor should get, from its name alone: encoder.layer.<i>. is d = L - 1 - i layers below
    the top one; everything else is the head's"""
    m = re.match(r"encoder\.layer\.(\d+)\.", name)
    if m is None:
        return head_lr / lr
    return decay ** (L - 1 - int(m.group(1)))


# ---- the optimizer's lr_scale ------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [LAMB, AdamW])
def test_lr_scale_is_a_factor_of_the_groups_lr(cls):
    """a group at lr_scale s steps exactly as the same group at lr x s without one (bit for bit), and
    step(lr=) sets every group's lr, keeping each group's scale"""
    rng = np.random.default_rng(0)
    w = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3)]
    g = [[rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3)] for _ in range(3)]
    a = [x.copy() for x in w]
    b = [x.copy() for x in w]
    scaled = cls([{"params": [a[0]], "lr_scale": 0.5}, {"params": [a[1]]}, {"params": [a[2]], "lr_scale": 3.0}],
                 lr=1e-2, weight_decay=0.1)
    plain = cls([{"params": [b[0]], "lr": 5e-3}, {"params": [b[1]], "lr": 1e-2}, {"params": [b[2]], "lr": 3e-2}],
                lr=1e-2, weight_decay=0.1)
    for k, lr in enumerate((1e-2, 4e-3, 2.5e-3)):
        scaled.step(g[k], lr=lr)
        for grp, s in zip(plain.param_groups, (0.5, 1.0, 3.0)):
            grp["lr"] = lr * s
        plain.step(g[k])
        assert [grp["lr"] for grp in scaled.param_groups] == [lr] * 3
        assert [grp.get("lr_scale") for grp in scaled.param_groups] == [0.5, None, 3.0]
        for x, y in zip(a, b):
            assert np.array_equal(x, y)
    assert scaled.lr == 2.5e-3
    assert "lr_scale" in scaled.state_dict()["param_groups"][0]


def test_lr_scale_of_one_changes_nothing():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 4)).astype(np.float32)
    a, b = w.copy(), w.copy()
    oa, ob = LAMB([{"params": [a], "lr_scale": 1.0}], lr=1e-3), LAMB([b], lr=1e-3)
    for _ in range(3):
        grad = rng.normal(size=(4, 4)).astype(np.float32)
        oa.step([grad], lr=7e-4)
        ob.step([grad], lr=7e-4)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_bad_lr_scale_is_refused(bad):
    w = np.zeros((2, 2), np.float32)
    with pytest.raises((fasttran.InputError, fasttran.InputTypeError), match="lr_scale"):
        LAMB([{"params": [w], "lr_scale": bad}], lr=1e-3)
    if bad is True:   # (the step reads numbers as floats: True is 1 there, as for lr)
        return
    opt = LAMB([{"params": [w], "lr_scale": 2.0}], lr=1e-3)
    opt.param_groups[0]["lr_scale"] = bad   # set between steps: the C table reads it each step
    with pytest.raises((fasttran.InputError, fasttran.InputTypeError), match="lr_scale"):
        opt.step([np.ones((2, 2), np.float32)])


def test_lr_scale_with_a_torch_scheduler():
    torch = pytest.importorskip("torch")
    w1, w2 = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamW([{"params": [w1], "lr_scale": 0.25}, {"params": [w2]}], lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(2):
        w1.grad, w2.grad = torch.ones(3), torch.ones(3)
        opt.step()
        sched.step()
    # AdamW with a constant gradient moves each weight by lr (bias-corrected m / sqrt(v) = 1): 1e-2 then 5e-3
    assert np.allclose(w2.detach().numpy(), 1 - 1.5e-2, atol=1e-6)
    assert np.allclose(w1.detach().numpy(), 1 - 0.25 * 1.5e-2, atol=1e-6)


# ---- the Trainer's factors -----------------------------------------------------------------------
def test_factors_and_groups_against_the_names(enc, data):
    top3, _, y = data
    L = enc.num_layers
    tr = Trainer("classification", optimizer="adamw", lr=1e-3, head_lr=5e-3, layer_lr_decay=0.5, train_layers=3,
                 epochs=1, batch_size=8, show_progress=False, reduction=None)
    tr.fit(top3, y, stop_at_step=1)
    names = [n for n, _ in tr.model.named_parameters()]
    want = [_reference_factor(n, L, 1e-3, 5e-3, 0.5) for n in names]
    got = lr_factors(tr.model, tr.lr, tr.head_lr, tr.layer_lr_decay)
    assert np.allclose(got, want, rtol=1e-15, atol=0)
    assert sorted(set(round(f, 12) for f in want)) == [0.25, 0.5, 1.0, 5.0]
    # the optimizer's groups: runs of tensors in table order, each with its factor
    per_tensor = [(n, grp["lr_scale"]) for grp in tr.optimizer.param_groups for n in grp["param_names"]]
    assert [n for n, _ in per_tensor] == names
    assert np.allclose([f for _, f in per_tensor], want, rtol=1e-15, atol=0)
    assert len(tr.optimizer.param_groups) == 4


@pytest.mark.parametrize("py_loop", [False, True])
def test_each_tensor_receives_its_lr(enc, data, py_loop):
    """one AdamW step (no decay, no clipping, no warmup, constant schedule) and a float64 reference of
    it: w1 = w0 - lr x factor x g / (|g| + eps), the first step's bias-corrected moments; tensor by
    tensor in both loops"""
    top3, _, y = data
    L = enc.num_layers
    lr, head_lr, decay, eps = 2e-3, 1.5e-2, 0.4, 1e-8
    tr = Trainer("classification", optimizer="adamw", lr=lr, head_lr=head_lr, layer_lr_decay=decay, train_layers=3,
                 epochs=1, batch_size=8, warmup=0, schedule="constant", weight_decay=0.0, max_grad_norm=None,
                 eps=eps, dropout=0.0, layer_dropout=0.0, show_progress=False, reduction=None)
    tr._py_loop = py_loop
    # the weights before the step: the head starts from the data, so build, copy, then step
    tr._prepare(top3, y)
    w0 = {n: np.array(tr.device.host(p), np.float64) for n, p in tr.model.named_parameters()}
    tr.fit(top3, y, stop_at_step=1)
    assert tr.global_step == 1
    checked = 0
    for (n, p), (_, g) in zip(tr.model.named_parameters(), tr.model.named_gradients()):
        w1 = np.array(tr.device.host(p), np.float64)
        g = np.array(tr.device.host(g), np.float64)
        expect = w0[n] - lr * _reference_factor(n, L, lr, head_lr, decay) * g / (np.abs(g) + eps)
        assert np.allclose(w1, expect, rtol=0, atol=2e-7 + 1e-6 * np.abs(w0[n]).max()), n
        big = np.abs(g) > 1e-5   # where the step is lr x factor to 1e-3: the factor itself, tensor by tensor
        if big.any():
            got = np.median(np.abs(w1 - w0[n])[big])
            assert math.isclose(got, lr * _reference_factor(n, L, lr, head_lr, decay), rel_tol=2e-3), n
            checked += 1
    assert checked > 10


def test_neutral_values_change_nothing(enc, data):
    """head_lr = lr and layer_lr_decay = 1: one plain group, the run without them bit for bit"""
    top3, _, y = data
    kw = dict(optimizer="lamb", lr=1e-3, train_layers=3, epochs=2, batch_size=8, show_progress=False, reduction=None)
    a = Trainer("classification", **kw)
    b = Trainer("classification", head_lr=1e-3, layer_lr_decay=1.0, **kw)
    a.fit(top3, y)
    b.fit(top3, y)
    assert len(b.optimizer.param_groups) == 1 and "lr_scale" not in b.optimizer.param_groups[0]
    assert a.loss_curve == b.loss_curve
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert np.array_equal(np.asarray(p), np.asarray(q)), n


def test_checkpoint_keeps_the_groups(enc, data, tmp_path):
    top3, _, y = data
    tr = Trainer("classification", lr=1e-3, head_lr=3e-3, layer_lr_decay=0.8, train_layers=3, epochs=1,
                 batch_size=8, show_progress=False, reduction=None)
    tr.fit(top3, y, checkpoint_dir=str(tmp_path / "ck"))
    back = Trainer.load(str(tmp_path / "ck"), show_progress=False)
    assert (back.lr, back.head_lr, back.layer_lr_decay) == (1e-3, 3e-3, 0.8)
    back._build(top3.encoder)
    assert [g["lr_scale"] for g in back.optimizer.param_groups] == [g["lr_scale"] for g in tr.optimizer.param_groups]


def test_recipe_defaults(enc):
    for opt, table in DEFAULT_TOPK_RECIPES.items():
        for k in range(1, enc.num_layers + 1):
            tr = Trainer("classification", optimizer=opt, train_layers=k, show_progress=False, reduction=None)
            r = topk_recipe(opt, k)
            assert tr.lr == r["lr"] and (tr.head_lr or tr.lr) == r["head_lr"]
            assert tr.layer_lr_decay == r["layer_lr_decay"]
            assert tr.warmup == r.get("warmup", 0.1) and tr.epochs == r.get("epochs", 3)
            assert r == table[max(x for x in table if x <= k)] if any(x <= k for x in table) else True
    # a given lr: every tensor at it unless head_lr / layer_lr_decay say otherwise
    tr = Trainer("classification", lr=1e-4, train_layers=2, show_progress=False, reduction=None)
    assert (tr.head_lr, tr.layer_lr_decay) == (None, 1.0)
    # the head alone: lr is the head's
    assert Trainer("classification", layer_lr_decay=0.5, show_progress=False).layer_lr_decay == 0.5


@pytest.mark.parametrize("kw, match", [
    (dict(head_lr=1e-3), "head_lr is the head's learning rate beside"),
    (dict(train_layers=1, head_lr=0.0), "head_lr must be a finite number > 0"),
    (dict(train_layers=1, head_lr=float("nan")), "head_lr must be"),
    (dict(train_layers=1, layer_lr_decay=-0.5), "layer_lr_decay must be a finite number > 0"),
    (dict(train_layers=1, layer_lr_decay=True), "layer_lr_decay must be"),
])
def test_refusals(kw, match):
    with pytest.raises(fasttran.InputError, match=match):
        Trainer("classification", **kw)


# ---- the lr picked on held-out training data ----------------------------------------------------
def test_search_lr_keeps_the_best_try(enc, data):
    """each try is the run a trainer at that lr gives (its held-out score, bit for bit); the best
    becomes the lr, the head's keeping its ratio"""
    top3, mean, y = data
    ho = ActivationCache.build(enc, *[a[:12] for a in _tokens(enc, seed=12)], positions="all", layer=enc.num_layers - 3,
                               show_progress=False)
    y_ho = y[:12]
    kw = dict(train_layers=3, batch_size=8, seed=2, show_progress=False, reduction=None)
    tr = Trainer("classification", lr=1e-3, head_lr=4e-3, **kw)
    tries = tr.search_lr(top3, y, (ho, y_ho), lrs=[1e-4, 3e-3], metric="loss")
    assert [t["lr"] for t in tries] == [1e-4, 3e-3] and [t["head_lr"] for t in tries] == [4e-4, 1.2e-2]
    for t in tries:
        ref = Trainer("classification", lr=t["lr"], head_lr=t["head_lr"], epochs=1, **kw)
        ref.fit(top3, y, eval=(ho, y_ho))
        assert ref.history[-1]["eval_loss"] == t["loss"]
    best = min(tries, key=lambda t: t["loss"])
    assert (tr.lr, tr.head_lr) == (best["lr"], best["head_lr"]) and tr.lr_search_tries is tries
    tr.fit(top3, y)
    with pytest.raises(fasttran.InputError, match="before fit"):
        tr.search_lr(top3, y, (ho, y_ho))
    t2 = Trainer("classification", show_progress=False)
    with pytest.raises(fasttran.InputError, match="lrs must be"):
        t2.search_lr(mean, y, (mean, y), lrs=[0.0])
    with pytest.raises(fasttran.InputError, match="holdout must be a pair"):
        t2.search_lr(mean, y, mean)
    # the default tries: the lr x LR_SEARCH_FACTORS
    t2.search_lr(mean, y, (mean, y))
    assert [t["lr"] for t in t2.lr_search_tries] == [t2.LR_SEARCH_FACTORS[i] * 2e-2 for i in range(3)]
