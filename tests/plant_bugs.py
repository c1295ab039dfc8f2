"""Plant known CUDA bugs, one at a time, in a copy of the sources and check that the emulated CUDA
test suite catches each, in which mode (the goal: "CUDA kernels verified without a GPU").

    python tests/plant_bugs.py [--tests tests/test_backend_ops.py ...] [--workdir DIR] [--json OUT]

For each bug: apply the mutation to a copy of the tree, rebuild the emulated CUDA backend
(FASTTRAN_CUDA=emu), then run the tests in the three modes CI uses: plain, seeded
(FASTTRAN_EMU_SEED) and checking (FASTTRAN_EMU_CHECK=barriers,memory). The unmutated tree must pass
every mode first. Prints a table (caught / missed per mode); exits 1 if a bug goes uncaught in
every mode. Takes a few minutes (one rebuild of the emulated library per bug)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, text to find (exactly once), replacement)
BUGS = [
    ("removed __syncthreads between a shared-memory write and its read (block_sum)",
     "csrc/cuda/cuda_common.cuh",
     "    if (lane == 0) shared32[warp] = v;\n    __syncthreads();\n",
     "    if (lane == 0) shared32[warp] = v;\n"),
    ("removed barrier at the start of a block reduction (block_sum)",
     "csrc/cuda/cuda_common.cuh",
     "    __syncthreads();   // shared32 may still be read by a previous call\n",
     ""),
    ("wrong shuffle offset (masked softmax row max starts at 8, not 16)",
     "csrc/cuda/attention.cu",
     "for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));",
     "for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));"),
    ("__syncthreads inside a branch taken by part of the block (optimizer global norm)",
     "csrc/cuda/optim.cu",
     "        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];\n        __syncthreads();\n",
     "        if ((int)threadIdx.x < w) { sh[threadIdx.x] += sh[threadIdx.x + w]; __syncthreads(); }\n"),
    ("row loop bound off by one (LayerNorm normalisation writes column C)",
     "csrc/cuda/rowops.cu",
     "    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)\n        o[c] = from_f<T>",
     "    for (int64_t c = threadIdx.x; c <= C; c += blockDim.x)\n        o[c] = from_f<T>"),
    ("a kernel reading one element past its input (softmax max loop reads key T)",
     "csrc/cuda/attention.cu",
     "    for (int64_t j = lane; j < nk; j += 32) mx = fmaxf(mx, s[j]);",
     "    for (int64_t j = lane; j <= nk; j += 32) mx = fmaxf(mx, s[j]);"),
]

MODES = [("plain", {}), ("seed", {"FASTTRAN_EMU_SEED": "1"}),
         ("check", {"FASTTRAN_EMU_CHECK": "barriers,memory"})]


def copy_tree(dst):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if not os.path.exists(os.path.join(ROOT, f)):
            continue
        os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


def build(tree):
    env = dict(os.environ, FASTTRAN_CUDA="emu")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit("build failed:\n" + r.stdout[-3000:] + r.stderr[-3000:])


def run_tests(tree, tests, mode_env):
    env = dict(os.environ, FASTTRAN_CUDA_EMU="1", PYTHONPATH=tree, **mode_env)
    for k in ("FASTTRAN_EMU_SEED", "FASTTRAN_EMU_CHECK"):
        if k not in mode_env:
            env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED") or ln.startswith("ERROR")]
    return r.returncode == 0, (lines[0] if lines else r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", nargs="*", default=["tests/test_backend_ops.py"])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="run only the bugs whose name contains this text")
    args = ap.parse_args()
    bugs = [b for b in BUGS if args.only is None or args.only in b[0]]
    for name, path, find, _ in bugs:   # every mutation must still apply before anything is built
        n = open(os.path.join(ROOT, path)).read().count(find)
        if n != 1:
            raise SystemExit(f"bug {name!r}: the text to mutate occurs {n} times in {path}; update BUGS")
    tree = args.workdir or tempfile.mkdtemp(prefix="fasttran-bugs-")
    copy_tree(tree)
    print(f"tree copy: {tree}; tests: {' '.join(args.tests)}", flush=True)
    build(tree)
    for mode, env in MODES:
        ok, detail = run_tests(tree, args.tests, env)
        if not ok:
            raise SystemExit(f"the unmutated tree fails in mode {mode}: {detail}")
    print("unmutated tree: passes in every mode", flush=True)
    results = []
    for name, path, find, repl in bugs:
        src = os.path.join(tree, path)
        original = open(src).read()
        open(src, "w").write(original.replace(find, repl))
        t0 = time.time()
        try:
            build(tree)
            row = {"bug": name, "file": path}
            for mode, env in MODES:
                ok, detail = run_tests(tree, args.tests, env)
                row[mode] = "missed" if ok else "caught"
                row[mode + "_detail"] = detail
        finally:
            open(src, "w").write(original)
        results.append(row)
        print(f"{name}: " + ", ".join(f"{m} {row[m]}" for m, _ in MODES) + f" ({time.time() - t0:.0f} s)", flush=True)
        for m, _ in MODES:
            if row[m] == "caught":
                print(f"    {m}: {row[m + '_detail'][:300]}")
    build(tree)   # leave the copy as it was
    print("\n| bug | plain | seeded | checking |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['bug']} | {r['plain']} | {r['seed']} | {r['check']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    missed = [r["bug"] for r in results if all(r[m] == "missed" for m, _ in MODES)]
    if missed:
        print("NOT CAUGHT in any mode: " + "; ".join(missed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
