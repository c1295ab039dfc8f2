"""The real all-MiniLM-L6-v2 on real SST-2 sentences, against transformers and
sentence-transformers."""
import numpy as np
import pytest

import fasttran
from conftest import assert_matches_hf


@pytest.fixture(scope="module")
def enc(minilm_dir):
    return fasttran.Encoder.from_pretrained(minilm_dir)


def test_every_layer_matches_transformers(enc, minilm_dir, sst2_sentences):
    for start in (0, 100):   # two batches of 48 real sentences, padded to their longest
        ids, mask, types = enc.tokenize(sst2_sentences[start:start + 48])
        assert mask.min() == 0, "the batch should contain padding"
        assert_matches_hf(enc, minilm_dir, ids, mask, types)


def test_mean_pooling_matches_sentence_transformers(enc, minilm_dir, sst2_sentences):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(minilm_dir, device="cpu")
    sents = sst2_sentences[:300]
    ref = model.encode(sents, batch_size=32, convert_to_numpy=True)
    ours = enc.encode(sents, batch_size=17, normalize=True)   # the ST pipeline ends in Normalize
    cos = np.sum(ours * ref, 1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99999, cos.min()
    assert np.abs(ours - ref).max() < 1e-4


def test_pooling_modes_and_layers(enc, sst2_sentences):
    ids, mask, types = enc.tokenize(sst2_sentences[:5])
    hidden = enc.forward(ids, mask, types)
    assert hidden.shape == (5, ids.shape[1], 384)
    cls = enc.forward(ids, mask, types, pooling="cls")
    np.testing.assert_array_equal(cls, hidden[:, 0])
    mean = enc.forward(ids, mask, types, pooling="mean")
    m = mask[..., None].astype(np.float64)
    np.testing.assert_allclose(mean, (hidden * m).sum(1) / m.sum(1), atol=1e-5)
    first, last, again = enc.forward(ids, mask, types, output_layers=[0, -1, 6])
    np.testing.assert_array_equal(last, hidden)
    np.testing.assert_array_equal(again, hidden)
    assert last is not again   # duplicates are separate arrays
    assert not np.allclose(first, last)


def test_torch_tensors_read_in_place(enc, sst2_sentences):
    torch = pytest.importorskip("torch")
    ids, mask, types = enc.tokenize(sst2_sentences[:4])
    ref = enc.forward(ids, mask, types)
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask).bool()
    out = enc.forward(t_ids, t_mask, torch.from_numpy(types))
    np.testing.assert_array_equal(out, ref)
    # np.from_dlpack (what the encoder uses) shares memory with the tensor: no copy
    assert np.from_dlpack(t_ids).ctypes.data == t_ids.data_ptr()
    # a non-contiguous (transposed) int32 tensor is read through its strides
    tt = torch.from_numpy(np.ascontiguousarray(ids.T.astype(np.int32))).t()
    assert not tt.is_contiguous()
    np.testing.assert_array_equal(enc.forward(tt, mask, types), ref)


def test_encode_order_and_repr(enc, sst2_sentences):
    sents = sst2_sentences[:40]
    a = enc.encode(sents, batch_size=8)
    b = np.stack([enc.encode([s])[0] for s in sents[:5]])
    np.testing.assert_allclose(a[:5], b, atol=2e-5)
    assert "Encoder(bert, layers=6, hidden=384" in repr(enc)
    assert "<table>" in enc._repr_html_()
