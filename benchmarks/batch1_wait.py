"""Batch-1 latency against how OpenMP's idle workers wait (benchmarks/RESULTS.md section 1, steady
under load): all-MiniLM-L6-v2 float32 and int8 (Encoder.quantize), the first 64 SST-2 dev
sentences one at a time, mean pooling, 2 threads, median of 5 passes after one warm-up; each
setting in a fresh process (OpenMP reads it once, when it loads), alone and next to one busy
process (`python -c "while True: pass"`), and ONNX Runtime's dynamic int8 quantization of the same
model (its defaults: its workers spin) in the same run.

    python benchmarks/batch1_wait.py [--spins 0 100 300 1000 3000] [--threads 2]

Settings: "passive" (OMP_WAIT_POLICY=passive: sleep at once) and GOMP_SPINCOUNT=N for each N.
Writes benchmarks/last_batch1_wait.json."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sentences(n=64):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import sst2_file
    from fasttran.data import load_sst2
    s, _ = load_sst2(sst2_file("dev"))
    return s[:n]


def passes(fn, ids, mask, lengths, repeats=5):
    import numpy as np
    ts = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        for k in range(len(lengths)):
            T = int(lengths[k])
            fn(ids[k:k + 1, :T], mask[k:k + 1, :T])
        if r:
            ts.append((time.perf_counter() - t) / len(lengths) * 1000)
    return float(np.median(ts))


def fasttran_job(threads):
    """(float32 ms, int8 ms) in this process"""
    import numpy as np
    import fasttran
    fasttran.set_num_threads(threads)
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    q = enc.quantize()
    ids, mask = [np.asarray(a) for a in enc.tokenize(sentences())[:2]]
    L = mask.sum(1)
    return [passes(lambda i, m, e=e: e.forward(i, m, pooling="mean"), ids, mask, L) for e in (enc, q)]


def ort_job(threads, path):
    import numpy as np
    import onnxruntime as ort
    import fasttran
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    ids, mask = [np.asarray(a, np.int64) for a in enc.tokenize(sentences())[:2]]
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return passes(lambda i, m: sess.run(None, {"input_ids": i, "attention_mask": m, "token_type_ids": 0 * i}),
                  ids, mask, mask.sum(1))


def in_fresh_process(call, env):
    code = f"import sys, json; sys.path.insert(0, {HERE!r}); import batch1_wait as b; print(json.dumps({call}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spins", nargs="+", type=int, default=[0, 100, 300, 1000, 3000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "last_batch1_wait.json"))
    args = ap.parse_args()
    import fasttran
    from fasttran import compress
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    settings = {"passive": dict(base, OMP_WAIT_POLICY="passive")}
    settings.update({f"spin {n}": dict(base, GOMP_SPINCOUNT=str(n)) for n in args.spins if n > 0})
    res = {"meta": {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "command": " ".join(sys.argv),
                    "cpu_kernels": fasttran.build_info().get("cpu_kernels")}, "alone": {}, "busy": {}}
    with tempfile.TemporaryDirectory() as d:
        q8 = None
        try:
            from onnxruntime.quantization import QuantType, quantize_dynamic
            enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
            f32 = compress.export_onnx(compress.TaskModel(enc, fasttran.ClassificationHead(enc.hidden_size, 2)),
                                       os.path.join(d, "m.onnx"))
            q8 = os.path.join(d, "m.int8.onnx")
            quantize_dynamic(f32, q8, weight_type=QuantType.QInt8)
        except ImportError as e:
            print(f"ONNX Runtime left out: {e}")
        for where in ("alone", "busy"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if where == "busy" else None
            try:
                time.sleep(0.3)
                for name, env in settings.items():
                    f, i8 = in_fresh_process(f"b.fasttran_job({args.threads})", env)
                    res[where][name] = {"float32_ms": f, "int8_ms": i8}
                    print(f"{where:<6}{name:<12} fasttran float32 {f:6.2f} ms, int8 {i8:6.2f} ms", flush=True)
                if q8:
                    o = in_fresh_process(f"b.ort_job({args.threads}, {q8!r})", base)
                    res[where]["onnxruntime int8"] = {"int8_ms": o}
                    print(f"{where:<6}ONNX Runtime dynamic int8 {o:6.2f} ms", flush=True)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
