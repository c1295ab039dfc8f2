"""fasttran's bf16 CUDA encoder against PyTorch on the same GPU, same run, same inputs (the CUDA
encoder's benchmark).

Engines (all bfloat16, inference, last hidden state):
  fasttran        Encoder(dtype="bfloat16", device="cuda").forward(..., output="device"): cuBLASLt
                  projections with fused epilogues, the fused WMMA attention over real keys only,
                  padding removed (inputs are torch CUDA tensors read in place through DLPack)
  sdpa            transformers BertModel, attn_implementation="sdpa", torch.inference_mode()
  compile         the same model through torch.compile (default mode), full batches only
Models: BERT-base and BERT-large architectures, random weights (saved once in bf16 and loaded by
both, so both compute with the same numbers). Workloads:
  full            (32, 128), (256, 128), (64, 512): every token real
  sst2            256 sentences with SST-2's token lengths, padded to the batch's longest
  squad           32 question+context windows with SQuAD's lengths, padded to 384
  bytetransformer 16 x 512 and 64 x 128, lengths uniform with mean 0.6 x max (ByteTransformer's setting)
  latency         1 x 128 and 8 x 128 (launch-bound sizes)
The length distributions are benchmarks/length_distributions.json (SST-2 train, SQuAD train subset,
tokenized with the BERT uncased vocabulary), so the GPU machine needs no data files.

Before timing, fasttran's output is checked against transformers' (relative error of the real
tokens <= 2e-2: both are bf16). Each engine runs warm-up calls, then ROUNDS interleaved rounds of
REPS calls (CUDA-synchronised wall time); the median round is reported as tokens/s (real tokens),
ratios to sdpa and compile, and MFU: the model's FLOPs on real tokens (2 x multiply-adds of the
projections, Q K^T and P V over real keys) over the time, against a bf16 GEMM (8192^3, torch.matmul)
timed in the same run. Output: a table, and benchmarks/last_gpu_encoder.json (device, versions,
date, command, every number).

  python3 -m pytest benchmarks/test_gpu_encoder.py -s -p no:cacheprovider

Environment: FASTTRAN_BENCH_ROUNDS (default 5), FASTTRAN_BENCH_REPS (default 10),
FASTTRAN_BENCH_MODELS (default "base,large"), FASTTRAN_BENCH_COMPILE=0 skips torch.compile.
Skipped, with the reason, where there is no GPU (the emulator is not one).
"""
import json
import os
import platform
import sys
import time

import numpy as np
import pytest

import fasttran

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import needs_real_gpu  # noqa: E402

pytestmark = needs_real_gpu(torch)

ROUNDS = int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "5"))
REPS = int(os.environ.get("FASTTRAN_BENCH_REPS", "10"))
MODELS = os.environ.get("FASTTRAN_BENCH_MODELS", "base,large").split(",")
COMPILE = os.environ.get("FASTTRAN_BENCH_COMPILE", "1") != "0"
HERE = os.path.dirname(os.path.abspath(__file__))
ARCH = {"base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)}
RESULTS = {"meta": {}, "peak_bf16_tflops": None, "cases": []}


def lengths_for(kind, B, T, rng):
    if kind == "full":
        return np.full(B, T)
    if kind == "bytetransformer":   # uniform on [0.2 T, T]: mean 0.6 T
        return rng.integers(int(0.2 * T), T + 1, B)
    with open(os.path.join(HERE, "length_distributions.json")) as f:
        d = json.load(f)[kind]
    p = np.asarray(d["counts"], np.float64)
    return np.minimum(rng.choice(np.asarray(d["lengths"]), size=B, p=p / p.sum()), T)


WORKLOADS = [("full", 32, 128), ("full", 256, 128), ("full", 64, 512), ("sst2", 256, 128), ("squad", 32, 384),
             ("bytetransformer", 16, 512), ("bytetransformer", 64, 128), ("latency", 1, 128), ("latency", 8, 128)]


def flops(cfg, lens):
    """2 x multiply-adds of one forward over the real tokens (projections, Q K^T, P V)"""
    C, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    tokens = float(np.sum(lens))
    attn = float(np.sum(np.asarray(lens, np.float64) ** 2)) * 2 * C
    return 2.0 * L * (tokens * (4 * C * C + 2 * C * I) + attn)


def sync_time(fn, reps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def peak_bf16():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = min(sync_time(lambda: a @ b, 10) for _ in range(3))
    return 2 * 8192 ** 3 / t / 1e12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import BertConfig, BertModel
    out = {}
    for name in MODELS:
        cfg = dict(ARCH[name], vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
        d = str(tmp_path_factory.mktemp(f"bert-{name}"))
        torch.manual_seed(0)
        BertModel(BertConfig(**cfg), add_pooling_layer=False).to(torch.bfloat16).save_pretrained(d)
        hf = BertModel.from_pretrained(d, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
        ours = fasttran.Encoder.from_pretrained(d, device="cuda", dtype="bfloat16", load_tokenizer=False)
        out[name] = (cfg, hf, ours)
    RESULTS["peak_bf16_tflops"] = peak_bf16()
    yield out
    _report()


def _report():
    import transformers as tr
    p = torch.cuda.get_device_properties(0)
    RESULTS["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": p.name,
                       "device_memory_gib": round(p.total_memory / 2 ** 30, 1), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "transformers": tr.__version__, "fasttran": fasttran.__version__,
                       "fasttran_cuda": fasttran.build_info()["cuda"], "python": platform.python_version(),
                       "command": " ".join(sys.argv), "rounds": ROUNDS, "reps": REPS}
    lines = [f"\n{RESULTS['meta']['device']}, bf16 GEMM peak {RESULTS['peak_bf16_tflops']:.0f} TFLOP/s",
             "model | workload | B x T | real % | fasttran ms | sdpa ms | compile ms | vs sdpa | vs compile | "
             "fasttran Mtok/s | MFU"]
    for c in RESULTS["cases"]:
        t = c["ms"]
        lines.append(f"{c['model']} | {c['workload']} | {c['B']} x {c['T']} | {100 * c['real_fraction']:.0f} | "
                     f"{t['fasttran']:.3f} | {t['sdpa']:.3f} | {t.get('compile', float('nan')):.3f} | "
                     f"{c['vs_sdpa']:.2f}x | {c.get('vs_compile', float('nan')):.2f}x | "
                     f"{c['fasttran_tokens_per_s'] / 1e6:.2f} | {100 * c['mfu']:.1f}%")
    print("\n".join(lines))
    with open(os.path.join(HERE, "last_gpu_encoder.json"), "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("workload,B,T", WORKLOADS, ids=[f"{w}-{b}x{t}" for w, b, t in WORKLOADS])
def test_gpu_encoder(models, model, workload, B, T):
    cfg, hf, ours = models[model]
    rng = np.random.default_rng(B * T)
    lens = lengths_for("full" if workload == "latency" else workload, B, T, rng)
    Tb = int(lens.max()) if workload == "sst2" else T       # SST-2: padded to the batch's longest
    ids = torch.as_tensor(rng.integers(1000, 30000, (B, Tb)), device="cuda")
    mask = torch.as_tensor((np.arange(Tb)[None, :] < lens[:, None]).astype(np.int64), device="cuda")
    types = torch.zeros_like(ids)
    valid = mask.bool()

    def run_ours():
        return ours.forward(ids, mask, types, output="device")

    def run_hf(m):
        with torch.inference_mode():
            return m(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state

    a = torch.from_dlpack(run_ours()).float()
    b = run_hf(hf).float()
    rel = float((a - b)[valid].norm() / b[valid].norm())
    assert rel <= 2e-2, f"fasttran bf16 differs from transformers bf16 by {rel:.4f}"
    engines = {"fasttran": run_ours, "sdpa": lambda: run_hf(hf)}
    if COMPILE and workload == "full":
        compiled = torch.compile(hf)
        engines["compile"] = lambda: run_hf(compiled)
    for fn in engines.values():   # warm-up (workspaces, plans, compilation)
        for _ in range(3):
            fn()
    times = {k: [] for k in engines}
    order = list(engines)
    for r in range(ROUNDS):
        for k in order[r % len(order):] + order[:r % len(order)]:
            times[k].append(sync_time(engines[k], REPS))
    med = {k: float(np.median(v)) for k, v in times.items()}
    real = int(lens.sum())
    case = {"model": model, "workload": workload, "B": B, "T": Tb, "real_fraction": real / (B * Tb),
            "ms": {k: 1e3 * v for k, v in med.items()}, "rounds_ms": {k: [1e3 * x for x in v] for k, v in times.items()},
            "rel_error_vs_transformers_bf16": rel, "vs_sdpa": med["sdpa"] / med["fasttran"],
            "fasttran_tokens_per_s": real / med["fasttran"],
            "mfu": flops(cfg, lens) / med["fasttran"] / (RESULTS["peak_bf16_tflops"] * 1e12)}
    if "compile" in med:
        case["vs_compile"] = med["compile"] / med["fasttran"]
    RESULTS["cases"].append(case)
