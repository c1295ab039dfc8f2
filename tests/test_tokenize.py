"""Encoder.tokenize with sentence pairs and Encoder.tokenize_words equal transformers' tokenizer for
the same checkpoint (all-MiniLM-L6-v2) on every example of real MRPC, STS-B and CoNLL-2003 valid,
with and without truncation; words_from_tokens inverts the labelling; bad input is refused."""
import pickle

import numpy as np
import pytest

import fasttran
from fasttran.readers import read_conll, read_glue_tsv

from conftest import conll_file, glue_file


@pytest.fixture(scope="module")
def hf_tok(minilm_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def pairs():
    out = []
    for task in ("MRPC", "STS-B"):
        for split in ("train", "dev"):
            ex = read_glue_tsv(glue_file(task, split))
            out.append((f"{task} {split}", ex.texts, ex.text_pairs))
    return out


def hf_arrays(enc_out):
    return [np.asarray(enc_out[k], np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")]


def segments(mask, types):
    """The lengths of a pair's two segments, without [CLS] and the [SEP]s."""
    real = mask == 1
    return (real & (types == 0)).sum(axis=1) - 2, (real & (types == 1)).sum(axis=1) - 1


def test_pairs_equal_transformers_on_all_mrpc_and_stsb(enc, hf_tok, pairs):
    """Every pair of MRPC and STS-B (train + dev), at the model's max_seq_length and at 24 tokens,
    where most pairs are cut (longest_first: the longer side loses tokens first)."""
    total = cut_both = 0
    for name, a, b in pairs:
        for max_length in (enc.max_seq_length, 24):
            ours = enc.tokenize(a, b, max_length=max_length)
            ref = hf_arrays(hf_tok(a, b, truncation="longest_first", max_length=max_length, padding="longest"))
            for what, x, y in zip(("input_ids", "attention_mask", "token_type_ids"), ours, ref):
                assert x.dtype == np.int64 and x.shape == y.shape, (name, max_length, what, x.shape, y.shape)
                bad = np.nonzero((x != y).any(axis=1))[0]
                assert bad.size == 0, f"{name}, max_length={max_length}: {what} differ in pair {bad[0]}: {a[bad[0]]!r} / {b[bad[0]]!r}"
            if max_length == 24:
                assert ours[1].sum(axis=1).max() == 24
                _, fmask, ftypes = hf_arrays(hf_tok(a, b, padding="longest"))   # not truncated
                (fa, fb), (ca, cb) = segments(fmask, ftypes), segments(ours[1], ours[2])
                cut_both += int(((ca < fa) & (cb < fb)).sum())
            total += len(a)
    assert total == 2 * (3667 + 408 + 5749 + 1500)
    assert cut_both > 1000   # longest_first really cut both sides of many pairs


def test_pair_structure_and_default_length(enc, hf_tok):
    ids, mask, types = enc.tokenize(["a b", "c"], ["d", "e f g h"])
    cls, sep = hf_tok.cls_token_id, hf_tok.sep_token_id
    assert ids[0].tolist() == [cls, *hf_tok.convert_tokens_to_ids(["a", "b"]), sep, hf_tok.convert_tokens_to_ids("d"), sep, 0, 0]
    assert types[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and mask[0].tolist() == [1] * 6 + [0, 0]
    # a single pair as two strings; the default max_length is the model's max_seq_length (256)
    one = enc.tokenize("x " * 400, "y " * 10)
    assert one[0].shape == (1, enc.max_seq_length) and (one[2] == 1).sum() == 11
    # the tokenizer's own truncation is left as it was
    assert enc.tokenizer.truncation["max_length"] == enc.max_seq_length
    # the signature before pairs: tokenize(texts, max_length) positionally
    assert enc.tokenize(["a b c d e f"], 4)[0].shape == (1, 4)
    assert np.array_equal(enc.tokenize(["a b c"])[0], hf_arrays(hf_tok(["a b c"], padding="longest"))[0])


def test_pair_errors(enc):
    with pytest.raises(fasttran.InputError, match=r"texts has 2 entries but text_pairs has 1"):
        enc.tokenize(["a", "b"], ["c"])
    with pytest.raises(fasttran.InputTypeError, match=r"text_pairs\[1\] is NoneType.*expected a string.*''"):
        enc.tokenize(["a", "b"], ["c", None])
    with pytest.raises(fasttran.InputTypeError, match=r"texts\[0\] is int"):
        enc.tokenize([3, "b"])
    with pytest.raises(fasttran.InputTypeError, match="bytes"):
        enc.tokenize(b"abc")
    with pytest.raises(fasttran.InputError, match=r"max_length=2 is out of range: at least the 3 special tokens a pair"):
        enc.tokenize(["a b c"], ["d e f"], max_length=2)
    with pytest.raises(fasttran.InputError, match=r"at most the model's 512 positions"):
        enc.tokenize(["a"], max_length=513)
    with pytest.raises(fasttran.InputTypeError, match="max_length must be an int"):
        enc.tokenize(["a"], max_length=12.0)
    assert enc.tokenizer.truncation["max_length"] == enc.max_seq_length


@pytest.fixture(scope="module")
def conll_valid():
    return read_conll(conll_file("valid"))


def hf_word_reference(hf_tok, words, labels, max_length):
    """transformers' is_split_into_words encoding and the labels as its token-classification
    example aligns them (first sub-token labelled, the rest -100)."""
    out = hf_tok(words, is_split_into_words=True, truncation=True, max_length=max_length, padding="longest")
    arrays = hf_arrays(out)
    T = arrays[0].shape[1]
    wids = np.full((len(words), T), -1, np.int64)
    tok_labels = np.full((len(words), T), -100, np.int64)
    for i in range(len(words)):
        prev = None
        for t, w in enumerate(out.word_ids(i)):
            if w is not None:
                wids[i, t] = w
                if w != prev:
                    tok_labels[i, t] = labels[i][w]
            prev = w
    return arrays, wids, tok_labels


def test_words_equal_transformers_on_conll_valid(enc, hf_tok, conll_valid):
    """All 3,250 sentences of CoNLL-2003 valid, at 256 tokens (nothing cut) and at 16 (many words
    cut): ids, mask, types, word ids and first-sub-token labels equal transformers'; the words cut
    are counted, and words_from_tokens gives each kept word its label back."""
    words, labels = conll_valid.words, conll_valid.labels
    for max_length in (256, 16):
        wt = enc.tokenize_words(words, labels, max_length=max_length)
        (ids, mask, types), wids, tok_labels = hf_word_reference(hf_tok, words, labels, max_length)
        for what, x, y in (("input_ids", wt.input_ids, ids), ("attention_mask", wt.attention_mask, mask),
                           ("token_type_ids", wt.token_type_ids, types), ("word_ids", wt.word_ids, wids),
                           ("labels", wt.labels, tok_labels)):
            assert x.dtype == np.int64 and np.array_equal(x, y), (max_length, what)
        kept = np.array([len({w for w in r if w >= 0}) for r in wids])
        nwords = np.array([len(s) for s in words])
        assert np.array_equal(wt.missing_words, nwords - kept) and np.array_equal(wt.num_words, nwords)
        if max_length == 256:
            assert wt.missing_words.sum() == 0
        else:
            assert wt.missing_words.sum() > 10000 and "without a token" in repr(wt)
        back = fasttran.words_from_tokens(wt.labels, wt, fill=-1)
        for i in range(len(words)):
            assert len(back[i]) == len(words[i])
            k = kept[i]
            assert back[i][:k] == labels[i][:k].tolist() and back[i][k:] == [-1] * (len(words[i]) - k)


def test_words_from_tokens_shapes_and_fill(enc):
    wt = enc.tokenize_words([["Peter", "", "Blackburn"], ["EU"]])
    assert wt.labels is None and wt.missing_words.tolist() == [1, 0]   # '' has no sub-token
    ids, mask, types, labels, wids = wt                                  # unpacks as five arrays
    again = pickle.loads(pickle.dumps(wt))
    assert np.array_equal(again.missing_words, wt.missing_words) and again.max_length == wt.max_length
    logits = np.random.default_rng(0).normal(size=ids.shape + (3,))
    per_word = enc.words_from_tokens(logits, wids)                       # no word counts: up to the last word seen
    assert len(per_word[0]) == 3 and per_word[0][1] is None and per_word[0][0].shape == (3,)
    first = np.nonzero(wids[0] == 2)[0][0]
    assert np.array_equal(per_word[0][2], logits[0, first])
    assert fasttran.words_from_tokens(np.argmax(logits, -1), wids, num_words=[4, 2], fill="O")[1][1] == "O"
    with pytest.raises(fasttran.InputError, match="first two dimensions"):
        fasttran.words_from_tokens(logits[:, :2], wids)
    with pytest.raises(fasttran.InputError, match="num_words says 1 words"):
        fasttran.words_from_tokens(logits, wids, num_words=[1, 1])


def test_word_errors(enc):
    with pytest.raises(fasttran.InputError, match=r"labels\[1\] has 1 labels for 2 words: token labels must be aligned"):
        enc.tokenize_words([["a", "b"], ["c", "d"]], [[0, 1], [0]])
    with pytest.raises(fasttran.InputError, match="labels has 1 sentences but words has 2"):
        enc.tokenize_words([["a"], ["b"]], [[0]])
    with pytest.raises(fasttran.InputTypeError, match=r"list of sentences, each a list of words.*\[words\]"):
        enc.tokenize_words(["EU", "rejects"])
    with pytest.raises(fasttran.InputTypeError, match=r"words\[0\]\[1\] is int"):
        enc.tokenize_words([["a", 3]])
    with pytest.raises(fasttran.InputTypeError, match="map tag names to ids"):
        enc.tokenize_words([["a"]], [["B-PER"]])
    with pytest.raises(fasttran.InputTypeError, match="integer class ids"):
        enc.tokenize_words([["a"]], [[0.5]])
    with pytest.raises(fasttran.InputError, match="negative label -2"):
        enc.tokenize_words([["a"]], [[-2]])
    ok = enc.tokenize_words([["a", "b"]], [[-100, 1]])   # -100: a word to ignore
    assert ok.labels[0].tolist() == [-100, -100, 1, -100]
