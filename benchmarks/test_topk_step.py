"""The top-k training step on the CPU: fasttran against PyTorch training the same layers on the same
cached inputs (the CPU benchmark of top-k training).

    python -m pytest benchmarks/test_topk_step.py -s          (FASTTRAN_BENCH_ROUNDS=5 by default)

One step = the top k layers forward in training mode (dropout 0.1) + mean pooling + a linear
classification head + cross-entropy + backward + AdamW over layers and head (clipping at 1.0).
fasttran: Trainer._step's pieces (TopLayers, the C head, the fused AdamW). PyTorch: transformers'
BertLayer modules of the same weights, the same pooling and head, torch.optim.AdamW (foreach).
Both on batches of 32 full sequences of 128 tokens (every token real), 2 threads, interleaved
rounds, median wall and CPU time per step; the layers' outputs are checked to agree first.
Architectures: all-MiniLM-L6-v2 (real weights) and BERT-base (random weights), k = 1, 2, 6."""
import json
import os
import platform
import time

import numpy as np
import pytest

import fasttran
from fasttran.finetune import mean_rows

torch = pytest.importorskip("torch")
ROUNDS = int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "5"))
THREADS = int(os.environ.get("FASTTRAN_BENCH_THREADS", "2"))
B, T = 32, 128


def bert_base_dir(tmp):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    m = BertModel(BertConfig())
    m.save_pretrained(tmp)
    return tmp


def build(path, k, seed=0, precision="float32"):
    from transformers import BertModel
    from fasttran.finetune import TopLayers
    from fasttran.heads import ClassificationHead
    enc = fasttran.Encoder.from_pretrained(path, load_tokenizer=False)
    L, C = enc.num_layers, enc.hidden_size
    top = TopLayers(enc, k, hidden_dropout=0.1, attention_dropout=0.1, matmul_precision=precision)
    head = ClassificationHead(C, 2, dropout=0.1, seed=seed)
    named = top.named_parameters() + list(head.named_parameters())
    opt = fasttran.optim.AdamW(named, lr=5e-5, weight_decay=0.01, max_grad_norm=1.0)
    hgrads = np.zeros_like(head.params)
    gviews = [g for _, g in top.named_gradients()] + list(head.views(hgrads).values())

    ref = BertModel.from_pretrained(path).train()
    layers = torch.nn.ModuleList(ref.encoder.layer[L - k:])
    lin = torch.nn.Linear(C, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(head.tensors["classifier.weight"]))
        lin.bias.copy_(torch.from_numpy(head.tensors["classifier.bias"]))
    drop = torch.nn.Dropout(0.1)
    topt = torch.optim.AdamW(list(layers.parameters()) + list(lin.parameters()), lr=5e-5, weight_decay=0.01,
                             foreach=True)
    return enc, top, head, opt, hgrads, gviews, layers, lin, drop, topt


def fasttran_step(top, head, opt, hgrads, gviews, x, lengths, y, step):
    out = top.forward(x, lengths, training=True, seed=1, step=step)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pooled = mean_rows(out, offsets)   # the Trainer's pooling
    dpooled = np.empty_like(pooled)
    head.step(pooled, y, grads=hgrads, dx=dpooled, training=True, seed=1, step=step)
    top.backward(np.repeat(dpooled / lengths[:, None].astype(np.float32), lengths, axis=0))
    opt.step(gviews)


def torch_step(layers, lin, drop, topt, xt, yt, amp=False):
    topt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = lin(drop(run_layers(layers, xt).mean(dim=1)))
    loss = torch.nn.functional.cross_entropy(logits.float(), yt)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(layers.parameters()) + list(lin.parameters()), 1.0)
    topt.step()


def cached_inputs(enc, k):
    """the cached inputs (the real encoder's layer L - k states of random token ids), lengths, labels,
    and the same as torch tensors"""
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (B, T))
    x = np.ascontiguousarray(enc.forward(ids, output_layers=[enc.num_layers - k])[0].reshape(B * T, -1))
    y = rng.integers(0, 2, B).astype(np.int32)
    return x, np.full(B, T, np.int32), y, torch.from_numpy(x.reshape(B, T, -1)), torch.from_numpy(y.astype(np.int64))


def run_layers(layers, xt):
    h = xt
    for layer in layers:
        o = layer(h)
        h = o[0] if isinstance(o, tuple) else o
    return h


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


CASES = [("minilm", 1), ("minilm", 2), ("minilm", 6), ("bert-base", 1), ("bert-base", 2)]


@pytest.mark.parametrize("arch,k", CASES, ids=[f"{a}-k{k}" for a, k in CASES])
def test_topk_step_against_pytorch(arch, k, tmp_path):
    fasttran.set_num_threads(THREADS)
    torch.set_num_threads(THREADS)
    path = fasttran.models.minilm_path() if arch == "minilm" else bert_base_dir(str(tmp_path / "bert-base"))
    enc, top, head, opt, hgrads, gviews, layers, lin, drop, topt = build(path, k)
    x, lengths, y, xt, yt = cached_inputs(enc, k)
    # correctness first: the layers' eval-mode outputs agree
    layers.eval()
    with torch.no_grad():
        h = run_layers(layers, xt)
    assert np.abs(top.forward(x, lengths).reshape(B, T, -1) - h.numpy()).max() <= 1e-4
    layers.train()
    ours, theirs = [], []
    fasttran_step(top, head, opt, hgrads, gviews, x, lengths, y, 0)    # warm-up
    torch_step(layers, lin, drop, topt, xt, yt)
    for r in range(ROUNDS):
        pair = [("f", lambda: fasttran_step(top, head, opt, hgrads, gviews, x, lengths, y, r + 1)),
                ("t", lambda: torch_step(layers, lin, drop, topt, xt, yt))]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]):
            (ours if name == "f" else theirs).append(timed(fn))
    fw, fc = np.median([a for a, _ in ours]), np.median([b for _, b in ours])
    tw, tc = np.median([a for a, _ in theirs]), np.median([b for _, b in theirs])
    load = os.getloadavg()[0]
    row = {"arch": arch, "k": k, "batch": [B, T], "threads": THREADS, "rounds": ROUNDS,
           "fasttran_s": fw, "fasttran_cpu_s": fc, "torch_s": tw, "torch_cpu_s": tc, "speedup": tw / fw,
           "speedup_cpu": tc / fc, "load_avg": load, "cpu": platform.processor() or platform.machine(),
           "isa": fasttran.build_info().get("cpu_kernels"), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    print(f"\n{arch} k={k} {B}x{T}: fasttran {fw * 1e3:.0f} ms ({fc * 1e3:.0f} CPU), torch {tw * 1e3:.0f} ms "
          f"({tc * 1e3:.0f} CPU): {tw / fw:.2f}x ({tc / fc:.2f}x CPU), load {load:.1f}")
    out = os.path.join(os.path.dirname(__file__), "last_topk_step.json")
    rows = json.load(open(out)) if os.path.exists(out) else []
    rows = [r for r in rows if not (r["arch"] == arch and r["k"] == k and r.get("precision", "float32") == "float32")] + [row]
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


BF16_CASES = [("minilm", 1), ("minilm", 2), ("bert-base", 1)]


@pytest.mark.skipif(not fasttran._C.cpu_features()[0]["avx512_bf16"],
                    reason="bf16 layer training on the CPU needs bf16 products (AVX512_BF16 or AMX)")
@pytest.mark.parametrize("arch,k", BF16_CASES, ids=[f"{a}-k{k}" for a, k in BF16_CASES])
def test_bf16_topk_step_against_pytorch_amp(arch, k, tmp_path):
    """Mixed precision on a CPU with bf16 products: fasttran's step with bf16 products
    (precision="bfloat16": on AMX the tiles' bf16 term alone, else vdpbf16ps (cpu/lowp.c); float32
    storage and master weights) against PyTorch's CPU AMP (torch.autocast("cpu", bfloat16):
    oneDNN's bf16 kernels), and against both float32 steps (fasttran's and torch's)."""
    fasttran.set_num_threads(THREADS)
    torch.set_num_threads(THREADS)
    path = fasttran.models.minilm_path() if arch == "minilm" else bert_base_dir(str(tmp_path / "bert-base"))
    enc, top, head, opt, hgrads, gviews, layers, lin, drop, topt = build(path, k, precision="bfloat16")
    _, top32, head32, opt32, hgrads32, gviews32 = build(path, k)[:6]
    x, lengths, y, xt, yt = cached_inputs(enc, k)
    layers.eval()
    with torch.no_grad():
        want = run_layers(layers, xt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = run_layers(layers, xt)
    want, amp = want.numpy().astype(np.float64), amp.float().numpy().astype(np.float64)
    # the training forward multiplies in bf16 (evaluation, training=False, in float32): its error, dropout off
    from fasttran.finetune import TopLayers
    nodrop = TopLayers(enc, k, hidden_dropout=0.0, attention_dropout=0.0, matmul_precision="bfloat16")
    got = nodrop.forward(x, lengths, training=True).reshape(B, T, -1)
    rel = lambda a: float(np.linalg.norm(a - want) / np.linalg.norm(want))
    err, err_amp = rel(got), rel(amp)
    assert 1e-4 < err <= 2e-2 and np.abs(top32.forward(x, lengths).reshape(B, T, -1) - want).max() <= 1e-4, (err, err_amp)
    layers.train()
    steps = {"fasttran bf16": lambda r: fasttran_step(top, head, opt, hgrads, gviews, x, lengths, y, r),
             "fasttran fp32": lambda r: fasttran_step(top32, head32, opt32, hgrads32, gviews32, x, lengths, y, r),
             "torch AMP bf16": lambda r: torch_step(layers, lin, drop, topt, xt, yt, amp=True),
             "torch fp32": lambda r: torch_step(layers, lin, drop, topt, xt, yt)}
    for fn in steps.values():
        fn(0)   # warm-up (oneDNN's primitives, autocast's weight casts)
    times = {n: [] for n in steps}
    names = list(steps)
    for r in range(ROUNDS):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(timed(lambda: steps[n](r + 1)))
    med = {n: float(np.median([w for w, _ in v])) for n, v in times.items()}
    load = os.getloadavg()[0]
    row = {"arch": arch, "k": k, "batch": [B, T], "threads": THREADS, "rounds": ROUNDS, "precision": "bfloat16",
           "step_s": med, "rel_err_vs_torch_fp32": err, "torch_amp_rel_err_vs_torch_fp32": err_amp,
           "speedup_vs_torch_amp": med["torch AMP bf16"] / med["fasttran bf16"],
           "speedup_vs_torch_fp32": med["torch fp32"] / med["fasttran bf16"],
           "speedup_vs_fasttran_fp32": med["fasttran fp32"] / med["fasttran bf16"], "load_avg": load,
           "cpu": platform.processor() or platform.machine(), "isa": fasttran.build_info().get("cpu_kernels"),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(f"\n{arch} k={k} bf16 {B}x{T}: " + ", ".join(f"{n} {v * 1e3:.0f} ms" for n, v in med.items()) +
          f"; vs AMP {row['speedup_vs_torch_amp']:.2f}x, vs torch fp32 {row['speedup_vs_torch_fp32']:.2f}x, vs "
          f"fasttran fp32 {row['speedup_vs_fasttran_fp32']:.2f}x; "
          f"error vs fp32 {err:.2e} (AMP {err_amp:.2e}), load {load:.1f}")
    out = os.path.join(os.path.dirname(__file__), "last_topk_step.json")
    rows = json.load(open(out)) if os.path.exists(out) else []
    rows = [r for r in rows if not (r["arch"] == arch and r["k"] == k and r.get("precision") == "bfloat16"
                                    and r.get("isa") == row["isa"])] + [row]   # AMX's and AVX512_BF16's rows both kept
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
