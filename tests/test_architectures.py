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
}
ARCHS = sorted(SHAPES)


def make_model(path, model_type, wrapper=False, seed=0, **over):
    """A random-weight checkpoint of `model_type` (its base model, or the wrapper class with its
    prefix) saved by transformers (safetensors) into `path`."""
    cfg_cls, base_cls, wrap_cls, kw = SHAPES[model_type]
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
    assert enc.architecture.name == model_type and model_type in architectures.supported()
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
    names = json.loads(open(os.path.join(path, "config.json")).read())
    assert names["model_type"] == model_type
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
    supported = "bert, camembert, distilbert, electra, roberta, xlm-roberta"
    assert ", ".join(architectures.supported()) == supported
    for cfg, why in [({"model_type": "deberta-v2"}, "model_type 'deberta-v2' is not supported; supported model "
                      "types: " + supported),
                     ({"model_type": "modernbert"}, "model_type 'modernbert' is not supported yet: its pre-LN layers"),
                     ({"model_type": 7}, "model_type 7 is not supported")]:
        with pytest.raises(fasttran.UnsupportedModelError) as e:
            fasttran.Encoder(cfg)
        assert why in str(e.value)
        assert supported in str(e.value)
    modern = architectures.BY_MODEL_TYPE["modernbert"].unsupported()   # each field that is not implemented, named
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
