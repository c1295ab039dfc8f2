"""The command-line interface end to end on small real files (SST-2 sentences, real MiniLM):
encode -> cache -> train -> evaluate, JSONL and TSV inputs, --help on each command."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fasttran

from fasttran.data import load_sst2, sst2_path


def run(*args, cwd):
    r = subprocess.run([sys.executable, "-m", "fasttran.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_cli_steps(minilm_dir, tmp_path):
    s, y = load_sst2(sst2_path("train"))
    with open(tmp_path / "train.jsonl", "w") as f:
        for t, l in zip(s[:200], y[:200]):
            f.write(json.dumps({"text": t, "label": l}) + "\n")
    sd, yd = load_sst2(sst2_path("dev"))
    with open(tmp_path / "dev.tsv", "w") as f:
        f.write("label\tsentence\n" + "".join(f"{l}\t{t}\n" for t, l in zip(sd[:80], yd[:80])))
    for cmd in ("encode", "cache", "train", "evaluate"):
        assert "--input" in run(cmd, "--help", cwd=tmp_path)
    m = ["--model", minilm_dir]
    run("encode", *m, "--input", "dev.tsv", "--output", "emb.npy", cwd=tmp_path)
    emb = np.load(tmp_path / "emb.npy")
    assert emb.shape == (80, 384) and np.isfinite(emb).all()
    run("cache", *m, "--input", "train.jsonl", "--output", "ctrain", cwd=tmp_path)
    run("cache", *m, "--input", "dev.tsv", "--output", "cdev", cwd=tmp_path)
    out = run("train", *m, "--input", "train.jsonl", "--cache", "ctrain", "--output", "ck", "--epochs", "2",
              "--eval-input", "dev.tsv", "--eval-cache", "cdev", cwd=tmp_path)
    hist = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(hist) == 2 and "eval_accuracy" in hist[-1]
    res = json.loads(run("evaluate", *m, "--input", "dev.tsv", "--cache", "cdev", "--checkpoint", "ck",
                         "--predictions", "p.npy", cwd=tmp_path).strip().splitlines()[-1])
    assert res["accuracy"] == pytest.approx(hist[-1]["eval_accuracy"])
    assert np.load(tmp_path / "p.npy").shape == (80,)
    # a clear message for a missing file
    r = subprocess.run([sys.executable, "-m", "fasttran.cli", "encode", *m, "--input", "nope.tsv", "--output", "x.npy"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "nope.tsv not found" in r.stderr


def run_fail(*args, cwd):
    r = subprocess.run([sys.executable, "-m", "fasttran.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr


def test_cli_help_version_and_argument_errors(minilm_dir, tmp_path):
    top = run("--help", cwd=tmp_path)
    for step in ("fasttran cache", "fasttran train", "fasttran evaluate", "--task qa"):
        assert step in top
    assert run("--version", cwd=tmp_path).startswith(f"fasttran {fasttran.__version__} (backends: cpu")
    t = " ".join(run("train", "--help", cwd=tmp_path).split())   # help text is wrapped
    for default in ("(default: lamb)", "(default: 3)", "(default: 32)", "(default: linear)", "(default: 0.1)",
                    "lamb/linear", "--limit N", "(default: 0)"):
        assert default in t, default
    # --eval-input without --eval-cache is an error, not ignored (checked before any work)
    err = run_fail("train", "--model", minilm_dir, "--input", "x.tsv", "--cache", "c", "--output", "o",
                   "--eval-input", "dev.tsv", cwd=tmp_path)
    assert "--eval-input and --eval-cache go together" in err
    err = run_fail("evaluate", "--model", minilm_dir, "--input", sst2_path("dev"), "--cache", "missing",
                   "--checkpoint", "ck", cwd=tmp_path)
    assert "does not exist" in err


def test_cli_limit_repr_and_ctrl_c(minilm_dir, tmp_path):
    m = ["--model", minilm_dir]
    out = run("cache", *m, "--input", sst2_path("train"), "--output", "c100", "--limit", "100", cwd=tmp_path)
    assert "ActivationCache(examples=100," in out
    files = sum(os.path.getsize(os.path.join(tmp_path, "c100", f)) for f in os.listdir(tmp_path / "c100"))
    shown = float(re.search(r"files on disk=(\d+\.\d) MiB", out).group(1))
    assert abs(shown - files / 2**20) < 0.1, (shown, files)
    out = run("train", *m, "--input", sst2_path("train"), "--limit", "100", "--cache", "c100", "--output", "ck",
              "--epochs", "1", cwd=tmp_path)
    assert len([line for line in out.splitlines() if line.startswith("{")]) == 1
    # Ctrl-C during a long step: a short message and exit status 130, no traceback
    p = subprocess.Popen([sys.executable, "-m", "fasttran.cli", "cache", *m, "--input", sst2_path("train"),
                          "--output", "cbig"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # as from a terminal (a test run in a background job inherits SIGINT ignored)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not os.path.exists(tmp_path / "cbig" / "shard-000001.bin"):
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    assert "fasttran: interrupted" in err and "Traceback" not in err


SQUAD = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
    {"context": "The Eiffel Tower was completed in 1889 in Paris. It is 330 metres tall and was designed by the "
                "engineer Gustave Eiffel's company.",
     "qas": [{"id": "q1", "question": "When was the Eiffel Tower completed?",
              "answers": [{"text": "1889", "answer_start": -1}]},
             {"id": "q2", "question": "How tall is the Eiffel Tower?",
              "answers": [{"text": "330 metres", "answer_start": -1}]}]},
    {"context": "Marie Curie won the Nobel Prize in Physics in 1903 and the Nobel Prize in Chemistry in 1911. "
                "She was born in Warsaw.",
     "qas": [{"id": "q3", "question": "Where was Marie Curie born?",
              "answers": [{"text": "Warsaw", "answer_start": -1}]},
             {"id": "q4", "question": "When did Marie Curie win the Nobel Prize in Chemistry?",
              "answers": [{"text": "1911", "answer_start": -1}]}]}]}]}


def test_cli_question_answering(minilm_dir, tmp_path):
    for art in SQUAD["data"]:
        for para in art["paragraphs"]:
            for qa in para["qas"]:
                a = qa["answers"][0]
                a["answer_start"] = para["context"].index(a["text"])
    with open(tmp_path / "squad.json", "w") as f:
        json.dump(SQUAD, f)
    m = ["--model", minilm_dir]
    run("cache", *m, "--task", "qa", "--answers-only", "--input", "squad.json", "--output", "qtrain", cwd=tmp_path)
    run("cache", *m, "--task", "qa", "--input", "squad.json", "--output", "qdev", cwd=tmp_path)
    err = run_fail("train", *m, "--head", "qa", "--input", "squad.json", "--cache", "qdev", "--output", "qck",
                   cwd=tmp_path)
    assert "--answers-only" in err
    err = run_fail("train", *m, "--input", "squad.json", "--cache", "qtrain", "--output", "qck", cwd=tmp_path)
    assert "QA cache: use --head qa" in err
    out = run("train", *m, "--head", "qa", "--input", "squad.json", "--cache", "qtrain", "--output", "qck",
              "--epochs", "30", "--batch-size", "4", "--eval-input", "squad.json", "--eval-cache", "qdev",
              cwd=tmp_path)
    hist = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(hist) == 30 and "eval_f1" in hist[-1] and "eval_exact_match" in hist[-1]
    res = json.loads(run("evaluate", *m, "--input", "squad.json", "--cache", "qdev", "--checkpoint", "qck",
                         "--predictions", "preds.json", cwd=tmp_path).strip().splitlines()[-1])
    assert res["questions"] == 4 and res["f1"] == pytest.approx(hist[-1]["eval_f1"])
    with open(tmp_path / "preds.json") as f:
        preds = json.load(f)
    assert set(preds) == {"q1", "q2", "q3", "q4"}
    # 4 questions, 30 epochs: the head memorises its training questions
    assert res["f1"] > 50, (res, preds)
