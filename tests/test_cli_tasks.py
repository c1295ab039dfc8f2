"""The command line on the tasks beyond single sentences, on small slices of the real GLUE and
CoNLL-2003 files as they ship: pairs (MRPC), regression (STS-B), token classification (CoNLL) with
the top layers trained, and `fasttran export` into transformers; plus the errors a user meets."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import conll_file, glue_file


def run(*args, cwd, ok=True):
    r = subprocess.run([sys.executable, "-m", "fasttran.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=900)
    if ok:
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr


def history(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_pairs_and_regression(minilm_dir, tmp_path):
    m = ["--model", minilm_dir]
    mrpc, mrpc_dev = glue_file("MRPC", "train"), glue_file("MRPC", "dev")
    run("cache", *m, "--task", "pair", "--input", mrpc, "--limit", "64", "--output", "cm", cwd=tmp_path)
    run("cache", *m, "--task", "pair", "--input", mrpc_dev, "--limit", "32", "--output", "cmd", cwd=tmp_path)
    hist = history(run("train", *m, "--input", mrpc, "--cache", "cm", "--output", "ck", "--epochs", "2",
                       "--eval-input", mrpc_dev, "--eval-cache", "cmd", cwd=tmp_path))
    assert len(hist) == 2 and {"eval_accuracy", "eval_f1", "eval_matthews_corrcoef"} <= set(hist[-1])
    res = json.loads(run("evaluate", *m, "--input", mrpc_dev, "--cache", "cmd", "--checkpoint", "ck",
                         cwd=tmp_path).splitlines()[-1])
    assert res["accuracy"] == pytest.approx(hist[-1]["eval_accuracy"])
    # the features are the pairs': [CLS] a [SEP] b [SEP], as transformers tokenizes them
    import fasttran
    from fasttran import readers
    enc = fasttran.Encoder.from_pretrained(minilm_dir)
    ex = readers.read_glue_tsv(mrpc, limit=64)
    cache = fasttran.ActivationCache.open(tmp_path / "cm", encoder=enc)
    want = enc.forward(*enc.tokenize(ex.texts[:4], ex.text_pairs[:4]), pooling="mean")
    assert np.abs(cache.get(cache.example_ids[:4]) - want).max() <= 1e-6

    stsb, stsb_dev = glue_file("STS-B", "train"), glue_file("STS-B", "dev")
    run("cache", *m, "--task", "regression", "--input", stsb, "--limit", "64", "--positions", "cls", "--output", "cs",
        cwd=tmp_path)
    run("cache", *m, "--task", "regression", "--input", stsb_dev, "--limit", "32", "--positions", "cls",
        "--output", "csd", cwd=tmp_path)
    hist = history(run("train", *m, "--input", stsb, "--cache", "cs", "--output", "cks", "--epochs", "1", "--pooler",
                       "--eval-input", stsb_dev, "--eval-cache", "csd", cwd=tmp_path))
    assert {"eval_pearson", "eval_spearman", "eval_mse"} <= set(hist[-1])
    out = run("export", *m, "--checkpoint", "cks", "--output", "ms", cwd=tmp_path)
    assert "sequence-classification" in out and "AutoModelForSequenceClassification.from_pretrained(" in out
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(tmp_path / "ms").problem_type == "regression"
    # errors a user meets: a classification task on scores, a cache of another task
    err = run("train", *m, "--task", "classification", "--input", stsb, "--cache", "cs", "--output", "x",
              cwd=tmp_path, ok=False)
    assert "was built for --task regression" in err
    err = run("cache", *m, "--task", "pair", "--input", glue_file("CoLA", "train"), "--limit", "8", "--output", "y",
              cwd=tmp_path, ok=False)
    assert "--task pair needs two text columns" in err


def test_token_classification_with_trained_layers(minilm_dir, tmp_path):
    m = ["--model", minilm_dir]
    train, valid = conll_file("train"), conll_file("valid")
    run("cache", *m, "--task", "token", "--input", train, "--limit", "48", "--layer", "5", "--output", "ct",
        cwd=tmp_path)
    run("cache", *m, "--task", "token", "--input", valid, "--limit", "24", "--layer", "5", "--output", "ctd",
        cwd=tmp_path)
    hist = history(run("train", *m, "--input", train, "--cache", "ct", "--output", "ck", "--epochs", "1",
                       "--train-layers", "1", "--tempo", "all", "--batch-size", "16", "--eval-input", valid,
                       "--eval-cache", "ctd", cwd=tmp_path))
    assert {"eval_f1", "eval_precision", "eval_recall", "eval_token_accuracy"} <= set(hist[-1])
    run("evaluate", *m, "--input", valid, "--cache", "ctd", "--checkpoint", "ck", "--predictions", "p.npy",
        cwd=tmp_path)
    from fasttran import readers
    words = readers.read_conll(valid, limit=24).words
    pred = np.load(tmp_path / "p.npy", allow_pickle=True)
    assert [len(p) for p in pred] == [len(w) for w in words]   # a prediction per word
    assert "token-classification" in run("export", *m, "--checkpoint", "ck", "--output", "mt", cwd=tmp_path)
    err = run("train", *m, "--input", train, "--cache", "ct", "--output", "x", "--train-layers", "2", cwd=tmp_path,
              ok=False)
    assert "needs every token's state at layer 4" in err and "at layer 5" in err
    err = run("train", *m, "--input", train, "--cache", "ct", "--output", "x", "--train-layers", "1", "--tempo",
              "fast", cwd=tmp_path, ok=False)
    assert "--tempo: unknown option(s) ['fast']" in err


def test_train_embeddings(minilm_dir, tmp_path):
    """`fasttran train --train-layers L --train-embeddings` from a cache of layer 0: the exported model's
    embedding tables moved (they stay the checkpoint's bit for bit without the flag); other depths
    are refused before any cache is read"""
    m = ["--model", minilm_dir]
    mrpc = glue_file("MRPC", "train")
    run("cache", *m, "--task", "pair", "--input", mrpc, "--limit", "32", "--layer", "0", "--positions", "all",
        "--output", "c0", cwd=tmp_path)
    from transformers import AutoModel, AutoModelForSequenceClassification
    base = AutoModel.from_pretrained(minilm_dir).embeddings
    for flag, moved in ((["--train-embeddings"], True), ([], False)):
        run("train", *m, "--input", mrpc, "--cache", "c0", "--output", f"ck{moved}", "--epochs", "1", "--batch-size",
            "16", "--train-layers", "6", "--pooling", "cls", "--pooler", "--optimizer", "adamw", *flag, cwd=tmp_path)
        run("export", *m, "--checkpoint", f"ck{moved}", "--output", f"m{moved}", cwd=tmp_path)
        emb = AutoModelForSequenceClassification.from_pretrained(tmp_path / f"m{moved}").bert.embeddings
        for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"):
            a, b = getattr(emb, name).weight.detach().numpy(), getattr(base, name).weight.detach().numpy()
            assert np.array_equal(a, b) != moved, name
    err = run("train", *m, "--input", mrpc, "--cache", "c0", "--output", "x", "--train-layers", "3",
              "--train-embeddings", cwd=tmp_path, ok=False)
    assert "--train-embeddings trains the embeddings under every layer: it needs --train-layers 6" in err
