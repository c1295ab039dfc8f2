"""Trainer on real data (frozen all-MiniLM-L6-v2 features of real SST-2 sentences): with and
without the cache identical, deterministic, learns, save/load/resume exact, Ctrl-C leaves a
usable saved state, bad input refused, NaN loss stops with the step."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, ClassificationHead, Trainer

from conftest import DATA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def enc(minilm_dir):
    return fasttran.Encoder.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def sst(enc):
    from fasttran.data import load_sst2
    path = os.path.join(DATA, "sst2", "train.tsv")
    if not os.path.exists(path):
        pytest.skip(f"real SST-2 data not found at {path}")
    s, y = load_sst2(path)
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
        Trainer("regression")
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
    with pytest.raises(fasttran.UnsupportedError, match="CPU"):
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
