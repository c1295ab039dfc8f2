"""fasttran.compress beyond BERT: a random-weight RoBERTa, DistilBERT and ELECTRA (small widths, three layers)
pruned, saved in their own layout (config keys, tensor names), loaded back with the same outputs bit
for bit, exported to their own transformers base class with equal hidden states, in int8 within
BERT's error (tests/test_compress.py), and re-fine-tuned through Trainer.export (distillation) and
read back; the encoders whose embeddings are projected (ELECTRA-small) are refused."""
import json
import os

import numpy as np
import pytest

import fasttran
from fasttran import _C, compress
from fasttran.heads import ClassificationHead

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_architectures import SHAPES, make_model   # noqa: E402

C = 48
#: small widths of each architecture (its own config keys), three layers
SMALL = {"roberta": dict(hidden_size=C, num_attention_heads=4, intermediate_size=64, num_hidden_layers=3),
         "distilbert": dict(dim=C, n_heads=4, hidden_dim=64, n_layers=3),
         "electra": dict(hidden_size=C, embedding_size=C, num_attention_heads=4, intermediate_size=64,
                         num_hidden_layers=3)}
PLAN = {"ffn_group_size": 16, "layers": {"1": "prune",
                                         "0": {"heads": {"1": "prune", "3": "prune"}, "ffn_groups": {"0": "prune"}},
                                         "2": {"heads": {"0": "prune"}, "ffn_groups": {"1": "prune", "3": "prune"}}}}


@pytest.fixture(scope="module", params=sorted(SMALL))
def case(request, tmp_path_factory):
    t = request.param
    return t, make_model(tmp_path_factory.mktemp(t), t, seed=4, **SMALL[t])


def task_model(path, seed=1):
    return compress.TaskModel(fasttran.Encoder.from_pretrained(path), ClassificationHead(C, 2, seed=seed))


def batch(enc, seed, n=16, T=13):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, T + 1, n)
    lens[0] = T
    pad = enc.config["pad_token_id"]
    ids = rng.integers(3, enc.config["vocab_size"], (n, T))
    ids[ids == pad] = pad + 3
    mask = (np.arange(T)[None, :] < lens[:, None]).astype(np.int64)
    ids[mask == 0] = pad
    return ids, mask


def task_data(enc, seed, n=16):
    ids, mask = batch(enc, seed, n)
    return compress.TaskData(ids, mask, None, np.random.default_rng(seed).integers(0, 2, n))


def hidden(enc, ids, mask):
    L = enc.num_layers
    h, _ = enc._core.forward(input_ids=ids, attention_mask=mask, token_type_ids=None, layers=tuple(range(L + 1)),
                             pooling=_C.POOLINGS["none"], want_hidden=True)
    return h


def test_pruned_model_saves_in_its_own_layout_and_loads_back(case, tmp_path):
    t, path = case
    model = task_model(path)
    small = compress.apply(model, PLAN)
    s = small.structure
    assert small.num_layers == 2 and s["layer_heads"] == [2, 3] and s["layer_intermediate"] == [48, 32]
    data = task_data(small.encoder, 0)
    np.testing.assert_allclose(small.logits(data), model.logits(data, **compress.masks(model, PLAN)), atol=1e-4,
                               rtol=0)
    out = small.save(tmp_path / "m")
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["model_type"] == t and cfg["architectures"] == [SHAPES[t][1]]
    assert cfg[small.encoder.architecture.config_key("num_hidden_layers")] == 2
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:   # the base model's own names
        names = set(f.keys())
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        assert names <= set(f.keys())
    back = compress.TaskModel.load(out)
    assert back.encoder.architecture is small.encoder.architecture
    assert back.structure == small.structure and back.origin == small.origin
    assert np.array_equal(back.logits(data), small.logits(data))
    for name, v in small.encoder.state_dict().items():
        assert np.array_equal(back.encoder.state_dict()[name], v), name


def test_export_to_the_architectures_base_class_has_equal_hidden_states(case, tmp_path):
    t, path = case
    small = compress.apply(task_model(path), PLAN)
    out = compress.export_transformers(small, tmp_path / "hf")
    m = transformers.AutoModel.from_pretrained(out, attn_implementation="eager").eval()
    assert type(m).__name__ == SHAPES[t][1] and m.config.num_hidden_layers == 2
    ids, mask = batch(small.encoder, 5)
    with torch.no_grad():
        ref = m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True).hidden_states
    valid = mask.astype(bool)
    for l, (a, b) in enumerate(zip(hidden(small.encoder, ids, mask), ref)):
        assert np.abs(a - b.numpy())[valid].max() <= 1e-4, l
    # fasttran reads the export back (uniform shapes, zero-filled parts): the same logits
    data = task_data(small.encoder, 6)
    np.testing.assert_allclose(compress.TaskModel.load(out).logits(data), small.logits(data), atol=1e-4, rtol=0)


def test_int8_within_berts_error_and_round_trip(case, tmp_path):
    t, path = case
    model = task_model(path)
    q = compress.apply(model, dict(PLAN, weights="int8"))
    data = task_data(model.encoder, 12)
    ref = compress.apply(model, PLAN).logits(data)
    got = q.logits(data)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 1e-3   # tests/test_compress.py's bound for BERT
    back = compress.TaskModel.load(q.save(tmp_path / "q"))
    assert back.weights == "int8" and np.array_equal(back.logits(data), got)
    assert json.loads(open(tmp_path / "q" / "config.json").read())["model_type"] == t


def test_retraining_goes_through_the_export_and_back(case):
    """re-fine-tuning after pruning exports with the Trainer (the architecture's layout) and loads back:
    distillation brings the pruned model's logits closer to the teacher's"""
    from fasttran.compress.search import _retrain
    t, path = case
    model = task_model(path)
    train = task_data(model.encoder, 10, n=64)
    pruned = compress.apply(model, PLAN)
    teacher = model.logits(train)
    before = float(np.mean((pruned.logits(train) - teacher) ** 2))
    tuned = _retrain(pruned, train, 3, None, 1e-3, 16, 0, False, "adamw", teacher)
    assert tuned.encoder.architecture is model.encoder.architecture and tuned.structure == pruned.structure
    assert float(np.mean((tuned.logits(train) - teacher) ** 2)) < 0.5 * before


def test_search_meets_a_budget_and_its_result_loads_back(case, tmp_path):
    t, path = case
    model = task_model(path)
    train, select = task_data(model.encoder, 10, n=48), task_data(model.encoder, 11, n=24)
    res = compress.search(model, train, select, max_drop=100.0, steps=4, ffn_group_size_=16, latency_examples=8,
                          latency_batch=4, show_progress=False)
    assert res.met and res.model.size_bytes < model.size_bytes
    assert {"pruned", "re-fine-tuned"} <= {p["stage"] for p in res.points}
    back = compress.TaskModel.load(compress.save_result(res, tmp_path / "s"))
    assert back.encoder.architecture is model.encoder.architecture and back.structure == res.model.structure
    assert np.array_equal(back.logits(select), res.model.logits(select))


def test_onnx_export_runs_in_onnx_runtime(case, tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    t, path = case
    small = compress.apply(task_model(path), PLAN)
    sess = ort.InferenceSession(compress.export_onnx(small, str(tmp_path / "m.onnx")),
                                providers=["CPUExecutionProvider"])
    data = task_data(small.encoder, 14)
    ids, mask, types = data.padded()
    got = sess.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
    np.testing.assert_allclose(got, small.logits(data), atol=1e-4, rtol=0)


def test_projected_embeddings_are_refused(tmp_path):
    enc = fasttran.Encoder.from_pretrained(make_model(tmp_path / "e", "electra-small"))
    with pytest.raises(fasttran.UnsupportedError, match="embedding_size 128 != hidden_size 256"):
        compress.TaskModel(enc, ClassificationHead(enc.hidden_size, 2))


def test_roberta_vocabulary_keeps_its_special_tokens_and_reads_unk(tmp_path):
    """vocabulary() over RoBERTa's tokenizer: <s> <pad> </s> <unk> <mask> kept, removed ids read <unk>;
    the pruned model saved and exported in RobertaModel's layout with every id's row back"""
    from test_architecture_tokens import CORPUS, roberta_bpe
    tok, _ = roberta_bpe()
    path = make_model(tmp_path / "r", "roberta", seed=5, vocab_size=tok.get_vocab_size(), **SMALL["roberta"])
    tok.save(str(tmp_path / "r" / "tokenizer.json"))
    model = task_model(path)
    data = compress.TaskData.from_texts(model, CORPUS[:4], [0, 1, 0, 1], max_length=32)
    assert not data.types.any()   # no segment types
    voc = compress.vocabulary(model, data)
    specials = [tok.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")]
    assert voc["unknown"] == tok.token_to_id("<unk>") and set(specials) <= set(voc["keep"])
    assert set(np.unique(data.ids).tolist()) <= set(voc["keep"]) and len(voc["keep"]) < tok.get_vocab_size()
    small = compress.apply(model, dict(PLAN, vocabulary=voc))
    assert np.array_equal(small.logits(data), compress.apply(model, PLAN).logits(data))
    back = compress.TaskModel.load(small.save(tmp_path / "v"))
    assert np.array_equal(back.logits(data), small.logits(data))
    gone = next(i for i in range(tok.get_vocab_size()) if i not in voc["keep"])
    ids, mask, _ = data.padded()
    odd = ids.copy()
    odd[0, 1] = gone
    m = transformers.AutoModel.from_pretrained(compress.export_transformers(small, tmp_path / "hf")).eval()
    assert type(m).__name__ == "RobertaModel"
    with torch.no_grad():
        ref = m(input_ids=torch.tensor(odd), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    assert np.abs(hidden(small.encoder, odd, mask)[-1] - ref)[mask.astype(bool)].max() <= 1e-4
