"""Training the top encoder layers (csrc/model/layer.c over the backend's training ops): outputs,
gradients of every parameter and of the layer input against torch autograd in float64 on MiniLM's
real layer weights; dropout masks reproduced in torch; each of Tempo's options on and off giving
the same gradients and the activation bytes its design predicts. The CUDA backend runs the same
tests on a GPU or the CUDA emulator."""
import os

import numpy as np
import pytest

import fasttran
from fasttran import _C

torch = pytest.importorskip("torch")

M64 = (1 << 64) - 1
LENGTHS = [5, 1, 9, 4]   # packed sequences of a batch (one of length 1)


def mix64(z):
    z = (z + np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keep_mask(seed, step, site, n, p):
    """core/rng.h, vectorised: element i is kept when mix64(key + i) >> 32 >= p 2^32."""
    with np.errstate(over="ignore"):
        key = mix64(mix64(np.uint64(seed ^ 0x5851F42D4C957F2D)) ^ mix64(np.uint64((step * 0x2545F4914F6CDD1D + site) & M64)))
        thr = np.uint64(min(int(p * 4294967296.0), 0xFFFFFFFF))
        return (mix64(key + np.arange(n, dtype=np.uint64)) >> np.uint64(32)) >= thr


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from transformers import BertModel
    enc = fasttran.Encoder.from_pretrained(minilm_dir)
    ref = BertModel.from_pretrained(minilm_dir, torch_dtype=torch.float64).eval()
    return enc, ref


def torch_layers(ref, first, count, x, lengths, p_hidden=0.0, p_attn=0.0, seed=0, step=0, p_input=0.0):
    """The layers in float64 autograd, written out so fasttran's dropout masks can be applied
    (p_input: the stack's input dropout, site 15)."""
    cfg = ref.config
    C, NH = cfg.hidden_size, cfg.num_attention_heads
    hs = C // NH
    N = x.shape[0]
    P = NH * sum(n * n for n in lengths)
    h = x
    if p_input:
        h = h * torch.from_numpy(keep_mask(seed, step, 15, N * C, p_input)).reshape(N, C) / (1 - p_input)
    for layer in range(first, first + count):
        L = ref.encoder.layer[layer]
        sites = [16 + layer * 3 + s for s in range(3)]   # after the heads' sites 0..14 and the input's 15
        pm = torch.from_numpy(keep_mask(seed, step, sites[0], P, p_attn)) if p_attn else None
        m1 = torch.from_numpy(keep_mask(seed, step, sites[1], N * C, p_hidden)).reshape(N, C) if p_hidden else None
        m2 = torch.from_numpy(keep_mask(seed, step, sites[2], N * C, p_hidden)).reshape(N, C) if p_hidden else None
        q, k, v = L.attention.self.query(h), L.attention.self.key(h), L.attention.self.value(h)
        ctx, base, first_row = [], 0, 0
        for n in lengths:
            qb = q[first_row:first_row + n].reshape(n, NH, hs).transpose(0, 1)
            kb = k[first_row:first_row + n].reshape(n, NH, hs).transpose(0, 1)
            vb = v[first_row:first_row + n].reshape(n, NH, hs).transpose(0, 1)
            probs = torch.softmax(qb @ kb.transpose(1, 2) / hs ** 0.5, dim=-1)
            if pm is not None:
                probs = probs * pm[base:base + NH * n * n].reshape(NH, n, n) / (1 - p_attn)
            ctx.append((probs @ vb).transpose(0, 1).reshape(n, C))
            base += NH * n * n
            first_row += n
        a = L.attention.output.dense(torch.cat(ctx))
        if m1 is not None:
            a = a * m1 / (1 - p_hidden)
        h1 = L.attention.output.LayerNorm(a + h)
        f = L.intermediate.intermediate_act_fn(L.intermediate.dense(h1))
        y = L.output.dense(f)
        if m2 is not None:
            y = y * m2 / (1 - p_hidden)
        h = L.output.LayerNorm(y + h1)
    return h


def on_device(device):
    """(to the stack's device, back to NumPy) for device -1 (the CPU) or a CUDA index"""
    if device >= 0:
        return (lambda a: fasttran.from_dlpack(a).to("cuda")), (lambda t: t.numpy())
    return (lambda a: a), np.asarray


def run_fasttran(enc, first, count, x, lengths, dout, device=-1, **opt):
    st = _C.LayerStack(enc._core, first, count, device, **opt)
    lens = np.asarray(lengths, np.int32)
    to, as_np = on_device(device)
    xd, out = to(x), to(np.zeros_like(x))
    training = dict(training=True, seed=11, step=3)
    st.forward(xd, lens, out, **training)
    dx = to(np.zeros_like(x))
    st.backward(to(dout), dx)
    names, total = st.tensors()
    grads = np.asarray(st.grads.numpy() if device >= 0 else st.grads)
    g = {n: grads[o:o + int(np.prod(s))].reshape(s) for n, s, o in names}
    return as_np(out), g, as_np(dx), st


def reference(ref, first, count, x, lengths, dout, **drop):
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ref.zero_grad()
    out = torch_layers(ref, first, count, xt, lengths, seed=11, step=3, **drop)
    (out * torch.from_numpy(dout).double()).sum().backward()
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None}
    return out.detach().numpy(), grads, xt.grad.numpy()


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_grads(g, g_r, tol):
    """Relative error per tensor. The key bias is the exception: adding a constant to every key
    shifts each score row by a constant, which softmax ignores, so its exact gradient is zero;
    what fp32 leaves there is compared with the scale of the key weight's gradient instead."""
    for name, grad in g.items():
        if name.endswith("attention.self.key.bias"):
            scale = np.abs(g_r[name.replace(".bias", ".weight")]).max()
            assert np.abs(g_r[name]).max() <= 1e-5 * scale
            err = float(np.abs(grad - g_r[name]).max() / scale)
        else:
            err = rel(grad, g_r[name])
        assert err <= tol, f"{name}: relative error {err:.2e}"


def inputs(enc, first, seed=0):
    """Real hidden states at layer `first` for random token ids, packed; a random output gradient."""
    rng = np.random.default_rng(seed)
    xs = []
    for n in LENGTHS:
        ids = np.concatenate([[101], rng.integers(1000, 20000, n - 1)])[:n][None]
        xs.append(enc.forward(ids, output_layers=[first])[0][0])
    x = np.ascontiguousarray(np.concatenate(xs)).astype(np.float32)
    return x, rng.standard_normal(x.shape).astype(np.float32)


DEVICES = [pytest.param(-1, id="cpu"),
           pytest.param(0, id="cuda", marks=pytest.mark.skipif(not fasttran.cuda_available(), reason="no CUDA device "
                                                                   "or emulator (FASTTRAN_CUDA_EMU=1)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2])
def test_gradients_match_autograd_on_minilm(minilm, device, k):
    enc, ref = minilm
    L = enc.num_layers
    x, dout = inputs(enc, L - k)
    out, g, dx, _ = run_fasttran(enc, L - k, k, x, LENGTHS, dout, device)
    out_r, g_r, dx_r = reference(ref, L - k, k, x, LENGTHS, dout)
    assert np.abs(out - out_r).max() <= 1e-4
    # the top layer's output is the encoder's own forward, bit for bit on the CPU
    assert len(g) == 16 * k
    check_grads(g, g_r, 1e-4)
    assert rel(dx, dx_r) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_masks_reproduced_in_torch_give_the_same_gradients(minilm, device):
    enc, ref = minilm
    L = enc.num_layers
    x, dout = inputs(enc, L - 2, seed=1)
    out, g, dx, _ = run_fasttran(enc, L - 2, 2, x, LENGTHS, dout, device, hidden_dropout=0.1, attention_dropout=0.2)
    out_r, g_r, dx_r = reference(ref, L - 2, 2, x, LENGTHS, dout, p_hidden=0.1, p_attn=0.2)
    assert np.abs(out - out_r).max() <= 1e-4
    check_grads(g, g_r, 1e-4)
    assert rel(dx, dx_r) <= 1e-4
    # the masks really dropped something: without dropout the output differs
    out0, _, _, _ = run_fasttran(enc, L - 2, 2, x, LENGTHS, dout, device)
    assert np.abs(out - out0).max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_input_dropout_is_the_embeddings_dropout(minilm, device):
    """input_dropout drops the stack's input (at layer 0: the embeddings' output, as BERT's embeddings
    do after their LayerNorm) with the masks of site 15; the gradients, d x included (through the
    same mask), equal autograd's with those masks, and evaluation's forward drops nothing."""
    enc, ref = minilm
    x, dout = inputs(enc, 0, seed=2)
    drop = dict(hidden_dropout=0.1, attention_dropout=0.1)
    out, g, dx, st = run_fasttran(enc, 0, 2, x, LENGTHS, dout, device, input_dropout=0.25, **drop)
    out_r, g_r, dx_r = reference(ref, 0, 2, x, LENGTHS, dout, p_hidden=0.1, p_attn=0.1, p_input=0.25)
    assert np.abs(out - out_r).max() <= 1e-4
    check_grads(g, g_r, 1e-4)
    assert rel(dx, dx_r) <= 1e-4
    assert (dx == 0).mean() >= 0.2   # the dropped inputs have no gradient
    without, _, _, _ = run_fasttran(enc, 0, 2, x, LENGTHS, dout, device, **drop)
    assert np.abs(out - without).max() > 1e-2
    # evaluation: no dropout anywhere, the same output as a stack without it
    lens = np.asarray(LENGTHS, np.int32)
    to, as_np = on_device(device)
    e1, e2 = to(np.zeros_like(x)), to(np.zeros_like(x))
    st.forward(to(x), lens, e1, training=False)
    _C.LayerStack(enc._core, 0, 2, device).forward(to(x), lens, e2, training=False)
    assert np.array_equal(as_np(e1), as_np(e2))
    # its copy of the input counts in the memory report
    other = _C.LayerStack(enc._core, 0, 2, device, **drop)
    assert st.memory(4, 16)["activations"]["input"] == 2 * other.memory(4, 16)["activations"]["input"]
    with pytest.raises(fasttran.InputError, match="input"):
        _C.LayerStack(enc._core, 0, 1, device, input_dropout=1.0)


def token_rows(seed=0):
    """random token ids (a [CLS] first, some repeated) and types for LENGTHS' packed rows"""
    rng = np.random.default_rng(seed)
    ids, types = [], []
    for n in LENGTHS:
        ids.append(np.concatenate([[101], rng.integers(1000, 1012, n - 1)])[:n])   # few ids: rows repeat
        types.append((np.arange(n) >= n // 2).astype(np.int32))
    return np.concatenate(ids).astype(np.int32), np.concatenate(types)


@pytest.mark.parametrize("device", DEVICES)
def test_trained_embeddings(minilm, device):
    """train_embeddings: the stack starts from token ids -- word + type + position rows, their
    LayerNorm, its dropout (site 15) -- and the tables' gradients (dense, repeated ids summed) and
    the LayerNorm's equal float64 autograd through transformers' own embedding modules; evaluation
    gives the cached path's bits on the CPU (the embeddings' output as the encoder computes it)."""
    enc, ref = minilm
    L = enc.num_layers
    ids, types = token_rows(seed=4)
    lens = np.asarray(LENGTHS, np.int32)
    N, C = len(ids), enc.hidden_size
    dout = np.random.default_rng(5).standard_normal((N, C)).astype(np.float32)
    to, as_np = on_device(device)
    drop = dict(hidden_dropout=0.1, attention_dropout=0.1, input_dropout=0.25)
    st = _C.LayerStack(enc._core, 0, L, device, train_embeddings=True, **drop)
    out = to(np.zeros((N, C), np.float32))
    st.forward(None, lens, out, training=True, seed=11, step=3, ids=ids, types=types)
    st.backward(to(dout))
    names, total = st.tensors()
    grads = np.asarray(st.grads.numpy() if device >= 0 else st.grads)
    g = {n: grads[o:o + int(np.prod(s))].reshape(s) for n, s, o in names}
    emb = ref.embeddings
    ref.zero_grad()
    pos = np.concatenate([np.arange(n) for n in LENGTHS])
    e = emb.LayerNorm(emb.word_embeddings(torch.from_numpy(ids).long()) +
                      emb.token_type_embeddings(torch.from_numpy(types).long()) +
                      emb.position_embeddings(torch.from_numpy(pos).long()))
    out_r = torch_layers(ref, 0, L, e, LENGTHS, p_hidden=0.1, p_attn=0.1, seed=11, step=3, p_input=0.25)
    (out_r * torch.from_numpy(dout).double()).sum().backward()
    g_r = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None}
    assert np.abs(as_np(out) - out_r.detach().numpy()).max() <= 1e-4
    assert [n for n, _, _ in names][:5] == ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                                            "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
                                            "embeddings.LayerNorm.bias"]
    assert set(g) == set(g_r)   # every parameter but the pooler's
    check_grads(g, g_r, 1e-4)
    word = g["embeddings.word_embeddings.weight"]
    assert set(np.flatnonzero(np.abs(word).sum(1))) == set(ids)   # the rows read, and only those
    # evaluation: the cached embeddings' output through the same layers, bit for bit
    plain = _C.LayerStack(enc._core, 0, L, device)
    x = np.concatenate([enc.forward(ids[None, a:a + n], token_type_ids=types[None, a:a + n], output_layers=[0])[0][0]
                        for a, n in zip(np.cumsum([0] + LENGTHS[:-1]), LENGTHS)]).astype(np.float32)
    e1, e2 = to(np.zeros((N, C), np.float32)), to(np.zeros((N, C), np.float32))
    st.forward(None, lens, e1, ids=ids, types=types)
    plain.forward(to(np.ascontiguousarray(x)), lens, e2)
    if device < 0:   # (x is the CPU encoder's: on CUDA the sums of the embeddings' LayerNorm run in another order)
        assert np.array_equal(as_np(e1), as_np(e2))
    assert np.abs(as_np(e1) - as_np(e2)).max() <= 1e-5
    # the tables count in the parameters; their sum and statistics in the input's memory
    assert total == plain.tensors()[1] + sum(int(np.prod(s)) for n, s, _ in names if n.startswith("embeddings."))
    assert st.memory(4, 16)["activations"]["input"] > _C.LayerStack(enc._core, 0, L, device, **drop).memory(4, 16)[
        "activations"]["input"]
    # the tokens are checked, asked for, and used once
    for bad, what in [(np.full(N, enc.config["vocab_size"], np.int32), "vocab_size"), (-ids, "out of range")]:
        with pytest.raises(fasttran.InputError, match=what):
            st.forward(None, lens, e1, ids=bad, types=types)
    with pytest.raises(fasttran.InputError, match="type_vocab_size"):
        st.forward(None, lens, e1, ids=ids, types=types + 2)
    with pytest.raises(fasttran.InputError, match="x must be NULL|token ids"):
        st.forward(to(np.ascontiguousarray(x)), lens, e1)
    with pytest.raises(fasttran.InputError, match="every layer"):
        _C.LayerStack(enc._core, 1, L - 1, device, train_embeddings=True)


TEMPO = ["inplace_gelu", "inplace_layernorm", "recompute_attention_dropout", "recompute_attention_probs"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", TEMPO)
def test_each_tempo_option_keeps_the_gradients_and_saves_what_it_predicts(minilm, device, option):
    enc, _ = minilm
    L = enc.num_layers
    x, dout = inputs(enc, L - 2, seed=2)
    drop = dict(hidden_dropout=0.1, attention_dropout=0.1)
    base = dict(drop, inplace_gelu=False, inplace_layernorm=False, recompute_attention_dropout=False,
                recompute_attention_probs=False)
    off = run_fasttran(enc, L - 2, 2, x, LENGTHS, dout, device, **base)
    on = run_fasttran(enc, L - 2, 2, x, LENGTHS, dout, device, **dict(base, **{option: True}))
    assert np.array_equal(off[0], on[0])   # the forward is the same
    if option == "recompute_attention_dropout":   # the same mask, regenerated: the same bits
        assert all(np.array_equal(on[1][n], off[1][n]) for n in off[1]) and np.array_equal(on[2], off[2])
    # fp32 rounding: the backward reads the activations back in another form (the LayerNorm's
    # normalised input from its output; GELU's input from its output, its branch bit and, near the
    # minimum, the GEMM it came from; the probabilities from Q K^T and their rows' max and 1/sum)
    check_grads(on[1], {n: v.astype(np.float64) for n, v in off[1].items()}, 2e-6)
    assert rel(on[2], off[2]) <= 2e-6
    # saved bytes: what the design predicts, per layer (2 layers, B sequences of T tokens)
    B, T = 8, 128
    N, C, I, NH = B * T, enc.config["hidden_size"], enc.config["intermediate_size"], enc.config["num_attention_heads"]
    m_off, m_on = off[3].memory(B, T)["activations"], on[3].memory(B, T)["activations"]
    # the report of the other configuration, asked of this stack, is that stack's own report
    assert off[3].memory(B, T, **{option: 1}) == on[3].memory(B, T)
    assert on[3].memory(B, T, **{option: 0}) == off[3].memory(B, T)
    saved = sum(m_off.values()) - sum(m_on.values())
    predicted = {"inplace_gelu": N * I * 4 - (N * I + 7) // 8,          # GELU input -> one bit per element
                 "inplace_layernorm": 2 * N * C * 4,                    # both LayerNorm inputs
                 "recompute_attention_dropout": B * NH * T * T,  # the byte mask of the probabilities
                 # the probabilities (NH T^2 floats per sequence) -> their rows' max and 1/sum (2 N NH floats)
                 "recompute_attention_probs": B * NH * T * T * 4 - 2 * N * NH * 4}[option]
    assert saved == 2 * predicted, (option, saved, 2 * predicted)


def test_any_thread_count_gives_the_same_result(minilm):
    """One thread, and more threads than CPUs set from another Python thread (whose OpenMP default
    is still the CPU count: per-thread attention scratch must follow the backend's thread count,
    not OpenMP's; it once overran its buffer here): the same outputs and gradients to fp32 rounding
    (the layers' GEMMs are OpenBLAS's, whose blocking follows the thread count), long sequences."""
    import threading
    enc, _ = minilm
    L = enc.num_layers
    lengths = [300, 7, 211]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((sum(lengths), enc.hidden_size)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    before = fasttran.get_num_threads()
    results = []

    def run():
        results.append(run_fasttran(enc, L - 2, 2, x, lengths, dout, hidden_dropout=0.1, attention_dropout=0.1)[:3])
    try:
        for n in (1, 2 * (os.cpu_count() or 1) + 1):
            fasttran.set_num_threads(n)
            t = threading.Thread(target=run)
            t.start()
            t.join()
    finally:
        fasttran.set_num_threads(before)
    assert len(results) == 2
    (o1, g1, d1), (o2, g2, d2) = results
    assert rel(o1, o2) <= 1e-6 and rel(d1, d2) <= 1e-5
    for n in g1:   # the key bias's exact gradient is zero (see check_grads): its noise against the key weight's
        scale = np.abs(g1[n.replace(".bias", ".weight")] if n.endswith("self.key.bias") else g1[n]).max()
        assert np.abs(g1[n] - g2[n]).max() <= 1e-5 * scale, n


def test_memory_report_agrees_with_what_is_allocated(minilm):
    enc, _ = minilm
    L = enc.num_layers
    st = _C.LayerStack(enc._core, L - 2, 2, -1, hidden_dropout=0.1, attention_dropout=0.1)
    B, T = 4, 16
    x = np.random.default_rng(0).standard_normal((B * T, enc.config["hidden_size"])).astype(np.float32)
    st.forward(x, np.full(B, T, np.int32), np.zeros_like(x), training=True)
    m = st.memory(B, T)
    now, peak = st.allocated()
    held = m["weights"] + m["gradients"] + sum(v for k, v in m["activations"].items() if k != "input") + m["workspace"]
    # the arena and workspace are 64-byte aligned views: the report is exact to that alignment
    assert 0 <= now - held <= 64 * 32 * 2 and peak == now


def test_an_inference_forward_holds_one_layers_activations(minilm):
    """Evaluation keeps nothing for a backward: the layers share one layer's activations (and two
    output buffers), so a long evaluation batch does not hold k layers' attention probabilities.
    Its outputs equal a training forward's without dropout, and training afterwards is unchanged."""
    enc, _ = minilm
    L, C = enc.num_layers, enc.config["hidden_size"]
    lengths = np.array([40, 7, 33, 1, 40], np.int32)
    x = np.random.default_rng(1).standard_normal((int(lengths.sum()), C)).astype(np.float32)
    dout = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    make = lambda: _C.LayerStack(enc._core, L - 4, 4, -1, hidden_dropout=0.0, attention_dropout=0.0)
    ev, tr = make(), make()
    y_ev, y_tr = np.zeros_like(x), np.zeros_like(x)
    ev.forward(x, lengths, y_ev)                      # evaluation first, on a fresh stack
    tr.forward(x, lengths, y_tr, training=True)
    np.testing.assert_array_equal(y_ev, y_tr)
    # the bytes held (on fresh stacks, a batch of equal lengths: what memory() reports exactly)
    B, T = 5, 40
    xu = np.random.default_rng(3).standard_normal((B * T, C)).astype(np.float32)
    ev2, tr2 = make(), make()
    ev2.forward(xu, np.full(B, T, np.int32), np.zeros_like(xu))
    tr2.forward(xu, np.full(B, T, np.int32), np.zeros_like(xu), training=True)
    acts = sum(v for k, v in tr2.memory(B, T)["activations"].items() if k != "input")
    (held_ev, _), (held_tr, _) = ev2.allocated(), tr2.allocated()
    assert held_tr - held_ev >= 0.6 * acts, (held_ev, held_tr, acts)   # 4 layers' against about one's
    with pytest.raises(Exception, match="no training forward"):
        ev.backward(dout)
    dx_ev, dx_tr = np.zeros_like(x), np.zeros_like(x)
    y2 = np.zeros_like(x)
    ev.forward(x, lengths, y2, training=True)         # and training after it lays its own out again
    np.testing.assert_array_equal(y2, y_tr)
    ev.backward(dout, dx_ev)
    tr.backward(dout, dx_tr)
    np.testing.assert_array_equal(dx_ev, dx_tr)


def test_bad_input(minilm):
    enc, _ = minilm
    L = enc.num_layers
    with pytest.raises(fasttran.InputError, match="not layers of this 6-layer encoder"):
        _C.LayerStack(enc._core, L - 7, 7, -1)
    with pytest.raises(fasttran.InputError, match="dropout"):
        _C.LayerStack(enc._core, L - 1, 1, -1, hidden_dropout=1.0)
    st = _C.LayerStack(enc._core, L - 1, 1, -1)
    x = np.zeros((5, enc.config["hidden_size"]), np.float32)
    with pytest.raises(fasttran.InputError, match="x has 1920 elements, expected 2304"):
        st.forward(x, np.array([6], np.int32), np.zeros((6, 384), np.float32))
    with pytest.raises(fasttran.InputError, match="no training forward"):
        st.backward(x)
    with pytest.raises(fasttran.InputError, match="sequence 0 has 0 tokens"):
        st.forward(x[:0], np.array([0], np.int32), x[:0])
