"""The encoders besides BERT (fasttran/architectures.py): RoBERTa, XLM-R, CamemBERT, DistilBERT and
ELECTRA checkpoints written by transformers from random weights at the real models' widths (two
layers and small vocabularies keep it fast), loaded by fasttran and run against transformers' own
classes: every layer's hidden states on real tokens within 1e-4 of float32 and float64, padded and
ragged batches, left padding, wrapper prefixes, the pooler; the refusals; and the same forward on
device="cuda" where there is a CUDA backend (the emulator without a GPU)."""
import json
import os

import numpy as np
import pytest

import fasttran
from fasttran import architectures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 211   # vocabulary: small, so the checkpoints are quick to write
_BASE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=2)
_ROBERTA = dict(_BASE, vocab_size=V, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                pad_token_id=1, bos_token_id=0, eos_token_id=2)
#: model_type -> (config class, base model class, a wrapper class, config keywords of the real model's shape)
SHAPES = {
    "roberta": ("RobertaConfig", "RobertaModel", "RobertaForSequenceClassification", _ROBERTA),      # roberta-base
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForTokenClassification", _ROBERTA),
    "camembert": ("CamembertConfig", "CamembertModel", "CamembertForSequenceClassification", _ROBERTA),
    "distilbert": ("DistilBertConfig", "DistilBertModel", "DistilBertForSequenceClassification",   # distilbert-base
                   dict(vocab_size=V, dim=768, n_heads=12, hidden_dim=3072, n_layers=2, pad_token_id=0)),
    "electra": ("ElectraConfig", "ElectraModel", "ElectraForPreTraining",                          # electra-base
                dict(_BASE, vocab_size=V, embedding_size=768, pad_token_id=0)),
    "electra-small": ("ElectraConfig", "ElectraModel", "ElectraForPreTraining",   # embeddings_project 128 -> 256
                      dict(vocab_size=V, embedding_size=128, hidden_size=256, num_attention_heads=4,
                           intermediate_size=1024, num_hidden_layers=2, pad_token_id=0)),
}
ARCHS = sorted(SHAPES)


def make_model(path, case, wrapper=False, seed=0, **over):
    """A random-weight checkpoint of SHAPES[case] (its base model, or the wrapper class with its
    prefix) saved by transformers (safetensors) into `path`."""
    cfg_cls, base_cls, wrap_cls, kw = SHAPES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**dict(kw, **over))
    model = getattr(transformers, wrap_cls if wrapper else base_cls)(config)
    with torch.no_grad():   # wider than the 0.02 default so layers mix tokens and errors show
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 2 and "embeddings" not in name:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_outputs(path, ids, mask, double=False):
    """transformers' base model for the checkpoint: (hidden states of every layer, pooler output or None)"""
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    if double:
        model = model.double()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), output_hidden_states=True)
    pooled = getattr(out, "pooler_output", None)
    return [h.numpy() for h in out.hidden_states], None if pooled is None else pooled.numpy()


def ragged(rng, pad_id, lengths, T):
    """ids (B, T) with real tokens (never the padding id) then padding; mask 1 on real tokens"""
    B = len(lengths)
    ids = rng.integers(3, V, (B, T))
    ids[ids == pad_id] = pad_id + 3
    mask = np.zeros((B, T), np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = pad_id
    return ids, mask


def assert_layers_match(ours, path, ids, mask, tol=1e-4):
    ref32, _ = hf_outputs(path, ids, mask)
    ref64, _ = hf_outputs(path, ids, mask, double=True)
    valid = mask.astype(bool)
    assert len(ours) == len(ref32)
    for layer, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        assert a.shape == b.shape and a.dtype == np.float32
        e32, e64 = np.abs(a - b)[valid].max(), np.abs(a - c)[valid].max()
        assert e32 <= tol and e64 <= tol, f"layer {layer}: {e32:.2e} vs float32, {e64:.2e} vs float64"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """one base-model checkpoint per architecture, written once"""
    root = tmp_path_factory.mktemp("archs")
    return {t: make_model(root / t, t) for t in ARCHS}


@pytest.mark.parametrize("model_type", ARCHS)
def test_every_layer_matches_transformers(models, model_type):
    path = models[model_type]
    enc = fasttran.Encoder.from_pretrained(path)
    t = json.loads(open(os.path.join(path, "config.json")).read())["model_type"]
    assert enc.architecture.name == t and t in architectures.supported()
    assert repr(enc).startswith(f"Encoder({t}, layers=2, hidden=")
    pad = enc.config["pad_token_id"]
    ids, mask = ragged(np.random.default_rng(1), pad, [23, 9, 1, 17], 23)   # ragged, right-padded
    ours = enc.forward(ids, mask, output_layers=list(range(enc.num_layers + 1)))
    assert_layers_match(ours, path, ids, mask)
    # pooled outputs: mean over the real tokens and the first token, from the same rows
    ref, _ = hf_outputs(path, ids, mask)
    m = mask[..., None].astype(np.float64)
    mean = (ref[-1] * m).sum(1) / m.sum(1)
    np.testing.assert_allclose(enc.forward(ids, mask, pooling="mean"), mean, atol=1e-4, rtol=0)
    np.testing.assert_allclose(enc.forward(ids, mask, pooling="cls"), ref[-1][:, 0], atol=1e-4, rtol=0)
    # a token's result does not depend on the batch or padding around it: bit for bit
    alone = enc.forward(ids[1:2, :9], mask[1:2, :9])
    assert np.array_equal(alone[0], ours[-1][1, :9])


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_unpadded_and_left_padded(models, model_type):
    path = models[model_type]
    enc = fasttran.Encoder.from_pretrained(path)
    pad = enc.config["pad_token_id"]
    ids, mask = ragged(np.random.default_rng(2), pad, [12, 12], 12)
    assert_layers_match(enc.forward(ids, None, output_layers=[0, 1, 2]), path, ids, mask)
    if enc.architecture.position_ids != "after_padding":
        return
    # RoBERTa's positions count real tokens: left padding leaves every real token's result unchanged
    left_ids = np.concatenate([np.full((2, 5), pad), ids], 1)
    left_mask = np.concatenate([np.zeros((2, 5), np.int64), mask], 1)
    out = enc.forward(left_ids, left_mask, output_layers=[0, 1, 2])
    assert_layers_match(out, path, left_ids, left_mask)
    assert np.array_equal(out[-1][:, 5:], enc.forward(ids, mask))


@pytest.mark.parametrize("model_type", ARCHS)
def test_wrapper_checkpoints_load_with_their_prefix(tmp_path, model_type):
    path = make_model(tmp_path / "wrapped", model_type, wrapper=True, seed=3)
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask = ragged(np.random.default_rng(4), enc.config["pad_token_id"], [7, 3], 7)
    assert_layers_match(enc.forward(ids, mask, output_layers=[0, 1, 2]), path, ids, mask)


def test_roberta_pooler(models):
    path = models["roberta"]
    enc = fasttran.Encoder.from_pretrained(path)
    assert enc.has_pooler
    ids, mask = ragged(np.random.default_rng(5), 1, [6, 4], 6)
    _, pooled = hf_outputs(path, ids, mask)
    sd = enc.state_dict()
    first = enc.forward(ids, mask, pooling="cls")
    ours = np.tanh(first @ sd["pooler.dense.weight"].T + sd["pooler.dense.bias"])
    np.testing.assert_allclose(ours, pooled, atol=1e-5, rtol=0)
    for t in ("distilbert", "electra"):   # their base models have no pooler
        assert not fasttran.Encoder.from_pretrained(models[t]).has_pooler


def test_sentence_transformers_layout(models, tmp_path):
    import shutil
    root = tmp_path / "st"
    shutil.copytree(models["distilbert"], root / "0_Transformer")
    (root / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "0_Transformer",
                                                    "type": "sentence_transformers.models.Transformer"}]))
    enc = fasttran.Encoder.from_pretrained(str(root))
    ids, mask = ragged(np.random.default_rng(6), 0, [5], 5)
    assert np.array_equal(enc.forward(ids, mask), fasttran.Encoder.from_pretrained(models["distilbert"]).forward(ids, mask))


def test_token_types(models):
    distil = fasttran.Encoder.from_pretrained(models["distilbert"])
    assert distil.config["type_vocab_size"] == 0
    assert "embeddings.token_type_embeddings.weight" not in distil.state_dict()   # no type table at all
    ids, mask = ragged(np.random.default_rng(7), 0, [4], 4)
    zeros = np.zeros_like(ids)
    assert np.array_equal(distil.forward(ids, mask, zeros), distil.forward(ids, mask))
    with pytest.raises(fasttran.InputError, match="no token types"):
        distil.forward(ids, mask, np.ones_like(ids))
    roberta = fasttran.Encoder.from_pretrained(models["roberta"])   # one type row, read for every token
    with pytest.raises(fasttran.InputError, match="type_vocab_size 1"):
        roberta.forward(ids, mask, np.ones_like(ids))


def test_positions_limit_sequence_length(models):
    enc = fasttran.Encoder.from_pretrained(models["roberta"])
    assert enc.max_seq_length == 512   # 514 positions, two before the first real one
    ok = np.full((1, 512), 5)
    assert enc.forward(ok).shape == (1, 512, 768)
    with pytest.raises(fasttran.InputError, match="exceeds max_position_embeddings 514.*at most 512 tokens"):
        enc.forward(np.full((1, 513), 5))
    # padding beyond the limit is fine: only real tokens take positions
    ids = np.concatenate([ok, np.ones((1, 2), np.int64)], 1)
    mask = np.concatenate([np.ones((1, 512), np.int64), np.zeros((1, 2), np.int64)], 1)
    assert np.array_equal(enc.forward(ids, mask)[:, :512], enc.forward(ok))


def test_refused_model_types(tmp_path):
    supported = "bert, camembert, distilbert, electra, modernbert, roberta, xlm-roberta"
    assert ", ".join(architectures.supported()) == supported
    for cfg, why in [({"model_type": "deberta-v2"}, "model_type 'deberta-v2' is not supported; supported model "
                      "types: " + supported),
                     ({"model_type": 7}, "model_type 7 is not supported")]:
        with pytest.raises(fasttran.UnsupportedModelError) as e:
            fasttran.Encoder(cfg)
        assert why in str(e.value)
        assert supported in str(e.value)
    # ModernBERT loads (tests/test_modernbert.py); a field value the C encoder does not know is refused, named
    import dataclasses
    odd = dataclasses.replace(architectures.BY_MODEL_TYPE["modernbert"], norm="sandwich", positions="alibi")
    assert len(odd.unsupported()) == 2 and any("alibi" in w for w in odd.unsupported())
    modern = architectures.BY_MODEL_TYPE["modernbert"].layer_differences()   # what BERT-layer operations refuse, named
    assert len(modern) == 5 and any("rotary" in w for w in modern) and any("GeGLU" in w for w in modern)


def test_more_layers_than_the_config(models, tmp_path):
    import shutil
    d = tmp_path / "cut"
    shutil.copytree(models["distilbert"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fasttran.CheckpointError, match="transformer.layer.1.*num_hidden_layers = 1"):
        fasttran.Encoder.from_pretrained(str(d))
    cfg["n_layers"], cfg["hidden_dim"] = 2, 1000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fasttran.CheckpointError, match="'transformer.layer.0.ffn.lin1.weight' has shape"):
        fasttran.Encoder.from_pretrained(str(d))


@pytest.mark.skipif(not fasttran.cuda_available(), reason="no usable CUDA device (the emulator: FASTTRAN_CUDA=emu "
                    "build, FASTTRAN_CUDA_EMU=1)")
@pytest.mark.parametrize("model_type", ARCHS)
def test_cuda_forward(models, model_type):
    path = models[model_type]
    cpu = fasttran.Encoder.from_pretrained(path)
    gpu = fasttran.Encoder.from_pretrained(path, device="cuda")
    ids, mask = ragged(np.random.default_rng(8), cpu.config["pad_token_id"], [11, 4, 1], 11)
    out = gpu.forward(ids, mask, output_layers=[0, 1, 2])
    assert_layers_match(out, path, ids, mask)
    np.testing.assert_allclose(gpu.forward(ids, mask, pooling="mean"), cpu.forward(ids, mask, pooling="mean"),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["distilbert", "xlm-roberta", "electra-small"])
def test_save_pretrained_in_the_architectures_own_layout(tmp_path, model_type):
    path = make_model(tmp_path / "src", model_type, seed=9)
    enc = fasttran.Encoder.from_pretrained(path)
    out = enc.save_pretrained(str(tmp_path / "out"))
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["model_type"] == json.loads(open(os.path.join(path, "config.json")).read())["model_type"]
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "np") as a, safe_open(os.path.join(out, "model.safetensors"), "np") as b:
        assert set(b.keys()) <= set(a.keys())   # the base model's own names
        for k in b.keys():
            assert np.array_equal(a.get_tensor(k), b.get_tensor(k)), k
    ids, mask = ragged(np.random.default_rng(10), enc.config["pad_token_id"], [6, 2], 6)
    assert_layers_match(fasttran.Encoder.from_pretrained(out).forward(ids, mask, output_layers=[0, 1, 2]), out, ids, mask)


@pytest.mark.parametrize("embeddings", [True, False])
def test_projected_embeddings_in_int8(tmp_path, embeddings):
    """ELECTRA-small in int8: the layers (and the 128-wide word embeddings) int8, embeddings_project
    float32; within BERT's int8 error, and its state_dict loads back into a quantized copy bit for bit
    (compression refuses it: tests/test_compress_architectures.py)"""
    path = make_model(tmp_path / "small", "electra-small")
    enc = fasttran.Encoder.from_pretrained(path)
    assert enc.config["embedding_size"] == 128
    ids, mask = _batch(enc, n=8, seed=16)
    ref = enc.forward(ids, mask, pooling="mean")
    q = enc.quantize(embeddings=embeddings)
    assert q.dtype == "int8" and q.int8_embeddings == embeddings
    sd = q.state_dict()
    assert sd["embeddings_project.weight"].dtype == np.float32 and sd["embeddings_project.weight"].shape == (256, 128)
    assert (sd["embeddings.word_embeddings.weight"].dtype == np.int8) == embeddings
    got = q.forward(ids, mask, pooling="mean")
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99 and cos.mean() >= 0.997   # BERT's bound (tests/test_lowp.py, MiniLM)
    back = fasttran.Encoder.from_pretrained(path).quantize(embeddings=embeddings)
    back.load_state_dict(sd)
    assert np.array_equal(back.forward(ids, mask, pooling="mean"), got)
    if embeddings:
        assert np.array_equal(fasttran.Encoder.from_pretrained(path, dtype="int8").forward(ids, mask, pooling="mean"),
                              got)


# ---- everything else that works on BERT: top-k training, heads, cache, export, int8 ---------------------

def torch_top_layers(model, arch, first, count, x, lengths):
    """the layers [first, first + count) in float64 autograd over the transformers model's own
    parameters, found through the architecture's name map (the post-LN layer, written out)"""
    params = dict(model.named_parameters())
    prefix = next(p for p in ("",) + arch.prefixes
                  if prefix_ok(params, p + arch.checkpoint_name("encoder.layer.0.attention.self.query.weight")))

    def P(name):
        return params[prefix + arch.checkpoint_name(name)]
    C, hs = x.shape[1], 64
    NH = C // hs
    h = x
    for l in range(first, first + count):
        def lin(x, what):
            return x @ P(f"encoder.layer.{l}.{what}.weight").T + P(f"encoder.layer.{l}.{what}.bias")

        def ln(x, what):
            return torch.nn.functional.layer_norm(x, (C,), P(f"encoder.layer.{l}.{what}.weight"),
                                                  P(f"encoder.layer.{l}.{what}.bias"), model.config_eps)
        q, k, v = (lin(h, f"attention.self.{n}") for n in ("query", "key", "value"))
        ctx, r = [], 0
        for n in lengths:
            qb, kb, vb = (t[r:r + n].reshape(n, NH, hs).transpose(0, 1) for t in (q, k, v))
            ctx.append((torch.softmax(qb @ kb.transpose(1, 2) / hs ** 0.5, -1) @ vb).transpose(0, 1).reshape(n, C))
            r += n
        h1 = ln(lin(torch.cat(ctx), "attention.output.dense") + h, "attention.output.LayerNorm")
        f = torch.nn.functional.gelu(lin(h1, "intermediate.dense"))
        h = ln(lin(f, "output.dense") + h1, "output.LayerNorm")
    return h, P


def prefix_ok(params, name):
    return name in params


@pytest.mark.parametrize("model_type", ARCHS)
def test_top_layer_gradients_match_autograd(models, model_type):
    from fasttran import _C
    path = models[model_type]
    enc = fasttran.Encoder.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).double()
    model.config_eps = enc.config["layer_norm_eps"]
    lengths = [5, 1, 9]
    rng = np.random.default_rng(11)
    ids, mask = ragged(rng, enc.config["pad_token_id"], lengths, 9)
    first = 1
    hid = enc.forward(ids, mask, output_layers=[first])[0]
    x = np.ascontiguousarray(np.concatenate([hid[b, :n] for b, n in enumerate(lengths)])).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    st = _C.LayerStack(enc._core, first, 1, -1)
    out = np.zeros_like(x)
    st.forward(x, np.asarray(lengths, np.int32), out, training=True, seed=1, step=0)
    dx = np.zeros_like(x)
    st.backward(dout, dx)
    names, _ = st.tensors()
    grads = np.asarray(st.grads)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ref, P = torch_top_layers(model, enc.architecture, first, 1, xt, lengths)
    (ref * torch.from_numpy(dout).double()).sum().backward()
    assert np.abs(out - ref.detach().numpy()).max() <= 1e-4
    # the top layer's output is the encoder's own forward
    last = enc.forward(ids, mask)
    assert np.abs(np.concatenate([last[b, :n] for b, n in enumerate(lengths)]) - out).max() <= 1e-5
    assert len(names) == 16
    for name, shape, off in names:
        g = grads[off:off + int(np.prod(shape))].reshape(shape)
        want = P(name).grad.numpy()
        scale = np.abs(P(name.replace(".bias", ".weight")).grad.numpy()).max() if "key.bias" in name else \
            np.abs(want).max()
        assert np.abs(g - want).max() <= 1e-4 * scale, name
    assert np.abs(dx - xt.grad.numpy()).max() <= 1e-4 * np.abs(xt.grad.numpy()).max()


@pytest.mark.parametrize("model_type", ARCHS)
def test_trained_embeddings_match_autograd(models, model_type):
    """train_embeddings: every layer and the embeddings from token ids, against transformers' own
    model in float64 autograd -- RoBERTa's positions after the padding id, DistilBERT's missing token
    types, the tables' dense gradients; ELECTRA-small's projection is refused, saying so."""
    from fasttran import _C
    path = models[model_type]
    enc = fasttran.Encoder.from_pretrained(path)
    L = enc.num_layers
    if model_type == "electra-small":
        with pytest.raises(fasttran.UnsupportedError, match="projection"):
            _C.LayerStack(enc._core, 0, L, -1, train_embeddings=True)
        return
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").double()
    lengths = [5, 1, 9]
    rng = np.random.default_rng(12)
    ids, mask = ragged(rng, enc.config["pad_token_id"], lengths, 9)
    ids[0, 2] = ids[2, 4] = ids[2, 6]   # a token twice: its table row sums both
    real = mask.astype(bool)
    st = _C.LayerStack(enc._core, 0, L, -1, train_embeddings=True)
    out = np.zeros((int(real.sum()), enc.hidden_size), np.float32)
    st.forward(None, np.asarray(lengths, np.int32), out, training=True, seed=1, step=0,
               ids=ids[real].astype(np.int32))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    st.backward(dout)
    ref = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).last_hidden_state
    (ref[torch.as_tensor(real)] * torch.from_numpy(dout).double()).sum().backward()
    assert np.abs(out - ref.detach().numpy()[real]).max() <= 1e-4
    names, _ = st.tensors()
    grads = np.asarray(st.grads)
    params = dict(model.named_parameters())
    arch = enc.architecture
    prefix = next(p for p in ("",) + arch.prefixes if p + arch.checkpoint_name(names[0][0]) in params)
    emb = [n for n, _, _ in names if n.startswith("embeddings.")]
    assert emb[0] == "embeddings.word_embeddings.weight" and len(emb) == (4 if model_type == "distilbert" else 5)
    for name, shape, off in names:
        g = grads[off:off + int(np.prod(shape))].reshape(shape)
        want = params[prefix + arch.checkpoint_name(name)].grad.numpy()
        scale = np.abs(params[prefix + arch.checkpoint_name(name.replace(".bias", ".weight"))].grad.numpy()).max() \
            if "key.bias" in name else np.abs(want).max()
        assert np.abs(g - want).max() <= 1e-4 * scale, name


def _fit(enc, task, k, ids, mask, targets, pooling="cls", **kw):
    tr = fasttran.Trainer(task, epochs=1, batch_size=8, show_progress=False, seed=1, train_layers=k, pooling=pooling,
                          **kw)
    if k:
        cache = tr.cache_for(enc, ids, mask, show_progress=False)
    else:
        positions = "all" if task in ("token-classification", "qa") else pooling
        cache = fasttran.ActivationCache.build(enc, ids, mask, positions=positions, show_progress=False)
    tr.fit(cache, targets)
    return tr, cache


def _batch(enc, n=24, T=12, seed=12):
    rng = np.random.default_rng(seed)
    return ragged(rng, enc.config["pad_token_id"], list(rng.integers(3, T + 1, n)), T)


@pytest.mark.parametrize("model_type,k", [("roberta", 0), ("roberta", 2), ("xlm-roberta", 1), ("camembert", 1)])
def test_pooler_head_exports_as_roberta_for_sequence_classification(models, tmp_path, model_type, k):
    """RobertaForSequenceClassification's head (dense, tanh, out_proj on the first token) is fasttran's
    pooler head"""
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc)
    y = np.arange(len(ids)) % 2
    tr, cache = _fit(enc, "classification", k, ids, mask, y, pooler=True, label_names=["neg", "pos"])
    tr.export(tmp_path / "m")
    m = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    assert type(m).__name__ == SHAPES[model_type][1].replace("Model", "ForSequenceClassification")
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    assert np.abs(tr._outputs(cache) - theirs).max() <= 1e-4
    assert m.config.id2label == {0: "neg", 1: "pos"}
    from fasttran.export import how_to_load
    assert f"({type(m).__name__}, the head in place)" in how_to_load(tr.head, "m", enc)
    back = fasttran.Encoder.from_pretrained(str(tmp_path / "m"))   # fasttran reads its encoder back
    from fasttran.export import fine_tuned_encoder
    assert np.abs(back.forward(ids, mask) - fine_tuned_encoder(enc, tr.top).forward(ids, mask)).max() <= 1e-6


@pytest.mark.parametrize("model_type", ["distilbert", "electra"])
def test_pooler_head_without_a_counterpart_goes_out_as_sentence_transformers(models, tmp_path, model_type):
    """BERT's pooler (dense + tanh) over DistilBERT / ELECTRA: no class of theirs holds it (a head made
    for the encoder has its classes' shape and exports to them: tests/test_export_heads.py)"""
    from fasttran.export import how_to_load, layout_of
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc)
    tanh = fasttran.heads.make_head("classification", enc.hidden_size, num_labels=2, pooler=True, pooling="cls",
                                    shape=fasttran.heads.DenseShape())
    tr, _ = _fit(enc, tanh, 1, ids, mask, np.arange(len(ids)) % 2)
    assert layout_of(tr.head) == "sequence-classification"   # as BERT
    assert layout_of(tr.head, enc) == "sentence-transformers"   # no class of this architecture holds it
    assert "sentence-transformers layout" in how_to_load(tr.head, "m", enc)
    tr.export(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "modules.json").read_text())[0]["path"] == ""
    inner = transformers.AutoModel.from_pretrained(tmp_path / "m").eval()   # the Transformer module: its own class
    assert type(inner).__name__ == SHAPES[model_type][1]
    choice = fasttran.heads.make_head("multiple-choice", enc.hidden_size, num_labels=2)
    with pytest.raises(fasttran.UnsupportedModelError, match="multiple-choice head is not supported for "
                       + SHAPES[model_type][1] + ".*tanh"):
        fasttran.export.export(tmp_path / "c", enc, choice)


@pytest.mark.parametrize("model_type,k", [("distilbert", 0), ("electra", 1), ("xlm-roberta", 1)])
def test_token_head_exports_in_the_architectures_class(models, tmp_path, model_type, k):
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc, seed=13)
    labels = np.where(mask == 1, np.arange(ids.size).reshape(ids.shape) % 3, -100)
    tr, cache = _fit(enc, "token-classification", k, ids, mask, labels, label_names=["O", "B", "I"])
    tr.export(tmp_path / "m")
    m = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "m").eval()
    assert type(m).__name__.endswith("ForTokenClassification") and not type(m).__name__.startswith("Bert")
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    ours = tr._outputs(cache)
    assert max(np.abs(o - theirs[b, :int(mask[b].sum())]).max() for b, o in enumerate(ours)) <= 1e-4


@pytest.mark.parametrize("model_type", ["electra-small", "roberta", "distilbert"])
def test_qa_head_exports_in_the_architectures_class(tmp_path, model_type):
    path = make_model(tmp_path / "src", model_type, seed=14)
    enc = fasttran.Encoder.from_pretrained(path)
    rng = np.random.default_rng(14)
    ids, mask = ragged(rng, enc.config["pad_token_id"], list(rng.integers(6, 15, 16)), 14)
    spans = (np.full(16, 2), 2 + np.arange(16) % 3)
    if enc.architecture.token_types != "segments":   # no token types: the context comes with the SquadFeatures
        with pytest.raises(fasttran.InputError, match="question answering over " + SHAPES[model_type][1]
                           + " needs the SquadFeatures"):   # (tests/test_architecture_qa.py: trained and exported)
            _fit(enc, "qa", 1, ids, mask, spans, lr=1e-3)
        return
    types = (np.arange(ids.shape[1])[None] >= 2).astype(np.int64) * mask   # the context from the third token
    tr = fasttran.Trainer("qa", epochs=1, batch_size=8, show_progress=False, seed=1, train_layers=1, lr=1e-3)
    cache = tr.cache_for(enc, ids, mask, types, show_progress=False)
    tr.fit(cache, spans)
    tr.export(tmp_path / "m")
    m = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "m").eval()
    assert not type(m).__name__.startswith("Bert")
    with torch.no_grad():
        out = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), token_type_ids=torch.as_tensor(types))
    for b, o in enumerate(tr._outputs(cache)):
        ctx = np.isfinite(o[0])
        w = o.shape[1]
        assert np.abs(o[0][ctx] - out.start_logits.numpy()[b, :w][ctx]).max() <= 1e-4
        assert np.abs(o[1][ctx] - out.end_logits.numpy()[b, :w][ctx]).max() <= 1e-4


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_cache_gives_the_encoders_rows(models, tmp_path, model_type):
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc, n=6, seed=15)
    cache = fasttran.ActivationCache.build(enc, ids, mask, positions="all", show_progress=False,
                                           disk_dir=tmp_path / "c")
    again = fasttran.ActivationCache.open(tmp_path / "c", encoder=enc)
    full = enc.forward(ids, mask)
    assert len(again) == 6 and cache.model_fingerprint == again.model_fingerprint
    values, got_mask = again.get(np.arange(6))
    for b in range(6):
        n = int(mask[b].sum())
        assert got_mask[b].sum() == n and np.array_equal(values[b, :n], full[b, :n])


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_int8_within_berts_error(models, model_type):
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc, n=8, seed=16)
    ref = enc.forward(ids, mask, pooling="mean")
    q = enc.quantize().forward(ids, mask, pooling="mean")
    cos = (q * ref).sum(1) / np.linalg.norm(q, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99 and cos.mean() >= 0.997   # BERT's bound (tests/test_lowp.py, MiniLM)


def test_compression_takes_other_architectures(models):
    """(pruning, files, export and int8 per architecture: tests/test_compress_architectures.py)"""
    from fasttran.compress import TaskModel
    enc = fasttran.Encoder.from_pretrained(models["roberta"])
    head = fasttran.heads.make_head("classification", enc.hidden_size, num_labels=2)
    assert TaskModel(enc, head).encoder.architecture.name == "roberta"


@pytest.mark.skipif(not fasttran._C.cpu_features()[1].get("avx512_bf16"), reason="bf16 on the CPU needs AVX512_BF16")
@pytest.mark.parametrize("model_type", ["electra-small", "distilbert", "roberta"])
def test_bfloat16_on_the_cpu(models, tmp_path, model_type):
    path = models.get(model_type) or make_model(tmp_path / "m", model_type)
    f32 = fasttran.Encoder.from_pretrained(path)
    bf16 = fasttran.Encoder.from_pretrained(path, dtype="bfloat16")
    ids, mask = _batch(f32, n=8, seed=17)
    a, b = f32.forward(ids, mask, pooling="mean"), bf16.forward(ids, mask, pooling="mean")
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() >= 0.9999   # BERT's bound for bf16 (tests/test_lowp.py, MiniLM)
    assert bf16.memory_report()["weights"] != f32.memory_report()["weights"]   # bf16 kernels ran


def test_bad_descriptions_refused_at_the_boundary(models):
    from fasttran import _C
    base = dict(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8,
                max_position_embeddings=8, type_vocab_size=1, layer_norm_eps=1e-5, activation=0, pad_token_id=1)
    with pytest.raises(fasttran.InputError, match="unknown position_ids 7"):
        _C.EncoderCore(**base, position_ids=7)
    with pytest.raises(fasttran.InputError, match="embedding_size must be in"):
        _C.EncoderCore(**base, embedding_size=-1)
    with pytest.raises(fasttran.InputError, match="pad_token_id < max_position_embeddings - 1"):
        _C.EncoderCore(**dict(base, pad_token_id=7), position_ids=_C.POSITION_IDS["after_padding"])
    core = _C.EncoderCore(**base, position_ids=_C.POSITION_IDS["after_padding"])
    n = len(core.tensors())
    with pytest.raises(fasttran.InputError, match=f"names must be a list of {n} tensor names"):
        core.load(os.path.join(models["roberta"], "model.safetensors"), names=["x"])
    with pytest.raises(fasttran.InputError, match="names\\[0\\] must be a str"):
        core.save("/nonexistent/x.safetensors", names=[0] * n)
    with pytest.raises(fasttran.CheckpointError, match="no tensor named '\\[prefix\\]nope'"):
        core.load(os.path.join(models["roberta"], "model.safetensors"), names=["nope"] * n)
    # a config whose fields contradict themselves
    with pytest.raises(fasttran.CheckpointError, match="leaves no position after pad_token_id"):
        fasttran.Encoder({"model_type": "roberta", "max_position_embeddings": 2, "pad_token_id": 1, "vocab_size": 5})
    with pytest.raises(fasttran.CheckpointError, match="embedding_size must be a positive integer"):
        fasttran.Encoder({"model_type": "electra", "embedding_size": 0})


def test_a_parsed_config_is_not_read_as_berts(tmp_path):
    """Encoder.config of a non-BERT encoder (fasttran's parsed fields, no model_type) handed back to
    Encoder() is refused, pointing at raw_config, instead of running BERT's positions silently"""
    src = make_model(tmp_path / "r", "roberta", seed=3)
    enc = fasttran.Encoder.from_pretrained(str(src))
    with pytest.raises(fasttran.CheckpointError, match="raw_config"):
        fasttran.Encoder(enc.config)
    again = fasttran.Encoder(enc.raw_config)
    assert again.architecture is enc.architecture
