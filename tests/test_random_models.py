"""Random-weight checkpoints with awkward shapes written by transformers, against
transformers (fp32 on real tokens, float64 everywhere)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fasttran
from conftest import assert_matches_hf, hf_hidden_states, make_checkpoint

AWKWARD = dict(vocab_size=99, hidden_size=72, num_attention_heads=3, intermediate_size=150,
               num_hidden_layers=5, type_vocab_size=2, max_position_embeddings=512)


def batch(rng, B, T, vocab=99, pad_frac=0.0, types=2):
    ids = rng.integers(1, vocab, (B, T))
    mask = np.ones((B, T), np.int64)
    if pad_frac:
        for b in range(B):
            n = max(1, int(T * (1 - rng.uniform(0, pad_frac))))   # at least one real token
            mask[b, n:] = 0
            ids[b, n:] = 0
    tt = rng.integers(0, types, (B, T))
    return ids, mask, tt


@pytest.mark.parametrize("B,T,pad", [(1, 1, 0.0), (1, 7, 0.0), (33, 7, 0.9), (2, 509, 0.0), (3, 509, 0.95)])
def test_awkward_shapes(checkpoint, B, T, pad):
    path = checkpoint(**AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask, types = batch(np.random.default_rng(T + B), B, T, pad_frac=pad)
    assert_matches_hf(enc, path, ids, mask, types)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints(checkpoint, dtype):
    path = checkpoint(dtype=dtype, **AWKWARD)
    from safetensors import safe_open
    with safe_open(path + "/model.safetensors", "np") as f:
        assert f.get_slice("embeddings.word_embeddings.weight").get_dtype() == {"float16": "F16", "bfloat16": "BF16"}[dtype]
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask, types = batch(np.random.default_rng(1), 4, 33, pad_frac=0.5)
    # the reference loads the same half-precision weights upcast to float32/float64
    assert_matches_hf(enc, path, ids, mask, types)


def test_prefixed_checkpoint_without_pooler_and_gelu_new(checkpoint):
    path = checkpoint(wrapper="classifier", hidden_act="gelu_new", **AWKWARD)   # "bert." prefix + classifier head
    enc = fasttran.Encoder.from_pretrained(path)
    assert enc.has_pooler
    ids, mask, types = batch(np.random.default_rng(2), 5, 20, pad_frac=0.5)
    assert_matches_hf(enc, path, ids, mask, types)
    nopool = checkpoint(pooler=False, hidden_act="relu", **AWKWARD)
    enc2 = fasttran.Encoder.from_pretrained(nopool)
    assert not enc2.has_pooler
    assert_matches_hf(enc2, nopool, ids, mask, types)


def test_save_pretrained_round_trip(checkpoint, tmp_path):
    import torch
    from transformers import BertModel
    path = checkpoint(**AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path)
    out = enc.save_pretrained(tmp_path / "saved")
    model = BertModel.from_pretrained(out).eval()
    ids, mask, types = batch(np.random.default_rng(3), 4, 16, pad_frac=0.5)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    token_type_ids=torch.tensor(types)).last_hidden_state.numpy()
    ours = fasttran.Encoder.from_pretrained(out).forward(ids, mask, types)
    np.testing.assert_array_equal(ours, enc.forward(ids, mask, types))   # bit-identical weights
    valid = mask.astype(bool)
    assert np.abs(ours - ref)[valid].max() <= 1e-4
    sd = enc.state_dict()
    for name, p in model.state_dict().items():
        np.testing.assert_array_equal(sd[name], p.numpy(), err_msg=name)
    # half-precision save loads back through transformers too
    half = enc.save_pretrained(tmp_path / "bf16", dtype="bfloat16")
    assert BertModel.from_pretrained(half) is not None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(heads=st.integers(1, 4), head_size=st.integers(1, 17), inter=st.integers(1, 70), layers=st.integers(0, 3),
       types=st.integers(1, 3), B=st.integers(1, 5), T=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       act=st.sampled_from(["gelu", "gelu_new", "relu"]))
def test_property_random_configs(tmp_path_factory, heads, head_size, inter, layers, types, B, T, seed, act):
    cfg = dict(vocab_size=50, hidden_size=heads * head_size, num_attention_heads=heads, intermediate_size=inter,
               num_hidden_layers=layers, type_vocab_size=types, max_position_embeddings=64, hidden_act=act)
    path = make_checkpoint(str(tmp_path_factory.mktemp("h")), seed=seed % 1000, **cfg)
    enc = fasttran.Encoder.from_pretrained(path)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, (B, T))
    mask = (rng.random((B, T)) < 0.7).astype(np.int64)   # holes anywhere, not only right padding
    mask[:, rng.integers(0, T)] = 1                        # every row attends to something
    tt = rng.integers(0, types, (B, T))
    assert_matches_hf(enc, path, ids, mask, tt)


def test_mask_none_equals_all_ones(checkpoint):
    path = checkpoint(**AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path)
    ids, _, types = batch(np.random.default_rng(4), 3, 9)
    np.testing.assert_array_equal(enc.forward(ids), enc.forward(ids, np.ones_like(ids), np.zeros_like(ids)))
    ref = hf_hidden_states(path, ids)[-1]
    assert np.abs(enc.forward(ids) - ref).max() <= 1e-4


def test_sequence_with_no_real_token(checkpoint):
    """A row whose mask is all zeros: zero attention output, as transformers' default (SDPA)
    BertModel gives; the other rows are unaffected."""
    path = checkpoint(**AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path)
    ids, mask, types = batch(np.random.default_rng(5), 3, 11, pad_frac=0.5)
    mask[1] = 0
    ours = enc.forward(ids, mask, types, output_layers=list(range(AWKWARD["num_hidden_layers"] + 1)))
    ref = hf_hidden_states(path, ids, mask, types)
    for a, b in zip(ours, ref):
        assert np.abs(a[1] - b[1]).max() <= 1e-4
        assert np.abs(a[0] - b[0])[mask[0].astype(bool)].max() <= 1e-4
    np.testing.assert_allclose(enc.forward(ids[[0]], mask[[0]], types[[0]])[0], ours[-1][0], atol=1e-5)


def test_memory_report_on_the_cpu(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), **AWKWARD)
    enc = fasttran.Encoder.from_pretrained(path)
    before = enc.memory_report()
    assert before["workspace"] == 0 and before["packed_weights"] == 0
    enc.forward(*batch(np.random.default_rng(0), 4, 33, pad_frac=0.3))
    r = enc.memory_report()
    assert r["parameters"] == 4 * enc.num_parameters and r["device"] == "cpu" and r["dtype"] == "float32"
    assert r["workspace"] > 0 and r["packed_weights"] > 0 and r["total_device"] == 0
    assert 0 < r["device_free"] <= r["device_total"]
