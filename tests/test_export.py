"""Trainer.export(): the fine-tuned model in transformers' AutoModelFor* classes (and, for heads
transformers has no class for, in sentence-transformers) gives fasttran's logits within 1e-4, for
every head, frozen and with the top layers trained; id2label and problem_type travel with it."""
import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer

from conftest import sst2_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sents():
    from fasttran.data import load_sst2
    s, y = load_sst2(sst2_file("train"))
    return s[:40], np.array(y[:40])


def _fit(enc, task, k, inputs, targets, pooling="cls", **kw):
    args = dict(epochs=1, batch_size=8, show_progress=False, seed=1, train_layers=k, pooling=pooling)
    args.update(kw)
    tr = Trainer(task, **args)
    if k:
        cache = tr.cache_for(enc, *inputs, show_progress=False)
    else:
        positions = "all" if task in ("token-classification", "qa") else pooling
        cache = ActivationCache.build(enc, *inputs, positions=positions, show_progress=False)
    tr.fit(cache, targets)
    return tr, cache


def _torch_inputs(inputs):
    ids, mask, types = inputs
    return dict(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                token_type_ids=torch.as_tensor(types))


def _max_diff(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("task", ["classification", "regression", "multi-label"])
def test_sequence_heads_load_in_automodel_for_sequence_classification(enc, sents, tmp_path, k, task):
    s, y = sents
    inputs = enc.tokenize(s)
    targets = {"classification": y, "regression": y * 4.0 + 0.5,
               "multi-label": np.stack([y, 1 - y, y], 1)}[task]
    tr, cache = _fit(enc, task, k, inputs, targets, pooler=True,
                     label_names=["neg", "pos"] if task == "classification" else None)
    tr.export(tmp_path / "m")
    ours = tr._outputs(cache)
    from transformers import AutoModelForSequenceClassification
    m = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        theirs = m(**_torch_inputs(inputs)).logits.numpy()
    assert _max_diff(ours, theirs) <= 1e-4
    want = {"classification": "single_label_classification", "regression": "regression",
            "multi-label": "multi_label_classification"}[task]
    assert m.config.problem_type == want
    if task == "classification":
        assert m.config.id2label == {0: "neg", 1: "pos"}
        from transformers import pipeline
        pipe = pipeline("text-classification", model=str(tmp_path / "m"), device="cpu")
        assert pipe(s[0])[0]["label"] == ["neg", "pos"][int(ours[0].argmax())]
    # fasttran reads its encoder back from the directory
    back = fasttran.Encoder.from_pretrained(str(tmp_path / "m"))
    from fasttran.export import fine_tuned_encoder
    assert _max_diff(back.forward(*inputs, pooling="cls"),
                     fine_tuned_encoder(enc, tr.top).forward(*inputs, pooling="cls")) <= 1e-6


@pytest.mark.parametrize("k", [0, 1])
def test_token_head_loads_in_automodel_for_token_classification(enc, sents, tmp_path, k):
    s, _ = sents
    words = [t.split() for t in s[:24]]
    rng = np.random.default_rng(0)
    names = ["O", "B-X", "I-X"]
    labels = [list(rng.integers(0, 3, len(w))) for w in words]
    tok = enc.tokenize_words(words, labels)
    inputs = tuple(tok)[:3]
    tr, cache = _fit(enc, "token-classification", k, inputs, tok.labels, label_names=names)
    tr.export(tmp_path / "m")
    ours = tr._outputs(cache)
    from transformers import AutoModelForTokenClassification
    m = AutoModelForTokenClassification.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        theirs = m(**_torch_inputs(inputs)).logits.numpy()
    mask = inputs[1]
    assert max(_max_diff(o, theirs[b, :int(mask[b].sum())]) for b, o in enumerate(ours)) <= 1e-4
    assert m.config.id2label == dict(enumerate(names))


@pytest.mark.parametrize("k", [0, 1])
def test_qa_head_loads_in_automodel_for_question_answering(enc, sents, tmp_path, k):
    s, _ = sents
    ids, mask, types = enc.tokenize(s[0:30:2], s[1:30:2])
    first = np.argmax(types == 1, axis=1)                       # the context's first token
    last = mask.sum(axis=1) - 2                                  # its last (before the final [SEP])
    spans = (np.minimum(first + 1, last), np.minimum(first + 2, last))
    tr, cache = _fit(enc, "qa", k, (ids, mask, types), spans, lr=1e-3)
    tr.export(tmp_path / "m")
    ours = tr._outputs(cache)
    from transformers import AutoModelForQuestionAnswering
    m = AutoModelForQuestionAnswering.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        out = m(**_torch_inputs((ids, mask, types)))
    for b, o in enumerate(ours):
        ctx = np.isfinite(o[0])
        n = o.shape[1]
        assert _max_diff(o[0][ctx], out.start_logits.numpy()[b, :n][ctx]) <= 1e-4
        assert _max_diff(o[1][ctx], out.end_logits.numpy()[b, :n][ctx]) <= 1e-4


@pytest.mark.parametrize("k,pooler", [(0, False), (2, True)])
def test_mean_pooled_heads_load_in_sentence_transformers(enc, sents, tmp_path, k, pooler):
    """BERT's classes have no mean-pooled classifier: SentenceTransformer(dir).encode gives the logits."""
    st = pytest.importorskip("sentence_transformers")
    s, y = sents
    inputs = enc.tokenize(s)
    tr, cache = _fit(enc, "classification", k, inputs, y, pooling="mean", pooler=pooler)
    tr.export(tmp_path / "m")
    from fasttran.export import layout_of
    assert layout_of(tr.head) == "sentence-transformers"
    ours = tr._outputs(cache)
    model = st.SentenceTransformer(str(tmp_path / "m"), device="cpu")
    theirs = model.encode(list(s), convert_to_numpy=True, batch_size=16)
    assert _max_diff(ours, theirs) <= 1e-4


def test_export_needs_the_encoder(enc, sents, tmp_path):
    s, y = sents
    inputs = enc.tokenize(s[:16])
    c = ActivationCache.build(enc, *inputs, positions="cls", show_progress=False, disk_dir=tmp_path / "c")
    tr = Trainer("classification", pooler=True, epochs=1, show_progress=False)
    tr.fit(ActivationCache.open(tmp_path / "c"), y[:16])   # opened without its encoder
    with pytest.raises(fasttran.InputError, match="needs the encoder"):
        tr.export(tmp_path / "m")
    tr.export(tmp_path / "m", encoder=enc)
    assert c.fingerprint == tr.features["fingerprint"]
