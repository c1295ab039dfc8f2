"""fasttran.compress stands on the public API (no _C, no core, no private Encoder / head names);
the Encoder's public methods it uses (structure, masked forwards, compressed copies, weight files,
tokenizer sharing); the layer stack's significance recorder switched on, off and on again."""
import ast
import os

import numpy as np
import pytest

import fasttran
from conftest import make_checkpoint
from fasttran import compress
from fasttran.errors import CheckpointError, InputError, InputTypeError
from fasttran.finetune import TopLayers

SMALL = dict(vocab_size=99, hidden_size=48, num_attention_heads=4, intermediate_size=64, num_hidden_layers=3,
             type_vocab_size=2, max_position_embeddings=64)
PRIVATE = {"_C", "_core", "_wrap", "_Head", "_raw_config", "_tokenizer_dir", "_load_tokenizer", "_stack", "_info"}


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("small")), seed=5, **SMALL)


def batch(seed, n=5, T=11):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, T + 1, n)
    lens[0] = T
    ids = rng.integers(1, SMALL["vocab_size"], (n, T))
    mask = (np.arange(T)[None, :] < lens[:, None]).astype(np.int64)
    return ids * mask, mask, rng.integers(0, 2, (n, T)) * mask


def test_compress_uses_the_public_api_only():
    root = os.path.dirname(compress.__file__)
    checked = 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name)) as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                bad = ({a.name for a in node.names} | {(node.module or "").split(".")[0]}) & PRIVATE
                assert not bad, f"compress/{name}:{node.lineno} imports {sorted(bad)}"
            elif isinstance(node, ast.Import):
                bad = {a.name.split(".")[-1] for a in node.names} & PRIVATE
                assert not bad, f"compress/{name}:{node.lineno} imports {sorted(bad)}"
            elif isinstance(node, ast.Attribute):
                assert node.attr not in PRIVATE, f"compress/{name}:{node.lineno} reaches into .{node.attr}"
        checked += 1
    assert checked >= 6   # __init__, measure, model, plan, search, significance, tasks


def test_forward_masked_without_masks_is_forward(small_path):
    enc = fasttran.Encoder.from_pretrained(small_path)
    ids, mask, types = batch(1)
    for layer in (0, 2, -1):
        assert np.array_equal(enc.forward_masked(ids, mask, types, layer=layer), enc.forward(ids, mask, types, layer))
    for pooling in ("mean", "cls"):
        assert np.array_equal(enc.forward_masked(ids, mask, types, pooling=pooling),
                              enc.forward(ids, mask, types, pooling=pooling))
    with pytest.raises(InputTypeError, match="one int"):
        enc.forward_masked(ids, mask, types, layer=[1])
    with pytest.raises(InputError, match="out of range"):
        enc.forward_masked(ids, mask, types, layer=4)
    with pytest.raises(InputError, match="pooling"):
        enc.forward_masked(ids, mask, types, pooling="max")
    # a head switched off: the layers below unchanged, the layer above changed
    keep = np.ones(sum(enc.structure["layer_heads"]), np.uint8)
    keep[5] = 0   # layer 1, head 1
    off = [enc.forward_masked(ids, mask, types, layer=l, head_keep=keep) for l in range(4)]
    ref = enc.forward(ids, mask, types, [0, 1, 2, 3])
    assert np.array_equal(off[1], ref[1]) and not np.allclose(off[2], ref[2])


def test_compressed_copy_keeps_its_structure_through_files(small_path, tmp_path):
    enc = fasttran.Encoder.from_pretrained(small_path)
    heads = sum(enc.structure["layer_heads"])
    keep = np.ones(heads, np.uint8)
    keep[6] = 0                       # layer 1 loses a head
    modes = np.zeros(heads, np.uint8)
    modes[0] = 1                      # layer 0, head 0: sign matching (its layer's attention: the heads op)
    small = enc.compressed_copy(keep_heads=keep, head_attention=modes, sign_match_keys=3)
    assert enc.structure["layer_heads"] == [4, 4, 4] and small.structure["layer_heads"] == [4, 3, 4]
    assert small.structure["head_attention"][:5] == [1, 0, 0, 0, 0] and small.structure["sign_match_keys"] == 3
    assert small.raw_config["fasttran_layer_heads"] == [4, 3, 4] and "fasttran_layer_heads" not in enc.raw_config
    assert small.weight_bytes == 4 * small.num_parameters < enc.weight_bytes == 4 * enc.num_parameters
    ids, mask, types = batch(2)
    out = small.forward(ids, mask, types)
    assert not np.allclose(out, enc.forward(ids, mask, types))
    path = small.save_pretrained(str(tmp_path / "small"))
    back = fasttran.Encoder.from_pretrained(path)
    assert back.structure == small.structure
    assert np.array_equal(back.forward(ids, mask, types), out)
    # the weights alone, with their record; a damaged file is refused before it is read
    rec = small.save_weights(str(tmp_path / "w.safetensors"))
    assert rec["bytes"] == os.path.getsize(tmp_path / "w.safetensors")
    other = fasttran.Encoder(small.raw_config).load_weights(str(tmp_path / "w.safetensors"), expect=rec)
    assert np.array_equal(other.forward(ids, mask, types), out)
    with pytest.raises(CheckpointError):
        other.load_weights(str(tmp_path / "w.safetensors"), expect={"bytes": rec["bytes"], "crc32c": rec["crc32c"] ^ 1})
    assert other.tokenizer_dir is None and other.use_tokenizer_of(enc).tokenizer is enc.tokenizer
    q = enc.quantize()
    assert q.weight_bytes < enc.weight_bytes and q.int8_embeddings and not enc.int8_embeddings
    assert [n for n, _ in q.parameter_shapes()] == [n for n, _ in enc.parameter_shapes()]


def test_significance_recorder_switches_on_off_and_on(small_path):
    enc = fasttran.Encoder.from_pretrained(small_path)
    L, C = enc.num_layers, enc.hidden_size
    top = TopLayers(enc, L, hidden_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0, inplace_gelu=False,
                    inplace_layernorm=False)
    rng = np.random.default_rng(0)
    lengths = np.array([5, 3, 7], np.int32)
    x = rng.standard_normal((lengths.sum(), C)).astype(np.float32)
    dout = rng.standard_normal((lengths.sum(), C)).astype(np.float32)

    def step():
        top.forward(x, lengths, training=True)
        top.backward(dout)
        return [g.copy() for _, g in top.named_gradients()]

    plain = step()
    with pytest.raises(InputError, match="not recorded"):
        top.significance()
    top.record_significance(16)
    on = step()
    first = top.significance()
    assert [a.shape for a in first] == [(3, 12), (3, 12), (3, L)]
    assert all(np.isfinite(a).all() and np.abs(a).max() > 0 for a in first)
    with pytest.raises(InputError, match="does not divide"):
        top.record_significance(7)   # refused: the recorder in force stays
    again = step()
    assert all(np.array_equal(a, b) for a, b in zip(top.significance(), first))
    top.record_significance(0)
    off = step()
    with pytest.raises(InputError, match="not recorded"):
        top.significance()
    top.record_significance(16)
    step()
    assert all(np.array_equal(a, b) for a, b in zip(top.significance(), first))
    for grads in (on, again, off):   # recording never changes the gradients
        assert all(np.array_equal(a, b) for a, b in zip(grads, plain))
