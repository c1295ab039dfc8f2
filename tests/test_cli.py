"""The command-line interface end to end on small real files (SST-2 sentences, real MiniLM):
encode -> cache -> train -> evaluate, JSONL and TSV inputs, --help on each command."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

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
