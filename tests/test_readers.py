"""fasttran.readers: real GLUE TSVs (MRPC, STS-B, CoLA, SST-2) and CoNLL-2003 read as their README
describes them; the other GLUE layouts, byte-order marks, CRLF, label maps shared between train and
dev, records and datasets.Dataset columns; every bad input refused with file:line (or record)."""
import numpy as np
import pytest

import fasttran
from fasttran.readers import Examples, from_records, read_conll, read_glue_tsv

from conftest import conll_file, glue_file, sst2_file


def plain_rows(path, header=True):
    """The file split by hand (the reference the reader is checked against)."""
    with open(path, encoding="utf-8-sig") as f:
        rows = [l.rstrip("\n").split("\t") for l in f]
    return rows[1:] if header else rows


@pytest.mark.parametrize("split", ["train", "dev"])
def test_real_glue_files(split):
    mrpc = read_glue_tsv(glue_file("MRPC", split))
    rows = plain_rows(glue_file("MRPC", split))
    assert mrpc.task == "classification" and mrpc.label_names == ["0", "1"] and len(mrpc) == len(rows)
    assert mrpc.texts == [r[3] for r in rows] and mrpc.text_pairs == [r[4] for r in rows]
    assert mrpc.labels.dtype == np.int64 and mrpc.labels.tolist() == [int(r[0]) for r in rows]
    assert not mrpc.texts[0].startswith("\ufeff") and repr(mrpc).startswith(f"Examples(MRPC {split}.tsv: ")

    sts = read_glue_tsv(glue_file("STS-B", split))
    rows = plain_rows(glue_file("STS-B", split))
    assert sts.task == "regression" and sts.label_names is None and len(sts) == {"train": 5749, "dev": 1500}[split]
    assert sts.labels.dtype == np.float32 and np.array_equal(sts.labels, np.array([float(r[9]) for r in rows], np.float32))
    assert sts.texts == [r[7] for r in rows] and sts.text_pairs == [r[8] for r in rows]

    cola = read_glue_tsv(glue_file("CoLA", split))   # no header: recognised by its 4 columns
    rows = plain_rows(glue_file("CoLA", split), header=False)
    assert len(cola) == {"train": 8551, "dev": 1043}[split] and cola.text_pairs is None
    assert cola.texts == [r[3] for r in rows] and cola.labels.tolist() == [int(r[1]) for r in rows]
    assert repr(cola).startswith(f"Examples(CoLA {split}.tsv: ")

    sst = read_glue_tsv(sst2_file(split))
    assert sst.texts[:5] == fasttran.data.load_sst2(sst2_file(split))[0][:5]


def test_dev_uses_train_label_map(tmp_path):
    train = tmp_path / "train.tsv"
    train.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tnot_entailment\n1\tc\td\tentailment\n")
    dev = tmp_path / "dev.tsv"
    dev.write_text("index\tsentence1\tsentence2\tlabel\n0\te\tf\tnot_entailment\n1\tg\th\tnot_entailment\n")
    tr = read_glue_tsv(train)
    assert tr.label_names == ["entailment", "not_entailment"] and tr.labels.tolist() == [1, 0]
    dv = read_glue_tsv(dev, label_names=tr.label_names)
    assert dv.labels.tolist() == [1, 1] and dv.label_map == {"entailment": 0, "not_entailment": 1}
    bad = tmp_path / "bad.tsv"
    bad.write_text("index\tsentence1\tsentence2\tlabel\n0\te\tf\tentailment\n1\tg\th\tneutral\n")
    with pytest.raises(fasttran.InputError, match=r"bad.tsv:3: label 'neutral' is not one of the known labels "
                                                  r"\['entailment', 'not_entailment'\] \(a label the training data never had\)"):
        read_glue_tsv(bad, label_names=tr.label_names)
    # integer classes: a class id past train's is refused the same way
    with pytest.raises(fasttran.InputError, match=r"x.tsv:3: class id 2 is not one of the 2 known labels"):
        p = tmp_path / "x.tsv"
        p.write_text("sentence\tlabel\na\t1\nb\t2\n")
        read_glue_tsv(p, label_names=["0", "1"])


def test_glue_layouts_bom_crlf_and_columns(tmp_path):
    # MNLI (12 columns in train, gold_label last): GLUE's class order whatever the file's order
    head = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
            "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
    rows = [f"{i}\t1\t1g\tgov\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tpremise {i}\thypothesis {i}\t{l}\t{l}"
            for i, l in enumerate(["neutral", "contradiction", "entailment", "neutral"])]
    p = tmp_path / "mnli.tsv"
    p.write_bytes(("\ufeff" + "\r\n".join([head] + rows) + "\r\n").encode())   # BOM and CRLF
    m = read_glue_tsv(p)
    assert m.label_names == ["entailment", "neutral", "contradiction"] and m.labels.tolist() == [1, 2, 0, 1]
    assert m.texts[1] == "premise 1" and m.text_pairs[3] == "hypothesis 3" and repr(m).startswith("Examples(MNLI")
    # QNLI: question / sentence
    q = tmp_path / "qnli.tsv"
    q.write_text("index\tquestion\tsentence\tlabel\n0\tWho?\tHim.\tentailment\n")
    assert read_glue_tsv(q).text_pairs == ["Him."]
    # a test file: no label column -> unlabelled
    t = tmp_path / "test.tsv"
    t.write_text("index\tsentence\n0\ta film\n1\tanother\n")
    ex = read_glue_tsv(t)
    assert ex.labels is None and ex.task is None and ex.texts == ["a film", "another"] and "unlabelled" in repr(ex)
    # columns by index, no header, negative indices; the text keeps quotes (GLUE's files are not CSV-quoted)
    n = tmp_path / "noheader.tsv"
    n.write_text('x\t"quoted" text\t3\ny\tmore\t0\n')
    ex = read_glue_tsv(n, text=1, label=-1)
    assert ex.texts == ['"quoted" text', "more"] and ex.labels.tolist() == [3, 0] and ex.label_names == ["0", "1", "2", "3"]
    # by name with an explicit header, regression forced, a multi-label column
    c = tmp_path / "custom.tsv"
    c.write_text("body\ttags\tscore\nfirst\tsport,politics\t1\nsecond\t\t2\nthird\tpolitics\t3\n")
    reg = read_glue_tsv(c, text="body", label="score", task="regression")
    assert reg.labels.dtype == np.float32 and reg.labels.tolist() == [1.0, 2.0, 3.0]
    ml = read_glue_tsv(c, text="body", label="tags", task="multilabel")
    assert ml.label_names == ["politics", "sport"] and ml.labels.tolist() == [[1, 1], [0, 0], [1, 0]]
    assert read_glue_tsv(c, text="body", label="score", limit=2).labels.tolist() == [1, 2]
    sub = ml[np.array([2, 0])]
    assert len(sub) == 2 and sub.texts == ["third", "first"] and sub.labels.tolist() == [[1, 0], [1, 1]]


GLUE_ERRORS = [   # (file name, content, keyword arguments, error, message)
    ("empty.tsv", "\ufeff\n", {}, fasttran.InputError, r"empty.tsv: the file is empty"),
    ("head.tsv", "sentence\tlabel\n", {}, fasttran.InputError, r"head.tsv: no examples \(only a header\)"),
    ("cols.tsv", "sentence\tlabel\na\t1\nb\t1\textra\n", {}, fasttran.InputError,
     r"cols.tsv:3: 3 tab-separated columns, expected 2 \(as the header has\)"),
    ("float.tsv", "sentence\tlabel\na\t1\nb\t0.5\n", {"task": "classification"}, fasttran.InputTypeError,
     r"float.tsv:3: label 0.5 is a float; classification takes integer"),
    ("str.tsv", "sentence\tscore\na\thigh\nb\t0.5\n", {}, fasttran.InputTypeError,
     r"str.tsv:2: label 'high' is a string; regression takes numbers"),
    ("mix.tsv", "sentence\tlabel\na\t1\nb\tpositive\n", {}, fasttran.InputTypeError,
     r"mixed label types: .*mix.tsv:2 has the class id 1 and .*mix.tsv:3 the name 'positive'"),
    ("gap.tsv", "sentence\tlabel\na\t1\nb\t\n", {}, fasttran.InputError, r"gap.tsv:3: no label \(an empty field\)"),
    ("neg.tsv", "sentence\tlabel\na\t-1\n", {}, fasttran.InputError, r"neg.tsv:2: label -1 is negative"),
    ("utf.tsv", b"sentence\tlabel\n\xff\t1\n", {}, fasttran.InputError, r"utf.tsv:2: not UTF-8"),
    ("what.tsv", "a\tb\tc\n", {}, fasttran.InputError, r"cannot tell which column holds the text .*no header, 3 columns"),
    ("ok.tsv", "sentence\tlabel\na\t1\n", {"text": "txt", "label": "label"}, fasttran.InputError,
     r"no column 'txt' for text; the header has \['sentence', 'label'\]"),
    ("nh.tsv", "a\t1\n", {"text": "sentence"}, fasttran.InputError, r"text='sentence' names a column, but the file has no header"),
]


@pytest.mark.parametrize("name, content, kwargs, error, message", GLUE_ERRORS, ids=[c[0] for c in GLUE_ERRORS])
def test_glue_errors(tmp_path, name, content, kwargs, error, message):
    p = tmp_path / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(error, match=message):
        read_glue_tsv(p, **kwargs)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_glue_tsv(tmp_path / "missing.tsv")


CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
-DOCSTART- -X- -X- O
BRUSSELS NNP B-NP B-LOC
"""


def test_conll(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(CONLL)
    ex = read_conll(p)
    assert ex.words == [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"], ["BRUSSELS"]]
    assert ex.label_names == ["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER"]
    assert [l.tolist() for l in ex.labels] == [[5, 0, 3, 0], [7, 8], [1]] and ex.task == "tokens"
    assert read_conll(p, column=1, scheme=None).label_names == ["JJ", "NN", "NNP", "VBZ"]
    assert len(read_conll(p, limit=2)) == 2
    # IOB1 (I- opens an entity) is converted when asked, refused by the IOB2 check otherwise
    p1 = tmp_path / "iob1.txt"
    p1.write_text("EU I-ORG\nrejects O\nGerman I-MISC\n")
    with pytest.raises(fasttran.InputError, match=r"iob1.txt:1: I-ORG follows O: in IOB2 an entity starts with B-"):
        read_conll(p1)
    iob2 = read_conll(p1, scheme="IOB1")
    assert [iob2.label_names[i] for i in iob2.labels[0]] == ["B-ORG", "O", "B-MISC"]
    with pytest.raises(fasttran.InputError, match=r"tiny.txt:3: tag 'NNP' is not IOB2"):
        read_conll(p, column=1)
    bad = tmp_path / "cols.txt"
    bad.write_text("EU NNP B-ORG\nrejects O\n")
    with pytest.raises(fasttran.InputError, match=r"cols.txt:2: 2 columns, expected 3 \(as .*cols.txt:1 has\)"):
        read_conll(bad)
    with pytest.raises(fasttran.InputError, match=r"tiny.txt:8: tag 'B-PER' is not one of the known labels"):
        read_conll(p, label_names=["O", "B-ORG", "I-ORG", "B-MISC", "I-MISC", "B-LOC", "I-LOC"])
    empty = tmp_path / "docs.txt"
    empty.write_text("-DOCSTART- -X- -X- O\n\n")
    with pytest.raises(fasttran.InputError, match="no sentences"):
        read_conll(empty)


def test_real_conll():
    train = read_conll(conll_file("train"))
    valid = read_conll(conll_file("valid"), label_names=train.label_names)
    assert len(train) == 14041 and sum(map(len, train.words)) == 203621
    assert len(valid) == 3250 and sum(map(len, valid.words)) == 51362
    # the tags as the file has them, line by line
    tags = [l.split()[-1] for l in open(conll_file("valid")) if l.strip() and not l.startswith("-DOCSTART-")]
    assert [valid.label_names[i] for l in valid.labels for i in l] == tags


def test_records_and_datasets():
    rows = [{"s1": "a", "s2": "b", "y": "pos"}, {"s1": "c", "s2": "d", "y": "neg"}]
    ex = from_records(rows, text="s1", text_pair="s2", label="y")
    assert ex.texts == ["a", "c"] and ex.text_pairs == ["b", "d"] and ex.label_names == ["neg", "pos"]
    assert ex.labels.tolist() == [1, 0]
    assert from_records(iter(rows), text="s1", label=None).labels is None   # any iterable, unlabelled
    reg = from_records([{"text": "x", "label": 0.25}, {"text": "y", "label": 3}])
    assert reg.task == "regression" and reg.labels.tolist() == [0.25, 3.0]
    ml = from_records([{"text": "x", "label": ["a", "b"]}, {"text": "y", "label": []}], task="multilabel")
    assert ml.labels.tolist() == [[1, 1], [0, 0]]

    import datasets
    ds = datasets.Dataset.from_dict(
        {"sentence": ["good", "bad", "fine"], "label": [1, 0, 1]},
        features=datasets.Features({"sentence": datasets.Value("string"),
                                    "label": datasets.ClassLabel(names=["negative", "positive"])}))
    ex = from_records(ds, text="sentence")
    assert ex.label_names == ["negative", "positive"] and ex.labels.tolist() == [1, 0, 1] and ex.texts == ["good", "bad", "fine"]
    ner = datasets.Dataset.from_dict(
        {"tokens": [["EU", "rejects"], ["Peter"]], "ner_tags": [[3, 0], [1]]},
        features=datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                    "ner_tags": datasets.Sequence(datasets.ClassLabel(names=["O", "B-PER", "I-PER", "B-ORG", "I-ORG"]))}))
    tok = from_records(ner, words="tokens", label="ner_tags")
    assert tok.task == "tokens" and tok.label_names[3] == "B-ORG" and [l.tolist() for l in tok.labels] == [[3, 0], [1]]
    with pytest.raises(fasttran.InputError, match=r"no column 'text'; the data set has \['sentence', 'label'\]"):
        from_records(ds)

    import pandas as pd
    df = pd.DataFrame({"text": ["p", "q"], "label": [0, 1]})
    assert from_records(df).labels.tolist() == [0, 1]


def test_record_errors():
    with pytest.raises(fasttran.InputError, match=r"record 1 has no 'text'; its keys are \['label', 'txt'\]"):
        from_records([{"text": "a", "label": 1}, {"txt": "b", "label": 0}])
    with pytest.raises(fasttran.InputTypeError, match=r"record 0: 'text' is int"):
        from_records([{"text": 5, "label": 1}])
    with pytest.raises(fasttran.InputTypeError, match=r"record 1: label 0.5 is a float"):
        from_records([{"text": "a", "label": 1}, {"text": "b", "label": 0.5}], task="classification")
    with pytest.raises(fasttran.InputTypeError, match=r"record 0: label 'x' is a string; regression"):
        from_records([{"text": "a", "label": "x"}], task="regression")
    with pytest.raises(fasttran.InputError, match=r"record 1: 1 labels for 2 words; token labels must be aligned"):
        from_records([{"w": ["a"], "t": ["O"]}, {"w": ["b", "c"], "t": ["O"]}], words="w", label="t")
    with pytest.raises(fasttran.InputTypeError, match="iterable of dicts.*read_glue_tsv"):
        from_records("train.tsv")
    with pytest.raises(fasttran.InputError, match="GLUE's test splits mark missing labels with -1"):
        from_records([{"text": "a", "label": -1}])
    with pytest.raises(fasttran.InputError, match="not both or neither"):
        Examples()


def test_examples_tokenize(enc):
    ex = from_records([{"a": "x y", "b": "z", "label": 1}], text="a", text_pair="b")
    ids, mask, types = ex.tokenize(enc)
    assert np.array_equal(ids, enc.tokenize(["x y"], ["z"])[0]) and types[0, -1] == 1
    words = from_records([{"tokens": ["EU", "rejects"], "tags": ["B-ORG", "O"]}], words="tokens", label="tags")
    wt = words.tokenize(enc)
    assert wt.labels[0, 1] == words.label_names.index("B-ORG") and (wt.labels[0] != -100).sum() == 2
