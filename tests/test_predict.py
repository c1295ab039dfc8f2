"""Trainer.predict(cache, output="labels"|"logits"|"probabilities", words=...) for every head,
against the head's own math on the same features (head.step on the cache's rows), and the token
head's round trip from words to per-word label names."""
import numpy as np
import pytest

from fasttran import ActivationCache, Trainer
from fasttran.errors import InputError, UnsupportedError
from fasttran.tokens import words_from_tokens

from conftest import sst2_file


@pytest.fixture(scope="module")
def sst(enc):
    from fasttran.data import load_sst2
    s, y = load_sst2(sst2_file("train"))
    return list(s[:96]), np.array(y[:96])


@pytest.fixture(scope="module")
def pooled(enc, sst):
    return ActivationCache.build(enc, *enc.tokenize(sst[0]), positions="mean", show_progress=False)


def _fit(task, cache, targets, **kw):
    tr = Trainer(task, epochs=1, batch_size=16, show_progress=False, seed=2, **kw)
    tr.fit(cache, targets)
    return tr


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_sequence_heads(pooled, sst):
    y = sst[1]
    x = pooled.get(pooled.example_ids)
    tr = _fit("classification", pooled, y)
    logits = tr.predict(pooled, output="logits")
    want, _ = tr.head.step(x)   # the head's own forward on the same features
    assert logits.shape == (len(y), 2) and np.abs(logits - want).max() <= 1e-5
    p = tr.predict(pooled, output="probabilities")
    assert np.abs(p - _softmax(want)).max() <= 1e-6 and np.allclose(p.sum(1), 1, atol=1e-6)
    assert np.array_equal(tr.predict(pooled), want.argmax(1))
    ml = _fit("multi-label", pooled, np.stack([y, 1 - y], 1))
    z, _ = ml.head.step(x)
    assert np.abs(ml.predict(pooled, output="probabilities") - 1 / (1 + np.exp(-z.astype(np.float64)))).max() <= 1e-6
    pooler = _fit("classification-pooler", pooled, y)   # the task's pooler, and an explicit pooler= over it
    assert pooler.head.pooler and not _fit("classification-pooler", pooled, y, pooler=False).head.pooler
    assert pooler.predict(pooled, output="logits").shape == (len(y), 2)
    reg = _fit("regression", pooled, y * 2.0)
    assert reg.predict(pooled, output="logits").shape == (len(y), 1)
    with pytest.raises(UnsupportedError, match="output='logits'"):
        reg.predict(pooled, output="probabilities")
    with pytest.raises(InputError, match="output must be"):
        tr.predict(pooled, output="scores")
    with pytest.raises(InputError, match="words= is for token heads"):
        tr.predict(pooled, words=[["a"]])


def test_token_head_predicts_words(enc, sst):
    sents = [s.split() for s in sst[0][:40]]
    names = ["O", "B-X", "I-X"]
    rng = np.random.default_rng(1)
    labels = [list(rng.integers(0, 3, len(w))) for w in sents]
    tok = enc.tokenize_words(sents, labels)
    cache = ActivationCache.build(enc, *tuple(tok)[:3], positions="all", show_progress=False)
    tr = _fit("token-classification", cache, tok.labels, label_names=names)
    ids = tr.predict(cache)
    lengths = np.asarray(cache.lengths)
    assert ids.shape == (len(sents), lengths.max())
    assert all((ids[i, n:] == -100).all() and (ids[i, :n] >= 0).all() for i, n in enumerate(lengths))
    logits = tr.predict(cache, output="logits")
    x, offsets = cache.get(cache.example_ids, ragged=True)
    want, _ = tr.head._run(np.asarray(x), np.diff(np.asarray(offsets)).astype(np.int32), None, None, None, None,
                           False, 0, 0)
    want = want.reshape(-1, 3)
    got = np.concatenate([logits[i, :n] for i, n in enumerate(lengths)])
    assert np.abs(got - want).max() <= 1e-5 and np.isnan(logits[0, lengths[0]:]).all()
    probs = tr.predict(cache, output="probabilities")
    assert np.allclose(np.nansum(probs, -1)[ids >= 0], 1, atol=1e-6)
    # words: the label name of each word's first sub-token, one per word
    per_word = tr.predict(cache, words=tok)
    assert [len(p) for p in per_word] == [len(w) for w in sents]
    padded = np.pad(ids, [(0, 0), (0, tok.input_ids.shape[1] - ids.shape[1])], constant_values=-100)
    assert per_word == [[names[i] for i in s] for s in words_from_tokens(padded, tok)]
    assert tr.predict(cache, words=tok, output="probabilities")[0][0].shape == (3,)


def test_qa_and_multiple_choice_outputs(enc, sst):
    q = ["What is it?"] * 8
    ids, mask, types = enc.tokenize(q, sst[0][:8])
    cache = ActivationCache.build(enc, ids, mask, types, positions="all", show_progress=False)
    lengths = np.asarray(cache.lengths)
    ctx_start = np.array([int(np.argmax(t == 1)) for t in types])
    spans = (ctx_start, ctx_start + 1)
    tr = _fit("qa", cache, spans)
    start, end = tr.predict(cache, output="logits")
    ragged = tr.predict(cache)
    for i, r in enumerate(ragged):
        assert np.array_equal(start[i, :r.shape[1]], r[0]) and np.isneginf(start[i, r.shape[1]:]).all()
    ps, pe = tr.predict(cache, output="probabilities")
    assert np.allclose(ps.sum(1), 1, atol=1e-6) and np.allclose(pe.sum(1), 1, atol=1e-6)
    assert (ps[types[:, :ps.shape[1]] == 0] == 0).all()
    assert start.shape == (8, lengths.max())


def test_long_sequences_are_evaluated_in_fewer_per_batch(enc, sst):
    """Evaluation batches hold at most _EVAL_TOKEN_PAIRS token pairs (one layer's attention
    probabilities bounded): 512-token sequences go 16 a batch, and the outputs are those of one
    sequence at a time."""
    from fasttran import trainer as trainer_mod
    long = [" ".join((sst[0] * 2)[i:i + 80]) for i in range(40)]
    ids, mask, types = enc.tokenize(long, max_length=512)
    assert mask.sum(1).min() == 512
    tr = Trainer("classification", train_layers=1, pooling="cls", pooler=True, epochs=1, batch_size=8,
                 show_progress=False, seed=0)
    cache = tr.cache_for(enc, ids, mask, types, show_progress=False)
    tr.fit(cache, sst[1][:40])
    seen, forward = [], tr.model.forward
    tr.model.forward = lambda x, lengths, valid=None: seen.append(len(lengths)) or forward(x, lengths, valid)
    logits = tr.predict(cache, output="logits")
    assert seen == [16, 16, 8] and trainer_mod._EVAL_TOKEN_PAIRS // 512 ** 2 == 16
    one = tr._outputs(cache, batch_size=1)   # one sequence a batch
    assert np.abs(logits - one).max() <= 1e-5
