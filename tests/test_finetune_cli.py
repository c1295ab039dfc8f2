"""`fasttran finetune`: the task table against files in GLUE's, CoNLL's and SQuAD's real layouts
(written here, and the real files where $FASTTRAN_DATA has them), Trainer.fit(keep_best=...), and
the command end to end on small slices: the table it prints, the best epoch's weights in the
export, and the export loading in transformers / sentence-transformers with fasttran's logits."""
import json
import os

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer, cli, finetune_cli
from fasttran.errors import InputError
from fasttran.finetune_cli import TASKS, read_split, task_files

from conftest import DATA, data_skip

BOM = "\ufeff"


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return path


def tsv(*rows):
    return "".join("\t".join(map(str, r)) + "\n" for r in rows)


MNLI_TRAIN_HEAD = ("index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                   "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label")
MNLI_DEV_HEAD = MNLI_TRAIN_HEAD[:11] + ("label2", "label3", "label4", "label5", "gold_label")
STSB_HEAD = ("index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
             "score")


def glue_fixtures(root):
    """Two rows per split of each GLUE task, in the layout GLUE ships (MRPC with a byte-order mark,
    CoLA without a header, MNLI's dev_matched), under root/glue/<folder> (SST-2: root/SST-2)."""
    g = os.path.join(root, "glue")
    for split in ("train", "dev"):
        write(f"{g}/MRPC/{split}.tsv", BOM + tsv(("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
                                                 (1, 11, 12, f"a cat sat {split}", "a cat was sitting"),
                                                 (0, 13, 14, "it rained", "the sun shone")))
        write(f"{g}/CoLA/{split}.tsv", tsv(("gj04", 1, "", f"The sailors rode the breeze {split}."),
                                           ("gj04", 0, "*", "The more does Bill smoke.")))
        write(f"{g}/STS-B/{split}.tsv", tsv(STSB_HEAD, (0, "main-captions", "MSRvid", "2012test", 1, "none", "none",
                                                        f"A plane is taking off {split}.", "An air plane is taking off.",
                                                        "5.000"),
                                            (1, "main-captions", "MSRvid", "2012test", 4, "none", "none",
                                             "A man is playing a flute.", "A man is eating.", "0.500")))
        write(f"{g}/RTE/{split}.tsv", tsv(("index", "sentence1", "sentence2", "label"),
                                          (0, f"Dana Reeve died {split}.", "Christopher Reeve had an accident.",
                                           "not_entailment"),
                                          (1, "Yet, we now are discovering", "Bacteria is winning.", "entailment")))
        write(f"{g}/QNLI/{split}.tsv", tsv(("index", "question", "sentence", "label"),
                                           (0, f"When did it open {split}?", "It opened in 1901.", "entailment"),
                                           (1, "Who won?", "The weather was fine.", "not_entailment")))
        write(f"{root}/SST-2/{split}.tsv", tsv(("sentence", "label"), (f"a fine film {split} ", 1), ("dull ", 0)))
    mnli = lambda head, gold: [head, (0, 31193, "31193n", "government", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
                                      "Conceptually cream skimming has two dimensions.",
                                      "Product and geography are what make it work.") + ("neutral",) * gold,
                               (1, 101457, "101457e", "telephone", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
                                "you know during the season", "You lose the things.") + ("entailment",) * gold]
    write(f"{g}/MNLI/train.tsv", tsv(*mnli(MNLI_TRAIN_HEAD, 2)))
    write(f"{g}/MNLI/dev_matched.tsv", tsv(*mnli(MNLI_DEV_HEAD, 6)))


def squad_fixture(root, ctx, questions):
    """root/squad/{train,dev}-v1.1.json: one paragraph `ctx` with (question, answer) pairs, dev = train"""
    qas = [{"id": f"q{i + 1}", "question": q, "answers": [{"text": a, "answer_start": ctx.index(a)}]}
           for i, (q, a) in enumerate(questions)]
    text = json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": qas}]}]})
    write(f"{root}/squad/train-v1.1.json", text)
    write(f"{root}/squad/dev-v1.1.json", text)


def test_task_table_reads_each_layout(tmp_path):
    glue_fixtures(str(tmp_path))
    write(f"{tmp_path}/conll2003/train.txt", "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n"
                                             "German JJ B-NP B-MISC\n\nPeter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n")
    write(f"{tmp_path}/conll2003/valid.txt", "CRICKET NNP B-NP O\n- : O O\nLEICESTERSHIRE NNP B-NP B-ORG\n")
    squad_fixture(str(tmp_path), "Fasttran was written in 2026 in a small town.", [("When?", "2026")])
    want = {  # task: (train texts[0], pairs[0] or None, labels, label names)
        "mrpc": ("a cat sat train", "a cat was sitting", [1, 0], ["0", "1"]),
        "cola": ("The sailors rode the breeze train.", None, [1, 0], ["0", "1"]),
        "stsb": ("A plane is taking off train.", "An air plane is taking off.", [5.0, 0.5], None),
        "rte": ("Dana Reeve died train.", "Christopher Reeve had an accident.", [1, 0], ["entailment", "not_entailment"]),
        "qnli": ("When did it open train?", "It opened in 1901.", [0, 1], ["entailment", "not_entailment"]),
        "sst2": ("a fine film train ", None, [1, 0], ["0", "1"]),
        "mnli": ("Conceptually cream skimming has two dimensions.", "Product and geography are what make it work.",
                 [1, 0], ["entailment", "neutral", "contradiction"]),
    }
    assert set(want) | {"conll", "squad"} == set(TASKS)
    for task, (text, pair, labels, names) in want.items():
        files = task_files(task, str(tmp_path))
        assert files["dev"].endswith("dev_matched.tsv" if task == "mnli" else "dev.tsv"), task
        ex = read_split(task, files["train"])
        assert ex.texts[0] == text and (ex.text_pairs is None if pair is None else ex.text_pairs[0] == pair), task
        np.testing.assert_allclose(ex.labels, labels, err_msg=task)
        assert ex.label_names == names, task
        dev = read_split(task, files["dev"], label_names=ex.label_names)
        assert len(dev) == 2 and ("dev" in dev.texts[0] or task == "mnli"), task
    files = task_files("conll", str(tmp_path))
    ex = read_split("conll", files["train"])
    assert ex.words == [["EU", "rejects", "German"], ["Peter", "Blackburn"]]
    assert ex.label_names == list(finetune_cli.CONLL_TAGS)
    assert [list(y) for y in ex.labels] == [[5, 0, 3], [7, 8]]
    assert read_split("conll", files["dev"]).words[0] == ["CRICKET", "-", "LEICESTERSHIRE"]
    squad = read_split("squad", task_files("squad", str(tmp_path))["train"])
    assert squad[0]["answers"] == ["2026"] and squad[0]["context"][24:28] == "2026"
    # GLUE's own layout: DIR/RTE/train.tsv (no glue/ folder); and the task folder itself
    rte = task_files("rte", str(tmp_path / "glue"))
    assert rte["train"] == str(tmp_path / "glue" / "RTE" / "train.tsv")
    assert task_files("rte", str(tmp_path / "glue" / "RTE"))["dev"] == str(tmp_path / "glue" / "RTE" / "dev.tsv")


def test_errors_name_what_to_fix(tmp_path):
    glue_fixtures(str(tmp_path))
    with pytest.raises(InputError) as e:
        task_files("mnli", str(tmp_path / "nowhere-else"))
    assert "no such directory" in str(e.value)
    os.remove(tmp_path / "glue" / "MNLI" / "dev_matched.tsv")
    with pytest.raises(InputError) as e:
        task_files("mnli", str(tmp_path))
    msg = str(e.value)
    for tried in (tmp_path / "MNLI" / "dev_matched.tsv", tmp_path / "glue" / "MNLI" / "dev_matched.tsv",
                  tmp_path / "dev_matched.tsv"):
        assert str(tried) in msg
    assert "--data" in msg and "--input" in msg
    with pytest.raises(InputError, match="known tasks: mrpc, sst2, cola, stsb, rte, qnli, mnli, conll, squad"):
        task_files("wnli", str(tmp_path))
    # a label outside the task's label set names its line
    bad = write(f"{tmp_path}/bad/MRPC/train.tsv", BOM + tsv(("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
                                                            (1, 1, 2, "a", "b"), (2, 3, 4, "c", "d")))
    with pytest.raises(InputError, match=r"train.tsv:3: class id 2 is not one of the 2 known labels"):
        read_split("mrpc", bad)
    bad = write(f"{tmp_path}/bad/RTE/train.tsv", tsv(("index", "sentence1", "sentence2", "label"),
                                                     (0, "a", "b", "entailment"), (1, "c", "d", "maybe")))
    with pytest.raises(InputError, match=r"train.tsv:3: label 'maybe' is not one of the known labels"):
        read_split("rte", bad)
    bad = write(f"{tmp_path}/bad/conll2003/train.txt", "EU NNP B-NP B-ORG\nrejects VBZ B-VP B-TIME\n")
    with pytest.raises(InputError, match=r"train.txt:2: tag 'B-TIME' is not one of the known labels"):
        read_split("conll", bad)


def cli_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(["finetune", *argv])
    return str(e.value.code) + capsys.readouterr().err


def test_command_errors(tmp_path, capsys, minilm_dir):
    err = cli_error(capsys, "--task", "wnli", "--data", str(tmp_path))
    assert "unknown task 'wnli'" in err and "mrpc, sst2, cola" in err and "classification, pair" in err
    err = cli_error(capsys, "--task", "rte", "--data", str(tmp_path))
    assert "no train file for --task rte" in err and str(tmp_path / "glue" / "RTE" / "train.tsv") in err
    err = cli_error(capsys, "--task", "rte")
    assert "needs --data DIR" in err
    err = cli_error(capsys, "--task", "pair", "--input", str(tmp_path / "x.tsv"))
    assert "--input needs --eval-input" in err
    err = cli_error(capsys, "--task", "mrpc", "--input", str(tmp_path / "x.tsv"), "--eval-input", "y")
    assert "is a known task: use --data DIR" in err
    err = cli_error(capsys, "--task", "qa", "--input", str(tmp_path / "train.json"), "--eval-input", "dev.json")
    assert f"--input {tmp_path / 'train.json'}: no such file" in err
    glue_fixtures(str(tmp_path / "g"))
    err = cli_error(capsys, "--task", "mrpc", "--data", str(tmp_path / "g"), "--model", minilm_dir,
                    "--train-layers", "0", "--precision", "bfloat16")
    assert "--precision bfloat16 trains the encoder's layers" in err and "(--train-layers 0) trains in float32" in err


def lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


@pytest.mark.parametrize("task,rows", [("mrpc", "lines"), ("cola", (8551, 1043)), ("stsb", (5749, 1500)),
                                       ("sst2", (67349, 872)), ("conll", (14041, 3250)), ("squad", (11877, 10570))])
def test_real_files(task, rows):
    """The table against the real files in $FASTTRAN_DATA (counts from its README; MRPC's train.tsv
    has 3,667 rows where the README says 3,668: every line of the file, less the header)."""
    try:
        files = task_files(task, DATA)
    except InputError as e:
        data_skip(f"real {task} data", DATA, f"set FASTTRAN_DATA to a directory holding it ({str(e).splitlines()[0]})")
    if task == "squad":
        assert (len(read_split(task, files["train"])), len(read_split(task, files["dev"]))) == rows
        return
    train = read_split(task, files["train"])
    dev = read_split(task, files["dev"], label_names=train.label_names)
    if rows == "lines":
        rows = (lines(files["train"]) - 1, lines(files["dev"]) - 1)
    assert (len(train), len(dev)) == rows
    if task == "conll":
        assert train.label_names == list(finetune_cli.CONLL_TAGS)
    elif task == "stsb":
        assert train.labels.dtype == np.float32 and 0 <= train.labels.min() and train.labels.max() <= 5
    else:
        assert set(np.unique(train.labels)) == {0, 1} and (train.text_pairs is not None) == (task == "mrpc")


# ---- Trainer.fit(keep_best=...) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def sst_small(enc):
    from conftest import sst2_file
    from fasttran.data import load_sst2
    s, y = load_sst2(sst2_file("train"))
    return s[:96], np.array(y[:96])


@pytest.mark.parametrize("layers", [0, 1])
def test_keep_best_restores_the_best_epochs_weights(enc, sst_small, layers):
    """Evaluated against flipped labels, the first epoch scores best: fit(keep_best=True) ends with
    its weights -- those of a run stopped after that epoch (same schedule) -- not the last epoch's."""
    s, y = sst_small
    ids, mask, types = enc.tokenize(s)
    kw = dict(layer=enc.num_layers - 1, positions="all") if layers else dict(positions="mean")
    cache = ActivationCache.build(enc, ids, mask, types, show_progress=False, **kw)
    make = lambda: Trainer("classification", epochs=3, batch_size=16, seed=3, lr=2e-2 if not layers else 2e-3,
                           train_layers=layers, show_progress=False)
    tr = make()
    hist = tr.fit(cache, y, eval=(cache, 1 - y), keep_best=True)
    acc = [h["eval_accuracy"] for h in hist]
    assert tr.best_epoch == int(np.argmax(acc)) + 1 == 1 and acc[0] > acc[-1]
    first = make()
    first.fit(cache, y, stop_at_step=len(cache) // 16)
    last = make()
    last.fit(cache, y)
    for a, b in zip(tr.head.state_dict().values(), first.head.state_dict().values()):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(tr.head.state_dict()["classifier.weight"], last.head.state_dict()["classifier.weight"])
    if layers:
        for (n, a), (_, b) in zip(tr.top.named_parameters(), first.top.named_parameters()):
            np.testing.assert_array_equal(a, b, err_msg=n)
    assert tr.evaluate(cache, 1 - y)["accuracy"] == acc[0]
    # a metric by name, lower-is-better loss; and the errors
    tr2 = make()
    tr2.fit(cache, y, eval=(cache, y), keep_best="loss")
    losses = [h["eval_loss"] for h in tr2.history]
    assert tr2.best_epoch == int(np.argmin(losses)) + 1
    with pytest.raises(InputError, match="keep_best needs eval"):
        make().fit(cache, y, keep_best=True)
    with pytest.raises(InputError, match=r"keep_best='pearson': the evaluation gives no such metric; it gives \["):
        make().fit(cache, y, eval=(cache, y), keep_best="pearson")


# ---- the command end to end ---------------------------------------------------------------------------
def finetune(capsys, *argv):
    args = cli.build_parser().parse_args(["finetune", *argv])
    res = finetune_cli.run(args)
    return res, capsys.readouterr().out


def table_rows(out):
    """(epoch, train loss, dev metric, seconds, kept) of the printed table"""
    rows = []
    for line in out.splitlines():
        parts = line.replace("*", " ").split()
        if len(parts) == 4 and parts[0].isdigit():
            rows.append((int(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), line.startswith("*")))
    return rows


def check_table(res, out, metric):
    tr = res.trainer
    rows = table_rows(out)
    assert [r[0] for r in rows] == [h["epoch"] for h in tr.history]
    assert [r[4] for r in rows].index(True) + 1 == tr.best_epoch
    for r, h in zip(rows, tr.history):
        assert r[1] == pytest.approx(h["train_loss"], abs=1e-4) and r[2] == pytest.approx(h[f"eval_{metric}"], abs=1e-4)
    best = [h[f"eval_{metric}"] for h in tr.history]
    assert tr.history[tr.best_epoch - 1][f"eval_{metric}"] == max(best)
    # the weights in place (those exported) are the kept epoch's: the dev evaluation gives its numbers
    cache, targets = res.dev
    now = tr.evaluate(cache, targets)
    kept = tr.history[tr.best_epoch - 1]
    same = [k for k, v in now.items() if isinstance(v, float) and f"eval_{k}" in kept]
    assert metric in same
    for k in same:
        assert now[k] == kept[f"eval_{k}"], k
    info = json.load(open(os.path.join(res.output, "finetune.json")))
    assert info["best_epoch"] == tr.best_epoch and info["metric"] == metric


def mrpc_pairs(n):
    from conftest import glue_file
    from fasttran import readers
    ex = readers.read_glue_tsv(glue_file("MRPC", "dev"), limit=n)
    return ex.texts, ex.text_pairs


def pipeline_gives(model_dir, texts, pairs, logits, every):
    """pipeline("text-classification") on the export: every `every`-th pair's scores are fasttran's logits"""
    from transformers import pipeline
    pipe = pipeline("text-classification", model=model_dir, device="cpu")
    for i in range(0, len(logits), every):
        scores = pipe({"text": texts[i], "text_pair": pairs[i]}, function_to_apply="none", top_k=None)
        got = {d["label"]: d["score"] for d in scores}
        np.testing.assert_allclose([got["0"], got["1"]], logits[i], atol=1e-4)


def test_mrpc_frozen_head_and_one_layer(minilm_dir, tmp_path, capsys):
    from conftest import glue_file
    glue_file("MRPC", "train")   # (skips without the real files)
    common = ["--task", "mrpc", "--data", DATA, "--limit", "48", "--epochs", "2", "--model", minilm_dir]
    res, out = finetune(capsys, *common, "--train-layers", "0", "--output", str(tmp_path / "frozen"))
    check_table(res, out, "f1")
    assert "sentence-transformers layout" in out and "SentenceTransformer(" in out
    texts, pairs = mrpc_pairs(48)
    logits = res.trainer.predict(res.dev[0], output="logits")
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(tmp_path / "frozen"), device="cpu")
    got = st.encode(list(zip(texts, pairs)), convert_to_numpy=True, batch_size=1)
    np.testing.assert_allclose(got, logits, atol=1e-4)

    res, out = finetune(capsys, *common, "--train-layers", "1", "--output", str(tmp_path / "k1"))
    check_table(res, out, "f1")
    assert "AutoModelForSequenceClassification.from_pretrained(" in out and "the head in place" in out
    logits = res.trainer.predict(res.dev[0], output="logits")
    pipeline_gives(str(tmp_path / "k1"), texts, pairs, logits, every=5)


def test_the_default_trains_every_layer_with_the_swept_recipe(minilm_dir, tmp_path, capsys):
    """only --task and --data: K = every layer (FINETUNE_DEFAULT) with its optimizer's recipe, the
    export in transformers' layout with the head in place, its logits fasttran's"""
    from conftest import glue_file
    glue_file("MRPC", "train")
    res, out = finetune(capsys, "--task", "mrpc", "--data", DATA, "--limit", "24", "--epochs", "1", "--model",
                        minilm_dir, "--output", str(tmp_path / "d"))
    tr, d = res.trainer, fasttran.trainer.FINETUNE_DEFAULT
    want_k = fasttran.trainer.finetune_layers(6, 24)
    assert want_k == max(1, round(d["layers"] * 6))   # 24 examples: below FINETUNE_DEFAULT["large_train"]
    assert tr.train_layers == want_k and tr.optimizer_name == d["optimizer"]
    recipe = fasttran.trainer.topk_recipe(d["optimizer"], want_k)
    assert tr.lr == recipe["lr"] and (tr.head_lr or tr.lr) == recipe["head_lr"]   # (None: the layers' lr)
    precision = fasttran.trainer.finetune_precision(want_k)   # bf16 where this CPU multiplies it
    assert tr.precision == precision and tr.top.matmul_precision == precision
    emb = fasttran.trainer.finetune_embeddings(want_k, 6)   # FINETUNE_DEFAULT["embeddings"] at every layer
    assert tr.train_embeddings == emb and tr.top.train_embeddings == emb
    info = json.load(open(tmp_path / "d" / "finetune.json"))
    assert info["train_layers"] == want_k and info["optimizer"] == d["optimizer"] and info["precision"] == precision
    assert info["train_embeddings"] == emb
    assert "AutoModelForSequenceClassification.from_pretrained(" in out
    assert f"top 6 layer(s){' + embeddings' if emb else ''} + head" in out
    assert ("bfloat16 mixed precision" in out) == (precision == "bfloat16")
    # (the mixed precision is the training steps': predict multiplies in float32, as the export does)
    texts, pairs = mrpc_pairs(24)
    logits = tr.predict(res.dev[0], output="logits")
    pipeline_gives(str(tmp_path / "d"), texts, pairs, logits, every=7)


@pytest.mark.parametrize("flag", ["--train-embeddings", "--no-train-embeddings"])
def test_train_embeddings_flag(minilm_dir, tmp_path, capsys, flag):
    """--train-embeddings / --no-train-embeddings whatever the default: the embeddings train with every
    layer (only then: below it the command says what it needs), and the export -- its embeddings the
    trained ones -- gives fasttran's logits in pipeline(...)"""
    from conftest import glue_file
    glue_file("MRPC", "train")
    on = flag == "--train-embeddings"
    if on:
        with pytest.raises(SystemExit, match="--train-layers 6"):
            finetune(capsys, "--task", "mrpc", "--data", DATA, "--limit", "16", "--epochs", "1", "--model", minilm_dir,
                     "--train-layers", "3", flag, "--output", str(tmp_path / "k3"))
    res, out = finetune(capsys, "--task", "mrpc", "--data", DATA, "--limit", "24", "--epochs", "1", "--model",
                        minilm_dir, flag, "--output", str(tmp_path / "e"))
    tr = res.trainer
    assert tr.train_embeddings == on and ("top 6 layer(s) + embeddings + head" in out) == on
    assert json.load(open(tmp_path / "e" / "finetune.json"))["train_embeddings"] == on
    from safetensors.numpy import load_file
    word = next(v for k, v in load_file(str(tmp_path / "e" / "model.safetensors")).items()
                if k.endswith("word_embeddings.weight"))
    trained = dict(tr.top.named_parameters()).get("embeddings.word_embeddings.weight")
    assert (trained is not None) == on and (not on or np.array_equal(word, trained))
    texts, pairs = mrpc_pairs(24)
    pipeline_gives(str(tmp_path / "e"), texts, pairs, tr.predict(res.dev[0], output="logits"), every=11)


def test_the_default_depth_halves_from_large_training_sets(minilm_dir, tmp_path, capsys, monkeypatch):
    """finetune_layers: every layer below FINETUNE_DEFAULT["large_train"] training examples, half of
    them (rounded, at least one) from there; the command counts SQuAD's windows once cut (written
    here: runs without the real data)"""
    fl, d = fasttran.trainer.finetune_layers, fasttran.trainer.FINETUNE_DEFAULT
    n = d["large_train"]
    assert (fl(6, n - 1), fl(6, n), fl(12, 10 * n), fl(24, n), fl(1, 10 * n), fl(3, n)) == (6, 3, 6, 12, 1, 2)
    squad_fixture(str(tmp_path), "Fasttran was written in 2026 in a small town by three people.",
                  [("When?", "2026"), ("Where?", "a small town"), ("By whom?", "three people")])
    for large, want_k in ((4, 6), (3, 3)):   # three windows: "large" from 3 on (the wiring, not the boundary)
        monkeypatch.setitem(d, "large_train", large)
        res, out = finetune(capsys, "--task", "squad", "--data", str(tmp_path), "--epochs", "1", "--model", minilm_dir,
                            "--output", str(tmp_path / f"q{large}"), "--cache-dir", str(tmp_path / f"c{large}"))
        assert len(res.train_cache) == 3 and res.trainer.train_layers == want_k, (large, res.trainer.train_layers)
        assert f"top {want_k} layer(s) + head" in out and "AutoModelForQuestionAnswering" in out
        assert json.load(open(tmp_path / f"q{large}" / "finetune.json"))["train_layers"] == want_k


def test_the_default_depth_counts_the_training_split(minilm_dir, tmp_path, capsys, monkeypatch):
    """a GLUE task: the training split's examples (after --limit) set the depth, and the recipe follows it"""
    from conftest import glue_file
    d = fasttran.trainer.FINETUNE_DEFAULT
    glue_file("MRPC", "train")
    monkeypatch.setitem(d, "large_train", 20)   # a small "large" split: the wiring, not the boundary
    for limit, want_k in ((19, 6), (20, 3)):
        res, out = finetune(capsys, "--task", "mrpc", "--data", DATA, "--limit", str(limit), "--epochs", "1", "--model",
                            minilm_dir, "--output", str(tmp_path / f"m{limit}"))
        tr = res.trainer
        assert len(res.train_cache) == limit and tr.train_layers == want_k, (limit, tr.train_layers)
        assert tr.lr == fasttran.trainer.topk_recipe(d["optimizer"], want_k)["lr"]
        assert f"top {want_k} layer(s) + head" in out
        assert json.load(open(tmp_path / f"m{limit}" / "finetune.json"))["train_layers"] == want_k


def test_conll_one_layer(minilm_dir, tmp_path, capsys):
    from conftest import conll_file
    conll_file("train")
    res, out = finetune(capsys, "--task", "conll", "--data", DATA, "--limit", "40", "--epochs", "2",
                        "--train-layers", "1", "--batch-size", "16", "--model", minilm_dir, "--output",
                        str(tmp_path / "ner"))
    check_table(res, out, "f1")
    assert "AutoModelForTokenClassification.from_pretrained(" in out
    logits = res.trainer.predict(res.dev[0], output="logits")   # (examples, longest, labels), NaN past the tokens
    import torch
    from transformers import AutoModelForTokenClassification
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "ner")).eval()
    assert model.config.id2label[5] == "B-ORG"
    enc = fasttran.Encoder.from_pretrained(minilm_dir)
    dev = read_split("conll", res.data.files["dev"], limit=40)
    tok = enc.tokenize_words(dev.words)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tok.input_ids).long(),
                     attention_mask=torch.from_numpy(tok.attention_mask).long(),
                     token_type_ids=torch.from_numpy(tok.token_type_ids).long()).logits.numpy()
    lengths = tok.attention_mask.sum(1)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(want[b, :n], logits[b, :n], atol=1e-4)


def test_own_files_keep_the_best_epoch(minilm_dir, tmp_path, capsys, sst_small):
    """--input / --eval-input: a dev file with the labels flipped makes the first epoch the best,
    and the export holds its weights, not the last epoch's."""
    s, y = sst_small
    write(f"{tmp_path}/train.tsv", tsv(("sentence", "label"), *zip(s, y)))
    write(f"{tmp_path}/flipped.tsv", tsv(("sentence", "label"), *zip(s, 1 - y)))
    res, out = finetune(capsys, "--task", "classification", "--input", str(tmp_path / "train.tsv"),
                        "--eval-input", str(tmp_path / "flipped.tsv"), "--epochs", "3", "--lr", "0.02",
                        "--train-layers", "0", "--optimizer", "lamb",
                        "--model", minilm_dir, "--output", str(tmp_path / "m"))
    tr = res.trainer
    check_table(res, out, "accuracy")
    assert tr.best_epoch == 1 and tr.history[0]["eval_accuracy"] > tr.history[-1]["eval_accuracy"]
    from fasttran.safetensors_io import read_safetensors
    exported = read_safetensors(str(tmp_path / "m" / "head.safetensors"))
    for k, v in tr.head.state_dict().items():
        np.testing.assert_array_equal(exported[k], v)
    assert "kept epoch 1" in out


def test_search_picks_the_lr_on_the_training_split(minilm_dir, tmp_path, capsys):
    """--search: the default lr x 0.5, 1, 2 each tried for an epoch on the training split less its last
    tenth, scored on that tenth (never on dev); the best is the lr the run trains with, in the table
    and finetune.json"""
    from conftest import glue_file
    glue_file("MRPC", "train")
    res, out = finetune(capsys, "--task", "mrpc", "--data", DATA, "--limit", "40", "--epochs", "1", "--train-layers",
                        "1", "--search", "--model", minilm_dir, "--output", str(tmp_path / "s"))
    tries = res.trainer.lr_search_tries
    base = fasttran.trainer.topk_recipe(fasttran.trainer.FINETUNE_DEFAULT["optimizer"], 1)["lr"]
    assert [t["lr"] for t in tries] == pytest.approx([base * 0.5, base, base * 2])
    best = max(tries, key=lambda t: t["f1"])   # (ties: the first)
    assert res.trainer.lr == best["lr"]
    assert "lr search" in out and out.count(" lr ") >= 3
    info = json.load(open(tmp_path / "s" / "finetune.json"))
    assert info["lr"] == best["lr"] and len(info["lr_search"]) == 3
    with pytest.raises(SystemExit, match="--search is for the sentence and token tasks"):
        finetune(capsys, "--task", "squad", "--data", DATA, "--limit", "4", "--search", "--model", minilm_dir)
