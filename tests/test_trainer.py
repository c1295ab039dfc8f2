"""Trainer on real data (frozen all-MiniLM-L6-v2 features of real SST-2 sentences): with and
without the cache identical, deterministic, learns, save/load/resume exact, Ctrl-C leaves a
usable saved state, bad input refused, NaN loss stops with the step."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, ClassificationHead, Trainer

from conftest import block_import, sst2_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sst(enc):
    from fasttran.data import load_sst2
    s, y = load_sst2(sst2_file("train"))
    s, y = s[:480], np.array(y[:480])
    ids, mask, types = enc.tokenize(s)
    return ids, mask, types, y


@pytest.fixture(scope="module")
def cache(enc, sst):
    ids, mask, types, _ = sst
    return ActivationCache.build(enc, ids, mask, types, positions="mean", show_progress=False)


def trainer(**kw):
    args = dict(optimizer="lamb", lr=3e-3, epochs=2, batch_size=32, seed=7, show_progress=False, dropout=0.1)
    args.update(kw)
    return Trainer("classification", **args)


def test_encoder_is_padding_and_batch_invariant(enc, sst):
    """What makes the no-cache baseline exact: an example's output does not depend on its batch."""
    ids, mask, types, _ = sst
    full = enc.forward(ids[:64], mask[:64], types[:64], pooling="mean")
    L = int(mask[5:17].sum(1).max())
    part = enc.forward(ids[5:17, :L], mask[5:17, :L], types[5:17, :L], pooling="mean")
    assert np.array_equal(part, full[5:17])


def test_cache_and_no_cache_train_identically(enc, sst, cache):
    ids, mask, types, y = sst
    a = trainer()
    ha = a.fit(cache, y)
    nocache = ActivationCache.uncached(enc, ids, mask, types, positions="mean")
    b = trainer()
    hb = b.fit(nocache, y)
    assert [r["train_loss"] for r in ha] == [r["train_loss"] for r in hb]
    assert np.array_equal(a.head.params, b.head.params)
    st = nocache.stats()
    assert st["hits"] == 0 and st["misses"] >= len(y) * 2   # the encoder really ran every epoch
    # deterministic: the same seed again gives the same bits; another seed does not
    c = trainer()
    c.fit(cache, y)
    assert np.array_equal(a.head.params, c.head.params)
    d = trainer(seed=8)
    d.fit(cache, y)
    assert not np.array_equal(a.head.params, d.head.params)


def test_learns_and_evaluates(enc, sst, cache):
    ids, mask, types, y = sst
    tr = trainer(epochs=6, lr=5e-2)
    hist = tr.fit(cache, y, eval=(cache, y))
    assert len(hist) == 6 and hist[-1]["train_loss"] < hist[0]["train_loss"]
    m = tr.evaluate(cache, y)
    assert m["accuracy"] > 0.75 and 0 < m["f1"] <= 1 and m["accuracy"] == hist[-1]["eval_accuracy"]
    pred = tr.predict(cache)
    assert pred.shape == (len(y),) and (pred == y).mean() == m["accuracy"]
    assert "Trainer(" in repr(tr) and "<table>" in tr._repr_html_()


@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_save_load_and_resume_are_exact(cache, sst, tmp_path, optimizer):
    y = sst[3]
    full = trainer(epochs=3, optimizer=optimizer)
    full.fit(cache, y)
    part = trainer(epochs=3, optimizer=optimizer)
    part.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), stop_at_step=20)   # inside epoch 2
    assert part.global_step == 20 and len(part.history) == 1
    # a new process would do this: load, then continue to the end
    resumed = Trainer.load(str(tmp_path / "ck"), show_progress=False)
    assert resumed.global_step == 20 and np.array_equal(resumed.head.params, part.head.params)
    resumed.fit(cache, y)
    assert np.array_equal(resumed.head.params, full.head.params)
    assert len(resumed.history) == 3
    # corruption of a checkpoint file is caught
    p = tmp_path / "ck" / "head.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x40
    p.write_bytes(bytes(raw))
    with pytest.raises(fasttran.CheckpointError, match="corrupt"):
        Trainer.load(str(tmp_path / "ck"))


CTRL_C_SCRIPT = r"""
import os, sys, numpy as np, fasttran
from fasttran import ActivationCache, Trainer
rng = np.random.default_rng(0)
ids = rng.integers(1000, 2000, (4000, 12)); mask = np.ones_like(ids)
enc = fasttran.Encoder.from_pretrained(sys.argv[1])
cache = ActivationCache.uncached(enc, ids, mask, positions="cls")
y = rng.integers(0, 2, 4000)
tr = Trainer("classification", epochs=50, batch_size=16, show_progress=False)
print("ready", flush=True)
tr.fit(cache, y, checkpoint_dir=sys.argv[2])
print("returned", tr.global_step, flush=True)
"""


def test_ctrl_c_stops_between_steps_and_saves(minilm_dir, tmp_path, cache, sst):
    ck = str(tmp_path / "ck")
    p = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, minilm_dir, ck], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    assert p.stdout.readline().strip() == "ready"
    time.sleep(4)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "interrupted after step" in err and "returned" in out
    step = int(out.split("returned")[1].split()[0])
    assert step > 0
    back = Trainer.load(ck)
    assert back.global_step == step and back.optimizer.step_count == step


def test_bad_input(cache, sst):
    y = sst[3]
    with pytest.raises(fasttran.InputError, match="lr"):
        Trainer("classification", lr=0)
    with pytest.raises(fasttran.InputError, match="unknown optimizer"):
        Trainer("classification", optimizer="sgd")
    with pytest.raises(fasttran.InputError, match="unknown head"):
        Trainer("segmentation")
    with pytest.raises(fasttran.InputError, match="entries but the cache has 480"):
        trainer().fit(cache, y[:-1])
    with pytest.raises(fasttran.InputError, match=r"label 2 of example 3 is outside \[0, 2\)"):
        yy = y.copy()
        yy[3] = 2
        trainer(num_labels=2).fit(cache, yy)
    with pytest.raises(fasttran.InputError, match="positions='all'"):
        Trainer("qa", show_progress=False).fit(cache, (y, y))
    with pytest.raises(fasttran.InputError, match="width 384, the head expects 100"):
        Trainer(ClassificationHead(100, 2), show_progress=False).fit(cache, y)
    with pytest.raises(fasttran.InputError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        Trainer("classification", device="gpu")
    if not fasttran.cuda_available():   # with a GPU (or the emulator): tests/test_cuda_training.py
        with pytest.raises(fasttran.NoGPUError, match="no usable GPU"):
            Trainer("classification", device="cuda:0")


def test_nan_features_and_nan_loss(enc, sst, tmp_path):
    ids, mask, types, y = sst
    d = tmp_path / "nan"
    built = ActivationCache.build(enc, ids[:64], mask[:64], types[:64], positions="mean", show_progress=False,
                                  disk_dir=d)
    # poison one stored value in the shard file and re-sign it (a tool that writes NaN features
    # and a valid checksum): NaN features are named by example
    import json
    from fasttran.cache import persist
    man = json.loads((d / "manifest.json").read_text())
    man.pop("checksum")
    entry = man["shards"][0]
    raw = bytearray((d / entry["file"]).read_bytes())
    row = built.get(built.example_ids[:1])[0]
    at = bytes(raw).find(row.tobytes())
    assert at > 0
    raw[at:at + 4] = np.float32(np.nan).tobytes()
    (d / entry["file"]).write_bytes(bytes(raw))
    entry["bytes"], entry["crc32c"] = len(raw), fasttran._C.crc32c(bytes(raw))
    persist.write_manifest(str(d), man)
    bad = ActivationCache.open(d)
    with pytest.raises(fasttran.InputError, match="contain NaN"):
        trainer().fit(bad, y[:64])
    # a head with a broken (NaN) weight: the NaN loss stops training, naming the step
    good = ActivationCache.build(enc, ids[:64], mask[:64], types[:64], positions="mean", show_progress=False)
    head = ClassificationHead(384, 2)
    head.tensors["classifier.bias"][1] = np.nan
    tr = Trainer(head, epochs=2, show_progress=False)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 1 \(epoch 1, batch 1\)"):
        tr.fit(good, y[:64])
    assert tr.optimizer.step_count == 0


def test_defaults_come_from_the_sweep():
    from fasttran.trainer import DEFAULT_LR, default_lr
    assert Trainer("classification").lr == DEFAULT_LR[("lamb", "linear")]
    assert Trainer("classification", optimizer="adamw").lr == DEFAULT_LR[("adamw", "linear")]
    assert Trainer("classification-pooler").lr == DEFAULT_LR[("lamb", "pooler")]
    assert Trainer("qa", optimizer="adamw").lr == DEFAULT_LR[("adamw", "qa")]
    assert Trainer(ClassificationHead(8, 2), optimizer="ADAMW").lr == default_lr("adamw", "classification")
    assert Trainer("classification", lr=0.1).lr == 0.1
    # every default is a value the sweep measured (benchmarks/defaults_sweep.json)
    path = os.path.join(ROOT, "benchmarks", "defaults_sweep.json")
    with open(path) as f:
        sweep = json.load(f)
    names = {"linear": "classification", "pooler": "classification-pooler", "qa": "qa"}
    for (opt, kind), lr in DEFAULT_LR.items():
        part = sweep["qa" if kind == "qa" else "sst2"]
        assert part["chosen"][f"{opt}/{names[kind]}"][0] == lr, (opt, kind)


def test_history_progress_lines_and_plot(enc, sst, cache, capsys):
    ids, mask, types, y = sst
    dev = ActivationCache.build(enc, ids[:64], mask[:64], types[:64], positions="mean", show_progress=False)
    tr = Trainer("classification", epochs=3, show_progress=True)
    hist = tr.fit(cache, y, eval=(dev, y[:64]))
    assert hist is tr.history and [r["epoch"] for r in hist] == [1, 2, 3]
    for r in hist:
        assert {"train_loss", "train_accuracy", "eval_accuracy", "eval_loss", "seconds", "lr"} <= set(r)
    assert len(tr.loss_curve) == hist[-1]["steps"] == 3 * 15
    # one line per epoch stays on screen, ending with its loss, accuracy and dev accuracy (captured
    # stderr is not a terminal: the bar writes lines, the epoch's last one holds its final state)
    err = capsys.readouterr().err
    assert "\r" not in err
    final = [line for line in err.split("\n") if "epoch" in line]
    for e, r in zip((1, 2, 3), hist):
        line = [l for l in final if l.startswith(f"epoch {e}/3")][-1]
        assert "15/15" in line and f"loss={r['train_loss']:.4f}" in line
        assert f"acc={r['train_accuracy']:.4f}" in line and f"dev_acc={r['eval_accuracy']:.4f}" in line
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    fig = tr.plot()
    ax_loss, ax_acc = fig.axes[:2]
    assert ax_loss.get_ylabel() == "loss" and ax_acc.get_ylabel() == "accuracy"
    ys = {l.get_label(): list(l.get_ydata()) for l in ax_acc.get_lines()}
    assert ys["eval"] == pytest.approx([r["eval_accuracy"] for r in hist])
    assert ys["train"] == pytest.approx([r["train_accuracy"] for r in hist])
    with pytest.raises(fasttran.InputError, match="fit"):
        Trainer("classification").plot()


def test_text_bars_in_a_kernel_without_ipywidgets(monkeypatch):
    """tqdm.auto warns 'IProgress not found' in a notebook without ipywidgets; ours falls back
    to the text bar, silently."""
    import warnings
    from fasttran import _progress
    monkeypatch.setattr(_progress, "_CLS", None)
    monkeypatch.setattr(_progress, "_in_notebook", lambda: True)
    block_import(monkeypatch, "ipywidgets")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bar = _progress.progress(range(3), disable=True)
        list(bar)
    assert _progress.bar_class().__module__ == "tqdm.std"
    monkeypatch.setattr(_progress, "_CLS", None)


def test_cache_for_a_frozen_encoder_builds_what_the_head_reads(enc, sst):
    """train_layers=0: cache_for gives the last layer pooled as the Trainer pools (mean or cls), or
    every token for a token head -- the same features ActivationCache.build gives -- and fit runs
    on it"""
    ids, mask, types = (a[:24] for a in sst[:3])
    for task, kw, positions in (("classification", {}, "mean"), ("classification", {"pooling": "cls"}, "cls"),
                                ("token-classification", {"num_labels": 2}, "all")):
        tr = Trainer(task, show_progress=False, epochs=1, **kw)
        c = tr.cache_for(enc, ids, mask, types, show_progress=False)
        want = ActivationCache.build(enc, ids, mask, types, positions=positions, show_progress=False)
        assert c.positions == positions and c.layer == want.layer == enc.num_layers
        every = np.arange(len(c))
        got, ref = (c.get(every, ragged=True)[0], want.get(every, ragged=True)[0]) if positions == "all" else \
            (c.get(every), want.get(every))
        assert np.array_equal(np.asarray(got), np.asarray(ref))
        y = [np.arange(n) % 2 for n in c.lengths] if positions == "all" else sst[3][:24]
        tr.fit(c, y)
        assert len(tr.history) == 1
