"""Data-parallel training on one machine (the speed points): MiniLM's top 2 layers + a head
on real SST-2 sentences, one epoch at global batch 32 (or --batch-size), as
  1 process x 1 thread, 1 process x 2 threads, and 2 processes x 1 thread (gloo, DataParallel),
in one run on one machine: examples per second of each, the 2-process run against twice the first
and against the second, and each rank's time in the reduction (the step's checked collective, the
gradient buckets' sums past the backward, the loss) as a share of its step.

    python benchmarks/distributed_speed.py [--n 2000] [--k 2] [--epochs 1] [--batch-size 32] [--load 0]
    [--transport auto|shared_memory|group]

--load N runs N busy processes (a pure-Python loop each) beside every configuration: a machine
that is not idle. --transport picks how the 2 ranks sum their gradients (DataParallel's).

Writes benchmarks/last_distributed_speed.json. The cache (layer 4, every token) is built once, on
disk, before any timing; each configuration runs in a fresh process."""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def job(rank, world, n, k, epochs, cache_dir, threads=1, batch=32, transport="auto"):
    """one configuration's training: examples per second over the epoch(s), this rank's seconds in its
    steps and in the reduction by part"""
    import numpy as np
    import fasttran
    from fasttran.data import load_sst2
    from conftest import sst2_file
    fasttran.set_num_threads(threads)
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    _, y = load_sst2(sst2_file("train"))
    y = np.array(y[:n])
    cache = fasttran.ActivationCache.open(cache_dir, encoder=enc)
    red = None
    if world > 1:
        from fasttran.distributed import DataParallel
        red = DataParallel(transport=transport)

    def trainer():
        return fasttran.Trainer("classification", optimizer="adamw", lr=1e-4, epochs=epochs, batch_size=batch, seed=0,
                                train_layers=k, show_progress=False, reduction=red)
    trainer().fit(cache, y, stop_at_step=2)   # warm-up: buffers, the cache's pages
    if red is not None:
        red.seconds = {key: 0 for key in red.seconds}
    tr = trainer()
    step_s = [0.0]
    inner = tr._step

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            step_s[0] += time.perf_counter() - t
    tr._step = timed
    t0 = time.perf_counter()
    tr.fit(cache, y)
    wall = time.perf_counter() - t0
    return {"examples_per_s": n * epochs / wall, "wall_s": wall, "step_s": step_s[0], "steps": tr.global_step,
            "reduction_s": dict(red.seconds) if red is not None else None,
            "transport": red.transport_used if red is not None else None}


def run_one(n, k, epochs, cache_dir, threads, batch):
    code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import distributed_speed as d; "
            f"print(json.dumps(d.job(0, 1, {n}, {k}, {epochs}, {cache_dir!r}, {threads}, {batch})))")
    env = dict(os.environ, FASTTRAN_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="the global batch")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside each configuration")
    ap.add_argument("--transport", default="auto", choices=["auto", "shared_memory", "group"])
    ap.add_argument("--out", default=os.path.join(HERE, "last_distributed_speed.json"))
    args = ap.parse_args()
    import fasttran
    import torch
    from fasttran.data import load_sst2
    from conftest import sst2_file
    from distributed_util import run_ranks
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    s, _ = load_sst2(sst2_file("train"))
    with tempfile.TemporaryDirectory(prefix="fasttran-dp-") as tmp:
        cache_dir = os.path.join(tmp, "c")
        fasttran.ActivationCache.build(enc, *enc.tokenize(s[:args.n]), layer=enc.num_layers - args.k, positions="all",
                                       disk_dir=cache_dir, show_progress=False)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        try:
            load0 = os.getloadavg()
            one1 = run_one(args.n, args.k, args.epochs, cache_dir, 1, args.batch_size)
            one2 = run_one(args.n, args.k, args.epochs, cache_dir, 2, args.batch_size)
            import distributed_speed   # (a module the ranks import by name, not __main__)
            two = run_ranks(distributed_speed.job, 2, args.n, args.k, args.epochs, cache_dir, 1, args.batch_size,
                            args.transport, timeout=3600,
                            env={"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")})
            load1 = os.getloadavg()
        finally:
            for p in busy:
                p.kill()
                p.wait()
    thr2 = args.n * args.epochs / max(r["wall_s"] for r in two)
    comm = [r["reduction_s"] for r in two]
    share = [(c["begin"] + c["ready"] + c["finish"]) / r["step_s"] for c, r in zip(comm, two)]
    res = {"meta": {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "n": args.n, "k": args.k, "epochs": args.epochs, "global_batch": args.batch_size,
                    "busy_processes": args.load, "transport": two[0]["transport"],
                    "torch": torch.__version__, "load_avg": [load0, load1], "command": " ".join(sys.argv)},
           "one_process_1_thread": one1, "one_process_2_threads": one2, "two_processes_1_thread": two,
           "two_processes_examples_per_s": thr2,
           "vs_twice_1x1": thr2 / (2 * one1["examples_per_s"]), "vs_1x2": thr2 / one2["examples_per_s"],
           "reduction_share_of_step": share}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"1 process x 1 thread : {one1['examples_per_s']:.1f} examples/s")
    print(f"1 process x 2 threads: {one2['examples_per_s']:.1f} examples/s")
    print(f"2 processes x 1 thread ({two[0]['transport']}): {thr2:.1f} examples/s = {res['vs_twice_1x1']:.3f} of twice 1x1, "
          f"{res['vs_1x2']:.3f} of 1x2")
    for r, (c, sh) in enumerate(zip(comm, share)):
        print(f"  rank {r}: reduction {100 * sh:.1f}% of its steps (begin {c['begin']:.2f} s, ready "
              f"{c['ready']:.2f} s, finish {c['finish']:.2f} s over {c['steps']} steps)")
    print(f"load average before / after: {load0} / {load1}")


if __name__ == "__main__":
    main()
