#!/usr/bin/env bash
# The device runs the CUDA work needs, one phase per call of the lent GPU machine (each call is
# limited to 10 minutes; the machine keeps the build between calls while it stays warm).
# Logs, JUnit files and benchmark JSON go under $OUT (default ./gpu-out).
#
#   bash .ci/gpu_session.sh build      # wheels from .whl/ (carried), FASTTRAN_CUDA=1 build (~90 s)
#   bash .ci/gpu_session.sh test       # the CUDA tests on the device (fp32, bf16/fp16, TF32, OOM)
#   bash .ci/gpu_session.sh sanitize   # compute-sanitizer memcheck (leaks), racecheck, synccheck, initcheck
#   bash .ci/gpu_session.sh bench base # benchmarks/test_gpu_encoder.py on BERT-base (bf16 vs SDPA and
#                                      # torch.compile); "large" for BERT-large (one model per call: time)
#   bash .ci/gpu_session.sh optim      # benchmarks/test_gpu_optim.py (LAMB/AdamW vs torch fused, timm)
#   bash .ci/gpu_session.sh cache      # benchmarks/test_gpu_cache.py (tier read rates, prefetch overlap)
#   bash .ci/gpu_session.sh topk       # benchmarks/test_gpu_topk.py (the top-k step against
#                                      # torch fp32 and AMP bf16; the largest batch at seq 512, Tempo on/off),
#                                      # then the BERT-base steps again on the per-sequence training attention,
#                                      # and benchmarks/train_attention.py (the attention ops alone, per precision)
#   bash .ci/gpu_session.sh table1     # benchmarks/gpu_table1.py: FastTran's Table 1 (SQuAD, 3,433
#                                      # features, 5 epochs), then --accuracy (MiniLM, CUDA vs CPU EM/F1)
#   bash .ci/gpu_session.sh cudnn      # cuDNN attention (tests/test_cudnn_att.py): which attention runs and
#                                      # why, the host-side graph checks, and cuDNN against transformers'
#                                      # SDPA (bf16, head size 32, seq % 128 == 64 and length 1; forward,
#                                      # training forward, deterministic backward twice)
#   bash .ci/gpu_session.sh residual   # FASTTRAN_CUDA_RESIDUAL_LN=epilogue against rowpass (BERT-base bf16), profile
#   bash .ci/gpu_session.sh all        # build + test + sanitize (bench separately: it takes minutes)
#   bash .ci/gpu_session.sh lease      # one call within LEASE_S (540) seconds: the steps of LEASE_STEPS
#                                      # (default: build cudnn base test topk table1 optim cache large sanitize);
#                                      # logs packed in $OUT/gpu-logs.tgz
#
# cuDNN attention is built by the build step where the image's nvidia-cudnn-cu13 and nvidia-cuda-nvrtc
# wheels are installed (torch's) and the cudnn-frontend headers are found: carry the
# nvidia-cudnn-frontend wheel in .whl, or only its include/ folder as .cudnn-frontend/include (3 MB).
# Carry: .whl (the scipy-openblas32 wheel for python 3.12, see the device README) and, for the real
# MiniLM case, .minilm-bf16 (config.json + model.safetensors in bf16 + tokenizer files:
# FASTTRAN_MINILM_BF16); for table1, .bench-data (squad/train-subset-v1.1.json, squad/dev-v1.1.json).
# The carry limit is 64 MiB a call: .whl + .minilm-bf16 + .bench-data + the repo is about 62 MB.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# FASTTRAN_CUDA: 1 on the device; a rehearsal on a machine without a GPU sets it to "1,emu" and
# FASTTRAN_CUDA_EMU=1 (the nvcc build compiles, the steps run on the emulator)
export PYTHONUNBUFFERED=1 FASTTRAN_CUDA=${FASTTRAN_CUDA:-1} FASTTRAN_CUDA_ARCHS=${FASTTRAN_CUDA_ARCHS:-90}
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
# where cuBLAS comes from an nvidia-cublas wheel, an in-place build's library cannot reach it by
# its $ORIGIN rpath: put the wheel's folder on the loader's path
CUBLAS_WHEEL_LIB=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for s in site.getsitepackages() for p in glob.glob(s + '/nvidia/**/libcublasLt.so*', recursive=True)})))" 2>/dev/null)
[ -n "$CUBLAS_WHEEL_LIB" ] && export LD_LIBRARY_PATH=$CUBLAS_WHEEL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# the SQuAD files travel compressed (the carry limit): .bench-data/squad.tar.xz holds squad/*.json
[ -f .bench-data/squad.tar.xz ] && [ ! -f .bench-data/squad/dev-v1.1.json ] && tar xJf .bench-data/squad.tar.xz -C .bench-data
[ -d .minilm-bf16 ] && export FASTTRAN_MINILM_BF16=$PWD/.minilm-bf16
[ -d .cudnn-frontend/include ] && export FASTTRAN_CUDNN_FRONTEND_INCLUDE=$PWD/.cudnn-frontend/include
CUDA_TESTS="tests/test_backend_ops.py tests/test_cuda.py tests/test_layer_training.py tests/test_cuda_training.py"
# the C training loop, the architectures and the trained embeddings on the device (their CUDA cases;
# CPU cases run in CI)
LOOP_ARCH_TESTS="tests/test_train_loop.py tests/test_architectures.py tests/test_modernbert.py tests/test_modernbert_training.py tests/test_layer_training.py::test_trained_embeddings"

phase_build() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
        | tee -a "$OUT/device.txt"
    python3 setup.py build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; return 1; }
    python3 -c "import fasttran, json; print(json.dumps(fasttran.build_info()['cuda']))" | tee "$OUT/build_info.json"
    python3 -c "import fasttran, sys; sys.exit(0 if fasttran.cuda_available() else 'no usable CUDA device after the build')"
}

phase_cudnn() {
    # what the image has, what the build made of it, then the tests (skips say why, with -rs)
    python3 -m pip list 2>/dev/null | grep -i -E "nvidia-cudnn|nvidia-cuda-nvrtc" | tee "$OUT/cudnn-info.txt"
    ls -la fasttran/libfasttran_cudnn.so 2>&1 | tee -a "$OUT/cudnn-info.txt"
    python3 -c "import fasttran, json; print(json.dumps(fasttran._info.cuda_attention(0)))" 2>&1 | tee -a "$OUT/cudnn-info.txt"
    python3 -m pytest -q -rs -s -p no:cacheprovider --junitxml="$OUT/cudnn-tests.xml" tests/test_cudnn_att.py 2>&1 \
        | tee "$OUT/cudnn-tests.log" | tail -30
}

phase_test() {
    python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" $CUDA_TESTS 2>&1 | tee "$OUT/cuda-tests.log" | tail -30
}

phase_sanitize() {
    local cs=compute-sanitizer t
    command -v $cs >/dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
    # the half-precision, fp32 encoder and optimizer paths; a subset keeps each tool inside the limit
    local sel="half or awkward_fp32 or lamb or adamw or too_large or trainer or device_tier"
    for t in "memcheck --leak-check full" racecheck synccheck initcheck; do
        local name=${t%% *}
        timeout 140 $cs --tool $t --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py \
            -k "$sel" >"$OUT/sanitize-$name.log" 2>&1
        echo "$name: exit $? ($(grep -c '=========' "$OUT/sanitize-$name.log") sanitizer lines)"
        grep -m5 "ERROR SUMMARY\|LEAK SUMMARY" "$OUT/sanitize-$name.log"
    done
    # the fused training attention's kernels (shared-memory tiles, shuffles, barriers): racecheck and
    # synccheck over its op cases (small shapes, every path: kept / recomputed probabilities, dropout)
    for t in racecheck synccheck; do
        timeout 120 $cs --tool $t --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
            tests/test_backend_ops.py -k "cuda and (attention_train or attention_backward or bit_for_bit or mixed_precision_training_attention)" \
            >"$OUT/sanitize-$t-train-attention.log" 2>&1
        echo "$t (training attention): exit $? ($(grep -c '=========' "$OUT/sanitize-$t-train-attention.log") sanitizer lines)"
        grep -m5 "ERROR SUMMARY" "$OUT/sanitize-$t-train-attention.log"
    done
    # the CUDA Trainer's paths (head only and top-k layers): memcheck with the leak check
    timeout 140 $cs --tool memcheck --leak-check full --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
        tests/test_cuda_training.py -k "topk or matches_the_cpu" >"$OUT/sanitize-memcheck-training.log" 2>&1
    echo "memcheck (training): exit $? ($(grep -c '=========' "$OUT/sanitize-memcheck-training.log") sanitizer lines)"
    grep -m5 "ERROR SUMMARY\|LEAK SUMMARY" "$OUT/sanitize-memcheck-training.log"
}

phase_bench() {
    FASTTRAN_BENCH_MODELS=${1:-base} python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_encoder.py 2>&1 \
        | tee "$OUT/gpu-encoder-${1:-base}.log" | tail -40
    cp benchmarks/last_gpu_encoder.json "$OUT/last_gpu_encoder_${1:-base}.json" 2>/dev/null || true
}

phase_optim() {
    python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_optim.py 2>&1 | tee "$OUT/gpu-optim.log" | tail -30
    cp benchmarks/last_gpu_optim.json "$OUT/" 2>/dev/null || true
}

phase_table1() {
    python3 benchmarks/gpu_table1.py --data .bench-data --model .minilm-bf16 --json "$OUT/table1.json" 2>&1 \
        | tee "$OUT/table1.log" | tail -25
    python3 benchmarks/gpu_table1.py --data .bench-data --model .minilm-bf16 --accuracy --epochs 2 \
        --json "$OUT/table1_accuracy.json" 2>&1 | tee "$OUT/table1_accuracy.log" | tail -20
}

# the residual projections' two forms (FASTTRAN_CUDA_RESIDUAL_LN: the residual as cuBLASLt's C operand,
# or added in the LayerNorm's row pass) on BERT-base's full batches, same call, then the profile of the
# row-pass form: which one should be the default
phase_residual() {
    local m
    for m in epilogue rowpass; do
        FASTTRAN_CUDA_RESIDUAL_LN=$m FASTTRAN_BENCH_COMPILE=0 FASTTRAN_BENCH_MODELS=base python3 -m pytest -q -s \
            -p no:cacheprovider benchmarks/test_gpu_encoder.py -k "full or squad" 2>&1 | tee "$OUT/gpu-encoder-residual-$m.log" | grep "|"
        cp benchmarks/last_gpu_encoder.json "$OUT/last_gpu_encoder_residual_$m.json" 2>/dev/null || true
    done
    FASTTRAN_CUDA_RESIDUAL_LN=rowpass python3 benchmarks/gpu_profile.py --json "$OUT/gpu_profile_rowpass.json" 2>&1 \
        | tee "$OUT/gpu-profile-rowpass.log" | grep -A3 "^== \|fasttran wall"
}

# One lease in one call (a lent machine now gives 15 minutes in all, start included): the steps of
# LEASE_STEPS in order, each cut to the time left before LEASE_S seconds (a step with under 25 s
# left is skipped and says so). Logs and JSON are packed into $OUT/gpu-logs.tgz after every step, so
# a call stopped at its limit still brings back what finished. Steps: build, test, profile
# (benchmarks/gpu_profile.py), sanitize (memcheck with the leak check, racecheck, synccheck,
# initcheck on subsets), topk, topk-cudnn (its steps with cuDNN training attention, dropout 0), table1, residual (the
# residual projections' two forms), cache,
# base, large (the encoder benchmark), optim, optim-groups (LAMB's tensor-group size swept:
# FASTTRAN_CUDA_OPT_GROUP_BYTES), loop-arch (the C training loop's and the architectures' CUDA tests), diag.
phase_lease() {
    local end=$((SECONDS + ${LEASE_S:-540})) logs=/tmp/gpu-logs
    mkdir -p $logs
    export OUT CUDA_TESTS LOOP_ARCH_TESTS FASTTRAN_BENCH_ROUNDS=${FASTTRAN_BENCH_ROUNDS:-3}
    export -f phase_build phase_test phase_bench phase_sanitize_short phase_cudnn phase_table1 phase_residual
    pack() { cp "$OUT"/*.log "$OUT"/*.json "$OUT"/*.xml "$OUT"/*.txt benchmarks/last_gpu_*.json $logs/ 2>/dev/null
             rm -f "$OUT"/*.log "$OUT"/*.xml; tar czf "$OUT/gpu-logs.tgz" -C $logs . ; }
    step() {   # name, most seconds, command
        local name=$1 most=$2 left=$((end - SECONDS)); shift 2
        [ $left -lt $most ] && most=$left
        if [ $most -lt 25 ]; then echo "== $name: skipped, ${left}s left"; return 0; fi
        echo "== $name (at most ${most}s, started at ${SECONDS}s)"
        timeout -k 5 $most bash -c "$*"; local rc=$?
        echo "== $name: exit $rc after ${SECONDS}s"; pack; return $rc
    }
    local t
    for t in ${LEASE_STEPS:-build cudnn base test topk table1 optim cache large sanitize}; do
        case $t in
            build) step build 170 phase_build || { pack; return 1; } ;;
            test) step test 150 phase_test ;;
            cudnn) step cudnn 120 phase_cudnn ;;
            profile) step profile 90 'python3 benchmarks/gpu_profile.py --json "$OUT/gpu_profile.json" 2>&1 | tee "$OUT/gpu-profile.log" | grep -v Warning' ;;
            sanitize) step sanitize 150 phase_sanitize_short ;;
            topk) step topk 170 'python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_topk.py 2>&1 | tee "$OUT/gpu-topk.log" | tail -30' ;;
            cache) step cache 120 'python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_cache.py 2>&1 | tee "$OUT/gpu-cache.log" | tail -14' ;;
            base|large) step "bench-$t" 180 phase_bench $t ;;
            diag) step diag 80 phase_diag ;;
            table1) step table1 150 phase_table1 ;;
            residual) step residual 120 phase_residual ;;
            topk-cudnn) step topk-cudnn 120 'FASTTRAN_BENCH_DROPOUT=0 FASTTRAN_CUDA_ATTENTION=cudnn python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_topk.py -k step 2>&1 | tee "$OUT/gpu-topk-cudnn.log" | tail -20; cp benchmarks/last_gpu_topk.json "$OUT/last_gpu_topk_cudnn.json"' ;;
            optim-groups) step optim-groups 120 'for g in 8000000 16000000 33000000; do echo "FASTTRAN_CUDA_OPT_GROUP_BYTES=$g"; FASTTRAN_CUDA_OPT_GROUP_BYTES=$g python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_optim.py 2>&1 | grep "fasttran_lamb \|LAMB"; done 2>&1 | tee "$OUT/gpu-optim-groups.log"' ;;
            loop-arch) step loop-arch 150 'python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/loop-arch-tests.xml" -k "cuda or gpu or device" $LOOP_ARCH_TESTS 2>&1 | tee "$OUT/loop-arch-tests.log" | tail -20' ;;
            optim) step optim 45 'python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_optim.py 2>&1 | tee "$OUT/gpu-optim.log" | tail -15' ;;
            *) echo "unknown lease step $t" ;;
        esac
    done
    pack
}

# two questions the sanitizers left: does initcheck see what cuBLASLt's Hopper kernels write (torch's
# bf16 matmul, then a kernel reading its output: a report there is the tool's, not ours), and does
# the memcheck subset's process end cleanly without the sanitizer (exit code, faulthandler)
phase_diag() {
    local cs=compute-sanitizer
    command -v $cs >/dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
    cat >/tmp/lt_read.py <<'PY'
import torch
a = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
b = torch.randn(768, 2304, device="cuda", dtype=torch.bfloat16)
c = a @ b                       # cuBLASLt (nvjet) writes c
print("sum", float(c.float().sum()))   # a torch kernel reads it
PY
    timeout 40 $cs --tool initcheck python3 /tmp/lt_read.py >"$OUT/diag-initcheck-torch.log" 2>&1
    echo "initcheck on torch's bf16 matmul output: $(grep -c 'Uninitialized' "$OUT/diag-initcheck-torch.log") reports; $(grep -m1 'ERROR SUMMARY' "$OUT/diag-initcheck-torch.log")"
    grep -m3 "at .*kernel\|at void\|Uninitialized" "$OUT/diag-initcheck-torch.log" | cut -c1-160
    timeout 60 python3 -X faulthandler -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_training.py \
        -k "half_precision_outputs or too_large or device_tier_frees or classification-adamw or classification-2-mean-adamw-tempo4 or bf16_topk_trainer" \
        >"$OUT/diag-exit.log" 2>&1
    echo "the memcheck subset without the sanitizer: exit $?; $(grep -E '[0-9]+ (passed|failed)' "$OUT/diag-exit.log" | tail -1)"
    tail -5 "$OUT/diag-exit.log" | cut -c1-200
}

# the sanitizers on short subsets (a lease's step): each tool's leaks or errors counted, and for the
# leak check only the allocations made by fasttran's own libraries (torch's caching allocator and
# cuBLAS keep theirs for the process)
phase_sanitize_short() {
    local cs=compute-sanitizer
    command -v $cs >/dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
    timeout 75 $cs --tool memcheck --leak-check full --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_cuda.py tests/test_cuda_training.py -k "half_precision_outputs or too_large or device_tier_frees or \
        classification-adamw or classification-2-mean-adamw-tempo4 or bf16_topk_trainer" >"$OUT/sanitize-memcheck.log" 2>&1
    echo "memcheck: exit $?; $(grep -E '[0-9]+ (passed|failed)' "$OUT/sanitize-memcheck.log" | tail -1)"
    python3 - "$OUT/sanitize-memcheck.log" <<'PY'
import re, sys
t = open(sys.argv[1], errors="replace").read()
ours = other = 0
for b in t.split("========= Leaked")[1:]:
    size = int(b.split(" bytes")[0].strip().replace(",", ""))
    frames = b.split("=========     Saved")[1].split("\n")[1:8] if "Saved" in b else []
    mine = any("fasttran" in f or "_C.cpython" in f for f in frames)
    ours, other = (ours + size, other) if mine else (ours, other + size)
print(f"memcheck leaks: fasttran {ours} bytes, others (torch, cuBLAS, cuDNN) {other} bytes;",
      re.findall(r"ERROR SUMMARY: \d+ errors?", t)[-1:] or "no summary")
PY
    for t in racecheck synccheck; do
        timeout 60 $cs --tool $t --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x tests/test_backend_ops.py \
            -k "cuda and (attention_train or attention_backward) and bfloat16" >"$OUT/sanitize-$t.log" 2>&1
        echo "$t: exit $?; $(grep -E '[0-9]+ (passed|failed)' "$OUT/sanitize-$t.log" | tail -1); $(grep -m1 'ERROR SUMMARY' "$OUT/sanitize-$t.log")"
    done
    # our kernels only (cuDNN's and cuBLASLt's writes are invisible to initcheck on Hopper, and
    # tracking cuDNN under it ran past the step's time)
    FASTTRAN_CUDA_ATTENTION=wmma timeout 70 $cs --tool initcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        -x tests/test_cuda.py -k "half_precision_outputs or awkward_fp32" >"$OUT/sanitize-initcheck.log" 2>&1
    echo "initcheck: exit $?; $(grep -E '[0-9]+ (passed|failed)' "$OUT/sanitize-initcheck.log" | tail -1); $(grep -m1 'ERROR SUMMARY' "$OUT/sanitize-initcheck.log")"
}

case "${1:-all}" in
    build) phase_build ;;
    test) phase_test ;;
    sanitize) phase_sanitize ;;
    bench) phase_bench "${2:-base}" ;;
    optim) phase_optim ;;
    cache) python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_cache.py 2>&1 | tee "$OUT/gpu-cache.log" | tail -20
           cp benchmarks/last_gpu_cache.json "$OUT/" 2>/dev/null || true ;;
    topk) python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_gpu_topk.py 2>&1 | tee "$OUT/gpu-topk.log" | tail -40
          cp benchmarks/last_gpu_topk.json "$OUT/" 2>/dev/null || true
          # the training attention's earlier variant (a sequence at a time) on the BERT-base steps, to
          # measure the fused kernels against
          FASTTRAN_CUDA_TRAIN_ATTENTION=per_sequence python3 -m pytest -q -s -p no:cacheprovider \
              benchmarks/test_gpu_topk.py -k "step and bert" 2>&1 | tee "$OUT/gpu-topk-per-sequence.log" | tail -15
          cp benchmarks/last_gpu_topk_per_sequence.json "$OUT/" 2>/dev/null || true
          # the training attention ops alone, fp32 / bf16 / fp16 products, fused and per-sequence
          for v in fused per_sequence; do
              FASTTRAN_CUDA_TRAIN_ATTENTION=$v FASTTRAN_BENCH_DEVICE=cuda python3 benchmarks/train_attention.py 2>&1 \
                  | tee "$OUT/gpu-train-attention-$v.log" | tail -12
          done
          cp benchmarks/last_train_attention.json "$OUT/" 2>/dev/null || true ;;
    table1) phase_table1 ;;
    cudnn) phase_cudnn ;;
    residual) phase_residual ;;
    lease) phase_lease ;;
    all) phase_build && phase_test && phase_sanitize ;;
    *) echo "usage: $0 build|test|sanitize|bench [base|large]|optim|cache|topk|table1|cudnn|residual|lease|all" >&2; exit 2 ;;
esac
