"""The cache and the Trainer on CUDA: the cache's device tier, and the Trainer on device="cuda".

Runs on a GPU, and without one on the CUDA emulator (FASTTRAN_CUDA=emu build, FASTTRAN_CUDA_EMU=1),
unchanged. The references are the same encoder's host-tier cache (the device tier must return
the same bits) and the CPU Trainer (a head trained on CUDA equals it within fp32 rounding: the
emulated cuBLAS and the CPU GEMMs add in different orders). What the emulator cannot check --
stream overlap, real copy speed -- is left to a GPU run (docs/architecture.md)."""
import gc
import os

import numpy as np
import pytest

import fasttran
from fasttran import _C

pytestmark = pytest.mark.skipif(not fasttran.cuda_available(),
                                reason="no usable CUDA device: " + str(fasttran.build_info()["cuda"]["unavailable_reason"]))

from conftest import make_checkpoint  # noqa: E402
from test_random_models import AWKWARD, batch  # noqa: E402

CODECS = ("float32", "float16", "bfloat16", "int8")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("m") / "m"), **AWKWARD)


@pytest.fixture(scope="module")
def enc_cuda(model):
    return fasttran.Encoder.from_pretrained(model, device="cuda")


@pytest.fixture(scope="module")
def inputs():
    return batch(np.random.default_rng(0), 26, 19, pad_frac=0.6)


def values(b, positions):
    return b[0] if positions == "all" else b


def host(x):
    return x.numpy() if isinstance(x, fasttran.Tensor) else x


# ---- the device tier -------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["mean", "all"])
@pytest.mark.parametrize("dtype", CODECS)
def test_device_tier_returns_the_host_tiers_bits(enc_cuda, inputs, positions, dtype, tmp_path):
    """Shards spread over the device, host memory and disk; every read path (get into host or
    device memory, padded and ragged, the prefetching reader) returns exactly what an all-host
    cache of the same encoder returns: the device decodes f16/bf16/int8 as the CPU does. (Not
    uncached examples: the CUDA encoder's bits depend on the batch an example is recomputed in.)"""
    ids, mask, types = inputs
    kw = dict(positions=positions, dtype=dtype, batch_size=4, show_progress=False)
    ref = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, **kw)
    row = ref._row_bytes * (1 if positions == "mean" else 12)
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, device_bytes=8 * row, host_bytes=6 * row,
                                       disk_dir=tmp_path / "c", **kw)
    t = c.stats()["tiers"]
    assert t["device"]["entries"] and t["host"]["entries"] and t["disk"]["entries"], t
    assert c.device == "cuda:0" and "device (cuda:0)" in repr(c)
    order = np.random.default_rng(1).permutation(len(ids))
    for ragged in ((False, True) if positions == "all" else (False,)):
        a = ref.get(order, ragged=ragged)
        for got in (c.get(order, ragged=ragged), c.get(order, ragged=ragged, output="device")):
            v = values(got, positions)
            assert np.array_equal(host(v), values(a, positions))
            if positions == "all":
                assert np.array_equal(got[1], a[1])
        assert values(c.get(order, ragged=ragged, output="device"), positions).device == "cuda:0"
        got = list(c.batches(5, seed=3, output="device", ragged=ragged))
        want = list(ref.batches(5, seed=3, ragged=ragged))
        assert len(got) == len(want)
        for (i1, b1), (i2, b2) in zip(got, want):
            assert np.array_equal(i1, i2)
            assert values(b1, positions).device == "cuda:0"
            assert np.array_equal(values(b1, positions).numpy(), values(b2, positions))
        ranks = []
        for r in range(7):   # data parallel, 7 ranks: each rank's slice of every global batch (some empty)
            got = list(c.batches(5, seed=3, output="device", ragged=ragged, rank=r, world_size=7))
            want = list(ref.batches(5, seed=3, ragged=ragged, rank=r, world_size=7))
            assert len(got) == len(want) == 6
            for (i1, b1, w1), (i2, b2, w2) in zip(got, want):
                assert np.array_equal(i1, i2) and w1 == w2
                assert np.array_equal(values(b1, positions).numpy(), values(b2, positions))
            ranks.append([i for i, _, _ in got])
        # global batches of 5 (and 1, the last) over 7 ranks: together each global batch, in order; at
        # least 2 of the 7 slices of every step empty
        whole = [i for i, _ in ref.batches(5, seed=3, ragged=ragged)]
        for s, ids in enumerate(whole):
            assert np.array_equal(np.concatenate([ranks[r][s] for r in range(7)]), ids)
            assert sum(len(ranks[r][s]) == 0 for r in range(7)) >= 7 - len(ids)


def test_fp32_device_cache_is_the_encoders_output(enc_cuda, inputs):
    """fp32 device tier, pooled: each example's row is bit for bit what the CUDA encoder gives for
    its build batch (the plan pads a batch to its longest, and the CUDA encoder's output for an
    example is read at that padding)."""
    ids, mask, types = inputs
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="mean", batch_size=5,
                                       device_bytes=1 << 20, show_progress=False)
    assert c.stats()["tiers"]["device"]["entries"] == len(ids)
    for b in range(c._plan.n_batches):
        idx = c._plan.shard_examples(b, len(ids))
        ex_ids, ex_mask, ex_types = c.inputs(c.example_ids[idx])
        want = enc_cuda.forward(ex_ids, ex_mask, ex_types, output_layers=c.layer, pooling="mean")
        assert np.array_equal(c.get(c.example_ids[idx], output="device").numpy(), want)


def test_device_tier_out_buffer_and_uncached_on_device(enc_cuda, inputs):
    ids, mask, types = inputs
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="all", batch_size=4,
                                       device_bytes=1 << 20, show_progress=False)
    u = fasttran.ActivationCache.uncached(enc_cuda, ids, mask, types, positions="all", batch_size=4)
    ex = np.arange(7)
    want, offs = c.get(ex, ragged=True)
    out = fasttran.from_dlpack(np.full(want.size + 100, np.nan, np.float32)).to("cuda")
    v, o = c.get(ex, ragged=True, output="device", out=out)
    assert v.data_ptr == out.data_ptr and np.array_equal(v.numpy(), want) and np.array_equal(o, offs)
    # recomputed on the host side, then copied up (CUDA bits depend on the batch: fp32 rounding)
    assert np.allclose(u.get(ex, ragged=True, output="device")[0].numpy(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(fasttran.InputError, match="room for"):
        c.get(ex, ragged=True, output="device", out=fasttran.from_dlpack(np.zeros(5, np.float32)).to("cuda"))
    with pytest.raises(fasttran.InputTypeError, match="cuda:0"):
        c.get(ex, ragged=True, output="device", out=np.zeros(want.size, np.float32))


def test_device_tier_persists_and_reopens(enc_cuda, inputs, tmp_path):
    ids, mask, types = inputs
    kw = dict(positions="mean", dtype="int8", batch_size=4, show_progress=False)
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, device_bytes=1 << 20, disk_dir=tmp_path / "c", **kw)
    want = c.get(np.arange(len(ids)))
    r = fasttran.ActivationCache.open(tmp_path / "c", encoder=enc_cuda, device_bytes=300)
    t = r.stats()["tiers"]
    assert t["device"]["entries"] and t["host"]["entries"]
    assert np.array_equal(r.get(np.arange(len(ids)), output="device").numpy(), want)
    with pytest.raises(fasttran.InputError, match="device_bytes needs an encoder on a CUDA device"):
        fasttran.ActivationCache.open(tmp_path / "c", device_bytes=300)


def test_device_tier_refused_on_the_cpu(model, inputs):
    ids, mask, types = inputs
    cpu = fasttran.Encoder.from_pretrained(model)
    with pytest.raises(fasttran.InputError, match="device_bytes needs an encoder on a CUDA device"):
        fasttran.ActivationCache.build(cpu, ids, mask, types, device_bytes=1 << 20)
    c = fasttran.ActivationCache.build(cpu, ids, mask, types, positions="mean", show_progress=False)
    assert c.device == "cpu"
    assert c.get([0, 1], output="device").device == "cpu"            # as before: a CPU Tensor
    t = c.get([0, 1], output="device", device="cuda")                  # a CPU cache read into CUDA memory
    assert t.device == "cuda:0" and np.array_equal(t.numpy(), c.get([0, 1]))
    with pytest.raises(fasttran.InputError, match="device= goes with output='device'"):
        c.get([0, 1], device="cuda")


def test_device_tier_frees_its_memory(model, inputs):
    """Shards, batches and staging are released with the cache and the reader (the emulator poisons and
    tracks every allocation: a device buffer read after it was freed would fail a later read); every
    device and pinned allocation made meanwhile is freed (counted by the emulator)."""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model, device="cuda")
    enc.forward(*[a[:4] for a in inputs])   # the encoder's own workspace, kept with it
    before = emu_counters()
    for _ in range(2):
        c = fasttran.ActivationCache.build(enc, ids, mask, types, positions="all", batch_size=4, device_bytes=1 << 20,
                                           show_progress=False)
        it = c.batches(4, output="device", ragged=True)
        first = next(it)
        it.close()
        want = c.get(first[0], ragged=True)[0]
        del c, it
        gc.collect()
        assert np.array_equal(first[1][0].numpy(), want)   # a batch handed out outlives its reader and cache
        del first
        gc.collect()
    if before is not None:
        d = [b - a for a, b in zip(before, emu_counters())]
        assert d[0] == d[1] > 0 and d[2] == d[12] > 0, f"{d[0]} / {d[1]} device, {d[2]} / {d[12]} pinned allocations / frees"


# ---- the Trainer on CUDA ---------------------------------------------------------------------------
def emu_counters():
    """(cudaMalloc, cudaFree, pinned allocations, H2D copies, H2D bytes, D2H copies, D2H bytes, D2D copies,
    stream syncs, event records, stream waits, event syncs, pinned frees, events created) of the emulator
    since it loaded; None on a real GPU"""
    if not fasttran.build_info()["cuda"]["emulated"]:
        return None
    import ctypes
    lib = ctypes.CDLL(os.path.join(os.path.dirname(fasttran.__file__), "libfasttran_cuda_emu.so"))
    out = (ctypes.c_longlong * 14)()
    lib.ftemu_counters(out)
    return list(out)


@pytest.fixture(scope="module")
def features(model, inputs):
    """one CPU-encoder cache per positions: both trainers read the same features"""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model)
    return {p: fasttran.ActivationCache.build(enc, ids, mask, types, positions=p, batch_size=8, show_progress=False)
            for p in ("mean", "all")}


def qa_targets(cache, rng):
    """answer spans inside each example's context (token type 1, not its last token)"""
    from fasttran.heads.span import context_rows
    ctx = np.split(context_rows(cache), np.cumsum(cache.lengths)[:-1])
    s = np.array([rng.choice(np.flatnonzero(r)) for r in ctx])
    e = np.array([rng.choice(np.flatnonzero(r[a:])) + a for r, a in zip(ctx, s)])
    return s, e


def close(a, b, rtol=2e-5):
    """equal within fp32 rounding of a few steps: the GEMMs add in other orders on the two backends"""
    return np.abs(a - b).max() <= rtol * max(1.0, np.abs(b).max()) * 10


@pytest.mark.parametrize("head,optimizer", [("classification", "lamb"), ("classification", "adamw"),
                                            ("classification-pooler", "lamb"), ("qa", "adamw"), ("qa", "lamb")])
def test_cuda_trainer_matches_the_cpu_trainer(features, head, optimizer):
    """A head trained on CUDA (heads, loss, clipping, fused optimizer on the device; batches read into
    device memory) equals the CPU-trained one within fp32 rounding after 3 epochs, loss by loss."""
    cache = features["all" if head == "qa" else "mean"]
    y = qa_targets(cache, np.random.default_rng(2)) if head == "qa" else np.random.default_rng(1).integers(0, 3, len(cache))
    kw = dict(optimizer=optimizer, epochs=3, batch_size=7, show_progress=False, lr=0.05 if head == "qa" else None,
              num_labels=None if head == "qa" else 3, dropout=0.2, max_grad_norm=0.5)
    cpu = fasttran.Trainer(head, **kw)
    cpu.fit(cache, y)
    gpu = fasttran.Trainer(head, device="cuda", **kw)
    assert gpu.device == "cuda:0"
    gpu.fit(cache, y)
    assert gpu.optimizer.device == "cuda:0" and gpu.global_step == cpu.global_step == 12
    for name, t in gpu.head.tensors.items():
        if head == "qa" and name == "qa_outputs.bias":
            # its gradient is zero up to rounding (softmax - one-hot sums to 0 over every row), so
            # Adam's normalised step follows the rounding noise of each backend: only bounded
            assert np.abs(t).max() <= 12 * kw["lr"]
            continue
        assert close(t, cpu.head.tensors[name]), (name, np.abs(t - cpu.head.tensors[name]).max())
    assert not np.array_equal(gpu.head.params, _fresh_params(gpu.head))   # it trained
    for (s1, l1), (s2, l2) in zip(gpu.loss_curve, cpu.loss_curve):
        assert s1 == s2 and abs(l1 - l2) <= 1e-4 * max(1.0, abs(l2))
    if head != "qa":
        assert gpu.history[-1]["train_accuracy"] == cpu.history[-1]["train_accuracy"]
        ev_g, ev_c = gpu.evaluate(cache, y), cpu.evaluate(cache, y)
        assert abs(ev_g["loss"] - ev_c["loss"]) <= 1e-5


def test_cuda_multiple_choice_matches_the_cpu(features):
    """The multiple-choice head (one score per choice through the pooler on its [CLS] row, softmax over
    each question's choices; questions kept whole in every batch) trains on CUDA as on the CPU."""
    cache = features["all"]   # 26 examples: 13 questions of 2 choices
    y = np.random.default_rng(5).integers(0, 2, len(cache) // 2)
    kw = dict(epochs=3, batch_size=3, show_progress=False, dropout=0.2, pooling="cls")
    cpu = fasttran.Trainer("multiple-choice", **kw)
    cpu.fit(cache, y)
    gpu = fasttran.Trainer("multiple-choice", device="cuda", **kw)
    gpu.fit(cache, y)
    assert gpu.head.num_choices == 2 and gpu.global_step == cpu.global_step == 15
    for name, t in gpu.head.tensors.items():
        if name == "classifier.bias":   # its gradient is zero up to rounding (a softmax over the choices)
            continue
        assert close(t, cpu.head.tensors[name]), (name, np.abs(t - cpu.head.tensors[name]).max())
    for (s1, l1), (s2, l2) in zip(gpu.loss_curve, cpu.loss_curve):
        assert s1 == s2 and abs(l1 - l2) <= 1e-4 * max(1.0, abs(l2))
    # the shared bias follows each backend's rounding noise (see above): the choices' scores agree up to it
    d = gpu.predict(cache, output="logits") - cpu.predict(cache, output="logits")
    assert np.abs(d - d.mean()).max() <= 1e-5, np.abs(d - d.mean()).max()
    assert np.abs(gpu.predict(cache, output="probabilities") - cpu.predict(cache, output="probabilities")).max() <= 1e-5


def _fresh_params(head):
    from fasttran.heads import _Head
    h = _Head.from_config(head.config())
    return h.params


def test_cuda_trainer_resumes_exactly_and_loads_on_the_cpu(features, tmp_path):
    cache = features["mean"]
    y = np.random.default_rng(3).integers(0, 2, len(cache))
    kw = dict(epochs=3, batch_size=6, show_progress=False, device="cuda", seed=5)
    full = fasttran.Trainer("classification-pooler", **kw)
    full.fit(cache, y)
    part = fasttran.Trainer("classification-pooler", **kw)
    part.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), stop_at_step=7)   # mid-epoch 2
    assert part.global_step == 7
    rest = fasttran.Trainer("classification-pooler", **kw)
    rest.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert rest.global_step == full.global_step
    assert np.array_equal(rest.head.params, full.head.params)   # bit for bit, as on the CPU
    m1, v1 = (np.asarray(a) for a in fasttran.optim.flat_state(rest.optimizer)[1:])
    m2, v2 = (np.asarray(a) for a in fasttran.optim.flat_state(full.optimizer)[1:])
    assert np.array_equal(m1, m2) and np.array_equal(v1, v2)
    full.save(str(tmp_path / "done"))
    back = fasttran.Trainer.load(str(tmp_path / "done"), device="cpu", show_progress=False)
    assert back.device == "cpu" and np.array_equal(back.head.params, full.head.params)
    assert back.evaluate(cache, y) == full.evaluate(cache, y)
    again = fasttran.Trainer.load(str(tmp_path / "done"), show_progress=False)   # the checkpoint's device
    assert again.device == "cuda:0" and again.optimizer.device == "cuda:0"
    assert np.array_equal(np.asarray(fasttran.optim.flat_state(again.optimizer)[1]), m2)


def test_cuda_trainer_on_the_device_tier(enc_cuda, inputs):
    """Features built by the CUDA encoder into the device tier (int8, decoded on the device) train the
    same head as the same features read from the host tier, bit for bit: both paths hand the
    kernels the same device buffer contents."""
    ids, mask, types = inputs
    kw = dict(positions="mean", dtype="int8", batch_size=8, show_progress=False)
    dev = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, device_bytes=1 << 20, **kw)
    hostc = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, **kw)
    assert dev.stats()["tiers"]["device"]["entries"] == len(ids)
    y = np.random.default_rng(4).integers(0, 2, len(ids))
    a = fasttran.Trainer("classification", device="cuda", epochs=2, batch_size=5, show_progress=False)
    a.fit(dev, y)
    b = fasttran.Trainer("classification", device="cuda", epochs=2, batch_size=5, show_progress=False)
    b.fit(hostc, y)
    assert np.array_equal(a.head.params, b.head.params)


def test_a_cuda_training_step_allocates_nothing(features):
    """After the first step, a step makes no device or pinned allocation: head buffers, workspace,
    gradients, optimizer state and tables are kept (counted by the emulator)."""
    if emu_counters() is None:
        pytest.skip("allocation counts come from the emulator")
    cache = features["mean"]
    y = np.random.default_rng(5).integers(0, 2, len(cache))
    tr = fasttran.Trainer("classification-pooler", device="cuda", epochs=1, batch_size=4, show_progress=False)
    prep = tr._prepare(cache, y)
    spe, total, warm = tr._loop_setup(cache)
    order = np.arange(len(cache))   # shuffle=False's order
    batches = list(tr._batches(cache, batch_size=4, shuffle=False))   # (ids, device batch, its place)
    tr._step(cache, prep, order, *batches[0], total, warm)   # the first step sizes the optimizer's tables
    before = emu_counters()
    for ids, x, where in batches[1:]:
        tr._step(cache, prep, order, ids, x, where, total, warm)
    after = emu_counters()
    steps = len(batches) - 1
    d = [b - a for a, b in zip(before, after)]
    assert d[0] == 0 and d[2] == 0, f"{d[0]} device and {d[2]} pinned allocations in {steps} steps"
    assert d[1] == 0, "device memory freed during steps"
    # per step: up the labels and the optimizer's coefficients; down the loss, the logits (accuracy)
    # and the optimizer's norm / finiteness verdict, each a wait for the stream; nothing else
    assert d[3] == 2 * steps and d[5] == 3 * steps and d[8] == 3 * steps, d


def test_cuda_trainer_refusals(features):
    with pytest.raises(fasttran.InputError, match="device must be"):
        fasttran.Trainer("classification", device="cuda:x")
    cache = features["mean"]
    y = np.zeros(len(cache), np.int64)
    y[1] = 5
    tr = fasttran.Trainer("classification", device="cuda", num_labels=2, show_progress=False)
    with pytest.raises(fasttran.InputError, match="outside"):
        tr.fit(cache, y)
    x = cache.get(cache.example_ids[:4])
    x[2, 3] = np.nan
    bad = fasttran.ActivationCache.build(fasttran.Encoder.from_pretrained(cache.encoder.path), *cache.inputs(
        cache.example_ids[:4]), positions="mean", show_progress=False)
    bad._tiers.shards[0].values[...] = x   # a NaN feature in the host tier
    tr = fasttran.Trainer("classification", device="cuda", num_labels=2, show_progress=False, batch_size=4)
    nan_example = int(bad.example_ids[np.flatnonzero(np.isnan(bad.get(bad.example_ids)).any(1))[0]])
    with pytest.raises(fasttran.InputError, match=f"features of example {nan_example} contain NaN"):
        tr.fit(bad, np.zeros(4, np.int64))   # the NaN loss of step 1, traced back to the features


# ---- top-layer training on CUDA -------------------------------------------------------------------
def _topk_pair(model, inputs, head, k, pooling="mean", **kw):
    """the same top-k training on the CPU and on CUDA, each from its own cache of layer L - k"""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model)
    out = []
    for dev in ("cpu", "cuda"):
        tr = fasttran.Trainer(head, device=dev, train_layers=k, pooling=pooling, show_progress=False, **kw)
        cache = tr.cache_for(enc, ids, mask, types, show_progress=False)
        y = qa_targets(cache, np.random.default_rng(2)) if head == "qa" else \
            np.random.default_rng(1).integers(0, 3, len(cache))
        tr.fit(cache, y)
        out.append((tr, cache, y))
    return out


@pytest.mark.parametrize("head,k,pooling,optimizer,tempo", [("classification", 1, "mean", "adamw", None),
                                                            ("classification", 2, "cls", "lamb", None),
                                                            ("classification-pooler", 5, "mean", "adamw", None),
                                                            ("qa", 2, "mean", "adamw", None),
                                                            ("classification", 2, "mean", "adamw",
                                                             {"recompute_attention_probs": True})])
def test_cuda_topk_trainer_matches_the_cpu_trainer(model, inputs, head, k, pooling, optimizer, tempo):
    """Top-layer training on CUDA (layers, pooling, head, loss, backward and the fused optimizer on the
    device; dropout in the layers and the head, with the CPU's masks) equals the CPU trainer within
    fp32 rounding, loss by loss and weight by weight, and evaluates the same (also with the attention
    probabilities recomputed in the backward on both)."""
    kw = dict(optimizer=optimizer, epochs=2, batch_size=7, lr=2e-3, max_grad_norm=0.5, layer_dropout=0.1,
              dropout=0.1, num_labels=None if head == "qa" else 3, tempo=tempo)
    (cpu, cache, y), (gpu, gcache, gy) = _topk_pair(model, inputs, head, k, pooling, **kw)
    assert gpu.top.device == "cuda:0" and gpu.optimizer.device == "cuda:0"
    assert np.array_equal(cache.get(cache.example_ids)[0], gcache.get(gcache.example_ids)[0])
    assert gpu.global_step == cpu.global_step == 8
    for (s1, l1), (s2, l2) in zip(gpu.loss_curve, cpu.loss_curve):
        assert s1 == s2 and abs(l1 - l2) <= 1e-4 * max(1.0, abs(l2)), (s1, l1, l2)
    moved = 0
    for (n, v), (n2, w) in zip(gpu.top.named_parameters(), cpu.top.named_parameters()):
        assert n == n2 and close(np.asarray(v), w), (n, np.abs(np.asarray(v) - w).max())
        moved += not np.array_equal(np.asarray(v), _initial(cache.encoder, n))
    assert moved == len(cpu.top.named_parameters())   # every layer tensor trained
    gpu._pull()
    for name, t in gpu.head.tensors.items():
        if head == "qa" and name == "qa_outputs.bias":   # see test_cuda_trainer_matches_the_cpu_trainer
            continue
        assert close(t, cpu.head.tensors[name]), (name, np.abs(t - cpu.head.tensors[name]).max())
    if head != "qa":
        ev_g, ev_c = gpu.evaluate(gcache, y), cpu.evaluate(cache, y)
        assert abs(ev_g["loss"] - ev_c["loss"]) <= 1e-5 and ev_g["accuracy"] == ev_c["accuracy"]


def _layer_step(enc, device, prec, x, lengths, dout, inplace_gelu):
    """(out, d x, {name: gradient}) of one training step of the top two layers, dropout off"""
    from fasttran.finetune import TopLayers
    top = TopLayers(enc, 2, device=device, hidden_dropout=0.0, attention_dropout=0.0, matmul_precision=prec,
                    inplace_gelu=inplace_gelu)
    out = host(top.forward(x, lengths, training=True))
    dx = host(top.backward(dout, want_dx=True))
    return out, dx, {n: np.array(host(g)) for n, g in top.named_gradients()}


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("prec", ["bfloat16", "float16"])
def test_mixed_precision_layers_on_cuda_against_the_cpu_reference(model, prec):
    """Mixed-precision layer training (float32 storage and sums, products of inputs rounded to bf16 /
    fp16, cuBLAS FAST_16BF / FAST_16F): the CUDA step equals the CPU backend's reference of the same
    arithmetic (gemm_prec rounds as tensor cores read), outputs, input gradient and every weight
    gradient, far closer than either is to float32; and against float32 it is off by about the
    precision's rounding (bf16 8 significant bits, fp16 11), not more."""
    enc = fasttran.Encoder.from_pretrained(model)
    rng = np.random.default_rng(5)
    lengths = np.array([7, 1, 12, 5], np.int32)
    C = enc.config["hidden_size"]
    x = rng.standard_normal((int(lengths.sum()), C)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    bound = {"bfloat16": 3e-2, "float16": 4e-3}[prec]
    for inplace_gelu in (False, True):
        ref32 = _layer_step(enc, "cpu", "float32", x, lengths, dout, inplace_gelu)
        cpu = _layer_step(enc, "cpu", prec, x, lengths, dout, inplace_gelu)
        gpu = _layer_step(enc, "cuda", prec, x, lengths, dout, inplace_gelu)
        # CUDA and CPU differ in fp32 by ulps (exp, erf, sum order); a half-precision rounding turns
        # the rare one that straddles a rounding boundary into one ulp of bf16 / fp16, and the
        # backward carries it on: they agree to a fraction of the precision's own error. fp16's
        # finer ulp is straddled about 8x as often, and a straddled attention operand (Q, K, V,
        # P: rounded since the attention's products run on tensor cores) moves its whole sequence
        # in the next layer: measured up to 0.39 of the error on these inputs on the emulator, 0.65
        # and 0.76 on an H200 (the value projection's weight and bias gradients: the GPU's exp2 and
        # its attention kernels' sum order differ from the CPU's in more places than the
        # emulator's), 0.01 for bf16
        agree = {"bfloat16": 0.35, "float16": 0.9}[prec]
        for k, what in ((0, "out"), (1, "dx")):
            far = _rel(cpu[k], ref32[k])
            assert _rel(gpu[k], cpu[k]) < agree * far + 1e-6, (what, _rel(gpu[k], cpu[k]), far)
            assert 1e-5 < far < bound, (what, far)
        # the gradient of the key bias is zero up to rounding (softmax ignores a per-row shift), so it
        # is compared with the largest gradient of its layer. With dS rounded to half precision
        # before dK = dS^T Q (as FlashAttention's backward) its rows no longer sum to exactly zero:
        # measured 7e-5 of that gradient in bf16 -- noise on both backends, not to be matched
        big = {n: max(np.linalg.norm(v) for m, v in ref32[2].items() if m.split(".")[2] == n.split(".")[2])
               for n in ref32[2]}
        relf = lambda a, b, n: float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-3 * big[n]))
        for n, g in cpu[2].items():
            if n.endswith("key.bias"):
                for got in (g, gpu[2][n]):
                    assert np.linalg.norm(np.asarray(got, np.float64) - ref32[2][n]) < 3e-4 * big[n], n
                continue
            far = relf(g, ref32[2][n], n)
            assert relf(gpu[2][n], g, n) < agree * far + 1e-5, (n, relf(gpu[2][n], g, n), far)
            assert far < bound, (n, far)


def test_bf16_topk_trainer_on_cuda(model, inputs, tmp_path):
    """Trainer(precision="bfloat16"): the top layers train with bf16 products on CUDA; losses follow the
    float32 run's within bf16 rounding, the weights move the same way, and a resumed run ends bit for
    bit where the straight one does. The refusals name what to do."""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model)
    kw = dict(device="cuda", train_layers=2, epochs=2, batch_size=6, seed=4, show_progress=False, num_labels=2,
              lr=1e-3, optimizer="adamw")
    f32 = fasttran.Trainer("classification", **kw)
    cache = f32.cache_for(enc, ids, mask, types, show_progress=False)
    y = np.random.default_rng(4).integers(0, 2, len(cache))
    f32.fit(cache, y)
    bf = fasttran.Trainer("classification", precision="bfloat16", **kw)
    bf.fit(cache, y)
    assert "bfloat16 products" in repr(bf.top)
    for (s1, l1), (s2, l2) in zip(bf.loss_curve, f32.loss_curve):
        assert s1 == s2 and abs(l1 - l2) <= 2e-2 * max(1.0, abs(l2)), (s1, l1, l2)
    assert any(l1 != l2 for (_, l1), (_, l2) in zip(bf.loss_curve, f32.loss_curve))   # bf16 products did run
    moves = {n: np.asarray(b) - _initial(enc, n) for n, b in f32.top.named_parameters()}
    for n, a in bf.top.named_parameters():
        if "key.bias" in n:   # its gradient is zero up to rounding: AdamW moves it by the noise's sign
            continue
        assert _rel(np.asarray(a) - _initial(enc, n), moves[n]) < 0.3, n   # the same updates, within bf16
    part = fasttran.Trainer("classification", precision="bfloat16", **kw)
    part.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), stop_at_step=3)
    rest = fasttran.Trainer.load(str(tmp_path / "ck"))
    assert rest.precision == "bfloat16"
    rest.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    for (n, a), (_, b) in zip(rest.top.named_parameters(), bf.top.named_parameters()):
        assert np.array_equal(np.asarray(a), np.asarray(b)), n
    on_cpu = fasttran.Trainer.load(str(tmp_path / "ck"), device="cpu")   # a CUDA bf16 run continues on the CPU
    assert on_cpu.precision == ("bfloat16" if _C.cpu_features()[0]["avx512_bf16"] else "float32")   # as this CPU can
    for bad, match in ((dict(kw, device="cpu", precision="float16"), "AMX"),
                       (dict(kw, train_layers=0), "train_layers >= 1"),
                       (dict(kw, precision="half"), "precision must")):
        with pytest.raises(fasttran.InputError, match=match):
            fasttran.Trainer("classification", **dict(dict(precision="bfloat16"), **bad))
    with pytest.raises(fasttran.InputError, match="matmul_precision"):
        fasttran.finetune.TopLayers(enc, 1, matmul_precision="int8")


def test_loss_scaling_keeps_small_gradients_in_float16(model):
    """Why float16 needs loss scaling, and that it works: with a loss gradient of 1e-9 (below fp16's
    smallest subnormal, 6e-8) the fp16 products flush the gradients to zero; with loss_scale 2**16
    the backward runs at 6.6e-5 and the gradients come back (divided by the scale) within fp16's
    error of float32's. On CUDA and on the CPU reference alike."""
    from fasttran.finetune import TopLayers
    enc = fasttran.Encoder.from_pretrained(model)
    rng = np.random.default_rng(8)
    lengths = np.array([6, 9], np.int32)
    x = rng.standard_normal((15, enc.config["hidden_size"])).astype(np.float32)
    dout = (1e-9 * rng.standard_normal(x.shape)).astype(np.float32)

    def grads(device, prec, scale):
        top = TopLayers(enc, 1, device=device, hidden_dropout=0.0, attention_dropout=0.0, matmul_precision=prec)
        top.forward(x, lengths, training=True)
        dx = host(top.backward(dout, want_dx=True, loss_scale=scale))
        return dx, {n: np.array(host(g)) for n, g in top.named_gradients()}
    ref_dx, ref = grads("cpu", "float32", 1.0)
    for device in ("cuda", "cpu"):
        dx0, g0 = grads(device, "float16", 1.0)
        w = "encoder.layer.4.intermediate.dense.weight"
        assert np.abs(g0[w]).max() == 0 and np.abs(ref[w]).max() > 0   # flushed to zero without scaling
        dx, g = grads(device, "float16", 2.0 ** 16)
        assert _rel(dx, ref_dx) < 4e-3, _rel(dx, ref_dx)
        for n in ("encoder.layer.4.intermediate.dense.weight", "encoder.layer.4.attention.self.value.weight",
                  "encoder.layer.4.output.dense.weight"):
            assert _rel(g[n], ref[n]) < 4e-3, (device, n, _rel(g[n], ref[n]))
    top = TopLayers(enc, 1, device="cuda", matmul_precision="float16")
    top.forward(x, lengths, training=True)
    with pytest.raises(fasttran.InputError, match="loss scale"):
        top.backward(dout, loss_scale=0.0)


def test_fp16_topk_trainer_scales_its_loss_and_skips_overflows(model, inputs, tmp_path, monkeypatch):
    """Trainer(precision="float16"): dynamic loss scaling. Started at an absurd scale (2**30) the fp16
    backward overflows: those steps are skipped (nothing updated, weights finite) and each halves the
    scale until it fits. From the default scale, the losses follow the float32 run's within fp16
    rounding; a resumed run repeats the straight one bit for bit, loss scale included."""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model)
    kw = dict(device="cuda", train_layers=2, epochs=3, batch_size=6, seed=5, show_progress=False, num_labels=2,
              lr=1e-3, optimizer="adamw", precision="float16")
    tr = fasttran.Trainer("classification", **kw)
    assert tr.loss_scale == [2.0 ** 16, 0]
    cache = tr.cache_for(enc, ids, mask, types, show_progress=False)
    y = np.random.default_rng(5).integers(0, 2, len(cache))
    tr.fit(cache, y)
    assert tr.skipped_steps == 0 and tr.loss_scale == [2.0 ** 16, tr.global_step]
    f32 = fasttran.Trainer("classification", **dict(kw, precision="float32"))
    f32.fit(cache, y)
    for (s1, l1), (s2, l2) in zip(tr.loss_curve, f32.loss_curve):
        assert abs(l1 - l2) <= 5e-3 * max(1.0, abs(l2)), (s1, l1, l2)
    monkeypatch.setattr(fasttran.trainer, "_SCALE_GROWTH_STEPS", 4)   # grows after 4 clean steps (2000 by default)
    grow = fasttran.Trainer("classification", **kw)
    grow.loss_scale = [2.0 ** 10, 0]
    grow.fit(cache, y)   # 15 clean steps
    assert grow.skipped_steps == 0 and grow.loss_scale == [2.0 ** 13, 3]
    monkeypatch.undo()
    kw4 = dict(kw, epochs=4)
    big = fasttran.Trainer("classification", **kw4)
    big.loss_scale = [2.0 ** 30, 0]
    big.fit(cache, y)   # 20 steps: the first ones overflow (6 on the emulator), then it fits and trains
    assert 0 < big.skipped_steps <= 10 and big.loss_scale[0] == 2.0 ** 30 / 2 ** big.skipped_steps
    assert 0 < big.loss_scale[1] <= big.global_step - big.skipped_steps   # clean steps since the last skip
    assert all(np.isfinite(np.asarray(v)).all() for _, v in big.top.named_parameters())
    assert big.optimizer.step_count == big.global_step - big.skipped_steps   # skipped steps updated nothing
    part = fasttran.Trainer("classification", **kw4)
    part.loss_scale = [2.0 ** 30, 0]
    part.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), stop_at_step=big.skipped_steps + 2)
    rest = fasttran.Trainer.load(str(tmp_path / "ck"))
    assert rest.loss_scale == part.loss_scale
    rest.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert rest.loss_scale == big.loss_scale
    for (n, a), (_, b) in zip(rest.top.named_parameters(), big.top.named_parameters()):
        assert np.array_equal(np.asarray(a), np.asarray(b)), n


def _initial(encoder, name):
    return encoder.state_dict()[name]


def test_cuda_topk_resumes_exactly_and_exports(model, inputs, tmp_path):
    """An interrupted CUDA top-k run resumed from its checkpoint ends bit for bit where the straight run
    ends (layers, head, optimizer state); the exported encoder loads on the CPU and gives the hidden
    states of the CPU-trained one within fp32 rounding; memory_report() sizes the device step."""
    ids, mask, types = inputs
    enc = fasttran.Encoder.from_pretrained(model)
    kw = dict(device="cuda", train_layers=2, epochs=2, batch_size=6, seed=3, show_progress=False, num_labels=2,
              lr=1e-3)
    full = fasttran.Trainer("classification", **kw)
    cache = full.cache_for(enc, ids, mask, types, show_progress=False)
    y = np.random.default_rng(3).integers(0, 2, len(cache))
    full.fit(cache, y)
    part = fasttran.Trainer("classification", **kw)
    part.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), stop_at_step=4)   # mid-epoch 1
    assert part.global_step == 4
    rest = fasttran.Trainer("classification", **kw)
    rest.fit(cache, y, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert rest.global_step == full.global_step
    for (n, a), (_, b) in zip(rest.top.named_parameters(), full.top.named_parameters()):
        assert np.array_equal(np.asarray(a), np.asarray(b)), n
    rest._pull()
    full._pull()
    assert np.array_equal(rest.head.params, full.head.params)
    m1 = np.asarray(fasttran.optim.flat_state(rest.optimizer)[1])
    assert np.array_equal(m1, np.asarray(fasttran.optim.flat_state(full.optimizer)[1]))
    cpu = fasttran.Trainer("classification", **dict(kw, device="cpu"))
    cpu.fit(cpu.cache_for(enc, ids, mask, types, show_progress=False), y)
    got = fasttran.Encoder.from_pretrained(full.export(str(tmp_path / "gpu")))
    want = fasttran.Encoder.from_pretrained(cpu.export(str(tmp_path / "cpu")))
    assert got.device == "cpu"
    h_got, h_want = got.forward(ids, mask, types), want.forward(ids, mask, types)
    assert np.abs(h_got - h_want).max() <= 1e-4, np.abs(h_got - h_want).max()
    rep = full.memory_report(batch_size=6, seq_len=19, budget_bytes=64 << 20)
    assert rep["total"] > rep["weights"] > 0 and rep["largest_batch"] >= 6
    layers = [np.asarray(v) for _, v in full.top.named_parameters()]
    assert full.profile(cache, y, steps=1, epoch=False)["training step"].wall > 0   # a CPU copy of it
    for a, (_, b) in zip(layers, full.top.named_parameters()):
        assert np.array_equal(a, np.asarray(b))


@pytest.mark.parametrize("recompute", [False, True], ids=["probs-kept", "probs-recomputed"])
def test_cuda_topk_memory_report_is_what_the_device_allocates(enc_cuda, recompute):
    """The layer stack's accounting on CUDA against the device allocator itself (free memory before
    and after a training step): the same bytes up to a few small tables, and the report for the
    batch's longest sequence bounds it. (The emulator's free memory is byte-exact; a GPU's moves in
    pages and with other users, so there the benchmark checks the report against the stack's count.)"""
    if emu_counters() is None:
        pytest.skip("byte-exact device memory accounting comes from the emulator")
    from fasttran.finetune import TopLayers
    lengths = np.array([19, 7, 12, 19], np.int32)
    N, C = int(lengths.sum()), enc_cuda.hidden_size
    x = fasttran.Tensor.from_dlpack(np.random.default_rng(0).standard_normal((N, C)).astype(np.float32)).to("cuda")
    dout = fasttran.Tensor.from_dlpack(np.ones((N, C), np.float32)).to("cuda")
    free = lambda: enc_cuda._core.memory_report()["device_free"]
    f0 = free()
    top = TopLayers(enc_cuda, 2, device="cuda", recompute_attention_probs=recompute)
    out = top.forward(x, lengths, training=True)   # a new (N, C) device buffer, kept
    top.backward(dout)
    used = f0 - free()
    now, peak = top.allocated()
    assert tuple(out.shape) == (N, C) and 0 <= used - now - N * C * 4 <= 4096, (used, now)
    rep = top.memory_report(batch_size=len(lengths), seq_len=int(lengths.max()))
    held = rep["weights"] + rep["gradients"] + rep["workspace"] + sum(
        v for kind, v in rep["activations"].items() if kind != "input")
    assert peak <= held, (peak, held)


# ---- the optimizer step's host side (item 4) -------------------------------------------------------
@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_optimizer_tables_stay_on_the_device(kind):
    """200 CUDA tensors: after the first step a step allocates nothing and copies up only the
    coefficients (one entry per distinct (group, update count)) and each tensor's index into them;
    the tensor and chunk tables are sent again only when an address changes (here: a tensor sits a
    step out). The result still follows the float64 reference (tests/test_optim.py)."""
    c0 = emu_counters()
    if c0 is None:
        pytest.skip("copy counts come from the emulator")
    import test_optim as ref
    from fasttran.optim import AdamW, LAMB
    rng = np.random.default_rng(7)
    shapes = [(int(rng.integers(1, 40)), int(rng.integers(1, 30))) for _ in range(200)]
    w32 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [fasttran.from_dlpack(x).to("cuda") for x in w32]
    grads = [fasttran.from_dlpack(np.zeros(s, np.float32)).to("cuda") for s in shapes]
    opt = (LAMB if kind == "lamb" else AdamW)(params, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    w64, m64, v64 = [x.astype(np.float64) for x in w32], [np.zeros(s) for s in shapes], [np.zeros(s) for s in shapes]
    per_step = []
    for t in range(1, 6):
        g32 = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in shapes]
        for g, x in zip(grads, g32):   # the gradients change in place (as a backward pass writes them)
            _C.device_write(g, x)
        before = emu_counters()
        opt.step(grads)
        per_step.append([b - a for a, b in zip(before, emu_counters())])
        ref.ref_step(kind, w64, [x.astype(np.float64) for x in g32], m64, v64, t, 1e-3, 0.9, 0.999, opt.eps,
                     opt.decays, 1.0)
    assert ref.rel_err([p.numpy() for p in params], w64) <= 1e-5
    coef_bytes = 256 * ((200 * 4 + 255) // 256) + 48   # coef_of (200 int32, padded) + one coefficient entry
    for d in per_step[1:]:
        assert d[0] == d[1] == d[2] == 0, f"allocations in a steady step: {d}"
        assert d[3] == 1 and d[4] == coef_bytes, f"host-to-device copies {d[3]} of {d[4]} bytes"
        assert d[5] == 1   # the norm / finiteness verdict (check_finite): one small copy down
    # a tensor without a gradient: the active set changes, the tables go up again, then stay
    g = list(grads)
    g[3] = None
    before = emu_counters()
    opt.step(g)
    d = [b - a for a, b in zip(before, emu_counters())]
    assert d[3] == 2 and d[0] == 0   # tables + coefficients (two entries: one tensor's count lags)
    before = emu_counters()
    opt.step(g)
    d = [b - a for a, b in zip(before, emu_counters())]
    assert d[3] == 1 and d[4] == coef_bytes


def test_device_reader_prefetches_on_a_side_stream(enc_cuda, inputs):
    """The device reader queues each batch's copies and decoding on its own stream and orders them with
    events instead of waiting for the backend's stream: per batch one `ready` event (recorded by the
    reader, waited for by the consumer before the batch is handed out) and one `released` event
    (recorded when the batch is given back, waited for by the side stream before the buffer is
    overwritten); the backend's stream is synchronised only on a buffer's first use. The emulator's
    streams are synchronous, so this checks the protocol is followed, not the overlap (a GPU run)."""
    if emu_counters() is None:
        pytest.skip("event counts come from the emulator")
    ids, mask, types = inputs
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="all", batch_size=4, device_bytes=30000,
                                       show_progress=False)
    assert c.stats()["tiers"]["device"]["entries"] and c.stats()["tiers"]["host"]["entries"]
    want = [(i, b[0]) for i, b in c.batches(2, seed=9, ragged=True)]
    # the counters are process-wide: no earlier test's device batch may be freed (and record its
    # own release) by the cyclic collector inside the window
    gc.collect()
    gc.disable()
    try:
        before = emu_counters()
        n = 0
        # a plain loop: zip() and enumerate() keep their last result tuple, and with it the
        # previous batch, alive until after they have asked the reader for the next one, so the
        # reader could need a fourth buffer (seen under AddressSanitizer's slower consumer)
        for i, (x, _) in c.batches(2, seed=9, ragged=True, output="device", prefetch=2):
            wi, wx = want[n]
            assert np.array_equal(i, wi) and np.array_equal(x.numpy(), wx)
            n += 1
            del x
        d = [b - a for a, b in zip(before, emu_counters())]
    finally:
        gc.enable()
    # buffers: at most prefetch 2 + the one being consumed; fewer when the consumer gives one back
    # before the reader needs another (timing). Each buffer makes its two events on its first use.
    buffers = d[13] // 2
    assert n == 13 and d[13] % 2 == 0 and 1 <= buffers <= 3, d
    assert d[9] == 2 * n, f"{d[9]} events recorded for {n} batches (ready + released each): {d}"
    assert d[10] == n - buffers, f"{d[10]} stream waits for {buffers} buffers: every reuse of a buffer waits for its release: {d}"
    assert d[11] >= n, f"the consumer waits for each batch's ready event: {d}"


def test_device_tier_stops_where_the_device_is_full(enc_cuda, inputs, monkeypatch):
    """device_bytes larger than the device holds: the tier takes what fits, the rest goes to the host
    (a device that is full after the first shard: its allocations fail with MemoryError, as
    cudaMalloc's out-of-memory does through the binding)."""
    ids, mask, types = inputs
    from fasttran.cache import tiers
    calls = []

    class FullDevice:
        def __init__(self, t):
            self.t = t

        def to(self, device):
            calls.append(device)
            if len(calls) > 1:
                raise MemoryError("cannot allocate on cuda:0: out of memory")
            return self.t.to(device)

    class FakeC:
        class Tensor:
            @staticmethod
            def from_dlpack(a):
                return FullDevice(_C.Tensor.from_dlpack(a))
    monkeypatch.setattr(tiers, "_C", FakeC)
    c = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="mean", batch_size=4,
                                       device_bytes=1 << 30, show_progress=False)
    monkeypatch.undo()
    t = c.stats()["tiers"]
    assert len(calls) == 2 and t["device"]["entries"] == 4 and t["host"]["entries"] == len(ids) - 4
    ref = fasttran.ActivationCache.build(enc_cuda, ids, mask, types, positions="mean", batch_size=4, show_progress=False)
    assert np.array_equal(c.get(np.arange(len(ids)), output="device").numpy(), ref.get(np.arange(len(ids))))
