"""The backend profiler: every op of the table is wrapped (its forwarded arguments match the op
list), the per-kind times of real work (MiniLM forward, training steps with and without the
cache) agree with the wall time measured around them, nothing is counted twice or while off,
and the Trainer's profile leaves the trainer as it was."""
import re
import time

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer, _C
from fasttran.data import load_sst2

from conftest import sst2_file


@pytest.fixture(scope="module")
def sst(enc):
    s, y = load_sst2(sst2_file("train"))
    s, y = s[:256], np.array(y[:256])
    return enc.tokenize(s), y


def _names(params):
    """Argument names of a C parameter list '(ft_backend *be, const float *A, int64_t lda)'."""
    return [re.findall(r"\w+", p)[-1] for p in params.strip("()").split(",")]


def test_every_op_is_wrapped_with_its_own_arguments():
    ops = {name: params for name, kind, _ret, params, _off in _C._backend_registry() if kind == "op"}
    stats = {s[0]: s for s in _C.profile_stats()}
    for name, params in ops.items():
        assert name in stats, f"op {name} has no profiler entry"
        assert _names(stats[name][5]) == _names(params), f"the argument names of {name} in the op list do not match its parameters"
    kinds = {s[0]: s[1] for s in _C.profile_stats()}
    assert kinds["gemm"] == kinds["gemm_prec"] == "gemm" and kinds["attention_forward"] == "attention"
    assert kinds["attention_train_forward"] == kinds["attention_backward"] == "attention"
    assert kinds["optim_step"] == "optimizer" and kinds["cache_gather"] == "cache read"
    assert kinds["upload"] == kinds["download"] == "copy" and kinds["bias_residual_ln_forward"] == "row ops"
    assert set(kinds.values()) == set(fasttran.profiling.KINDS)


def test_forward_breakdown_agrees_with_wall_time(enc, sst):
    (ids, mask, types), _ = sst
    ids, mask, types = ids[:32], mask[:32], types[:32]
    enc.forward(ids, mask, types)   # warm-up (workspace)
    t0 = time.perf_counter()
    p = fasttran.profile(enc.forward, ids, mask, types, repeat=3)
    wall = (time.perf_counter() - t0) / 3
    ph = p.phases[0]
    # per layer: QKV and FFN-in as linear_forward, the two projections fused with residual + LN
    assert ph.per == 3 and ph.ops["linear_forward"]["calls"] == 2 * enc.num_layers
    assert ph.ops["linear_residual_ln_forward"]["calls"] == 2 * enc.num_layers
    assert ph.ops["attention_forward"]["calls"] == enc.num_layers
    assert ph.attributed <= ph.wall * 1.0001 and ph.wall <= wall * 1.0001
    # the ops account for the wall time measured outside the profiler, within 5%
    assert ph.attributed >= 0.95 * wall, f"ops {ph.attributed:.4f} s of {wall:.4f} s wall"
    assert ph.kinds["gemm"] > ph.kinds["attention"] > 0 and ph.kinds["row ops"] > 0
    assert isinstance(p.result, np.ndarray) and p.result.shape == (32, ids.shape[1], 384)
    text = str(p)
    for col in ("phase", "wall", "gemm", "attention", "row ops", "other"):
        assert col in text
    assert "gemm" in p.ops_table() and "<table>" in p._repr_html_()


def test_layers_above_the_deepest_output_are_not_run(enc, sst):
    """A cache of layer l (top-k training's cache_for) runs l layers, not all of them, and gives the
    same bits as the full forward's layer-l output."""
    (ids, mask, types), _ = sst
    ids, mask, types = ids[:8], mask[:8], types[:8]
    full = enc.forward(ids, mask, types, output_layers=[2, enc.num_layers])[0]
    for layer in (0, 2):
        p = fasttran.profile(enc.forward, ids, mask, types, output_layers=[layer])
        assert p.phases[0].ops.get("attention_forward", {"calls": 0})["calls"] == layer
        if layer:
            assert np.array_equal(p.result[0], full)


def test_off_counts_nothing_and_profiles_do_not_nest(enc, sst):
    (ids, mask, types), _ = sst
    p = fasttran.profile(enc.forward, ids[:4], mask[:4], types[:4])
    before = [s[2] for s in _C.profile_stats()]
    enc.forward(ids[:4], mask[:4], types[:4])
    assert [s[2] for s in _C.profile_stats()] == before and not _C.profile_enabled()
    with pytest.raises(fasttran.InputError, match="do not nest"):
        with p.phase("outer"):
            fasttran.profile(enc.forward, ids[:2], mask[:2], types[:2])
    assert not _C.profile_enabled()
    with pytest.raises(fasttran.InputError):
        fasttran.profile(enc.forward, ids, repeat=0)


def test_trainer_profile_uncached_and_cached(enc, sst):
    (ids, mask, types), y = sst
    uncached = ActivationCache.uncached(enc, ids, mask, types, positions="mean")
    tr = Trainer("classification", show_progress=False)
    p = tr.profile(uncached, y, steps=3, epoch=False)
    assert tr.head is None and tr.global_step == 0 and tr.history == [] and tr.optimizer is None
    assert [ph.name for ph in p.phases] == ["forward", "training step"]
    step = p["training step"]
    # encoder in the loop: the backend ops are nearly all of a step, and never more than it
    assert 0.95 <= step.coverage <= 1.0001, step.coverage
    assert step.kinds["gemm"] > 0 and step.kinds["optimizer"] > 0 and step.ops["optim_step"]["calls"] == 1
    assert 0.95 <= p["forward"].coverage <= 1.0001

    cache = ActivationCache.build(enc, ids, mask, types, positions="mean", show_progress=False)
    tr.fit(cache, y)
    w = tr.head.params.copy()
    st = (tr.global_step, len(tr.history), tr.optimizer.step_count)
    p = tr.profile(cache, y, steps=10)
    assert np.array_equal(tr.head.params, w) and (tr.global_step, len(tr.history), tr.optimizer.step_count) == st
    assert [ph.name for ph in p.phases] == ["forward", "training step", "epoch"]
    for name in ("training step", "epoch"):
        ph = p[name]
        assert ph.kinds["cache read"] > 0 and ph.kinds["optimizer"] > 0 and ph.kinds["attention"] == 0
        assert ph.attributed <= ph.wall * 1.0001 and ph.other >= -1e-6
    assert p["epoch"].ops["optim_step"]["calls"] == (len(y) + tr.batch_size - 1) // tr.batch_size


def test_profile_plot(enc, sst):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    (ids, mask, types), _ = sst
    p = fasttran.profile(enc.forward, ids[:8], mask[:8], types[:8], name="forward")
    ax = p.plot()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"gemm", "attention", "row ops", "other"} <= set(labels)
    heights = sum(bar.get_height() for c in ax.containers for bar in c)
    assert heights == pytest.approx(100.0, abs=0.5)   # the stacked shares of one phase
