"""Trainer.fit's C loop (Model.train_steps over csrc/train/loop.c: many steps per call) against its
per-step Python loop (FASTTRAN_PY_LOOP=1 / trainer._py_loop): the same losses, weights, optimizer
state, history and evaluation, bit for bit, for every head (linear and pooler sequence heads:
classification, regression, multi-label; the token head; QA's spans with their context mask; multiple
choice, a question's choices kept together), with and without a trained top layer, dropout on,
several epochs, an uneven last batch, checkpoints, resume, stop_at_step and Ctrl-C. Features of the
real all-MiniLM-L6-v2 on random token ids. Runs on the CPU, and with device="cuda" on a GPU or
the CUDA emulator (FASTTRAN_CUDA=emu build, FASTTRAN_CUDA_EMU=1)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.optim import flat_state

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not fasttran.cuda_available(), reason="no usable CUDA device (or emulator)"))]
N = 90   # examples: batches of 16 leave a last one of 10


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(7)
    lengths = rng.integers(3, 11, N)
    ids = rng.integers(1000, 5000, (N, 10))
    mask = (np.arange(10)[None, :] < lengths[:, None]).astype(np.int64)
    return ids * mask, mask


def _cache(enc, inputs, **kw):
    return ActivationCache.build(enc, *inputs, show_progress=False, **kw)


@pytest.fixture(scope="module")
def caches(enc, inputs):
    L = enc.num_layers
    ids, mask = inputs
    pairs = (ids, mask, (np.arange(10)[None, :] >= 1) * mask)   # QA: every token but the first is context
    return {"mean": _cache(enc, inputs, positions="mean"), "cls": _cache(enc, inputs, positions="cls"),
            "all": _cache(enc, inputs, positions="all"), "top1": _cache(enc, inputs, positions="all", layer=L - 1),
            "qa": _cache(enc, pairs, positions="all"), "qatop1": _cache(enc, pairs, positions="all", layer=L - 1),
            "top2": _cache(enc, inputs, positions="all", layer=L - 2),
            "layer0": _cache(enc, inputs, positions="all", layer=0)}


@pytest.fixture(scope="module")
def targets(caches):
    rng = np.random.default_rng(3)
    lengths = np.asarray(caches["all"].lengths)
    tok = [np.where(rng.random(n) < 0.2, -100, rng.integers(0, 3, n)) for n in lengths]
    y = rng.integers(0, 3, N)
    starts = np.array([rng.integers(1, n - 1) for n in lengths])   # a span inside the context (not [SEP])
    ends = np.array([rng.integers(a, n - 1) for a, n in zip(starts, lengths)])
    return {"classification": y, "classification-pooler": y, "regression": rng.normal(size=N).astype(np.float32),
            "token-classification": tok, "multi-label": rng.integers(0, 2, (N, 4)), "qa": (starts, ends),
            "multiple-choice": rng.integers(0, 3, N // 3)}


CASES = {   # name: (task, cache, Trainer arguments)
    "linear": ("classification", "mean", dict(optimizer="lamb", dropout=0.1)),
    "pooler": ("classification-pooler", "cls", dict(optimizer="adamw", dropout=0.1, schedule="cosine")),
    "regression": ("regression", "mean", dict(optimizer="lamb", dropout=0.1, warmup=3)),
    "multilabel": ("multi-label", "mean", dict(optimizer="adamw", dropout=0.1)),
    "token": ("token-classification", "all", dict(optimizer="adamw", dropout=0.1)),
    "top1": ("classification", "top1", dict(optimizer="adamw", lr=1e-4, dropout=0.1, train_layers=1,
                                            layer_dropout=0.1)),
    "qa": ("qa", "qa", dict(optimizer="adamw", lr=0.05)),
    "qa-top1": ("qa", "qatop1", dict(optimizer="lamb", train_layers=1, layer_dropout=0.1)),
    "choice": ("multiple-choice", "cls", dict(optimizer="lamb", dropout=0.1, batch_size=4)),   # 3 choices each
    # a learning rate per group: the head's own, the lower layer's decayed (lr_scale in both loops)
    "top2groups": ("classification", "top2", dict(optimizer="lamb", lr=1e-3, head_lr=4e-3, layer_lr_decay=0.6,
                                                  dropout=0.1, train_layers=2, layer_dropout=0.1)),
    # every layer and the embeddings: the steps' rows as token ids (one epoch: six layers)
    "embeddings": ("classification", "layer0", dict(optimizer="adamw", lr=1e-4, train_layers=6, train_embeddings=True,
                                                    layer_dropout=0.1, embedding_dropout=0.1, epochs=1)),
}


def _trainer(case, device, py, **kw):
    task, _, args = CASES[case]
    args = dict(dict(epochs=3, batch_size=16, seed=5, show_progress=False, device=device, reduction=None), **args)
    tr = Trainer(task, **dict(args, **kw))
    tr._py_loop = py
    return tr


def _spy(monkeypatch):
    calls = []
    real = Trainer._c_epoch

    def spy(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(Trainer, "_c_epoch", spy)
    return calls


def _host(t):
    return np.array(t.device.host(t) if hasattr(t, "device") and hasattr(t.device, "host") else t)


def assert_same(a, b):
    """two trainers that trained the same run: every bit of what they hold"""
    assert a.global_step == b.global_step and a._pos == b._pos
    assert a.loss_curve == b.loss_curve
    strip = lambda h: [{k: v for k, v in r.items() if "seconds" not in k} for r in h]
    assert strip(a.history) == strip(b.history)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert np.array_equal(np.asarray(a.device.host(p)), np.asarray(b.device.host(q))), n
    sa, sb = flat_state(a.optimizer), flat_state(b.optimizer)
    assert sa[0] == sb[0]
    assert np.array_equal(sa[1], sb[1]) and np.array_equal(sa[2], sb[2])
    assert a.optimizer.lr == b.optimizer.lr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_c_loop_equals_the_python_loop(case, device, caches, targets, monkeypatch):
    task, source, _ = CASES[case]
    cache, y = caches[source], targets[task]
    calls = _spy(monkeypatch)
    ev = None if task == "qa" else (cache, y)   # (QA evaluates against SQuAD features)
    py = _trainer(case, device, True)
    py.fit(cache, y, eval=ev)
    assert not calls
    c = _trainer(case, device, False)
    c.fit(cache, y, eval=ev)
    assert c._c_loop_refusal(cache) is None
    assert len(calls) == c.epochs   # one per epoch
    assert_same(c, py)
    if ev is not None:
        assert c.evaluate(cache, y) == py.evaluate(cache, y)
    assert all(np.isfinite(loss) for _, loss in c.loss_curve)
    assert c._c_loop_reads(cache) == (device == "cpu")   # a host cache: read by the C loop on the CPU only


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["linear", "token", "qa", "choice"])
def test_many_calls_per_epoch(case, device, caches, targets, monkeypatch):
    """calls of a few batches each (read ahead on the CPU), stop_at_step and checkpoints between"""
    import fasttran.trainer as trainer_module
    task, source, _ = CASES[case]
    cache, y = caches[source], targets[task]
    monkeypatch.setattr(trainer_module, "_C_LOOP_CHUNK_BYTES", 2 * 16 * 4 * cache.hidden)
    monkeypatch.setattr(trainer_module, "_C_LOOP_STEPS", 3)
    py = _trainer(case, device, True)
    py.fit(cache, y, stop_at_step=14)
    py.fit(cache, y)
    c = _trainer(case, device, False)
    c.fit(cache, y, stop_at_step=14)
    c.fit(cache, y)
    assert_same(c, py)


@pytest.mark.parametrize("device", DEVICES)
def test_env_var_forces_the_python_loop(caches, targets, monkeypatch, device):
    calls = _spy(monkeypatch)
    monkeypatch.setenv("FASTTRAN_PY_LOOP", "1")
    tr = _trainer("linear", device, False, epochs=1)
    tr.fit(caches["mean"], targets["classification"])
    assert not calls and tr.global_step == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["linear", "top1", "top2groups"])
def test_stop_checkpoints_and_resume(case, device, caches, targets, tmp_path, monkeypatch):
    """stop_at_step mid-epoch with checkpoints every 4 steps, then resume: the Python loop's run,
    its checkpoints, and the full run's end state, bit for bit"""
    task, source, _ = CASES[case]
    cache, y = caches[source], targets[task]
    full = _trainer(case, device, True)
    full.fit(cache, y)
    runs = {}
    for py in (True, False):
        ck = str(tmp_path / f"ck{py}")
        part = _trainer(case, device, py)
        part.fit(cache, y, checkpoint_dir=ck, checkpoint_every=4, stop_at_step=9)
        assert part.global_step == 9 and part._pos == (1, 3)
        mid = Trainer.load(ck, show_progress=False)   # written at step 9 (stop), after 4 and 8
        back = Trainer.load(ck, show_progress=False, reduction=None)
        back._py_loop = py
        back.fit(cache, y, checkpoint_dir=ck, resume=True)
        runs[py] = (part, mid, back)
    assert_same(runs[True][0], runs[False][0])
    assert runs[True][1].global_step == runs[False][1].global_step == 9
    assert_same(runs[True][2], runs[False][2])
    for (n, p), (_, q) in zip(full.model.named_parameters(), runs[False][2].model.named_parameters()):
        assert np.array_equal(np.asarray(full.device.host(p)), np.asarray(runs[False][2].device.host(q))), n
    # a checkpoint step inside a C call: the file holds that step's state
    calls = _spy(monkeypatch)
    ck = str(tmp_path / "every")
    c = _trainer(case, device, False, epochs=1)
    c.fit(cache, y, checkpoint_dir=ck, checkpoint_every=4, stop_at_step=4)
    assert calls and Trainer.load(ck).global_step == 4


def test_refusals_keep_the_python_loop(enc, inputs, caches, targets):
    tr = _trainer("linear", "cpu", False)
    tr.fit(caches["mean"], targets["classification"], stop_at_step=1)
    assert tr._c_loop_refusal(caches["mean"]) is None
    tr._py_loop = True
    assert "FASTTRAN_PY_LOOP" in tr._c_loop_refusal(caches["mean"])
    tr._py_loop = False
    tr._optimizer_step = lambda total, warm: None   # a per-step hook keeps every step in Python
    assert "_optimizer_step" in tr._c_loop_refusal(caches["mean"])
    del tr._optimizer_step
    assert tr._c_loop_refusal(caches["mean"]) is None

    class Sub(Trainer):
        def _step(self, *a):
            return super()._step(*a)
    sub = Sub("classification", epochs=1, show_progress=False, reduction=None)
    sub.fit(caches["mean"], targets["classification"], stop_at_step=1)
    assert "_step" in sub._c_loop_refusal(caches["mean"])
    uncached = ActivationCache.uncached(enc, *inputs, positions="mean")
    assert "encoder" in tr._c_loop_refusal(uncached)


def test_divergence_stops_the_c_loop_as_the_python_loop_does(enc, inputs, targets, monkeypatch):
    cache = _cache(enc, inputs, positions="mean")
    calls = _spy(monkeypatch)
    for py in (True, False):
        tr = _trainer("linear", "cpu", py, lr=1e30, optimizer="adamw")
        with pytest.raises(FloatingPointError) as e:
            tr.fit(cache, targets["classification"])
        if py:
            want, steps = str(e.value), tr.global_step
        else:
            assert str(e.value) == want and tr.global_step == steps and calls


CTRL_C_SCRIPT = r"""
import sys, numpy as np, fasttran
from fasttran import ActivationCache, Trainer
rng = np.random.default_rng(0)
x_ids = rng.integers(1000, 2000, (400, 8)); mask = np.ones_like(x_ids)
enc = fasttran.Encoder.from_pretrained(sys.argv[1])
cache = ActivationCache.build(enc, x_ids, mask, positions="cls", show_progress=False)
y = rng.integers(0, 2, 400)
tr = Trainer("classification", epochs=100000, batch_size=4, show_progress=False, reduction=None)
print("ready", flush=True)
tr.fit(cache, y, checkpoint_dir=sys.argv[2])
print("returned", tr.global_step, tr._c_loop_refusal(cache), flush=True)
"""


def test_ctrl_c_stops_the_c_loop_and_saves(minilm_dir, tmp_path, caches):
    ck = str(tmp_path / "ck")
    p = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, minilm_dir, ck], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    assert p.stdout.readline().split()[0] == "ready"
    time.sleep(4)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "interrupted after step" in err and "returned" in out
    step, refusal = out.split("returned")[1].split()[:2]
    assert refusal == "None"   # the C loop ran
    step = int(step)
    assert step > 0
    back = Trainer.load(ck)
    assert back.global_step == step and back.optimizer.step_count == step
    epoch, b = back._pos
    assert epoch * 100 + b == step


@pytest.mark.skipif(not fasttran.cuda_available(), reason="no usable CUDA device (or emulator)")
def test_float16_loss_scaling_in_the_c_loop(caches, targets, monkeypatch):
    """float16 products: the dynamic loss scale's per-step decisions (an overflowing step skipped and
    the scale halved, growth after clean steps -- after each one here, up to 2**60, so both happen)
    made in C, the per-step loop's bits, scale and skip count"""
    import fasttran.trainer as trainer_module
    task, source, _ = CASES["top1"]
    cache, y = caches[source], targets[task]
    monkeypatch.setattr(trainer_module, "_SCALE_GROWTH_STEPS", 1)
    monkeypatch.setattr(trainer_module, "_SCALE_MAX", 2.0 ** 60)
    calls = _spy(monkeypatch)
    runs = []
    for py in (True, False):
        tr = _trainer("top1", "cuda", py, precision="float16")
        tr.loss_scale = [2.0 ** 24, 0]
        tr.fit(cache, y, stop_at_step=7)
        tr.fit(cache, y)
        runs.append(tr)
    py, c = runs
    assert calls and c._c_loop_refusal(cache) is None
    assert py.skipped_steps == c.skipped_steps > 0 and py.loss_scale == c.loss_scale
    assert len({s for s, _ in py.loss_curve}) == len(py.loss_curve) == py.global_step
    assert_same(c, py)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from conftest import make_checkpoint
    from test_random_models import AWKWARD
    return make_checkpoint(str(tmp_path_factory.mktemp("m") / "m"), **AWKWARD)


@pytest.mark.skipif(not fasttran.cuda_available(), reason="no usable CUDA device (or emulator)")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("case", ["linear", "token"])
def test_cuda_loop_gathers_the_device_tier(case, dtype, small_model, inputs, targets, monkeypatch):
    """a cache whose rows all sit in the device tier: the C loop gathers and decodes each step's rows
    on the device into the model's input (no chunk read through cache.get), the per-step loop's bits"""
    task, source, _ = CASES[case]
    ids, mask = inputs
    enc = fasttran.Encoder.from_pretrained(small_model, device="cuda")
    cache = ActivationCache.build(enc, (ids % 97 + 1) * mask, mask, positions="all" if source == "all" else "mean",
                                  dtype=dtype, device_bytes=1 << 30, show_progress=False)
    assert cache.stats()["tiers"]["device"]["entries"] == N
    y = targets[task]
    py = _trainer(case, "cuda", True)
    py.fit(cache, y)
    c = _trainer(case, "cuda", False)
    calls = _spy(monkeypatch)

    def no_chunks(*a, **k):
        raise AssertionError("the C loop read a chunk through cache.get")
    monkeypatch.setattr(cache, "get", no_chunks)
    c.fit(cache, y)
    monkeypatch.undo()
    assert len(calls) == 3 and c._c_loop_refusal(cache) is None and c._c_loop_reads(cache)
    assert_same(c, py)
    assert c.evaluate(cache, y) == py.evaluate(cache, y)


def test_train_steps_refuses_bad_plans(caches, targets):
    tr = _trainer("linear", "cpu", False, epochs=1)
    cache, y = caches["mean"], targets["classification"]
    tr.fit(cache, y, stop_at_step=1)
    core, opt = tr.model._core, tr.optimizer
    x = np.ascontiguousarray(cache.get(cache.example_ids[:8]))
    good = dict(optimizer=opt._table, groups=opt.param_groups, grads=tr._gviews, max_grad_norm=1.0, check_finite=True,
                x=x, lengths=np.ones(8, np.int32), examples=np.array([0, 4, 8], np.int64),
                targets=np.zeros(8, np.int32), denominators=np.full(2, 4.0), lrs=np.full(2, 1e-3), seed=0,
                first_step=0, losses=np.zeros(2))
    before = np.asarray(tr.model.params).copy()   # (np.array of a fasttran.Tensor is a view)
    bad = {"examples": dict(examples=np.array([1, 4, 8], np.int64)),
           "an empty step": dict(examples=np.array([0, 8, 8], np.int64)),
           "targets": dict(targets=np.zeros(7, np.int32)),
           "x": dict(x=x[:7]),
           "denominator": dict(denominators=np.array([4.0, 0.0])),
           "lr": dict(lrs=np.array([1e-3, np.nan])),
           "losses": dict(losses=np.zeros(3))}
    for what, change in bad.items():
        with pytest.raises(fasttran.InputError):
            core.train_steps(**dict(good, **change))
    store, index = cache._store, np.arange(8, dtype=np.int64)
    bad_reads = {"x and a cache": dict(cache=store, index=index),
                 "a cache without an index": dict(x=None, cache=store),
                 "an index outside the cache": dict(x=None, cache=store, index=index + N - 4),
                 "a negative index": dict(x=None, cache=store, index=index - 1),
                 "a short index": dict(x=None, cache=store, index=index[:7]),
                 "lengths the cache's rows do not match": dict(x=None, cache=store, index=index,
                                                               lengths=np.full(8, 2, np.int32))}
    for what, change in bad_reads.items():
        with pytest.raises(fasttran.InputError):
            core.train_steps(**dict(good, **change))
    with pytest.raises(fasttran.InputTypeError):
        core.train_steps(**dict(good, x=None, cache=object(), index=index))
    with pytest.raises(fasttran.InputTypeError):
        core.train_steps(**dict(good, targets=np.zeros(8, np.float32)))
    with pytest.raises(fasttran.InputTypeError):
        core.train_steps(**dict(good, optimizer=object()))
    assert np.array_equal(np.array(tr.model.params), before)   # nothing ran

    def boom(done):
        raise ValueError("from the callback")
    with pytest.raises(ValueError, match="from the callback"):
        core.train_steps(**good, every=1, callback=boom)
    assert good["losses"][0] != 0 and good["losses"][1] == 0   # the first step ran, then the callback stopped it
    done, stop, msg = core.train_steps(**dict(good, losses=np.zeros(2)), every=1, callback=lambda d: True)
    assert (done, stop, msg) == (1, 3, None)
    done, stop, msg = core.train_steps(**dict(good, losses=np.zeros(2)))
    assert (done, stop, msg) == (2, 0, None)
    # two trainers in the same state, the same steps over x and reading the cache: the same bits
    runs = []
    for change in ({}, dict(x=None, cache=store, index=index)):
        t = _trainer("linear", "cpu", False, epochs=1)
        t.fit(cache, y, stop_at_step=1)
        losses = np.zeros(2)
        assert t.model._core.train_steps(**dict(good, optimizer=t.optimizer._table, groups=t.optimizer.param_groups,
                                                grads=t._gviews, losses=losses, **change))[:2] == (2, 0)
        runs.append((losses, np.asarray(t.model.params).copy()))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
