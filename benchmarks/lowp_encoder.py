"""all-MiniLM-L6-v2 on the CPU in reduced precision: fasttran float32, int8 and bf16
against ONNX Runtime float32 and ONNX Runtime's dynamic int8 quantization of the same model, same
run, same inputs, same threads -- latency and, beside it, what each costs in accuracy.

    python benchmarks/lowp_encoder.py         # 2 threads (FASTTRAN_BENCH_THREADS), 7 rounds

Engines:
  fasttran f32   Encoder.from_pretrained(path)
  fasttran int8  the same encoder .quantize(): per-channel int8 weights and word embeddings,
                 per-token activations, int8 products where the CPU has VNNI / AMX-INT8
  fasttran bf16  Encoder.from_pretrained(path, dtype="bfloat16") (CPUs with AVX512_BF16)
  ORT f32        torch.onnx.export of transformers' BertModel (eager attention, opset 17), then
                 onnxruntime.transformers' BERT optimizer (fused attention / LayerNorm / GELU)
  ORT int8       onnxruntime.quantization.quantize_dynamic of that optimized model (its defaults:
                 int8 weights per tensor, uint8 activations quantized per tensor at run time;
                 the fused attention becomes QAttention, the projections MatMulInteger / DynamicQuantizeMatMul)
ORT sessions: intra_op_num_threads = threads, ONNX Runtime's defaults otherwise (its workers spin
while they wait, the way it is fastest on an idle machine; fasttran's spin briefly, then sleep).
Workloads: 1 x 128 and 32 x 128 tokens of random ids (every token real); the 872 SST-2 dev
sentences one at a time (the first 128) and in length-sorted batches of 32. Rounds are interleaved
(each round runs every engine once, in a rotating order); the median round is reported.
Accuracy: the mean-pooled embeddings of the 872 SST-2 dev sentences against fasttran float32 (which
equals transformers within 1e-4): cosine (min, mean); and dev accuracy of a logistic-regression head
trained on float32 features of the 4,000 shipped SST-2 training sentences, applied to each engine's
dev features (the change a frozen-feature classifier sees). Writes benchmarks/last_lowp_encoder.json
with the machine, its load average before and after, and the versions."""
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

import fasttran
from cpu_common import cpu_name_and_flags, export_onnx

THREADS = int(os.environ.get("FASTTRAN_BENCH_THREADS", "2"))
ROUNDS = int(os.environ.get("FASTTRAN_BENCH_ROUNDS", "7"))
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("FASTTRAN_DATA", os.path.join(HERE, "..", "..", "shared", "data"))


def onnx_models(model_dir, tmp):
    """(float32 optimized path, int8 path, notes) or None when onnxruntime / onnx are missing"""
    try:
        import onnx
        import torch  # noqa: F401  (the export)
        from onnxruntime.quantization import QuantType, quantize_dynamic
        from onnxruntime.transformers import optimizer
    except ImportError as e:
        print(f"ONNX Runtime engines skipped: {e}")
        return None
    raw = os.path.join(tmp, "minilm.onnx")
    cfg = export_onnx(model_dir, raw)
    opt = optimizer.optimize_model(raw, model_type="bert", num_heads=cfg.num_attention_heads,
                                   hidden_size=cfg.hidden_size, opt_level=1)
    fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    f32 = os.path.join(tmp, "minilm_opt.onnx")
    opt.save_model_to_file(f32)
    i8 = os.path.join(tmp, "minilm_int8.onnx")
    # the fused graph's contrib ops (Attention, SkipLayerNorm) escape ONNX shape inference: their
    # outputs are float32, as ORT's quantization examples for BERT say
    quantize_dynamic(f32, i8, weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    ops = {}
    for node in onnx.load(i8).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return f32, i8, {"fusions": fused, "quantize_dynamic": "weight_type=QInt8, DefaultTensorType=FLOAT, other "
                     "arguments default", "int8_graph_ops": ops}


def engines(model_dir, tmp):
    fasttran.set_num_threads(THREADS)
    f32 = fasttran.Encoder.from_pretrained(model_dir)
    out = {"fasttran f32": f32, "fasttran int8": f32.quantize()}
    if fasttran.build_info()["bf16_kernels"]:
        out["fasttran bf16"] = fasttran.Encoder.from_pretrained(model_dir, dtype="bfloat16")
    fns = {k: (lambda e: lambda ids, mask, types: e.forward(ids, mask, types))(e) for k, e in out.items()}
    notes = {k: e.memory_report()["weights"] for k, e in out.items()}
    onnx = onnx_models(model_dir, tmp)
    if onnx:
        import onnxruntime as ort
        for name, path in (("ORT f32", onnx[0]), ("ORT int8", onnx[1])):
            so = ort.SessionOptions()
            so.intra_op_num_threads = THREADS
            so.inter_op_num_threads = 1
            sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            fns[name] = (lambda s: lambda ids, mask, types: s.run(None, {"input_ids": ids, "attention_mask": mask,
                                                                         "token_type_ids": types})[0])(sess)
            notes[name] = onnx[2]
    return f32, fns, notes


def pooled(fn, batches):
    out = []
    for ids, mask, types in batches:
        h = fn(ids, mask, types)
        m = mask[..., None].astype(np.float32)
        out.append((h * m).sum(1) / np.maximum(m.sum(1), 1e-9))
    return np.concatenate(out)


def sst2(split):
    """the real dev set (872 sentences, FASTTRAN_DATA or ../shared/data) or the shipped copy; for
    training the shipped 4,000-sentence sample"""
    from fasttran.data import load_sst2, sst2_path
    path = os.path.join(DATA, "sst2", f"{split}.tsv")
    sents, labels = load_sst2(path if split == "dev" and os.path.exists(path) else sst2_path(split))
    return sents, np.asarray(labels)


def batches_of(enc, sents, size):
    toks = enc.tokenizer.encode_batch(sents)
    order = np.argsort([-len(t.ids) for t in toks], kind="stable")
    return [enc._pad([toks[j] for j in order[i:i + size]]) for i in range(0, len(order), size)], order


def main():
    model_dir = fasttran.models.minilm_path()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        f32, fns, notes = engines(model_dir, tmp)
        rng = np.random.default_rng(0)
        dev, dev_y = sst2("dev")
        dev_b32, order = batches_of(f32, dev, 32)
        workloads = {}
        for B in (1, 32):
            ids = rng.integers(1000, 30000, (B, 128))
            workloads[f"{B} x 128"] = [(ids, np.ones_like(ids), np.zeros_like(ids))]
        workloads["SST-2 dev, batch 1 (128 sentences)"] = [f32._pad([t]) for t in f32.tokenizer.encode_batch(dev[:128])]
        workloads["SST-2 dev, batch 32 (872 sentences)"] = dev_b32
        # the outputs first: every engine must compute the same model (each token's hidden state at a
        # cosine >= 0.5 from float32's on the random batch: ORT int8 reaches 0.81, another model is near 0)
        ref = fns["fasttran f32"](*workloads["1 x 128"][0])[0]
        for name, fn in fns.items():
            h = fn(*workloads["1 x 128"][0])[0]
            cos = (h * ref).sum(1) / np.linalg.norm(h, axis=1) / np.linalg.norm(ref, axis=1)
            print(f"{name}: hidden states on 1 x 128 random ids against fasttran f32: cosine min {cos.min():.4f}, "
                  f"max |diff| {np.abs(h - ref).max():.3f}")
            assert cos.min() >= 0.5, f"{name} computes another model: cosine {cos.min()}"
        times = {w: {e: [] for e in fns} for w in workloads}
        names = list(fns)
        for r in range(ROUNDS):
            for w, batches in workloads.items():
                for name in names[r % len(names):] + names[:r % len(names)]:
                    t0 = time.perf_counter()
                    for b in batches:
                        fns[name](*b)
                    times[w][name].append((time.perf_counter() - t0) / len(batches))
                    time.sleep(0.05)
        # accuracy beside the speed
        emb = {name: pooled(fn, dev_b32) for name, fn in fns.items()}
        train, train_y = sst2("train")
        train_b, train_order = batches_of(f32, train, 32)
        from sklearn.linear_model import LogisticRegression
        head = LogisticRegression(max_iter=2000, C=1.0).fit(pooled(fns["fasttran f32"], train_b), train_y[train_order])
        acc = {}
        for name, e in emb.items():
            c = (e * emb["fasttran f32"]).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(emb["fasttran f32"], axis=1)
            acc[name] = {"cos_min": float(c.min()), "cos_mean": float(c.mean()),
                         "max_abs": float(np.abs(e - emb["fasttran f32"]).max()),
                         "dev_accuracy": float((head.predict(e) == dev_y[order]).mean())}
    load_after = os.getloadavg()
    med = {w: {e: statistics.median(v) for e, v in d.items()} for w, d in times.items()}
    print(f"all-MiniLM-L6-v2, {THREADS} threads, median of {ROUNDS} interleaved rounds; load average before "
          f"{tuple(round(x, 2) for x in load_before)}, after {tuple(round(x, 2) for x in load_after)}")
    for w, d in med.items():
        print(f"\n{w}: ms per batch (x = fasttran f32 time / engine time)")
        for e, t in d.items():
            print(f"  {e:14s} {t * 1e3:9.2f} ms  x{d['fasttran f32'] / t:5.2f}")
        if "ORT int8" in d:
            print(f"  fasttran int8 against ORT int8: x{d['ORT int8'] / d['fasttran int8']:.2f}")
    print("\nSST-2 dev (872 sentences), mean-pooled embeddings against fasttran f32; dev accuracy of a float32-trained "
          "logistic-regression head on each engine's features:")
    for e, a in acc.items():
        print(f"  {e:14s} cos min {a['cos_min']:.5f} mean {a['cos_mean']:.6f}  max |diff| {a['max_abs']:.4f}  "
              f"accuracy {100 * a['dev_accuracy']:.2f}%")
    versions = {"fasttran": fasttran._C.version, "python": platform.python_version(), "numpy": np.__version__}
    for mod in ("onnxruntime", "onnx", "torch", "transformers", "sklearn"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    cpu = cpu_name_and_flags()[0]
    rec = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/lowp_encoder.py", "threads": THREADS,
           "rounds": ROUNDS, "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "load_avg_before": load_before,
           "load_avg_after": load_after, "build_info": {k: fasttran.build_info()[k] for k in (
               "cpu_kernels", "cpu_features", "int8_kernels", "bf16_kernels")},
           "versions": versions, "engines": notes, "median_s": med, "rounds_s": times, "accuracy": acc}
    with open(os.path.join(HERE, "last_lowp_encoder.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print("\nbenchmarks/last_lowp_encoder.json")


if __name__ == "__main__":
    sys.exit(main())
