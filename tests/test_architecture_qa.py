"""Question answering on the architectures without segment types (RoBERTa, DistilBERT): SquadFeatures
against transformers' run_qa preprocessing over the same tokenizer (windows, offsets, the context as
the tokenizer's sequence id 1, start / end positions), a QA head trained on the top layer from them,
predict(squad=...) answers, and the export in the architecture's own *ForQuestionAnswering class with
equal logits. On BERT the features' context is the one token types give, bit for bit."""
import numpy as np
import pytest

import fasttran
from fasttran.squad import SquadFeatures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_architecture_tokens import CORPUS, roberta_bpe, wordpiece   # noqa: E402
from test_architectures import make_model   # noqa: E402

#: model_type -> (tokenizer builder, window length, stride): several windows per context with either
#: tokenizer (the byte-level BPE of the corpus alone cuts words into short pieces)
CASES = {"roberta": (roberta_bpe, 64, 16), "distilbert": (wordpiece, 28, 8)}


def examples(n=12, seed=0):
    """SQuAD-shaped questions over contexts made of the corpus sentences; the answer a run of words"""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ctx = " ".join(CORPUS[j] for j in rng.permutation(len(CORPUS))[:4])
        words = ctx.split(" ")
        a, k = int(rng.integers(0, len(words) - 3)), int(rng.integers(1, 4))
        start = len(" ".join(words[:a])) + (1 if a else 0)
        answer = " ".join(words[a:a + k])
        assert ctx[start:start + len(answer)] == answer
        q = " ".join(rng.choice(" ".join(CORPUS).split(" "), int(rng.integers(1, 3))))
        out.append({"id": f"q{i}", "question": q, "context": ctx, "answers": [answer], "answer_starts": [start]})
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    """(encoder with its tokenizer, path, model_type): a random-weight checkpoint of the real model's
    widths (two layers) with the tokenizer beside it"""
    t = request.param
    build, L, S = CASES[t]
    tok, special = build()
    root = tmp_path_factory.mktemp(t)
    path = make_model(root, t, seed=21, vocab_size=tok.get_vocab_size())
    tok.save(str(root / "tokenizer.json"))
    enc = fasttran.Encoder.from_pretrained(path)
    assert enc.tokenizer is not None and enc.architecture.token_types != "segments"
    return enc, path, t, special, L, S


def run_qa_features(tokenizer, exs, max_length, stride):
    """transformers' examples/pytorch/question-answering/run_qa.py preprocessing (train and
    validation), without padding: per feature (ids, context mask, context offsets, start, end),
    start = end = -1 (run_qa: the CLS index) where the window does not hold the answer"""
    enc = tokenizer([e["question"].lstrip() for e in exs], [e["context"] for e in exs], truncation="only_second",
                    max_length=max_length, stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    out = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        seq = enc.sequence_ids(i)
        ex = exs[enc["overflow_to_sample_mapping"][i]]
        s_char = ex["answer_starts"][0]
        e_char = s_char + len(ex["answers"][0])
        ctx = [k for k, s in enumerate(seq) if s == 1]
        first, last = ctx[0], ctx[-1]
        if not (offsets[first][0] <= s_char and offsets[last][1] >= e_char):
            s = e = -1
        else:
            s, e = first, last
            while s <= last and offsets[s][0] <= s_char:
                s += 1
            s -= 1
            while offsets[e][1] >= e_char:
                e -= 1
            e += 1
        mask = np.array([x == 1 for x in seq], np.int32)
        offs = [o if x == 1 else (-1, -1) for o, x in zip(offsets, seq)]
        out.append((enc["input_ids"][i], mask, offs, s, e))
    return out


def test_features_equal_run_qa_preprocessing(model):
    enc, path, t, special, L, S = model
    exs = examples()
    feats = SquadFeatures(exs, enc, max_length=L, doc_stride=S)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=enc.tokenizer, **special)
    ref = run_qa_features(hf, exs, L, S)
    assert len(feats) == len(ref) > len(exs)   # several windows per question
    assert (feats.start_positions >= 0).sum() >= len(exs)
    for f, (ids, mask, offs, s, e) in enumerate(ref):
        n = len(ids)
        assert feats.attention_mask[f].sum() == n
        assert feats.input_ids[f, :n].tolist() == ids
        assert np.array_equal(feats.context_mask[f, :n], mask) and not feats.context_mask[f, n:].any()
        assert feats.offsets[f, :n].tolist() == [list(o) for o in offs]
        assert (int(feats.start_positions[f]), int(feats.end_positions[f])) == (s, e), f
    assert not feats.token_type_ids.any()   # no segment types: zeros, as the encoder takes them
    sub = feats.with_answers()
    assert np.array_equal(sub.context_mask, feats.context_mask[feats.start_positions >= 0])


def test_qa_head_trains_predicts_and_exports(model, tmp_path):
    enc, path, t, _, L, S = model
    exs = examples(16, seed=1)
    feats = SquadFeatures(exs, enc, max_length=L, doc_stride=S)
    train = feats.with_answers()
    tr = fasttran.Trainer("qa", epochs=3, batch_size=8, show_progress=False, seed=1, train_layers=1, lr=1e-3)
    cache = tr.cache_for(enc, train.input_ids, train.attention_mask, train.token_type_ids, show_progress=False)
    # the spans alone do not say where the context is: refused, naming what to pass
    with pytest.raises(fasttran.InputError, match="needs the SquadFeatures"):
        fasttran.Trainer("qa", show_progress=False).fit(cache, (train.start_positions, train.end_positions))
    hist = tr.fit(cache, train)
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    # every window: the context rows only, answers as text
    full = tr.cache_for(enc, feats.input_ids, feats.attention_mask, feats.token_type_ids, show_progress=False)
    answers = tr.predict(full, squad=feats)
    assert sorted(answers) == sorted(e["id"] for e in exs)
    for e in exs:
        assert answers[e["id"]] in e["context"]
    m = tr.evaluate(full, feats)
    assert m["questions"] == len(exs) and 0 <= m["f1"] <= 100
    prep = tr.head.prepare_eval(full, feats)
    outs = tr._outputs(full, prep)
    for f, o in enumerate(outs):   # -inf exactly outside the features' context
        n = int(feats.attention_mask[f].sum())
        assert np.array_equal(np.isfinite(o[0]), feats.context_mask[f, :n] == 1)
    # features not from this cache are refused
    with pytest.raises(fasttran.InputError, match="not the ones this cache was built from"):
        tr.evaluate(full, SquadFeatures(examples(16, seed=2), enc, max_length=L, doc_stride=S))
    # the architecture's own QA class: equal logits on the context, the same answers
    tr.export(tmp_path / "m")
    hf = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "m").eval()
    assert type(hf).__name__ == {"roberta": "RobertaForQuestionAnswering",
                                 "distilbert": "DistilBertForQuestionAnswering"}[t]
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(feats.input_ids.astype(np.int64)),
                 attention_mask=torch.as_tensor(feats.attention_mask.astype(np.int64)))
    theirs = []
    for f, o in enumerate(outs):
        n, ctx = o.shape[1], feats.context_mask[f, :o.shape[1]] == 1
        lg = np.stack([out.start_logits.numpy()[f, :n], out.end_logits.numpy()[f, :n]])
        assert np.abs(o[:, ctx] - lg[:, ctx]).max() <= 1e-4
        theirs.append(np.where(ctx, lg, -np.inf))
    assert feats.postprocess(theirs) == answers


def test_bert_features_context_is_the_token_types_context(minilm_dir):
    """BERT: the features' context mask is type 1 but the final [SEP], so the head's rows are the same bits"""
    from fasttran.heads.span import context_rows
    enc = fasttran.Encoder.from_pretrained(minilm_dir)
    feats = SquadFeatures(examples(10, seed=3), enc.tokenizer, max_length=40, doc_stride=12)
    assert np.array_equal(feats.token_type_ids, SquadFeatures(examples(10, seed=3), enc, max_length=40,
                                                              doc_stride=12).token_type_ids)
    cache = fasttran.ActivationCache.build(enc, feats.input_ids, feats.attention_mask, feats.token_type_ids,
                                           positions="all", show_progress=False)
    a, b = context_rows(cache), context_rows(cache, squad=feats)
    assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b)
    idx = np.array([3, 0, 7])
    assert np.array_equal(context_rows(cache, idx), context_rows(cache, idx, squad=feats))
