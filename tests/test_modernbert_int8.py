"""ModernBERT in int8 (Encoder.quantize, dtype="int8"): each pre-LN layer's four projections (Wqkv,
Wo, Wi of 2I rows, the MLP's Wo; no biases) and the word embeddings int8 with a float32 scale per row,
BERT's scheme; RoPE, GeGLU, the norms and the window attention as in float32. Against float32
transformers' ModernBertModel at ModernBERT-base's shape (22 layers, random weights: test_modernbert.py's
checkpoint) on sequences longer than the 128-token window, within BERT's int8 bound (tests/test_lowp.py,
MiniLM: cosine >= 0.99 for every pooled vector, >= 0.997 on average)."""
import numpy as np
import pytest

import fasttran

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# the base checkpoint and the ragged batch longer than the window: test_modernbert.py's fixtures
from test_modernbert import _invariance, base, batch, hf_layers, make_model, ragged   # noqa: E402, F401


@pytest.fixture(scope="module")
def reference(base, batch):
    ids, mask = batch
    return hf_layers(base, ids, mask)[-1]   # transformers' final_norm'ed last layer, float32


@pytest.fixture(scope="module")
def int8(base):
    return fasttran.Encoder.from_pretrained(base).quantize()


def _cos(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _within_berts_bound(ours, ref):
    c = _cos(ours, ref)
    assert c.min() >= 0.99 and c.mean() >= 0.997, (c.min(), c.mean())   # BERT's bound (tests/test_lowp.py)


def test_pooled_and_hidden_states_within_berts_int8_error(int8, batch, reference):
    ids, mask = batch
    m = mask[..., None].astype(np.float64)
    ref_mean = (reference * m).sum(1) / m.sum(1)
    mean = int8.forward(ids, mask, pooling="mean")
    cls = int8.forward(ids, mask, pooling="cls")
    _within_berts_bound(mean, ref_mean)
    _within_berts_bound(cls, reference[:, 0])
    hidden = int8.forward(ids, mask)
    real = mask.astype(bool)
    _within_berts_bound(hidden[real], reference[real])   # every real token's final hidden state
    # the error is int8's: not float32's bits, and past the window too (the first sequence's last tokens)
    assert not np.array_equal(hidden[real], reference[real])
    _within_berts_bound(hidden[0, 200:300], reference[0, 200:300])
    assert int8.dtype == "int8" and int8.int8_embeddings


def test_what_is_int8(base, int8):
    """the four projections and the word embeddings are int8 with a scale per row; norms stay float32,
    and there are no biases to keep"""
    sd = int8.state_dict()
    f32 = fasttran.Encoder.from_pretrained(base).state_dict()
    C, I = 768, 1152
    layer = "encoder.layer.3."
    shapes = {"attention.self.qkv.weight": (3 * C, C), "attention.output.dense.weight": (C, C),
              "intermediate.dense.weight": (2 * I, C), "output.dense.weight": (C, I)}
    for name, shape in shapes.items():
        q, s = sd[layer + name], sd[layer + name + "_scale"]
        assert q.dtype == np.int8 and q.shape == shape and s.shape == (shape[0],), name
        w = f32[layer + name].astype(np.float64)
        assert np.array_equal(s, (np.abs(w).max(1) / 127).astype(np.float32)), name
        assert (np.abs(q * s[:, None].astype(np.float64) - w) <= s[:, None] * (0.5 + 1e-4)).all(), name
    assert sd["embeddings.word_embeddings.weight"].dtype == np.int8
    floats = [k for k, v in sd.items() if v.dtype == np.float32 and not k.endswith("_scale")]
    assert floats and all("norm" in k.lower() for k in floats), floats
    assert not any(k.endswith(".bias") for k in sd)
    assert int8.memory_report()["parameters"] < 0.3 * fasttran.Encoder.from_pretrained(base).memory_report()["parameters"]


def test_from_pretrained_int8_state_dict_and_float_embeddings(base, batch, reference, int8):
    """dtype="int8" at load is quantize(); the int8 state_dict loads into a blank int8 encoder bit for bit;
    with float32 word embeddings (embeddings=False) the layers alone stay within the bound"""
    ids, mask = batch
    got = int8.forward(ids, mask)
    assert np.array_equal(fasttran.Encoder.from_pretrained(base, dtype="int8").forward(ids, mask), got)
    blank = fasttran.Encoder(int8.raw_config, dtype="int8")
    blank.load_state_dict(int8.state_dict())
    assert np.array_equal(blank.forward(ids, mask), got)
    layers_only = fasttran.Encoder.from_pretrained(base).quantize(embeddings=False)
    assert not layers_only.int8_embeddings
    real = mask.astype(bool)
    hidden = layers_only.forward(ids, mask)
    _within_berts_bound(hidden[real], reference[real])
    assert not np.array_equal(hidden, got)


def test_a_token_does_not_depend_on_its_batch(int8, batch):
    """the int8 activations are quantized per token: alone, padded, left padded, at any thread count,
    a sequence's results are the same bits"""
    ids, mask = batch
    _invariance(int8, ids, mask, [5, 22])


def test_the_cache_and_a_head_on_int8_features_and_what_stays_refused(int8, batch, tmp_path):
    ids, mask = batch
    cache = fasttran.ActivationCache.build(int8, ids, mask, positions="mean", show_progress=False)
    values = cache.get(np.arange(3))
    assert np.array_equal(values, int8.forward(ids, mask, pooling="mean"))
    fasttran.Trainer("classification", epochs=1, batch_size=2, show_progress=False).fit(cache, np.array([1, 0, 1]))
    with pytest.raises(fasttran.UnsupportedError, match="an int8 model asked to train"):
        fasttran.finetune.TopLayers(int8, 1)
    with pytest.raises(fasttran.UnsupportedError, match="int8 encoder has none"):
        int8.save_pretrained(tmp_path / "x")
    with pytest.raises(fasttran.UnsupportedError, match="float32 encoder"):
        int8.quantize()


def test_a_non_finite_weight_is_refused_by_name(tmp_path):
    path = make_model(tmp_path / "m", num_hidden_layers=2, seed=3)
    enc = fasttran.Encoder.from_pretrained(path)
    sd = enc.state_dict()
    name = "encoder.layer.1.intermediate.dense.weight"
    sd[name][5, 7] = np.nan
    enc.load_state_dict(sd)
    ids, mask = ragged(np.random.default_rng(2), [9, 4], 9)
    with pytest.raises(fasttran.FastTranError, match=rf"{name}\[5, 7\] = nan"):
        enc.quantize(inplace=True)
    assert enc.dtype == "float32" and np.isnan(enc.forward(ids, mask)).any()
