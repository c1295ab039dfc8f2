"""Training ModernBERT's top layers (csrc/model/layer.c's pre-LN pair: attention norm, fused QKV
without biases, RoPE, local / global attention windows, GeGLU, the final norm in the last layer)
against torch autograd in float64 on transformers' ModernBertModel weights: the layers' outputs,
every parameter's gradient and d input within 1e-4, on ragged sequences longer than the window (so
local layers differ from global ones). The float64 reference is itself checked against transformers'
forward. Then Trainer(train_layers=k) end to end: the cache at layer L - k, the first step equal to
the encoder in the loop, the C epoch loop equal to the per-step one, the memory report against what
is allocated, and what stays refused by name (dropout, Tempo's in-place options). The CUDA backend
runs the same gradient checks where there is one (the emulator without a GPU)."""

import numpy as np
import pytest

import fasttran

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 97
# base-ish: head size 64 as ModernBERT-base's, 4 layers (0 and 3 global), a 32-token window
SMALL = dict(vocab_size=V, hidden_size=256, num_attention_heads=4, intermediate_size=384, num_hidden_layers=4,
             local_attention=32, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             cls_token_id=1, sep_token_id=2)
LENGTHS = [70, 9, 45]   # packed rows: longer and shorter than the window


def make_model(path, seed=0, **over):
    """test_modernbert's random checkpoint, at SMALL's shape"""
    from test_modernbert import make_model as checkpoint_at
    return checkpoint_at(path, seed, **dict(SMALL, **over))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("modernbert_training") / "small")
    hf = transformers.AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float64).eval()
    return path, hf


def layer_plan(hf):
    """per layer: (window half-width or None for global, rope theta)"""
    cfg = hf.config
    types = getattr(cfg, "layer_types", None) or [
        "full_attention" if i % cfg.global_attn_every_n_layers == 0 else "sliding_attention"
        for i in range(cfg.num_hidden_layers)]
    rope = cfg.rope_parameters
    return [(None if t == "full_attention" else cfg.local_attention // 2, float(rope[t]["rope_theta"])) for t in types]


def rotate(x, theta):
    """transformers' RoPE (rotate_half) on x (NH, n, hs) at positions 0..n-1, in float64"""
    n, hs = x.shape[1], x.shape[2]
    inv = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def torch_layers(hf, first, count, x, lengths):
    """layers [first, first + count) of ModernBertModel in float64 autograd on packed rows x (N, C),
    sequence by sequence; the final norm after the encoder's last layer"""
    cfg = hf.config
    C, NH = cfg.hidden_size, cfg.num_attention_heads
    hs = C // NH
    plan = layer_plan(hf)
    h = x
    for l in range(first, first + count):
        L = hf.layers[l]
        half, theta = plan[l]
        a = L.attn_norm(h)   # nn.Identity in layer 0
        qkv = L.attn.Wqkv(a)
        ctx, row = [], 0
        for n in lengths:
            t = qkv[row:row + n].reshape(n, 3, NH, hs).permute(1, 2, 0, 3)   # (3, NH, n, hs)
            q, k, v = rotate(t[0], theta), rotate(t[1], theta), t[2]
            s = q @ k.transpose(1, 2) / np.sqrt(hs)
            if half is not None:
                i = torch.arange(n)
                s = s.masked_fill((i[:, None] - i[None, :]).abs() > half, float("-inf"))
            ctx.append((s.softmax(-1) @ v).transpose(0, 1).reshape(n, C))
            row += n
        h = h + L.attn.Wo(torch.cat(ctx))
        m = L.mlp_norm(h)
        inp, gate = L.mlp.Wi(m).chunk(2, dim=-1)
        h = h + L.mlp.Wo(L.mlp.act(inp) * gate)
    if first + count == cfg.num_hidden_layers:
        h = hf.final_norm(h)
    return h


def packed_batch(seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = rng.integers(3, V, (len(lengths), T))
    mask = np.zeros(ids.shape, np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 0
    return ids, mask


def hf_hidden(hf, ids, mask):
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]


def pack(h, lengths):
    return np.concatenate([h[b, :n] for b, n in enumerate(lengths)])


def test_the_reference_is_transformers_forward(small):
    """the float64 layers above, from the embeddings' output, give transformers' hidden states, layer
    by layer (a wrong window, theta or norm would be off by far more than RoPE's float32 angles)"""
    _, hf = small
    ids, mask = packed_batch()
    # sequence by sequence: transformers' float64 eager attention gives NaN on padded rows that no
    # key in a window reaches, and they leak into the next global layer
    per = [hf_hidden(hf, ids[b:b + 1, :n], mask[b:b + 1, :n]) for b, n in enumerate(LENGTHS)]
    hs = [np.concatenate([p[l][0] for p in per]) for l in range(len(per[0]))]
    L = hf.config.num_hidden_layers
    for l in range(L):
        with torch.no_grad():
            got = torch_layers(hf, l, 1, torch.from_numpy(hs[l]), LENGTHS).numpy()
        # (transformers computes RoPE's cos / sin in float32 even in a float64 model)
        assert np.abs(got - hs[l + 1]).max() <= 1e-5 * max(1.0, np.abs(hs[l + 1]).max()), l


DEVICES = ["cpu"] + (["cuda"] if fasttran.cuda_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,recompute", [(2, False), (4, False), (1, True), (3, True)])
def test_gradients_match_autograd(small, device, k, recompute):
    """outputs, every parameter's gradient and d input of the top k layers (k = 4: from layer 0,
    whose attention norm is the identity) within 1e-4 of float64 autograd"""
    from fasttran.finetune import TopLayers
    path, hf = small
    enc = fasttran.Encoder.from_pretrained(path)
    L = enc.num_layers
    ids, mask = packed_batch(seed=k)
    first = L - k
    # the stack's input: hidden state `first` as inference gives it (the residual stream, not normed)
    hidden = enc.forward(ids, mask, output_layers=[first])[0]
    x = pack(hidden, LENGTHS).astype(np.float32)
    top = TopLayers(enc, k, device=device, recompute_attention_probs=recompute)
    assert top.options["hidden_dropout"] == top.options["attention_dropout"] == 0.0
    assert not top.options["inplace_gelu"] and not top.options["inplace_layernorm"]
    out = top.forward(x, LENGTHS, training=True, seed=1, step=0)
    dout = np.random.default_rng(7).standard_normal(np.shape(out)).astype(np.float32)
    dx = top.backward(dout, want_dx=True)
    out, dx = np.asarray(out), np.asarray(dx)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    hf.zero_grad()
    ref = torch_layers(hf, first, k, xt, LENGTHS)
    (ref * torch.from_numpy(dout).double()).sum().backward()
    ref = ref.detach().numpy()
    assert np.abs(out - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max()), "outputs"
    # the top layer's output is the encoder's own forward (final_norm'ed when the stack ends at L)
    last = enc.forward(ids, mask)
    assert np.abs(pack(last, LENGTHS) - out).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    params = dict(hf.named_parameters())
    names = [n for n, _ in top.named_gradients()]
    want_names = {enc.architecture.checkpoint_name(n) for n in names}
    trained = {n for n in params if n == "final_norm.weight" or
               (n.startswith("layers.") and int(n.split(".")[1]) >= first)}
    assert want_names == trained
    for name, g in top.named_gradients():
        want = params[enc.architecture.checkpoint_name(name)].grad.numpy()
        g = np.asarray(g)
        assert g.shape == want.shape, name
        assert np.abs(g - want).max() <= 1e-4 * np.abs(want).max(), name
    assert np.abs(dx - xt.grad.numpy()).max() <= 1e-4 * np.abs(xt.grad.numpy()).max()


@pytest.mark.parametrize("device", DEVICES)
def test_trained_embeddings_match_autograd(small, device):
    """train_embeddings on ModernBERT: words only (no position or type table: RoPE), a LayerNorm without
    bias, every layer above; the word table's and the norm's gradients within 1e-4 of float64
    autograd through transformers' own embeddings module, the layers' too"""
    from fasttran.finetune import TopLayers
    path, hf = small
    enc = fasttran.Encoder.from_pretrained(path)
    L = enc.num_layers
    ids, mask = packed_batch(seed=9)
    real = mask.astype(bool)
    top = TopLayers(enc, L, device=device, train_embeddings=True)
    out = np.asarray(top.forward(None, LENGTHS, training=True, seed=1, step=0, ids=ids[real]))
    dout = np.random.default_rng(8).standard_normal(out.shape).astype(np.float32)
    assert top.backward(dout) is None
    hf.zero_grad()
    x = hf.embeddings(input_ids=torch.as_tensor(ids[real])[None])[0]   # (eval: dropout off)
    ref = torch_layers(hf, 0, L, x, LENGTHS)
    (ref * torch.from_numpy(dout).double()).sum().backward()
    ref = ref.detach().numpy()
    assert np.abs(out - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max()), "outputs"
    params = dict(hf.named_parameters())
    names = [n for n, _ in top.named_gradients()]
    assert [n for n in names if n.startswith("embeddings.")] == ["embeddings.word_embeddings.weight",
                                                                 "embeddings.LayerNorm.weight"]
    for name, g in top.named_gradients():
        want = params[enc.architecture.checkpoint_name(name)].grad.numpy()
        assert np.abs(np.asarray(g) - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_at_modernbert_base_width(tmp_path, device):
    """ModernBERT-base's layer width (hidden 768, 12 heads, FFN 1152), the top 2 of 3 layers (a local
    one under a global one): outputs, gradients and d input within 1e-4 of float64 autograd"""
    from fasttran.finetune import TopLayers
    path = make_model(tmp_path / "base", seed=2, hidden_size=768, num_attention_heads=12, intermediate_size=1152,
                      num_hidden_layers=3, global_attn_every_n_layers=2)
    hf = transformers.AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float64).eval()
    assert [p[0] for p in layer_plan(hf)] == [None, 16, None]
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask = packed_batch(seed=9)
    x = pack(enc.forward(ids, mask, output_layers=[1])[0], LENGTHS).astype(np.float32)
    top = TopLayers(enc, 2, device=device)
    out = np.asarray(top.forward(x, LENGTHS, training=True))
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    dx = np.asarray(top.backward(dout, want_dx=True))
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ref = torch_layers(hf, 1, 2, xt, LENGTHS)
    (ref * torch.from_numpy(dout).double()).sum().backward()
    ref = ref.detach().numpy()
    assert np.abs(out - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    params = dict(hf.named_parameters())
    for name, g in top.named_gradients():
        want = params[enc.architecture.checkpoint_name(name)].grad.numpy()
        assert np.abs(np.asarray(g) - want).max() <= 1e-4 * np.abs(want).max(), name
    assert np.abs(dx - xt.grad.numpy()).max() <= 1e-4 * np.abs(xt.grad.numpy()).max()


def test_a_sequence_alone_and_packed(small):
    """a sequence's outputs and its share of d x alone and packed after others (RoPE's positions
    restart in each sequence, windows stay in it); as BERT's layers, not bit for bit: the
    projections' GEMMs see another row count"""
    from fasttran.finetune import TopLayers
    path, _ = small
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask = packed_batch(seed=3)
    x = pack(enc.forward(ids, mask, output_layers=[2])[0], LENGTHS).astype(np.float32)
    top = TopLayers(enc, 2)
    both = np.asarray(top.forward(x, LENGTHS, training=True)).copy()
    dout = np.random.default_rng(1).standard_normal(both.shape).astype(np.float32)
    dx_both = np.asarray(top.backward(dout, want_dx=True)).copy()
    n0, n1 = LENGTHS[0], LENGTHS[0] + LENGTHS[1]
    alone = np.asarray(top.forward(x[n0:n1], LENGTHS[1:2], training=True)).copy()
    dx_alone = np.asarray(top.backward(dout[n0:n1], want_dx=True))
    assert np.abs(alone - both[n0:n1]).max() <= 1e-5 * np.abs(both).max()
    assert np.abs(dx_alone - dx_both[n0:n1]).max() <= 1e-5 * np.abs(dx_both).max()


def test_what_stays_refused_by_name(small):
    from fasttran.finetune import TopLayers
    path, _ = small
    enc = fasttran.Encoder.from_pretrained(path)
    with pytest.raises(fasttran.FastTranError, match="no dropout"):
        TopLayers(enc, 2, hidden_dropout=0.1)
    with pytest.raises(fasttran.FastTranError, match="no dropout"):
        TopLayers(enc, 2, attention_dropout=0.1)
    with pytest.raises(fasttran.FastTranError, match="in-place LayerNorm"):
        TopLayers(enc, 2, inplace_layernorm=True)
    with pytest.raises(fasttran.FastTranError, match="in-place GELU"):
        TopLayers(enc, 2, inplace_gelu=True)
    top = TopLayers(enc, 2)
    with pytest.raises(fasttran.FastTranError, match="in-place GELU and LayerNorm"):
        top.memory_report(4, 64, inplace_layernorm=True)
    # the other operations that run BERT's layer code stay refused (int8: tests/test_modernbert_int8.py;
    # compression: tests/test_modernbert_compress.py)
    with pytest.raises(fasttran.UnsupportedModelError, match="^pruning, .* ModernBertModel"):
        from fasttran import compress
        compress.apply(compress.TaskModel(enc, fasttran.heads.ClassificationHead(enc.hidden_size, 2)),
                       {"layers": {"0": "prune"}})


# ---- Trainer(train_layers=k) end to end ---------------------------------------------------------------
def labelled_batch(n=12, seed=5):
    rng = np.random.default_rng(seed)
    lengths = [int(v) for v in rng.integers(5, 60, n)]
    lengths[0] = 60   # longer than the window
    ids, mask = packed_batch(seed, lengths)
    return ids, mask, lengths, (np.arange(n) % 2).astype(np.int64)


def make_trainer(k, **kw):
    from fasttran.heads import make_head
    head = make_head("classification", SMALL["hidden_size"], num_labels=2, dropout=0.0, seed=11)
    args = dict(optimizer="adamw", lr=1e-3, schedule="constant", warmup=0, weight_decay=0.0, max_grad_norm=1e9,
                epochs=3, batch_size=12, seed=3, show_progress=False, train_layers=k)
    args.update(kw)
    return fasttran.Trainer(head, **args), head


@pytest.mark.parametrize("k", [1, 2])
def test_trainer_steps_equal_torch_adamw_on_the_same_layers_and_head(small, k):
    """three AdamW steps of Trainer(train_layers=k) on the cache of layer L - k give the layers and the
    head that torch.optim.AdamW gives training the same float64 layers + mean pooling + linear head
    + cross-entropy from the same start (one batch of every example per step)"""
    path, hf0 = small
    enc = fasttran.Encoder.from_pretrained(path)
    L = enc.num_layers
    ids, mask, lengths, y = labelled_batch()
    tr, head = make_trainer(k)
    cache = tr.cache_for(enc, ids, mask, show_progress=False)
    # the cache holds hidden state L - k as inference gives it: the top layers on it are the encoder
    x0, offsets = cache.get(cache.example_ids, ragged=True)
    assert np.array_equal(np.diff(offsets), lengths)
    W0 = {n: np.array(v) for n, v in head.named_parameters()}
    tr.fit(cache, y)
    # torch: the same layers from the checkpoint, the head from its initial weights
    hf = transformers.AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float64).eval()
    names = [n for n, _ in tr.top.named_parameters()]
    P = dict(hf.named_parameters())
    trained = {n: P[enc.architecture.checkpoint_name(n)] for n in names}
    hw = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in W0.items()}
    wname = next(n for n in hw if hw[n].dim() == 2)
    bname = next(n for n in hw if hw[n].dim() == 1)
    opt = torch.optim.AdamW(list(trained.values()) + list(hw.values()), lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
                            weight_decay=0.0)
    x = torch.from_numpy(np.asarray(x0, np.float64))
    for step in range(3):
        opt.zero_grad()
        out = torch_layers(hf, L - k, k, x, lengths)
        pooled = torch.stack([out[a:b].mean(0) for a, b in zip(offsets[:-1], offsets[1:])])
        logits = pooled @ hw[wname].T + hw[bname]
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).backward()
        opt.step()
    for name, got in tr.top.named_parameters():
        want = trained[name].detach().numpy()
        # three steps of at most lr each: agreement to a small fraction of a step
        assert np.abs(np.asarray(got) - want).max() <= 3e-5, name
    for name, got in tr.head.named_parameters():
        assert np.abs(np.asarray(got) - hw[name].detach().numpy()).max() <= 3e-5, name
    # and it moved: three steps of lr, not the starting weights
    moved = max(np.abs(np.asarray(v) - P0).max() for (n, v), P0 in
                zip(tr.top.named_parameters(), [dict(transformers.AutoModel.from_pretrained(path).named_parameters())[
                    enc.architecture.checkpoint_name(n)].detach().numpy() for n in names]))
    assert moved > 1e-3


def test_trainer_c_epoch_loop_equals_the_per_step_loop(small, monkeypatch):
    """the C epoch loop (csrc/train/loop.c, the default) runs the pre-LN layers' step: the same
    weights, bit for bit, as the Python per-step loop; the memory report bounds what is allocated"""
    path, _ = small
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask, lengths, y = labelled_batch(n=24, seed=8)
    runs = []
    for py_loop in ("", "1"):
        monkeypatch.setenv("FASTTRAN_PY_LOOP", py_loop)
        tr, _ = make_trainer(2, batch_size=8, epochs=2, lr=3e-4)
        cache = tr.cache_for(enc, ids, mask, show_progress=False)
        hist = tr.fit(cache, y)
        runs.append((tr, hist))
        assert (tr._c_loop_refusal(cache) is None) == (py_loop == "")   # the first run was the C loop's
    (c_tr, c_hist), (py_tr, py_hist) = runs
    assert c_hist[-1]["train_loss"] == py_hist[-1]["train_loss"]
    for (n, a), (_, b) in zip(c_tr.top.named_parameters(), py_tr.top.named_parameters()):
        assert np.array_equal(np.asarray(a), np.asarray(b)), n
    assert np.array_equal(np.asarray(c_tr.head.params), np.asarray(py_tr.head.params))
    # memory: a full batch of the longest examples bounds every real batch (as BERT's)
    now, peak = c_tr.top.allocated()
    rep = c_tr.memory_report(batch_size=8, seq_len=max(lengths))
    held = rep["weights"] + rep["gradients"] + sum(v for k, v in rep["activations"].items() if k != "input") \
        + rep["workspace"]
    assert peak <= held + 64 * 64
    assert rep["activations"]["gelu_inputs"] > 0 and rep["activations"]["gelu_branch_bits"] == 0


def test_trained_layers_export_into_an_encoder(small):
    """export_to writes the trained layers and the final norm back into an encoder, whose forward then
    gives the stack's output (the final norm's place in the encoder's buffer is the stack's)"""
    from fasttran.finetune import TopLayers
    path, _ = small
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask = packed_batch(seed=4)
    x = pack(enc.forward(ids, mask, output_layers=[2])[0], LENGTHS).astype(np.float32)
    top = TopLayers(enc, 2)
    rng = np.random.default_rng(0)
    for name, view in top.named_parameters():   # other weights than the checkpoint's
        view[...] = view * (1 + 0.1 * rng.standard_normal(view.shape).astype(np.float32))
    out = np.asarray(top.forward(x, LENGTHS)).copy()
    assert np.abs(pack(enc.forward(ids, mask), LENGTHS) - out).max() > 1e-2   # not yet the encoder's
    top.export_to(enc)
    assert np.abs(pack(enc.forward(ids, mask), LENGTHS) - out).max() <= 1e-4 * np.abs(out).max()
    assert "final_norm.weight" in dict(top.named_parameters())


@pytest.mark.parametrize("recompute", [False, True], ids=["probs-kept", "probs-recomputed"])
@pytest.mark.parametrize("k", [1, 2])
def test_memory_report_bounds_a_long_document_step(small, k, recompute):
    """One sequence of 2,048 tokens (64 windows of 32; layer 3 global, 2 local) through a training
    step of the top k layers: the report's weights, gradients, saved activations and workspace bound
    the stack's peak within BERT's 64 x 64 bytes (tests/test_topk_trainer.py) and overshoot it by
    under 1% (benchmarks/modernbert_memory.py: the same at ModernBERT-base's shape, 4k / 8k tokens)"""
    from fasttran.finetune import TopLayers
    path, _ = small
    enc = fasttran.Encoder.from_pretrained(path)
    T = 2048
    top = TopLayers(enc, k, recompute_attention_probs=recompute)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((T, SMALL["hidden_size"])).astype(np.float32)
    out = np.asarray(top.forward(x, np.array([T], np.int32), training=True))
    top.backward(rng.standard_normal(out.shape).astype(np.float32), want_dx=True)
    now, peak = top.allocated()
    rep = top.memory_report(batch_size=1, seq_len=T)
    held = rep["weights"] + rep["gradients"] + sum(v for n, v in rep["activations"].items() if n != "input") \
        + rep["workspace"]
    assert peak <= held + 64 * 64, (peak, held, rep)
    assert held - peak <= 0.01 * peak, (peak, held, rep)
