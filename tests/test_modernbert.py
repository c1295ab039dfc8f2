"""ModernBERT (pre-LN layers, rotary positions, GeGLU, no biases, local / global attention) against
transformers' ModernBertModel: checkpoints written by transformers from random weights at
ModernBERT-base's shape (hidden 768, 12 heads, FFN 1152, 22 layers; a small vocabulary keeps them
quick), loaded by fasttran; every layer's hidden states on real tokens within 1e-4, padded and ragged
batches of sequences longer than the 128-token window (so local layers differ from global ones),
pooled outputs, 1,024 tokens, the tokenizer's template, what rides on the forward (encode, the cache,
a frozen head trained on it), and the operations refused by name. The same forward on
device="cuda" where there is a CUDA backend (the emulator without a GPU). bf16 / fp16 encoders (the
CPU's bf16 products, CUDA's half storage) at every layer against transformers' float32 model within
BERT's half-precision bounds, and a token's bits independent of its batch there too."""
import json

import numpy as np
import pytest

import fasttran
from fasttran import architectures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 211
BASE = dict(vocab_size=V, hidden_size=768, num_attention_heads=12, intermediate_size=1152, num_hidden_layers=22,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)


def make_model(path, seed=0, **over):
    """a random-weight ModernBertModel checkpoint (safetensors) in `path`; weights wider than the 0.02
    default and LayerNorm weights away from 1, so that every tensor shows in the outputs"""
    torch.manual_seed(seed)
    config = transformers.ModernBertConfig(**dict(BASE, **over))
    model = transformers.ModernBertModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2 and "embeddings" not in name:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_layers(path, ids, mask, attn="eager"):
    """transformers' hidden states: the embeddings' and each layer's output, the last final_norm'ed"""
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=attn).eval()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), output_hidden_states=True)
    hs = [h.numpy() for h in out.hidden_states]
    assert np.array_equal(hs[-1], out.last_hidden_state.numpy())   # transformers' last entry is final_norm's
    return hs


def ragged(rng, lengths, T):
    ids = rng.integers(3, V, (len(lengths), T))
    mask = np.zeros(ids.shape, np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 0
    return ids, mask


def assert_close(ours, ref, mask, tol=1e-4, what=""):
    real = mask.astype(bool)
    err = np.abs(ours[real] - ref[real]).max()
    assert err <= tol * max(1.0, np.abs(ref[real]).max() / 10), f"{what}: max error {err:.3g}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("modernbert") / "base")


@pytest.fixture(scope="module")
def batch():
    # longer than the window (128: keys |i - j| <= 64), ragged, one shorter than half the window
    return ragged(np.random.default_rng(0), [300, 200, 37], 300)


def test_the_descriptor(base):
    cfg = json.loads(open(f"{base}/config.json").read())
    arch = architectures.of_config(cfg)
    assert arch.name == "modernbert" and arch.unsupported() == []
    enc = fasttran.Encoder.from_pretrained(base)
    c = enc.config
    assert (c["rope_theta"], c["rope_theta_local"], c["attention_window"], c["global_every"]) == (160000.0, 10000.0, 128, 3)
    names = [n for n, _ in enc._core.tensors()]
    assert "encoder.layer.0.attention.LayerNorm.weight" not in names   # layer 0's attention norm is the identity
    assert "encoder.layer.1.attention.LayerNorm.weight" in names and "final_norm.weight" in names
    assert not any(n.endswith(".bias") and not n.startswith("pooler.") for n in names)
    assert dict(enc._core.tensors())["encoder.layer.3.intermediate.dense.weight"] == (2 * 1152, 768)
    assert enc.max_seq_length == 8192 and c["type_vocab_size"] == 0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_every_layer_matches_transformers(base, batch, attn):
    ids, mask = batch
    ref = hf_layers(base, ids, mask, attn)
    enc = fasttran.Encoder.from_pretrained(base)
    ours = enc.forward(ids, mask, output_layers=list(range(23)))
    assert len(ref) == len(ours) == 23
    for layer in range(23):
        assert_close(ours[layer], ref[layer], mask, what=f"layer {layer}")


def test_local_layers_are_local(base, batch, tmp_path):
    """The window is exercised: the same weights and thetas with every layer global give other outputs
    past the window, the same bits within a sequence shorter than half of it"""
    ids, mask = batch
    cfg = json.loads(open(f"{base}/config.json").read())
    cfg["rope_parameters"]["sliding_attention"]["rope_theta"] = cfg["rope_parameters"]["full_attention"]["rope_theta"]
    windowed_path = tmp_path / "windowed"
    windowed_path.mkdir()
    (windowed_path / "config.json").write_text(json.dumps(cfg))
    cfg["layer_types"] = ["full_attention"] * 22
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import shutil
    shutil.copy(f"{base}/model.safetensors", tmp_path / "model.safetensors")
    shutil.copy(f"{base}/model.safetensors", windowed_path / "model.safetensors")
    windowed = fasttran.Encoder.from_pretrained(str(windowed_path)).forward(ids, mask)
    glob = fasttran.Encoder.from_pretrained(str(tmp_path))
    assert glob.config["global_every"] == 1
    everywhere = glob.forward(ids, mask)
    assert np.abs(everywhere[0] - windowed[0]).max() > 1e-2
    assert np.array_equal(everywhere[2, :37], windowed[2, :37])


def test_a_token_does_not_depend_on_its_batch(base, batch):
    """bit for bit: alone, in a padded batch, left padded, and at any thread count"""
    ids, mask = batch
    _invariance(fasttran.Encoder.from_pretrained(base), ids, mask, [5, 22])


def test_pooled_outputs(base, batch):
    ids, mask = batch
    ref = hf_layers(base, ids, mask)[-1]
    enc = fasttran.Encoder.from_pretrained(base)
    cls = enc.forward(ids, mask, pooling="cls")
    mean = enc.forward(ids, mask, pooling="mean")
    m = mask[..., None].astype(np.float64)
    np.testing.assert_allclose(cls, ref[:, 0], atol=2e-4)
    np.testing.assert_allclose(mean, (ref * m).sum(1) / m.sum(1), atol=2e-4)


def test_1024_tokens_and_the_8k_limit(tmp_path):
    path = make_model(tmp_path / "m", num_hidden_layers=4, seed=1)
    ids, mask = ragged(np.random.default_rng(1), [1024, 700], 1024)
    ref = hf_layers(path, ids, mask, "sdpa")
    enc = fasttran.Encoder.from_pretrained(path)
    ours = enc.forward(ids, mask, output_layers=list(range(5)))
    for layer in range(5):
        assert_close(ours[layer], ref[layer], mask, what=f"layer {layer}")
    with pytest.raises(fasttran.InputError, match="max_position_embeddings 8192"):
        enc.forward(np.ones((1, 8193), np.int64))
    report = enc.memory_report()
    assert report["workspace"] > 0


def test_config_forms_and_refusals(base, tmp_path):
    cfg = json.loads(open(f"{base}/config.json").read())
    old = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_parameters")}
    old.update(global_attn_every_n_layers=2, global_rope_theta=5e4, local_rope_theta=1e3, local_attention=64)
    c = fasttran.Encoder(old).config
    assert (c["global_every"], c["rope_theta"], c["rope_theta_local"], c["attention_window"]) == (2, 5e4, 1e3, 64)
    for change, match in [({"mlp_bias": True}, "mlp_bias=true is not supported"),
                          ({"layer_types": ["full_attention", "sliding_attention"] * 11 }, None),
                          ({"layer_types": ["sliding_attention"] + ["full_attention"] * 21}, "global attention every n"),
                          ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}}, "rope_type"),
                          ({"layer_types": ["full_attention"]}, "layer_types must list 22")]:
            bad = dict(cfg, **change)
            if match is None:
                assert fasttran.Encoder(bad).config["global_every"] == 2
                continue
            with pytest.raises((fasttran.UnsupportedModelError, fasttran.CheckpointError), match=match):
                fasttran.Encoder(bad)


def test_operations_on_bert_layers_are_refused_by_name(base):
    """(training the top layers runs ModernBERT's own pre-LN layers: tests/test_modernbert_training.py; int8:
    tests/test_modernbert_int8.py; compression's model, files and int8: tests/test_modernbert_compress.py)"""
    enc = fasttran.Encoder.from_pretrained(base)
    for operation in ("train_layers", "int8", "compression"):
        enc.architecture.require(operation)
    with pytest.raises(fasttran.UnsupportedModelError, match="^pruning, .* ModernBertModel"):
        enc.architecture.require("pruning")
    with pytest.raises(ValueError, match="unknown operation"):
        enc.architecture.require("nothing")


def test_tokenizer_template_as_transformers(base, tmp_path):
    """ModernBERT's tokenizer.json: byte-level BPE with [CLS] a [SEP] b [SEP], no token types"""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import trainers
    trainer = trainers.BpeTrainer(vocab_size=180, special_tokens=specials)   # the corpus' bytes: ids < V
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "a b c hello world"] * 20, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    import shutil
    d = tmp_path / "tok"
    shutil.copytree(base, d)
    tok.save(str(d / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), pad_token="[PAD]")
    enc = fasttran.Encoder.from_pretrained(str(d))
    texts, pairs = ["the quick fox", "hello world, a lazy dog jumps"], ["over the dog", "c"]
    for args in ((texts,), (texts, pairs)):
        ids, mask, types = enc.tokenize(*args)
        want = hf(*args, padding="longest", return_token_type_ids=True)
        n = ids.shape[1]
        # the real tokens and the mask (padded ids never reach an output)
        assert [r[m.astype(bool)].tolist() for r, m in zip(ids, mask)] == \
            [[i for i, k in zip(r, m) if k] for r, m in zip(want["input_ids"], want["attention_mask"])]
        assert mask.tolist() == [row + [0] * (n - len(row)) for row in want["attention_mask"]]
        assert not types.any()   # no token types
    out = enc.encode(texts, pooling="cls")
    assert out.shape == (2, 768) and np.isfinite(out).all()


def test_cache_and_a_frozen_head(base, tmp_path):
    """the cache is built from this forward and read back bit for bit; a head trains on it"""
    ids, mask = ragged(np.random.default_rng(2), [40, 12, 200, 7, 90, 33], 200)
    enc = fasttran.Encoder.from_pretrained(base)
    cache = fasttran.ActivationCache.build(enc, ids, mask, positions="mean", batch_size=4, show_progress=False)
    want = enc.forward(ids, mask, pooling="mean")
    np.testing.assert_array_equal(cache.get(np.arange(len(ids))), want)
    labels = np.array([0, 1, 0, 1, 1, 0])
    trainer = fasttran.Trainer("classification", epochs=3, batch_size=2, show_progress=False, seed=1, train_layers=0,
                               lr=1e-2)
    trainer.fit(cache, labels)
    assert trainer.predict(cache).shape[0] == 6


@pytest.mark.skipif(not fasttran.cuda_available(), reason="no CUDA device and no emulator")
def test_the_same_forward_on_cuda(tmp_path):
    path = make_model(tmp_path / "m", num_hidden_layers=4, seed=3)
    ids, mask = ragged(np.random.default_rng(3), [300, 140, 9], 300)
    cpu = fasttran.Encoder.from_pretrained(path).forward(ids, mask, output_layers=[0, 2, 4])
    gpu = fasttran.Encoder.from_pretrained(path, device="cuda").forward(ids, mask, output_layers=[0, 2, 4])
    for a, b in zip(cpu, gpu):
        assert_close(b, a, mask, tol=1e-4, what="cuda vs cpu")


def test_save_pretrained_round_trip(tmp_path):
    """save_pretrained writes ModernBertModel's names and config: transformers and fasttran load it back"""
    path = make_model(tmp_path / "m", num_hidden_layers=3, seed=4)
    enc = fasttran.Encoder.from_pretrained(path)
    enc.save_pretrained(tmp_path / "again")
    ids, mask = ragged(np.random.default_rng(4), [150, 20], 150)
    ref = hf_layers(str(tmp_path / "again"), ids, mask)
    assert_close(enc.forward(ids, mask), ref[-1], mask)
    assert np.array_equal(fasttran.Encoder.from_pretrained(str(tmp_path / "again")).forward(ids, mask),
                          enc.forward(ids, mask))


def test_8192_tokens(tmp_path):
    """the longest sequence a ModernBERT config allows, on a narrow model (the layers' code is the
    base model's): within 1e-4 of transformers' SDPA path; the workspace reported grows to it"""
    path = make_model(tmp_path / "m", hidden_size=64, num_attention_heads=2, intermediate_size=96,
                      num_hidden_layers=3, seed=5)
    ids, mask = ragged(np.random.default_rng(5), [8192], 8192)
    ref = hf_layers(path, ids, mask, "sdpa")
    enc = fasttran.Encoder.from_pretrained(path)
    ours = enc.forward(ids, mask, output_layers=[1, 3])
    assert_close(ours[0], ref[1], mask, what="layer 1")
    assert_close(ours[1], ref[3], mask, what="layer 3")
    assert enc.memory_report()["workspace"] >= 8192 * (3 * 64 + 3 * 96) * 4


# ---- bf16 / fp16: the same layers in reduced precision ----------------------------------------------
# BERT's bounds (tests/test_cuda.py, test_half_precision_against_float64_and_transformers_bf16), here at
# every layer, relative error = Frobenius norm over the real tokens against transformers' float32 model:
# bfloat16's last layer never worse than transformers' own bfloat16 ModernBertModel (SDPA) on the same
# inputs, every layer within 1.05 times it (on the 22-layer base model transformers' grows from 0.3% to
# 2.3%; measured: the CPU's bf16 products 0.24% -> 1.06%, CUDA's bf16 storage on the emulator 0.98 to
# 1.003 times transformers'), float16 within FP16_BOUND at every layer.
FP16_BOUND = 1e-2
needs_bf16 = pytest.mark.skipif(not fasttran.build_info()["bf16_kernels"],
                                reason="bf16 on the CPU needs AVX512_BF16 (bf16 products)")


def _rel(a, b, mask):
    real = mask.astype(bool)
    return float(np.linalg.norm((a - b)[real]) / np.linalg.norm(b[real]))


def hf_layers_bf16(path, ids, mask):
    """transformers' ModernBertModel in bfloat16 (SDPA): its hidden states as float32"""
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), output_hidden_states=True)
    return [h.float().numpy() for h in out.hidden_states]


def assert_half_bound(ours, ref, mask, dtype, hf_bf16=None):
    """every layer within the bound of its type (above); and not float32's result (~1e-6)"""
    errs = [_rel(o, r, mask) for o, r in zip(ours, ref)]
    if dtype == "bfloat16":
        theirs = [_rel(h, r, mask) for h, r in zip(hf_bf16, ref)]
        assert errs[-1] <= theirs[-1] and all(e <= 1.05 * t for e, t in zip(errs, theirs)), list(zip(errs, theirs))
    else:
        assert max(errs) <= FP16_BOUND, errs
    assert errs[-1] > 1e-4, errs
    return errs


def _invariance(enc, ids, mask, layers, threads=True):
    """a token's bits never depend on its batch: sequence 1 alone, left padded, in the batch (and at
    another thread count)"""
    n = int(mask[1].sum())
    full = enc.forward(ids, mask, output_layers=layers)
    alone = enc.forward(ids[1:2, :n], mask[1:2, :n], output_layers=layers)
    left_ids = np.concatenate([np.zeros((1, 50), np.int64), ids[1:2, :n]], 1)
    left_mask = np.concatenate([np.zeros((1, 50), np.int64), mask[1:2, :n]], 1)
    left = enc.forward(left_ids, left_mask, output_layers=layers)
    other = full
    if threads:
        old = fasttran.get_num_threads()
        try:
            fasttran.set_num_threads(2 if old == 1 else 1)
            other = enc.forward(ids, mask, output_layers=layers)
        finally:
            fasttran.set_num_threads(old)
    for k in range(len(layers)):
        assert np.array_equal(full[k][1, :n], alone[k][0]), f"layer {layers[k]}: alone"
        assert np.array_equal(full[k][1, :n], left[k][0, 50:]), f"layer {layers[k]}: left padded"
        assert np.array_equal(full[k], other[k]), f"layer {layers[k]}: threads"
    return full


@needs_bf16
def test_bf16_on_the_cpu_every_layer_against_float32_transformers(base, batch):
    """dtype='bfloat16' on the CPU (bf16 weights and products, float32 activations, RoPE, GeGLU and
    statistics, as BERT's): all 22 layers, sequences past the 128-token window, within the bf16 bound
    at every layer, pooled outputs too"""
    ids, mask = batch
    ref = hf_layers(base, ids, mask)
    enc = fasttran.Encoder.from_pretrained(base, dtype="bfloat16")
    assert enc.dtype == "bfloat16" and "bf16 products" in enc.memory_report()["weights"]
    ours = enc.forward(ids, mask, output_layers=list(range(23)))
    errs = assert_half_bound(ours, ref, mask, "bfloat16", hf_layers_bf16(base, ids, mask))
    m = mask[..., None].astype(np.float64)
    pooled = enc.forward(ids, mask, pooling="mean")
    want = (ref[-1] * m).sum(1) / m.sum(1)
    assert _rel(pooled, want, np.ones(len(want))) <= 2 * errs[-1]


@needs_bf16
def test_bf16_on_the_cpu_a_token_does_not_depend_on_its_batch(base, batch):
    ids, mask = batch
    _invariance(fasttran.Encoder.from_pretrained(base, dtype="bfloat16"), ids, mask, [1, 5, 22])


def test_float16_on_the_cpu_is_refused_naming_the_devices(base):
    with pytest.raises(fasttran.UnsupportedError, match="float16' runs on CUDA only"):
        fasttran.Encoder.from_pretrained(base, dtype="float16")


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """ModernBERT-base's 22 layers, head size 64, window and thetas at a narrower width (128, 2 heads, FFN
    192): the CUDA emulator runs the half-precision attention kernel's warps one lane at a time, ~5 s a
    layer at base width"""
    return make_model(tmp_path_factory.mktemp("modernbert") / "narrow", hidden_size=128, num_attention_heads=2,
                      intermediate_size=192, seed=8)


@pytest.mark.skipif(not fasttran.cuda_available(), reason="no CUDA device and no emulator")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cuda(base, narrow, dtype):
    """dtype='bfloat16' / 'float16' on CUDA (weights and activations stored in the type, RoPE and GeGLU
    in float32 registers, the windowed half-precision attention kernel): all 22 layers within the
    type's bound at every layer (the base model on a GPU, the narrow one on the emulator), sequences
    past the window, float32 outputs; a sequence alone and left padded within the same bound (no
    padding or neighbour leaks in; CUDA promises no bits here: cuBLAS, and the emulator's OpenBLAS
    behind its cuBLAS, may sum in another order for another row count, and over 22 layers one ulp of
    bf16 grows to the type's error)"""
    emulated = fasttran.build_info()["cuda"]["emulated"]
    path = narrow if emulated else base
    ids, mask = ragged(np.random.default_rng(6), [150, 40, 9] if emulated else [300, 200, 37], 150 if emulated else 300)
    ref = hf_layers(path, ids, mask)
    enc = fasttran.Encoder.from_pretrained(path, device="cuda", dtype=dtype)
    assert enc.dtype == dtype and enc._core.dtype == dtype
    layers = list(range(23))
    ours = enc.forward(ids, mask, output_layers=layers)
    assert all(o.dtype == np.float32 and np.isfinite(o).all() for o in ours)
    hf = hf_layers_bf16(path, ids, mask) if dtype == "bfloat16" else None
    assert_half_bound(ours, ref, mask, dtype, hf)
    n = int(mask[1].sum())
    alone = enc.forward(ids[1:2, :n], mask[1:2, :n], output_layers=layers)
    pad = np.zeros((1, 30), np.int64)
    left = enc.forward(np.concatenate([pad, ids[1:2, :n]], 1), np.concatenate([pad, mask[1:2, :n]], 1), output_layers=layers)
    one = [r[1:2, :n] for r in ref], mask[1:2, :n], dtype, hf and [h[1:2, :n] for h in hf]
    assert_half_bound(alone, *one)
    assert_half_bound([o[:, 30:] for o in left], *one)


@needs_bf16
def test_top_layers_train_on_a_bf16_encoders_cache(tmp_path):
    """Trainer(train_layers=2) over a bf16 ModernBERT's cache: the top layers start from the float32
    master weights and train in float32, or in mixed precision (precision='bfloat16': bf16 products,
    float32 storage and sums); the losses follow the float32 encoder's within bf16's rounding, yet
    differ from them"""
    path = make_model(tmp_path / "m", num_hidden_layers=4, hidden_size=128, num_attention_heads=2,
                      intermediate_size=192, seed=7)
    ids, mask = ragged(np.random.default_rng(2), [40, 12, 200, 7, 90, 33, 150, 60], 200)
    y = np.array([0, 1, 0, 1, 1, 0, 1, 0])
    curves = {}
    for dtype, precision in [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]:
        enc = fasttran.Encoder.from_pretrained(path, dtype=dtype)
        trainer = fasttran.Trainer("classification", epochs=2, batch_size=4, show_progress=False, seed=1,
                                   train_layers=2, lr=1e-3, precision=precision)
        cache = trainer.cache_for(enc, ids, mask, show_progress=False)
        trainer.fit(cache, y)
        assert trainer.top.matmul_precision == precision
        curves[dtype, precision] = np.array([l for _, l in trainer.loss_curve])
    want = curves["float32", "float32"]
    for key in [("bfloat16", "float32"), ("bfloat16", "bfloat16")]:
        got = curves[key]
        assert np.isfinite(got).all() and np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max()), key
        assert not np.array_equal(got, want), key
