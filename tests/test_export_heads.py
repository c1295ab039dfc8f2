"""Task models of every architecture exported to the architecture's own transformers classes: a head
trained for export (Trainer(..., pooler=True), multiple choice) has the dense layer of the class
(fasttran.architectures' head_shapes: DistilBERT's ReLU pre_classifier, ELECTRA's GELU heads,
ModernBERT's prediction head) and loads in AutoModelFor* with the logits fasttran computes (1e-4),
on random-weight base-shape checkpoints built from transformers' own classes."""
import json
import shutil

import numpy as np
import pytest

import fasttran
from fasttran.heads import DenseShape, make_head

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import test_architectures as ta  # noqa: E402
import test_modernbert as tm  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {t: ta.make_model(root / t, t, seed=3) for t in ("distilbert", "electra")}
    out["modernbert"] = tm.make_model(root / "modernbert", seed=3, num_hidden_layers=3)
    return out


def _batch(enc, n=16, T=11, seed=21):
    rng = np.random.default_rng(seed)
    return ta.ragged(rng, enc.config["pad_token_id"], list(rng.integers(3, T + 1, n)), T)


def _fit(enc, task, k, ids, mask, y, pooling="cls", **kw):
    tr = fasttran.Trainer(task, epochs=1, batch_size=8, show_progress=False, seed=1, train_layers=k, pooling=pooling,
                          **kw)
    if k:
        cache = tr.cache_for(enc, ids, mask, show_progress=False)
    else:
        positions = "all" if task in ("token-classification", "qa", "multiple-choice") else pooling
        cache = fasttran.ActivationCache.build(enc, ids, mask, positions=positions, show_progress=False)
    tr.fit(cache, y)
    return tr, cache


CLASSES = {"distilbert": "DistilBert", "electra": "Electra", "modernbert": "ModernBert"}


@pytest.mark.parametrize("model_type,k,pooling", [("distilbert", 0, "cls"), ("distilbert", 1, "cls"),
                                                  ("electra", 1, "cls"), ("modernbert", 0, "cls"),
                                                  ("modernbert", 0, "mean"), ("modernbert", 1, "mean")])
def test_sequence_classification_exports_to_the_architectures_class(models, tmp_path, model_type, k, pooling):
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc)
    tr, cache = _fit(enc, "classification", k, ids, mask, np.arange(len(ids)) % 3, pooling=pooling, pooler=True,
                     label_names=["a", "b", "c"])
    assert tr.head.shape == enc.architecture.head_shape("sequence-classification", enc._raw_config)
    from fasttran.export import how_to_load, layout_of
    assert layout_of(tr.head, enc) == "sequence-classification"
    cls = CLASSES[model_type] + "ForSequenceClassification"
    assert f"({cls}, the head in place)" in how_to_load(tr.head, "m", enc)
    tr.export(tmp_path / "m")
    m = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    assert type(m).__name__ == cls and m.config.id2label == {0: "a", 1: "b", 2: "c"}
    if model_type == "modernbert":
        assert m.config.classifier_pooling == pooling and m.config.classifier_bias is False
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    assert np.abs(tr._outputs(cache) - theirs).max() <= 1e-4


@pytest.mark.parametrize("model_type", ["distilbert", "electra", "modernbert"])
def test_multiple_choice_exports_to_the_architectures_class(models, tmp_path, model_type):
    enc = fasttran.Encoder.from_pretrained(models[model_type])
    ids, mask = _batch(enc, n=12, seed=22)   # 6 questions of 2 choices
    tr, cache = _fit(enc, "multiple-choice", 0, ids, mask, np.arange(6) % 2)
    tr.export(tmp_path / "m")
    m = transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path / "m").eval()
    assert type(m).__name__ == CLASSES[model_type] + "ForMultipleChoice"
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(ids).reshape(6, 2, -1),
                   attention_mask=torch.as_tensor(mask).reshape(6, 2, -1)).logits.numpy()
    assert np.abs(tr._outputs(cache) - theirs).max() <= 1e-4


def _random_head(head, seed):
    rng = np.random.default_rng(seed)
    head.load_state_dict({n: (1 + 0.2 * rng.standard_normal(t.shape) if n.endswith("norm.weight") else
                              0.3 * rng.standard_normal(t.shape)).astype(np.float32) for n, t in head.tensors.items()})
    return head


def test_modernbert_token_and_qa_heads_export_with_the_prediction_head(models, tmp_path):
    """token classification and QA: ModernBERT's prediction head on every token (pooler=True)"""
    enc = fasttran.Encoder.from_pretrained(models["modernbert"])
    ids, mask = _batch(enc, seed=23)
    labels = np.where(mask == 1, np.arange(ids.size).reshape(ids.shape) % 3, -100)
    tr, cache = _fit(enc, "token-classification", 0, ids, mask, labels, pooler=True, label_names=["O", "B", "I"])
    assert tr.head.shape.per_token and "pooler.norm.weight" in tr.head.tensors
    tr.export(tmp_path / "t")
    m = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "t").eval()
    assert type(m).__name__ == "ModernBertForTokenClassification"
    with torch.no_grad():
        theirs = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    ours = tr._outputs(cache)
    assert max(np.abs(o - theirs[b, :int(mask[b].sum())]).max() for b, o in enumerate(ours)) <= 1e-4
    # QA: the head over the encoder's token states, exported and compared
    qa = _random_head(make_head("qa", enc.hidden_size, pooler=True, encoder=enc), 4)
    assert qa.shape.per_token
    fasttran.export.export(tmp_path / "q", enc, qa)
    m = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "q").eval()
    assert type(m).__name__ == "ModernBertForQuestionAnswering"
    with torch.no_grad():
        out = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask))
    x = enc.forward(ids, mask).astype(np.float32)
    logits, _ = qa.step(x, np.ones(ids.shape, np.float32))
    for b in range(len(ids)):
        n = int(mask[b].sum())
        assert np.abs(logits[0, b, :n] - out.start_logits.numpy()[b, :n]).max() <= 1e-4
        assert np.abs(logits[1, b, :n] - out.end_logits.numpy()[b, :n]).max() <= 1e-4


def test_a_head_of_another_shape_is_refused_or_goes_out_as_sentence_transformers(models, tmp_path):
    from fasttran.export import layout_of
    enc = fasttran.Encoder.from_pretrained(models["distilbert"])
    tanh = make_head("classification", enc.hidden_size, num_labels=2, pooler=True, pooling="cls",
                     shape=DenseShape())   # BERT's pooler: no DistilBERT class holds it
    assert layout_of(tanh, enc) == "sentence-transformers"
    fasttran.export.export(tmp_path / "s", enc, tanh)
    mods = json.loads((tmp_path / "s" / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in mods] == ["Transformer", "Pooling", "Dense", "Dense"]
    relu = make_head("classification", enc.hidden_size, num_labels=2, pooler=True, pooling="mean", encoder=enc)
    assert relu.shape.act == "relu" and layout_of(relu, enc) == "sentence-transformers"   # mean pooling
    fasttran.export.export(tmp_path / "r", enc, relu)
    dense = json.loads((tmp_path / "r" / "2_Dense" / "config.json").read_text())
    assert dense["activation_function"].endswith("ReLU")
    choice = make_head("multiple-choice", enc.hidden_size, num_labels=2, shape=DenseShape(act="gelu"))
    with pytest.raises(fasttran.UnsupportedModelError, match="multiple-choice head is not supported for DistilBertModel"
                       ": DistilBert's multiple-choice head runs dense \\+ relu, this head dense \\+ gelu"):
        fasttran.export.export(tmp_path / "c", enc, choice)
    bert = fasttran.Encoder.from_pretrained(ta.make_model(tmp_path / "rob", "roberta", seed=2))
    mb = make_head("classification", bert.hidden_size, num_labels=2, pooler=True, pooling="cls",
                   shape=DenseShape(act="gelu", bias=False, norm="layernorm"))
    with pytest.raises(fasttran.UnsupportedModelError, match="Roberta's sequence-classification head runs dense \\+ "
                       "tanh, this head dense without bias \\+ gelu \\+ LayerNorm without bias"):
        fasttran.export.export(tmp_path / "b", bert, mb)
    tok = make_head("token-classification", bert.hidden_size, num_labels=2, pooler=True, shape=DenseShape(act="gelu"))
    with pytest.raises(fasttran.UnsupportedModelError, match="runs no dense layer, this head dense \\+ gelu on every"):
        fasttran.export.export(tmp_path / "t", bert, tok)


def test_a_class_activation_fasttran_has_not_is_refused_by_name(models, tmp_path):
    src = models["modernbert"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["classifier_activation"] = "silu"
    (bad / "config.json").write_text(json.dumps(cfg))
    enc = fasttran.Encoder.from_pretrained(str(bad))
    with pytest.raises(fasttran.UnsupportedModelError, match="classifier_activation='silu'.*'silu'"):
        make_head("classification", enc.hidden_size, num_labels=2, pooler=True, encoder=enc)
    with pytest.raises(fasttran.UnsupportedModelError, match="classifier_activation='silu'"):
        fasttran.Trainer("classification", pooler=True, show_progress=False).fit(
            fasttran.ActivationCache.build(enc, *_batch(enc, n=4), positions="cls", show_progress=False), [0, 1, 0, 1])


def test_modernbert_export_keeps_its_other_refusals(models):
    arch = fasttran.Encoder.from_pretrained(models["modernbert"]).architecture
    arch.require("export")
    for op in sorted(set(fasttran.architectures.OPERATIONS) - set(fasttran.architectures.PRE_LN_OPERATIONS)):
        with pytest.raises(fasttran.UnsupportedModelError, match="ModernBertModel"):
            arch.require(op)


def test_pipeline_gives_the_exports_probabilities(tmp_path, minilm_dir):
    """transformers' text-classification pipeline on a DistilBERT export (the tokenizer of
    all-MiniLM-L6-v2, which shares BERT's vocabulary) gives fasttran's probabilities"""
    src = ta.make_model(tmp_path / "src", "distilbert", seed=5, vocab_size=30522, dim=96, n_heads=4, hidden_dim=192)
    import os
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(minilm_dir, f)):
            shutil.copy(os.path.join(minilm_dir, f), tmp_path / "src" / f)
    enc = fasttran.Encoder.from_pretrained(src)
    texts = ["a fine film", "dull and long", "the plot holds", "not my taste at all", "bright"] * 2
    tr = fasttran.Trainer("classification", pooler=True, pooling="cls", epochs=2, batch_size=4, show_progress=False,
                          label_names=["neg", "pos"])
    cache = fasttran.ActivationCache.build(enc, *enc.tokenize(texts)[:2], positions="cls", show_progress=False)
    tr.fit(cache, np.arange(len(texts)) % 2)
    tr.export(tmp_path / "m")
    pipe = transformers.pipeline("text-classification", model=str(tmp_path / "m"), device="cpu", top_k=None)
    ours = tr.predict(cache, output="probabilities")
    for i, text in enumerate(texts[:5]):
        got = {d["label"]: d["score"] for d in pipe([text])[0]}
        assert abs(got["neg"] - ours[i, 0]) <= 1e-4 and abs(got["pos"] - ours[i, 1]) <= 1e-4


LAYOUTS = (("sequence-classification", "classification", "AutoModelForSequenceClassification", np.arange(8) % 2),
           ("multiple-choice", "multiple-choice", "AutoModelForMultipleChoice", np.arange(4) % 2))


@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert", "electra"])
def test_a_dense_layer_starts_where_transformers_class_starts_it(models, tmp_path, minilm_dir, model_type):
    """A class that runs the base model's pooler (BERT's sequence classification and multiple choice,
    RoBERTa's multiple choice) loads it from the checkpoint, and a fasttran head with BERT's pooler on
    [CLS] starts from the same weights; a class with a dense layer of its own (RoBERTa's classification
    head, DistilBERT's pre_classifier, ELECTRA's heads) starts it at random, and so does the head."""
    path = {"bert": minilm_dir, "distilbert": models.get("distilbert"), "electra": models.get("electra")}.get(
        model_type) or ta.make_model(tmp_path / model_type, model_type, seed=4, num_hidden_layers=1)
    enc = fasttran.Encoder.from_pretrained(path)
    src = enc.pooler_state()
    assert bool(src) == enc.has_pooler
    for layout, task, auto, y in LAYOUTS:
        m = getattr(transformers, auto).from_pretrained(path)
        pooler = getattr(getattr(m, m.base_model_prefix), "pooler", None)   # the class runs the base pooler
        head = make_head(task, enc.hidden_size, y, pooling="cls", pooler=True, encoder=enc, examples=8)
        assert enc.architecture.dense_from_pooler(layout) == (pooler is not None), layout
        if pooler is not None:
            assert np.array_equal(head.tensors["pooler.dense.weight"], pooler.dense.weight.detach().numpy())
            assert np.array_equal(head.tensors["pooler.dense.bias"], pooler.dense.bias.detach().numpy())
        elif src:
            assert not np.array_equal(head.tensors["pooler.dense.weight"], src["pooler.dense.weight"])
        if layout == "sequence-classification" and pooler is not None:   # mean pooling: no class runs it
            mean = make_head(task, enc.hidden_size, y, pooling="mean", pooler=True, encoder=enc, examples=8)
            assert not np.array_equal(mean.tensors["pooler.dense.weight"], src["pooler.dense.weight"])
