"""Bad input: each case asserts the exception type and message. The whole battery also runs
in a subprocess that must exit normally (no crash of the interpreter)."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import fasttran
from fasttran import errors

SMALL = dict(vocab_size=40, hidden_size=8, num_attention_heads=2, intermediate_size=12,
             num_hidden_layers=2, type_vocab_size=2, max_position_embeddings=16)


def write_st(path, tensors, header_override=None, data_override=None):
    """A safetensors file built by hand, so tests can make it lie."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dt = {np.float32: "F32", np.float16: "F16", np.int64: "I64"}[arr.dtype.type]
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        blobs.append(arr.tobytes())
        off += arr.nbytes
    if header_override:
        header_override(header)
    h = json.dumps(header).encode()
    data = b"".join(blobs) if data_override is None else data_override
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def small_tensors(cfg=SMALL, seed=0):
    rng = np.random.default_rng(seed)
    C, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    t = {"embeddings.word_embeddings.weight": (V, C), "embeddings.position_embeddings.weight": (cfg["max_position_embeddings"], C),
         "embeddings.token_type_embeddings.weight": (cfg["type_vocab_size"], C),
         "embeddings.LayerNorm.weight": (C,), "embeddings.LayerNorm.bias": (C,)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{l}."
        for n in ("query", "key", "value"):
            t[p + f"attention.self.{n}.weight"] = (C, C)
            t[p + f"attention.self.{n}.bias"] = (C,)
        t.update({p + "attention.output.dense.weight": (C, C), p + "attention.output.dense.bias": (C,),
                  p + "attention.output.LayerNorm.weight": (C,), p + "attention.output.LayerNorm.bias": (C,),
                  p + "intermediate.dense.weight": (I, C), p + "intermediate.dense.bias": (I,),
                  p + "output.dense.weight": (C, I), p + "output.dense.bias": (C,),
                  p + "output.LayerNorm.weight": (C,), p + "output.LayerNorm.bias": (C,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in t.items()}


def make_dir(tmp_path, tensors=None, cfg=SMALL, **kw):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="bert", hidden_act="gelu")))
    write_st(str(d / "model.safetensors"), small_tensors(cfg) if tensors is None else tensors, **kw)
    return str(d)


@pytest.fixture
def enc(tmp_path):
    return fasttran.Encoder.from_pretrained(make_dir(tmp_path))


IDS = np.array([[1, 2, 3], [4, 5, 6]])


# ---- forward inputs ----------------------------------------------------------------------------
def test_wrong_dtype(enc):
    with pytest.raises(fasttran.InputTypeError, match="input_ids must be int32 or int64, got float32"):
        enc.forward(IDS.astype(np.float32))
    with pytest.raises(TypeError, match="input_ids has dtype .*complex"):
        enc.forward(IDS.astype(np.complex64))
    with pytest.raises(TypeError, match="token_type_ids must be int32 or int64, got float64"):
        enc.forward(IDS, None, IDS.astype(np.float64))


def test_wrong_rank(enc):
    with pytest.raises(fasttran.InputError, match="input_ids must be 2-D .* got a 1-D array"):
        enc.forward(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="attention_mask must be 2-D"):
        enc.forward(IDS, np.ones((2, 3, 1), np.int64))


def test_id_out_of_range(enc):
    with pytest.raises(fasttran.InputRangeError, match=r"input_ids\[1, 2\] = 40 is out of range for vocab_size 40"):
        enc.forward(np.array([[1, 2, 3], [4, 5, 40]]))
    with pytest.raises(IndexError, match=r"input_ids\[0, 0\] = -1"):
        enc.forward(np.array([[-1, 2, 3]], np.int32))


def test_token_type_out_of_range(enc):
    with pytest.raises(fasttran.InputRangeError, match=r"token_type_ids\[0, 1\] = 2 is out of range for type_vocab_size 2"):
        enc.forward(IDS, None, np.array([[0, 2, 0], [0, 0, 0]]))


def test_bad_mask_values(enc):
    with pytest.raises(fasttran.InputRangeError, match=r"attention_mask\[0, 0\] = 2; expected 0 or 1"):
        enc.forward(IDS, np.full((2, 3), 2))


def test_sequence_too_long(enc):
    with pytest.raises(fasttran.InputError, match="sequence length 17 exceeds max_position_embeddings 16"):
        enc.forward(np.ones((1, 17), np.int64))


def test_shape_mismatch(enc):
    with pytest.raises(fasttran.InputError, match=r"attention_mask has shape \(2, 2\) but input_ids has shape \(2, 3\)"):
        enc.forward(IDS, np.ones((2, 2), np.int64))
    with pytest.raises(fasttran.InputError, match=r"token_type_ids has shape \(1, 3\)"):
        enc.forward(IDS, None, np.zeros((1, 3), np.int64))


def test_empty_batch(enc):
    with pytest.raises(fasttran.InputError, match="empty batch"):
        enc.forward(np.zeros((0, 3), np.int64))
    with pytest.raises(fasttran.InputError, match="empty sequences"):
        enc.forward(np.zeros((2, 0), np.int64))


def test_bad_options(enc):
    with pytest.raises(fasttran.InputError, match="pooling must be None, 'cls' or 'mean'"):
        enc.forward(IDS, pooling="max")
    with pytest.raises(fasttran.InputError, match="output layer 3 out of range: this encoder has layers 0..2"):
        enc.forward(IDS, output_layers=3)
    with pytest.raises(fasttran.InputTypeError, match="must be a NumPy array, a DLPack tensor or a list"):
        enc.forward(object())
    with pytest.raises(fasttran.InputTypeError, match=r"got text.*encoder.encode\(texts\)"):
        enc.forward("hello")
    with pytest.raises(fasttran.InputError, match="unknown device"):
        fasttran.Encoder(dict(SMALL), device="tpu")


def test_non_contiguous_and_read_only_accepted(enc):
    ref = enc.forward(IDS)
    ro = IDS.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(enc.forward(ro), ref)
    wide = np.zeros((2, 6), np.int64)
    wide[:, ::2] = IDS                                   # strided view
    np.testing.assert_array_equal(enc.forward(wide[:, ::2]), ref)
    np.testing.assert_array_equal(enc.forward(np.asfortranarray(IDS)), ref)
    np.testing.assert_array_equal(enc.forward(IDS.astype(">i8")), ref)   # byte-swapped: copied, not refused
    np.testing.assert_array_equal(enc.forward(IDS.tolist()), ref)
    m = np.ones((2, 3), bool)
    np.testing.assert_array_equal(enc.forward(IDS, m), enc.forward(IDS, m.astype(np.float32)))


# ---- checkpoints ---------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(fasttran.CheckpointNotFoundError, match="does not exist"):
        fasttran.Encoder.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        fasttran.Encoder.from_pretrained(tmp_path / "empty")


def test_pickle_refused(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMALL))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(fasttran.CheckpointError, match="never loads pickle"):
        fasttran.Encoder.from_pretrained(d)


def test_truncated_file(tmp_path):
    d = make_dir(tmp_path)
    f = os.path.join(d, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[:-100])
    with pytest.raises(fasttran.CheckpointError, match="only .* bytes .*truncated file or lying header|data section"):
        fasttran.Encoder.from_pretrained(d)
    open(f, "wb").write(data[:5])
    with pytest.raises(fasttran.CheckpointError, match="too short for a safetensors header"):
        fasttran.Encoder.from_pretrained(d)
    open(f, "wb").write(data[:40])
    with pytest.raises(fasttran.CheckpointError, match="runs past the end"):
        fasttran.Encoder.from_pretrained(d)


def test_header_lies_about_offsets(tmp_path):
    def lie(h):
        h["embeddings.LayerNorm.bias"]["data_offsets"][1] += 4
    with pytest.raises(fasttran.CheckpointError, match="embeddings.LayerNorm.bias' spans 36 bytes but dtype F32 and its shape need 32"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, header_override=lie))

    def shape_lie(h):
        h["embeddings.LayerNorm.bias"]["shape"] = [9]
    with pytest.raises(fasttran.CheckpointError, match="spans 32 bytes but dtype F32 and its shape need 36"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, header_override=shape_lie))

    def negative(h):
        h["embeddings.LayerNorm.bias"]["data_offsets"] = [-8, 24]
    with pytest.raises(fasttran.CheckpointError, match="need 0 <= begin <= end"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, header_override=negative))


def test_overlapping_tensors(tmp_path):
    def overlap(h):
        a, b = h["embeddings.LayerNorm.weight"], h["embeddings.LayerNorm.bias"]
        b["data_offsets"] = list(a["data_offsets"])
    with pytest.raises(fasttran.CheckpointError, match="overlap"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, header_override=overlap))


def test_missing_tensor(tmp_path):
    t = small_tensors()
    del t["encoder.layer.1.output.dense.bias"]
    with pytest.raises(fasttran.CheckpointError, match=r"missing tensor 'encoder.layer.1.output.dense.bias' \(expected shape \[8\]\)"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, t))


def test_wrong_shape_or_dtype(tmp_path):
    t = small_tensors()
    t["encoder.layer.0.intermediate.dense.weight"] = np.zeros((12, 9), np.float32)
    with pytest.raises(fasttran.CheckpointError, match=r"has shape \[12, 9\]; the config needs \[12, 8\]"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, t))
    t = small_tensors()
    t["embeddings.LayerNorm.weight"] = np.zeros(8, np.int64)
    with pytest.raises(fasttran.CheckpointError, match="has dtype I64; expected F32, F16 or BF16"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, t))


def test_extra_layer_in_checkpoint(tmp_path):
    t = small_tensors()
    t["encoder.layer.2.output.dense.bias"] = np.zeros(8, np.float32)
    with pytest.raises(fasttran.CheckpointError, match="belongs to layer 2 but the config has num_hidden_layers = 2"):
        fasttran.Encoder.from_pretrained(make_dir(tmp_path, t))


def test_absurd_header_size(tmp_path):
    d = make_dir(tmp_path)
    f = os.path.join(d, "model.safetensors")
    data = bytearray(open(f, "rb").read())
    data[:8] = struct.pack("<Q", 2**62)
    open(f, "wb").write(bytes(data))
    with pytest.raises(fasttran.CheckpointError, match="header length 4611686018427387904 is absurd"):
        fasttran.Encoder.from_pretrained(d)


def test_header_not_json(tmp_path):
    d = make_dir(tmp_path)
    f = os.path.join(d, "model.safetensors")
    data = bytearray(open(f, "rb").read())
    data[8 + 5] = ord("\x01")   # a control byte inside the first key
    open(f, "wb").write(bytes(data))
    with pytest.raises(fasttran.CheckpointError, match="header is not valid JSON: control character in string at byte"):
        fasttran.Encoder.from_pretrained(d)


def test_unsupported_models_named(tmp_path):
    d = make_dir(tmp_path)
    cfg = dict(SMALL, model_type="deberta-v2")
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(fasttran.UnsupportedModelError, match="model_type 'deberta-v2' is not supported"):
        fasttran.Encoder.from_pretrained(d)
    cfg = dict(SMALL, position_embedding_type="relative_key")
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(fasttran.UnsupportedModelError, match="position_embedding_type 'relative_key'"):
        fasttran.Encoder.from_pretrained(d)
    cfg = dict(SMALL, hidden_act="silu")
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(fasttran.UnsupportedModelError, match="hidden_act 'silu' is not supported"):
        fasttran.Encoder.from_pretrained(d)
    cfg = dict(SMALL, num_attention_heads=3)
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(fasttran.CheckpointError, match="hidden_size 8 is not a multiple of num_attention_heads 3"):
        fasttran.Encoder.from_pretrained(d)


def test_battery_in_subprocess_exits_normally():
    """Every test above again, in a fresh interpreter: it must exit normally (a crash would
    show as a signal exit code)."""
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                        "-k", "not subprocess"], cwd=here, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
