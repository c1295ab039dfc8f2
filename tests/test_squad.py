"""SQuAD preprocessing, post-processing and the official metric on real SQuAD v1.1, and a QA
head trained from the activation cache (frozen MiniLM)."""
import os

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.squad import SquadFeatures, f1_score, load_squad, normalize_answer, squad_metrics

from conftest import squad_file


@pytest.fixture(scope="module")
def enc(minilm_dir):
    return fasttran.Encoder.from_pretrained(minilm_dir)


def _squad(name):
    return load_squad(squad_file(name))


@pytest.fixture(scope="module")
def squad_train():
    return _squad("train-subset-v1.1.json")


@pytest.fixture(scope="module")
def squad_dev():
    return _squad("dev-v1.1.json")


def test_official_normalisation_and_f1():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert f1_score("Denver Broncos", "the Denver Broncos") == 1.0
    assert f1_score("Broncos won", "Denver Broncos") == pytest.approx(0.5)
    ex = [{"id": "a", "answers": ["Denver Broncos", "Broncos"]}, {"id": "b", "answers": ["1990"]}]
    m = squad_metrics({"a": "broncos", "b": "in 1990"}, ex)
    assert m["exact_match"] == 50.0 and m["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)


def test_features_map_answers_and_back(enc, squad_train, squad_dev):
    assert len(squad_train) == 11877 and len(squad_dev) == 10570
    feats = SquadFeatures(squad_train[:300], enc.tokenizer, max_length=384, doc_stride=128)
    assert feats.input_ids.shape[1] <= 384 and len(feats) >= 300
    has = feats.start_positions >= 0
    assert has.mean() > 0.9
    # the token span's text is the answer (up to tokenisation boundaries)
    ok = 0
    for f in np.flatnonzero(has):
        ex = feats.examples[feats.example_index[f]]
        a, b = feats.offsets[f, feats.start_positions[f], 0], feats.offsets[f, feats.end_positions[f], 1]
        ok += normalize_answer(ex["context"][a:b]) == normalize_answer(ex["answers"][0])
    assert ok / has.sum() > 0.97
    # long contexts give several windows with 128 tokens of overlap
    small = SquadFeatures(squad_train[:50], enc.tokenizer, max_length=96, doc_stride=32)
    assert len(small) > 50
    # oracle logits (peaked on the true span) post-process to the answer: EM on those questions
    logits = []
    for f in range(len(small)):
        n = int(small.attention_mask[f].sum())
        lg = np.where(small.offsets[f, :n, 0] >= 0, 0.0, -np.inf) * np.ones((2, 1))
        if small.start_positions[f] >= 0:
            lg[0, small.start_positions[f]] = lg[1, small.end_positions[f]] = 10.0
        logits.append(lg)
    preds = small.postprocess(logits)
    answerable = sorted({small.examples[i]["id"] for i in small.example_index[small.start_positions >= 0]})
    m = squad_metrics(preds, [e for e in small.examples if e["id"] in answerable])
    assert m["f1"] > 97


def test_qa_head_trains_from_the_cache(enc, squad_train):
    feats = SquadFeatures(squad_train[:160], enc.tokenizer, max_length=192, doc_stride=64).with_answers()
    cache = ActivationCache.build(enc, feats.input_ids, feats.attention_mask, feats.token_type_ids, positions="all",
                                  dtype="float16", show_progress=False)
    tr = Trainer("qa", optimizer="lamb", lr=5e-2, epochs=4, batch_size=16, show_progress=False)
    hist = tr.fit(cache, (feats.start_positions, feats.end_positions))
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    m = tr.evaluate(cache, feats)
    # training-set fit of a frozen encoder + linear head, against the same head untrained (its random
    # spans overlap the answers: F1 5-8.5, EM 0-0.6 over seeds; trained: F1 7.4-10, EM 5-7)
    untrained = Trainer("qa", optimizer="lamb", lr=1e-12, epochs=1, batch_size=16, show_progress=False)
    untrained.fit(cache, (feats.start_positions, feats.end_positions))
    m0 = untrained.evaluate(cache, feats)
    assert m["questions"] == m0["questions"] == 160
    assert m["exact_match"] >= m0["exact_match"] + 3 and m["f1"] > m0["f1"], (m, m0)
    with pytest.raises(fasttran.InputError, match="not in the context"):
        s = feats.start_positions.copy()
        s[0] = 0      # [CLS]
        Trainer("qa", show_progress=False).fit(cache, (s, feats.end_positions))
