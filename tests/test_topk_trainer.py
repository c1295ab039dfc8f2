"""Trainer(train_layers=k): the top k layers of the real all-MiniLM-L6-v2 and a head trained from a
cache of layer L - k (every token's state), on real SST-2 sentences: the cache and the encoder in
the loop give the same step; it learns; save/resume is exact; export loads in transformers with the
same hidden states; memory report against what is allocated; bad input refused."""
import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer

from conftest import sst2_file


@pytest.fixture(scope="module")
def data(enc):
    from fasttran.data import load_sst2
    s, y = load_sst2(sst2_file("train"))
    ids, mask, types = enc.tokenize(s[:256])
    return ids, mask, types, np.array(y[:256])


def trainer(k=1, **kw):
    args = dict(optimizer="adamw", lr=1e-4, epochs=1, batch_size=16, seed=3, show_progress=False, train_layers=k)
    args.update(kw)
    return Trainer("classification", **args)


def assert_resumes_exactly(full, part, cache, targets, tmp_path):
    """`part` (configured as `full` was) stopped after 5 steps, saved, reloaded into a new
    Trainer and continued ends with `full`'s layers and head, bit for bit."""
    part.fit(cache, targets, checkpoint_dir=str(tmp_path / "ck"), stop_at_step=5)
    back = Trainer.load(str(tmp_path / "ck"), show_progress=False)
    back.fit(cache, targets, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    for (n, a), (_, b) in zip(full.top.named_parameters(), back.top.named_parameters()):
        assert np.array_equal(a, b), n
    assert np.array_equal(full.head.params, back.head.params)


@pytest.fixture(scope="module")
def cache1(enc, data):
    ids, mask, types, _ = data
    return trainer(1).cache_for(enc, ids, mask, types, show_progress=False)


def test_first_step_matches_the_encoder_in_the_loop(enc, data, cache1):
    """The top layer on cached layer-(L-1) states computes what the whole encoder computes: its
    output pooled equals the encoder's mean-pooled output, for every example."""
    from fasttran.finetune import TopLayers
    ids, mask, types, _ = data
    top = TopLayers(enc, 1)
    x, offsets = cache1.get(cache1.example_ids[:20], ragged=True)
    out = top.forward(x, np.diff(offsets))
    pooled = top.pool(out)
    ref = enc.forward(ids[:20], mask[:20], types[:20], pooling="mean")
    assert np.abs(pooled - ref).max() <= 1e-5


def test_learns_and_resumes_exactly(enc, data, cache1, tmp_path):
    y = data[3]
    # lr 3e-4: 256 sentences, two epochs (training accuracy 0.82 on the first 256 of the real train
    # set, 0.85 on the shipped sample, against 0.51 and 0.59 for the majority class)
    full = trainer(1, epochs=2, lr=3e-4)
    hist = full.fit(cache1, y)
    assert hist[1]["train_loss"] < hist[0]["train_loss"]
    majority = max(y.mean(), 1 - y.mean())
    assert full.evaluate(cache1, y)["accuracy"] > majority + 0.15
    # stopped at step 5 of 32, saved, reloaded into a new Trainer, continued: the same weights
    assert_resumes_exactly(full, trainer(1, epochs=2, lr=3e-4), cache1, y, tmp_path)


def test_recomputed_attention_probabilities_train_alike_and_resume_exactly(enc, data, cache1, tmp_path):
    """tempo={"recompute_attention_probs": True}: the same training to fp32 rounding as with the
    probabilities kept (16 steps), kept in the checkpoint, resumed bit for bit."""
    y = data[3]
    rp = {"recompute_attention_probs": True}
    kept, rec = trainer(1), trainer(1, tempo=rp)
    kept.fit(cache1, y)
    rec.fit(cache1, y)
    assert rec.top.options["recompute_attention_probs"] and "recompute_attention_probs" in repr(rec.top)
    for (n, a), (_, b) in zip(kept.top.named_parameters(), rec.top.named_parameters()):
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(a).max()), n
    assert_resumes_exactly(rec, trainer(1, tempo=rp), cache1, y, tmp_path)
    assert Trainer.load(str(tmp_path / "ck"), show_progress=False).tempo == rp


@pytest.mark.skipif(not fasttran.trainer.native_bf16(), reason="bf16 training on the CPU needs AVX512_BF16 or AMX")
def test_bf16_learns_like_float32_and_resumes_exactly(enc, data, cache1, tmp_path):
    """precision="bfloat16" on a CPU with bf16 products (AMX: the tiles in bf16, one term of the bf16x6
    split; AVX512_BF16: vdpbf16ps), float32 master weights. The losses follow the float32 run's within
    bf16's rounding (yet differ: the bf16 products did run), it learns as much, and resumes bit for bit."""
    y = data[3]
    f32 = trainer(1, epochs=2, lr=3e-4)
    f32.fit(cache1, y)
    bf = trainer(1, epochs=2, lr=3e-4, precision="bfloat16")
    bf.fit(cache1, y)
    assert bf.top.matmul_precision == "bfloat16"
    for (s1, l1), (s2, l2) in zip(bf.loss_curve, f32.loss_curve):
        assert abs(l1 - l2) <= 2e-2 * max(1.0, abs(l2)), (s1, l1, l2)
    assert any(l1 != l2 for (_, l1), (_, l2) in zip(bf.loss_curve, f32.loss_curve))
    acc_bf, acc_32 = bf.evaluate(cache1, y)["accuracy"], f32.evaluate(cache1, y)["accuracy"]
    assert abs(acc_bf - acc_32) <= 0.03, (acc_bf, acc_32)
    assert_resumes_exactly(bf, trainer(1, epochs=2, lr=3e-4, precision="bfloat16"), cache1, y, tmp_path)


def test_mixed_precision_trains_in_bf16_and_evaluates_in_float32(enc):
    """matmul_precision='bfloat16' is the training steps' arithmetic: forward(training=True) differs
    from float32 by bf16's rounding, forward(training=False) -- evaluation, predict -- is the float32
    stack's bit for bit, as the exported float32 model computes (on any CPU: without bf16 products
    the rounded reference runs)."""
    from fasttran.finetune import TopLayers
    rng = np.random.default_rng(3)
    lengths = np.array([9, 1, 14], np.int32)
    x = rng.standard_normal((int(lengths.sum()), enc.config["hidden_size"])).astype(np.float32)
    off = dict(hidden_dropout=0.0, attention_dropout=0.0)
    bf, f32 = TopLayers(enc, 2, matmul_precision="bfloat16", **off), TopLayers(enc, 2, **off)
    np.testing.assert_array_equal(np.array(bf.forward(x, lengths)), np.array(f32.forward(x, lengths)))
    trained = np.array(bf.forward(x, lengths, training=True))
    ref = np.array(f32.forward(x, lengths, training=True))
    err = np.abs(trained - ref).max() / np.abs(ref).max()
    assert 1e-5 < err < 3e-2, err
    np.testing.assert_array_equal(np.array(bf.forward(x, lengths)), np.array(f32.forward(x, lengths)))


def test_finetune_precision_is_bf16_where_the_device_multiplies_it(monkeypatch):
    """FINETUNE_DEFAULT's bf16 where layers train on CUDA or a CPU with AVX512_BF16; float32 for a head
    alone and on CPUs without bf16 products (where the Trainer would refuse it)"""
    fp = fasttran.trainer.finetune_precision
    assert fasttran.trainer.FINETUNE_DEFAULT["precision"] == "bfloat16"
    assert fp(0) == "float32" and fp(0, "cuda") == "float32" and fp(6, "cuda") == "bfloat16"
    for has, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(fasttran.trainer._C, "cpu_features", lambda has=has: ({"avx512_bf16": has}, {}))
        assert fp(6) == want and fp(1, "cpu") == want and fasttran.trainer.native_bf16() is has


def test_bf16_refused_where_the_cpu_has_no_bf16_products(monkeypatch):
    """(A process that is such a CPU: tests/test_lowp.py's FASTTRAN_CPU_ISA cases.)"""
    monkeypatch.setattr(fasttran.trainer._C, "cpu_features", lambda: ({"avx512_bf16": False}, {}))
    monkeypatch.setattr(fasttran.trainer, "_cpu_isa", lambda: "avx2")
    with pytest.raises(fasttran.InputError, match="avx512_bf16.*'avx2'"):
        trainer(1, precision="bfloat16")
    with pytest.raises(fasttran.InputError, match="avx512_bf16"):
        trainer(1, precision="float16")
    with pytest.raises(fasttran.InputError, match="train_layers >= 1"):
        trainer(0, precision="bfloat16")


def test_export_loads_in_transformers_with_the_same_hidden_states(enc, data, cache1, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import BertModel
    ids, mask, types, y = data
    tr = trainer(1)
    tr.fit(cache1, y)
    path = tr.export(str(tmp_path / "exported"))
    ours = fasttran.Encoder.from_pretrained(path)
    assert ours.tokenizer is not None
    ref = BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        h = ref(input_ids=torch.as_tensor(ids[:8]), attention_mask=torch.as_tensor(mask[:8]),
                token_type_ids=torch.as_tensor(types[:8])).last_hidden_state.numpy()
    got = ours.forward(ids[:8], mask[:8], types[:8])
    valid = mask[:8].astype(bool)
    assert np.abs(got - h)[valid].max() <= 1e-4
    # the trained layer really changed, the frozen ones did not
    before = enc.forward(ids[:8], mask[:8], types[:8], output_layers=[enc.num_layers - 1, enc.num_layers])
    after = ours.forward(ids[:8], mask[:8], types[:8], output_layers=[enc.num_layers - 1, enc.num_layers])
    assert np.array_equal(before[0], after[0]) and np.abs(before[1] - after[1]).max() > 1e-3


def test_memory_report_matches_what_is_allocated(enc, data, cache1):
    tr = trainer(1, batch_size=8)
    tr.fit(cache1, data[3], stop_at_step=1)
    now, peak = tr.top.allocated()
    rep = tr.memory_report(batch_size=8, seq_len=int(cache1.lengths.max()))
    held = rep["weights"] + rep["gradients"] + sum(v for k, v in rep["activations"].items() if k != "input") \
        + rep["workspace"]
    assert peak <= held + 64 * 64   # a full batch of the longest examples bounds every real batch
    big = tr.memory_report(32, 128, budget_bytes=1 << 30)
    assert big["total"] > rep["total"] and big["largest_batch"] >= 32
    # each memory option on and off (the others as configured): the report of a stack built that way
    from fasttran.finetune import TopLayers
    assert set(big["options"]) == {"inplace_gelu", "inplace_layernorm", "recompute_attention_dropout",
                                   "recompute_attention_probs"}
    for name, states in big["options"].items():
        for state, row in states.items():
            # the same layers with the head's floats after them (the report counts the head too)
            opts = dict(tr.top.options, **{name: state == "on"}, extra=tr.head.num_parameters)
            other = TopLayers(enc, 1, **opts).memory_report(32, 128)
            assert row["total"] == other["total"], (name, state)
            assert row["largest_batch"] == TopLayers(enc, 1, **opts).largest_batch(128, 1 << 30), (name, state)
        # what is on now equals the trainer's own report
        now = states["on" if tr.top.options[name] else "off"]
        assert now["total"] == big["total"] and now["largest_batch"] == big["largest_batch"]
    assert big["options"]["recompute_attention_probs"]["on"]["largest_batch"] > big["largest_batch"]
    with pytest.raises(fasttran.InputError, match="unknown memory option"):
        tr.top.memory_report(8, 128, inplace_relu=True)


def test_profile_of_a_topk_trainer(enc, data, cache1):
    """profile() runs the top layers' steps (ragged batches) on a copy: the trainer keeps its layers,
    head and step count."""
    ids, mask, types, y = data
    tr = trainer(k=1, epochs=1)
    tr.fit(cache1, y)
    layers = [np.array(v) for _, v in tr.top.named_parameters()]
    head, step = tr.head.params.copy(), tr.global_step
    p = tr.profile(cache1, y, steps=2, epoch=False)
    assert p["training step"].wall > 0 and "top 1 layer" in p.title
    assert tr.global_step == step and np.array_equal(tr.head.params, head)
    for a, (_, b) in zip(layers, tr.top.named_parameters()):
        assert np.array_equal(a, b)


def test_bad_input(enc, data, cache1):
    ids, mask, types, y = data
    with pytest.raises(fasttran.InputError, match="train_layers must be an int >= 0"):
        Trainer("classification", train_layers=-1)
    with pytest.raises(fasttran.InputError, match="train_layers=7 but the encoder has 6 layers"):
        trainer(7).cache_for(enc, ids, mask, types)
    pooled = ActivationCache.build(enc, ids, mask, types, positions="mean", show_progress=False)
    with pytest.raises(fasttran.InputError, match="needs every token's state at layer 5"):
        trainer(1).fit(pooled, y)
    with pytest.raises(fasttran.InputError, match="this cache holds positions='all' at layer 5"):
        trainer(2).fit(cache1, y)
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(fasttran.InputError, match="layer_dropout must be a probability"):
            Trainer("classification", train_layers=1, layer_dropout=bad)
    with pytest.raises(fasttran.InputError, match="tempo option"):
        Trainer("classification", train_layers=1, tempo={"inplace_relu": True})


def test_caches_of_another_model_or_another_dtype(enc, data, cache1, minilm_dir, tmp_path):
    """A cache computed by another model (same shapes, other weights) is refused before anything is
    trained; a float16 cache of the right layer trains (its states are widened on read) and
    evaluates like the float32 one to fp16 rounding."""
    import shutil
    from safetensors.numpy import load_file, save_file
    ids, mask, types, y = data
    other_dir = tmp_path / "other"
    shutil.copytree(minilm_dir, other_dir)
    weights = load_file(str(other_dir / "model.safetensors"))
    name = next(n for n in weights if n.endswith("layer.0.output.dense.bias"))
    weights[name] = weights[name] + np.float32(0.01)
    save_file(weights, str(other_dir / "model.safetensors"))
    other = fasttran.Encoder.from_pretrained(str(other_dir), load_tokenizer=False)
    t = trainer(1)
    other_cache = t.cache_for(other, ids[:32], mask[:32], types[:32], show_progress=False)
    t.fit(cache1, y, stop_at_step=1)
    before = [p.copy() for _, p in t.top.named_parameters()]
    with pytest.raises(fasttran.CacheMismatchError, match="another encoder"):
        t.fit(other_cache, y[:32])
    assert all(np.array_equal(a, p) for a, (_, p) in zip(before, t.top.named_parameters()))

    half = trainer(1).cache_for(enc, ids, mask, types, dtype="float16", show_progress=False)
    b = trainer(1)
    b.fit(half, y, stop_at_step=2)
    assert b.global_step == 2
    on32, on16 = t.evaluate(cache1, y), t.evaluate(half, y)
    assert abs(on32["loss"] - on16["loss"]) <= 1e-3 and abs(on32["accuracy"] - on16["accuracy"]) <= 2 / len(y)


def test_layer_dropout_reaches_the_layers_and_the_checkpoint(enc, data, cache1, tmp_path):
    """layer_dropout=None keeps the checkpoint's 0.1; a value sets both of the layers' dropouts and
    survives save/load."""
    y = data[3]
    t = trainer(1)
    t.fit(cache1, y, stop_at_step=1)
    assert t.top.options["hidden_dropout"] == t.top.options["attention_dropout"] == pytest.approx(0.1)
    t = trainer(1, layer_dropout=0.0, dropout=0.0)
    t.fit(cache1, y, stop_at_step=1, checkpoint_dir=str(tmp_path / "ck"))
    assert t.top.options["hidden_dropout"] == t.top.options["attention_dropout"] == 0.0
    back = Trainer.load(str(tmp_path / "ck"), show_progress=False)
    assert back.layer_dropout == 0.0
    back.fit(cache1, y, checkpoint_dir=str(tmp_path / "ck"), resume=True, stop_at_step=2)
    assert back.top.options["hidden_dropout"] == 0.0


@pytest.fixture(scope="module")
def qa_data(enc):
    """Question/context pairs from real SST-2 sentences; the answer: the 2nd and 3rd context tokens."""
    from fasttran.data import load_sst2
    s, _ = load_sst2(sst2_file("train"))
    encs = enc.tokenizer.encode_batch([(s[i], s[i + 1]) for i in range(0, 300, 2)])
    T = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), T), np.int64)
    mask, types = np.zeros_like(ids), np.zeros_like(ids)
    for i, e in enumerate(encs):
        ids[i, :len(e.ids)], mask[i, :len(e.ids)], types[i, :len(e.ids)] = e.ids, 1, e.type_ids
    first = np.argmax(types == 1, axis=1)
    ok = mask.sum(1) - first >= 4   # two context tokens past the first, then [SEP]
    return ids[ok], mask[ok], types[ok], (first[ok] + 1, first[ok] + 2)


def test_qa_head_trains_the_top_layers(enc, qa_data, tmp_path):
    """train_layers=k with the span head: token states of the top layers go to the head padded per
    example and its gradient comes back to the rows; it learns the span, resumes exactly, and its
    logits are the head's over what the exported encoder computes."""
    ids, mask, types, spans = qa_data

    def qa(**kw):
        args = dict(optimizer="adamw", lr=1e-3, epochs=8, batch_size=16, seed=3, show_progress=False, train_layers=1)
        args.update(kw)
        return Trainer("qa", **args)

    tr = qa()
    cache = tr.cache_for(enc, ids, mask, types, show_progress=False)
    hist = tr.fit(cache, spans)
    assert hist[-1]["train_loss"] < 0.5 * hist[0]["train_loss"], [h["train_loss"] for h in hist]
    logits = tr.predict(cache)
    exact = np.mean([l[0].argmax() == a and l[1].argmax() == b for l, a, b in zip(logits, *spans)])
    assert exact > 0.9, exact   # 0.99 measured; the untrained head: 0
    # the head's logits over the exported encoder's last hidden states, per example
    tr.export(str(tmp_path / "enc"))
    enc2 = fasttran.Encoder.from_pretrained(str(tmp_path / "enc"))
    states = enc2.forward(ids, mask, types)
    from fasttran.heads.span import context_rows
    valid = np.zeros(states.shape[:2], np.float32)
    for j, row in enumerate(np.split(context_rows(cache), np.cumsum(cache.lengths)[:-1])):
        valid[j, :len(row)] = row
    ref, _ = tr.head.step(states, valid)
    for j, lg in enumerate(logits):
        n = lg.shape[1]
        assert np.array_equal(np.isinf(lg), np.broadcast_to(valid[j, :n] == 0, lg.shape))
        assert np.abs(np.where(np.isinf(lg), 0, lg - ref[:, j, :n])).max() <= 1e-4
    # stopped after 5 steps, saved, reloaded, continued: the same layers and head
    assert_resumes_exactly(tr, qa(), cache, spans, tmp_path)


def test_embedding_dropout_at_every_layer(enc, data, tmp_path):
    """With every layer trained the layers' input is the embeddings' output, which transformers drops
    (hidden_dropout_prob): embedding_dropout does the same there (None: the checkpoint's), never below
    k = L; default 0. ELECTRA (dropout before its embedding projection) has none to apply. The
    Trainer's value reaches the layers and survives save / load."""
    from fasttran.architectures import BY_MODEL_TYPE
    from fasttran.finetune import TopLayers
    L = enc.num_layers
    assert TopLayers(enc, L).options["embedding_dropout"] == 0.0
    every = TopLayers(enc, L, embedding_dropout=None)
    assert every.options["embedding_dropout"] == pytest.approx(0.1) and "embeddings' 0.1" in repr(every)
    assert TopLayers(enc, L - 1, embedding_dropout=0.3).options["embedding_dropout"] == 0.0
    assert TopLayers(enc, L, embedding_dropout=0.3).options["embedding_dropout"] == pytest.approx(0.3)
    assert BY_MODEL_TYPE["electra"].embedding_dropout_key is None
    assert BY_MODEL_TYPE["distilbert"].embedding_dropout_key == "dropout"
    with pytest.raises(fasttran.InputError, match="dropout"):
        TopLayers(enc, L, embedding_dropout=1.0)
    with pytest.raises(fasttran.InputError, match="embedding_dropout"):
        trainer(L, embedding_dropout=1.5)
    y = data[3]
    cache = Trainer("classification", train_layers=L, show_progress=False).cache_for(enc, *data[:3],
                                                                                       show_progress=False)
    runs = {}
    for p in (0.0, None):
        t = trainer(L, embedding_dropout=p)
        t.fit(cache, y, stop_at_step=1, checkpoint_dir=str(tmp_path / f"ck{p}"))
        assert t.top.options["embedding_dropout"] == pytest.approx(0.1 if p is None else 0.0)
        runs[p] = [g.copy() for _, g in t.top.named_parameters()]
    assert any(not np.array_equal(a, b) for a, b in zip(runs[0.0], runs[None]))   # the masks changed the step
    back = Trainer.load(str(tmp_path / "ckNone"), show_progress=False)
    assert back.embedding_dropout is None


def test_trained_embeddings_resume_exactly_and_export(enc, data, tmp_path):
    """train_embeddings: the embeddings train with every layer (their tables in the flat table, in
    layer 0's lr group), resume bit for bit from a checkpoint, and export into a model transformers
    loads with them in place: its hidden states equal fasttran's, its embeddings the trained ones
    (not the checkpoint's)."""
    torch = pytest.importorskip("torch")
    from transformers import BertModel
    ids, mask, types, y = data
    L = enc.num_layers
    with pytest.raises(fasttran.InputError, match="train_layers"):
        trainer(0, train_embeddings=True)
    with pytest.raises(fasttran.InputError, match="every layer"):
        trainer(L - 1, train_embeddings=True).fit(trainer(L - 1).cache_for(enc, ids[:16], mask[:16], types[:16],
                                                                            show_progress=False), y[:16])
    cache = trainer(L).cache_for(enc, ids, mask, types, show_progress=False)
    full = trainer(L, train_embeddings=True, layer_lr_decay=0.8)
    full.fit(cache, y)
    names = [n for n, _ in full.model.named_parameters()]
    assert names[0] == "embeddings.word_embeddings.weight" and "embeddings" in repr(full.top)
    factors = dict(zip(names, fasttran.trainer.lr_factors(full.model, full.lr, full.head_lr, full.layer_lr_decay)))
    assert factors["embeddings.word_embeddings.weight"] == factors["encoder.layer.0.output.dense.weight"] \
        == pytest.approx(0.8 ** (L - 1))   # the embeddings train with layer 0
    assert_resumes_exactly(full, trainer(L, train_embeddings=True, layer_lr_decay=0.8), cache, y, tmp_path)
    path = full.export(str(tmp_path / "exported"))
    ref = BertModel.from_pretrained(path).eval()
    word = dict(full.top.named_parameters())["embeddings.word_embeddings.weight"]
    assert np.array_equal(ref.embeddings.word_embeddings.weight.detach().numpy(), word)
    assert not np.array_equal(word, BertModel.from_pretrained(enc.path).embeddings.word_embeddings.weight.detach().numpy())
    with torch.no_grad():
        h = ref(input_ids=torch.as_tensor(ids[:8]), attention_mask=torch.as_tensor(mask[:8]),
                token_type_ids=torch.as_tensor(types[:8])).last_hidden_state.numpy()
    got = fasttran.Encoder.from_pretrained(path).forward(ids[:8], mask[:8], types[:8])
    assert np.abs(got - h)[mask[:8].astype(bool)].max() <= 1e-4
    # evaluation reads the trained embeddings: the same logits as the exported encoder's features
    ev = full.evaluate(cache, y)
    assert ev == Trainer.load(str(tmp_path / "ck"), show_progress=False).evaluate(cache, y)
