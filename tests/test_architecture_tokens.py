"""Tokenization per architecture: tiny tokenizer.json files built with the `tokenizers` library in the
shapes the real checkpoints ship (RoBERTa's byte-level BPE with `<s> a </s></s> b </s>`, XLM-R's and
CamemBERT's SentencePiece Unigram, DistilBERT's and ELECTRA's WordPiece), and Encoder.tokenize equal
to transformers' PreTrainedTokenizerFast over the same file: ids, mask and token types, single texts
and pairs, with truncation. Architectures without token types get zeros, as their tokenizers give
no token_type_ids."""
import numpy as np
import pytest

import fasttran

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CORPUS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
          "fasttran fine-tunes encoders with an activation cache", "Le chat est sur la table.",
          "Wer reitet so spät durch Nacht und Wind?", "numbers 12 345 and symbols #$%!", "über café naïve résumé"]
TEXTS = ["the lazy fox saves time", "Le chat dort.", "an unseen wordpiece: xylophone!", "", "a " * 40,
         "über naïve café, 345 #"]
PAIRS = ["a stitch over the dog", "Wer reitet?", "b " * 30, "nine", "brown", "la table"]


def roberta_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>",
                                                                                      "<mask>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok, dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                     pad_token="<pad>", mask_token="<mask>")


def sentencepiece_unigram():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=150, special_tokens=["<s>", "<pad>", "</s>",
                                                                                          "<unk>", "<mask>"],
                                                            unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return tok, dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                     pad_token="<pad>", mask_token="<mask>")


def wordpiece():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]",
                                                                                            "[SEP]", "[MASK]"]))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok, dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


#: model_type -> (tokenizer builder, pad id, transformers' model_input_names for the architecture)
CASES = {
    "roberta": (roberta_bpe, 1, ["input_ids", "attention_mask"]),
    "xlm-roberta": (sentencepiece_unigram, 1, ["input_ids", "attention_mask"]),
    "camembert": (sentencepiece_unigram, 1, ["input_ids", "attention_mask"]),
    "distilbert": (wordpiece, 0, ["input_ids", "attention_mask"]),
    "electra": (wordpiece, 0, ["input_ids", "token_type_ids", "attention_mask"]),
    "bert": (wordpiece, 0, ["input_ids", "token_type_ids", "attention_mask"]),
}


@pytest.fixture(params=sorted(CASES))
def pair_of_tokenizers(request, tmp_path):
    model_type = request.param
    build, pad, names = CASES[model_type]
    tok, special = build()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"model_type": model_type, "vocab_size": tok.get_vocab_size(), "pad_token_id": pad, "num_hidden_layers": 1,
           "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8, "embedding_size": 8,
           "dim": 8, "n_layers": 1, "n_heads": 2, "hidden_dim": 8,
           "max_position_embeddings": 130 if pad else 128, "type_vocab_size": 2 if "token_type_ids" in names else 1}
    enc = fasttran.Encoder(cfg).load_tokenizer(str(tmp_path))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                              model_input_names=names, **special)
    return model_type, enc, hf


def hf_arrays(out, shape):
    types = out.get("token_type_ids")
    return (np.asarray(out["input_ids"], np.int64), np.asarray(out["attention_mask"], np.int64),
            np.zeros(shape, np.int64) if types is None else np.asarray(types, np.int64))


@pytest.mark.parametrize("max_length", [None, 12, 7])
def test_single_texts_and_pairs_as_transformers(pair_of_tokenizers, max_length):
    model_type, enc, hf = pair_of_tokenizers
    kw = dict(truncation="longest_first", max_length=max_length or enc.max_seq_length, padding="longest")
    for args in ((TEXTS,), (TEXTS, PAIRS)):
        ours = enc.tokenize(*args, max_length=max_length)
        theirs = hf_arrays(hf(*args, **kw), ours[0].shape)
        for name, a, b in zip(("input_ids", "attention_mask", "token_type_ids"), ours, theirs):
            assert a.shape == b.shape and np.array_equal(a, b), (model_type, name, len(args))
    ids, mask, types = enc.tokenize(TEXTS[:2], PAIRS[:2])
    if enc.architecture.token_types != "segments":
        assert not types.any()   # no token types: zeros
    else:
        assert types.any()
    if model_type == "roberta":   # <s> a </s></s> b </s>
        toks = hf.convert_ids_to_tokens(ids[1][mask[1] == 1].tolist())
        assert toks[0] == "<s>" and toks[-1] == "</s>" and "</s></s>" in "".join(toks)


def test_words_get_zero_types_too(pair_of_tokenizers):
    model_type, enc, hf = pair_of_tokenizers
    words = [t.split() for t in CORPUS[:3]]
    out = enc.tokenize_words(words, [[0] * len(w) for w in words])
    theirs = hf(words, is_split_into_words=True, truncation=True, max_length=enc.max_seq_length, padding="longest")
    assert np.array_equal(out.input_ids, np.asarray(theirs["input_ids"]))
    assert not out.token_type_ids.any()


def test_roberta_length_limit_leaves_room_for_the_padding_offset(tmp_path):
    tok, _ = roberta_bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    enc = fasttran.Encoder({"model_type": "roberta", "vocab_size": tok.get_vocab_size(), "num_hidden_layers": 1,
                            "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
                            "max_position_embeddings": 20, "type_vocab_size": 1, "pad_token_id": 1})
    enc.load_tokenizer(str(tmp_path))
    assert enc.max_seq_length == 18
    ids, mask, _ = enc.tokenize(["the " * 50])
    assert ids.shape == (1, 18) and enc.forward(ids, mask).shape == (1, 18, 8)
    with pytest.raises(fasttran.InputError, match="at most the model's 18 positions"):
        enc.tokenize(["the"], max_length=19)
