"""A cache build split over several processes (gloo on this machine; tests/distributed_util.py):
the files are a one-process build's byte for byte, a complete cache is opened and not rebuilt at
any world size, an interrupted build resumes at another world size (or in one process) without
re-encoding what was done, and ranks that disagree get an error instead of a mixed cache. Then
`torchrun --nproc-per-node=2 -m fasttran cache` on real SST-2 sentences with the real MiniLM."""
import filecmp
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fasttran
from conftest import make_checkpoint
from distributed_util import free_port, run_ranks

torch = pytest.importorskip("torch")

TINY = dict(vocab_size=99, hidden_size=32, num_attention_heads=2, intermediate_size=40, num_hidden_layers=2,
            max_position_embeddings=64)


def inputs(seed=0, n=150):
    """Examples of 0 to 29 tokens (some empty), right-padded."""
    rng = np.random.default_rng(seed)
    L = rng.integers(0, 30, n)
    ids = rng.integers(1, 99, (n, 29)) * (np.arange(29)[None] < L[:, None])
    return ids, (ids != 0).astype(np.int64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("tiny")), **TINY)


def _counting(rank, fail_after=None):
    """Count the shards this process encodes; with fail_after=(rank, n), that rank fails after n."""
    from fasttran.cache.activation import ActivationCache
    real, count = ActivationCache._encode_batch, [0]

    def encode(self, idx):
        if fail_after is not None and rank == fail_after[0] and count[0] >= fail_after[1]:
            raise RuntimeError(f"injected failure after {count[0]} shards")
        count[0] += 1
        return real(self, idx)
    ActivationCache._encode_batch = encode
    return count


def count_here(monkeypatch):
    """_counting in this (the test's) process, undone after the test."""
    from fasttran.cache.activation import ActivationCache
    monkeypatch.setattr(ActivationCache, "_encode_batch", ActivationCache._encode_batch)
    return _counting(0)


def _build(rank, world, model, out, kw, fail_after=None, seed=0):
    count = _counting(rank, fail_after)
    enc = fasttran.Encoder.from_pretrained(model)
    ids, mask = inputs(seed)
    dirs = out if isinstance(out, str) else out[rank]
    try:
        c = fasttran.ActivationCache.build(enc, ids, mask, disk_dir=dirs, show_progress=False, **kw)
    except fasttran.FastTranError as e:
        return f"{type(e).__name__}: {e}", count[0]
    vals = c.get(np.arange(len(ids)), ragged=kw.get("positions") == "all")
    vals = vals[0] if isinstance(vals, tuple) else vals
    return vals.tobytes(), count[0]


def same_cache(a, b):
    """Directories a and b hold the same cache: the same files, each byte for byte, the
    manifest's build_seconds (wall time) and its checksum aside."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        if n != "manifest.json":
            assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n
    ma, mb = (json.load(open(os.path.join(d, "manifest.json"))) for d in (a, b))
    for m in (ma, mb):
        del m["build_seconds"], m["checksum"]
    assert ma == mb
    return names


def one_process(model, out, kw):
    enc = fasttran.Encoder.from_pretrained(model)
    c = fasttran.ActivationCache.build(enc, *inputs(), disk_dir=out, show_progress=False, group=False, **kw)
    vals = c.get(np.arange(len(c)), ragged=kw.get("positions") == "all")
    return (vals[0] if isinstance(vals, tuple) else vals).tobytes()


def test_two_ranks_write_the_one_process_files_and_a_complete_cache_is_reused(model, tmp_path, monkeypatch):
    kw = dict(positions="all", dtype="int8", batch_size=16)
    ref = one_process(model, str(tmp_path / "one"), kw)
    two = str(tmp_path / "two")
    out = run_ranks(_build, 2, model, two, kw)
    names = same_cache(str(tmp_path / "one"), two)
    assert len([n for n in names if n.startswith("shard-")]) == 10 and not [n for n in names if "journal" in n]
    assert [v for v, _ in out] == [ref, ref]           # every rank holds the whole cache
    assert out[0][1] > 0 and out[1][1] > 0 and out[0][1] + out[1][1] == 10   # each encoded its part
    manifest = open(os.path.join(two, "manifest.json"), "rb").read()
    # complete: at world size 3 and in one process, nothing is encoded or written
    out = run_ranks(_build, 3, model, two, kw)
    assert out == [(ref, 0)] * 3
    count = count_here(monkeypatch)
    assert one_process(model, two, kw) == ref and count == [0]
    assert open(os.path.join(two, "manifest.json"), "rb").read() == manifest


def test_an_interrupted_split_build_resumes_at_another_world_size(model, tmp_path, monkeypatch):
    kw = dict(positions="mean", dtype="float16", batch_size=8)   # 19 shards
    ref = one_process(model, str(tmp_path / "one"), kw)
    d = str(tmp_path / "split")
    out = run_ranks(_build, 2, model, d, kw, fail_after=(1, 2), check=False)
    assert out[1].error_type == "RuntimeError" and "injected failure after 2 shards" in out[1].message
    msg, done0 = out[0].value
    assert msg == ("CollectiveError: rank 1 failed during 'cache build: shards': RuntimeError: injected failure "
                   "after 2 shards")
    assert not json.load(open(os.path.join(d, "manifest.json")))["complete"]
    assert len([n for n in os.listdir(d) if n.startswith("build-journal-")]) == 2
    shutil.copytree(d, str(tmp_path / "copy"))
    # three ranks finish it, encoding only what was not done
    out = run_ranks(_build, 3, model, d, kw)
    assert [v for v, _ in out] == [ref] * 3
    assert sum(n for _, n in out) == 19 - done0 - 2
    same_cache(str(tmp_path / "one"), d)
    # one process finishes the copy the same way (the journals are read there too)
    count = count_here(monkeypatch)
    assert one_process(model, str(tmp_path / "copy"), kw) == ref and count[0] == 19 - done0 - 2
    same_cache(str(tmp_path / "one"), str(tmp_path / "copy"))


def test_ranks_that_disagree_get_an_error(model, tmp_path):
    kw = dict(positions="cls", batch_size=32)
    # other inputs on rank 1
    out = run_ranks(_build_other_inputs, 2, model, str(tmp_path / "b"), kw)
    for msg, n in out:
        assert msg.startswith("CacheMismatchError: a cache build split over 2 ranks: rank 1 builds another cache "
                              "than rank 0"), msg
        assert n == 0
    # a directory per rank
    out = run_ranks(_build, 2, model, [str(tmp_path / "c0"), str(tmp_path / "c1")], kw)
    for msg, _ in out:
        assert msg.startswith("InputError: a cache build split over 2 ranks: the ranks passed different disk_dir "
                              "paths") and "group=False" in msg, msg
    out = run_ranks(_build, 2, model, [str(tmp_path / "d0"), str(tmp_path / "d1")], dict(kw, group=False))
    assert all(isinstance(v, bytes) for v, _ in out)   # group=False: a cache per rank


def _build_warned(rank, world, model, out, kw):
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _build(rank, world, model, out, kw)
    return [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]


def test_ranks_with_other_kernels_are_told(model, tmp_path):
    """AVX-512 and AVX2 ranks write correct shards whose last bits differ: rank 0 says so."""
    if fasttran._C.cpu_isa() not in ("avx512", "amx"):
        pytest.skip(f"needs a CPU with two kernel sets to mix (this one runs {fasttran._C.cpu_isa()})")
    out = run_ranks(_build_warned, 2, model, str(tmp_path / "c"), dict(positions="cls", batch_size=32),
                    rank_env={1: {"FASTTRAN_CPU_ISA": "avx2"}})
    kinds = "; ".join(sorted(["cpu avx2: ranks [1]", f"cpu {fasttran._C.cpu_isa()}: ranks [0]"]))
    assert out[0] == [f"the ranks compute with different kernels ({kinds}): the cache is correct, but its rows differ "
                      "in the last bits from a build on one kind of machine"], out
    assert out[1] == []


def _build_other_inputs(rank, world, model, out, kw):
    return _build(rank, world, model, out, kw, seed=rank)


def test_torchrun_cache_command_writes_the_one_process_files(minilm_dir, tmp_path):
    from conftest import sst2_file
    src = sst2_file("train")
    run = [sys.executable, "-m", "fasttran", "cache", "--model", minilm_dir, "--input", src, "--limit", "300",
           "--batch-size", "32"]
    env = dict(os.environ, FASTTRAN_PROGRESS_INTERVAL="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    one = subprocess.run(run + ["--output", str(tmp_path / "one")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}"]
    two = subprocess.run(torchrun + run[1:] + ["--output", str(tmp_path / "two")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    same_cache(str(tmp_path / "one"), str(tmp_path / "two"))
    assert two.stdout.count("ActivationCache(examples=300") == 1, two.stdout   # rank 0 prints
    assert "\r" not in two.stderr   # progress as lines in captured output
