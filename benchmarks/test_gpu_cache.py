"""The activation cache on the GPU: device-tier and host-tier read bandwidth against the device's
copy rates, and how much of the host-tier prefetch hides behind training (the GPU training's goal,
"prefetch overlap >= 90%").

Cache: N examples of per-token features (positions="all", hidden 768 as BERT-base, lengths uniform
in [16, 128]) built by a one-layer random encoder in bf16 (the features' values do not matter here),
stored as bf16, fp32 and int8, either all in device memory (device_bytes) or all in host memory.
Reads: one epoch of cache.batches(32, output="device"): decoded float32 batches (32, longest, 768)
in device memory. Bandwidth counts the float32 bytes delivered (and the stored bytes read).
Copy rates (same run): device-to-device copy_ of 1 GiB, and host-to-device from pinned memory.

Overlap: a stand-in for a training step (bf16 matmuls on the batch on torch's stream, sized to
take about as long as reading one batch) run on every batch of an epoch; alone (batches already
on the device), reading alone, and both: overlap = (t_read + t_compute - t_both) / min(t_read,
t_compute) (1.0: the reads are entirely hidden).

  python3 -m pytest benchmarks/test_gpu_cache.py -s -p no:cacheprovider   # -> last_gpu_cache.json
FASTTRAN_BENCH_SMOKE=1 runs tiny sizes on the CUDA emulator (a check that the script works; its
numbers mean nothing). Skipped, with the reason, where there is neither.
"""
import json
import os
import sys
import tempfile
import time

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import real_gpu  # noqa: E402

SMOKE = os.environ.get("FASTTRAN_BENCH_SMOKE") == "1"
GPU = real_gpu(torch)[0]
pytestmark = pytest.mark.skipif(not (GPU or (SMOKE and fasttran.cuda_available())),
                                reason="needs a real GPU (or FASTTRAN_BENCH_SMOKE=1 on the CUDA emulator)")
N = 16 if SMOKE else int(os.environ.get("FASTTRAN_BENCH_EXAMPLES", "20000"))
C = 64 if SMOKE else 768
OUT = {}


def sync():
    if GPU:
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t0, r


@pytest.fixture(scope="module")
def encoder():
    from transformers import BertConfig, BertModel
    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=C, num_hidden_layers=1, num_attention_heads=C // 64, intermediate_size=4 * C),
              add_pooling_layer=False).save_pretrained(d)
    yield fasttran.Encoder.from_pretrained(d, device="cuda", dtype="bfloat16", load_tokenizer=False)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_gpu_cache.json"), "w") as f:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0) if GPU else "emulator",
                "torch": torch.__version__, "fasttran": fasttran.__version__, "examples": N, "hidden": C,
                "command": " ".join(sys.argv)}
        json.dump({"meta": meta, "results": OUT}, f, indent=1)


def copy_rates():
    if not GPU:
        return {"d2d_GBps": float("nan"), "h2d_pinned_GBps": float("nan")}
    a = torch.empty(1 << 28, device="cuda")
    b = torch.empty_like(a)
    h = torch.empty(1 << 28, pin_memory=True)
    d2d = min(timed(lambda: b.copy_(a))[0] for _ in range(5))
    h2d = min(timed(lambda: a.copy_(h, non_blocking=True))[0] for _ in range(5))
    return {"d2d_GBps": 2 * a.numel() * 4 / d2d / 1e9, "h2d_pinned_GBps": a.numel() * 4 / h2d / 1e9}


def inputs(rng):
    lens = rng.integers(16, 129, N)
    ids = rng.integers(1000, 30000, (N, 128))
    mask = (np.arange(128)[None, :] < lens[:, None]).astype(np.int64)
    return ids, mask, lens


@pytest.mark.parametrize("codec", ["bfloat16", "float32", "int8"])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_gpu_cache(encoder, codec, tier):
    rng = np.random.default_rng(0)
    ids, mask, lens = inputs(rng)
    cache = ActivationCache.build(encoder, ids, mask, positions="all", dtype=codec, batch_size=256,
                                  device_bytes=(64 << 30) if tier == "device" else None, show_progress=False)
    st = cache.stats()["tiers"]
    stored = st.get(tier, {}).get("bytes", 0)
    assert st.get(tier, {}).get("entries", 0) == N, f"not every example in the {tier} tier: {st}"

    def read_epoch(step=None):
        delivered = 0
        for _, (x, m) in cache.batches(32, seed=1, output="device"):
            delivered += x.nbytes if hasattr(x, "nbytes") else int(np.prod(x.shape)) * 4
            if step:
                step(x)
        return delivered

    read_epoch()   # warm-up (reader buffers, plans)
    t_read, delivered = timed(read_epoch)
    res = {"tier": tier, "codec": codec, "stored_bytes": stored, "delivered_bytes": delivered,
           "read_s": t_read, "delivered_GBps": delivered / t_read / 1e9, "stored_GBps": stored / t_read / 1e9}
    res.update(copy_rates())
    # a stand-in training step on each batch, about as long as reading it
    if GPU:
        w = torch.randn(C, C, device="cuda", dtype=torch.bfloat16)
        reps = [1]

        def step(x):
            t = torch.from_dlpack(x)[..., :C].to(torch.bfloat16)
            for _ in range(reps[0]):
                t = torch.tanh(t @ w)
            return t

        one = cache.get(cache.example_ids[:32], output="device")[0]
        t1 = timed(lambda: [step(one) for _ in range(20)])[0] / 20
        reps[0] = max(1, int(round((t_read / (N / 32)) / t1)))
        batches = [cache.get(cache.example_ids[a:a + 32], output="device")[0] for a in range(0, min(N, 32 * 64), 32)]
        t_compute = timed(lambda: [step(batches[k % len(batches)]) for k in range((N + 31) // 32)])[0]
    else:
        def step(x):
            time.sleep(0.001)
        t_compute = ((N + 31) // 32) * 0.001
    t_both, _ = timed(lambda: read_epoch(step))
    res.update(compute_s=t_compute, both_s=t_both,
               overlap=(t_read + t_compute - t_both) / min(t_read, t_compute))
    OUT[f"{tier}-{codec}"] = res
    print(f"\n{tier:6s} {codec:8s} read {res['delivered_GBps']:7.1f} GB/s delivered ({res['stored_GBps']:6.1f} stored); "
          f"copy d2d {res['d2d_GBps']:.0f}, h2d pinned {res['h2d_pinned_GBps']:.1f} GB/s; overlap {100 * res['overlap']:.0f}%")
