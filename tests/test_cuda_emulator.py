"""The CUDA emulator itself (csrc/cuda_emu): barriers, warp intrinsics, exited threads, deadlock and
barrier checks, guard pages, half types, wmma and the cuBLAS / cuBLASLt shims, through the kernels
of csrc/cuda_emu/selftest.cu. Runs where the emulated backend is built (FASTTRAN_CUDA=emu) and
selected (FASTTRAN_CUDA_EMU=1); the checking modes come from FASTTRAN_EMU_SEED and
FASTTRAN_EMU_CHECK, and the tests that need a mode run it in a subprocess."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import fasttran

LIB = os.path.join(os.path.dirname(fasttran.__file__), "libfasttran_cuda_emu.so")
pytestmark = pytest.mark.skipif(not (fasttran.build_info()["cuda"]["emulated"] and os.path.exists(LIB)),
                                reason="the CUDA emulator is not selected (build with FASTTRAN_CUDA=emu, run with "
                                       "FASTTRAN_CUDA_EMU=1)")

F = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
I = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
U16 = np.ctypeslib.ndpointer(np.uint16, flags="C_CONTIGUOUS")


@pytest.fixture(scope="module")
def emu():
    lib = ctypes.CDLL(LIB)
    sig = {"block_sum": [F, F, ctypes.c_int, ctypes.c_int, ctypes.c_int], "shuffles": [I, I, ctypes.c_int, ctypes.c_int],
           "half_warp": [F, F], "early_exit": [F, ctypes.c_int, ctypes.c_int], "broken": [ctypes.c_int, F],
           "out_of_bounds": [ctypes.c_int, ctypes.c_int], "bad_launch": [], "convert": [F, U16, U16, F, F, ctypes.c_int],
           "wmma_half": [U16, U16, F], "wmma_tf32": [F, F, F], "wmma_operand": [ctypes.c_int, ctypes.c_int],
           "lt_gelu_bias": [U16, U16, U16, U16, U16, ctypes.c_int, ctypes.c_int, ctypes.c_int],
           "gemm_ex": [U16, U16, U16, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]}
    for name, args in sig.items():
        f = getattr(lib, "ftemu_selftest_" + name)
        f.argtypes, f.restype = args, ctypes.c_int
    lib.ftemu_selftest_message.restype = ctypes.c_char_p
    lib.message = lambda: lib.ftemu_selftest_message().decode()
    return lib


def mode():
    return os.environ.get("FASTTRAN_EMU_CHECK", ""), os.environ.get("FASTTRAN_EMU_SEED", "")


@pytest.mark.parametrize("threads,n", [(32, 32), (256, 200), (1024, 1024), (64, 1)])
def test_block_reduction(emu, threads, n):
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((7, n)).astype(np.float32)
    out = np.zeros(7, np.float32)
    assert emu.ftemu_selftest_block_sum(x.ravel(), out, 7, threads, n) == 0, emu.message()
    np.testing.assert_allclose(out, x.sum(axis=1, dtype=np.float64), rtol=1e-5, atol=1e-5)


def shuffle_reference(x, width):
    out = np.zeros((len(x), 8), np.int64)
    for t in range(len(x)):
        lane, w0 = t % 32, t - t % 32
        seg = lane & ~(width - 1)
        out[t, 0] = x[w0 + seg + (5 % width)]
        out[t, 1] = x[t - 3] if lane - seg >= 3 else x[t]
        out[t, 2] = x[t + 3] if lane - seg + 3 < width else x[t]
        src = lane ^ 6
        out[t, 3] = x[w0 + src] if src < seg + width else x[t]
        warp = x[w0:w0 + 32]
        out[t, 4] = np.int32(np.uint32(sum(int(v & 1) << i for i, v in enumerate(warp)) & 0xffffffff).view(np.int32))
        out[t, 5] = int((warp == 7).any())
        out[t, 6] = int((warp >= 0).all())
        out[t, 7] = int(warp.sum())
    return out


@pytest.mark.parametrize("width", [32, 16, 8, 4, 2, 1])
def test_shuffles_ballots_and_reductions(emu, width):
    x = np.random.default_rng(width).integers(0, 50, 64).astype(np.int32)
    out = np.zeros(64 * 8, np.int32)
    assert emu.ftemu_selftest_shuffles(x, out, 64, width) == 0, emu.message()
    np.testing.assert_array_equal(out.reshape(64, 8), shuffle_reference(x, width))


def test_half_warps_shuffle_independently(emu):
    x = np.arange(32, dtype=np.float32)
    out = np.zeros(32, np.float32)
    assert emu.ftemu_selftest_half_warp(x, out) == 0, emu.message()
    np.testing.assert_array_equal(out, np.r_[np.full(16, x[:16].sum()), np.full(16, x[16:].sum())])


def test_returned_threads_leave_barriers(emu):
    """Plain mode: as on the hardware, threads that returned leave later barriers. Checking mode
    holds kernels to the programming guide: every thread of the block reaches each barrier."""
    x = np.arange(256, dtype=np.float32)
    err = emu.ftemu_selftest_early_exit(x, 256, 100)
    if "barriers" in mode()[0] or "all" in mode()[0]:
        assert err != 0 and "reached by only 100 of the block's 256 threads" in emu.message(), emu.message()
        return
    assert err == 0, emu.message()
    np.testing.assert_array_equal(x[:100], np.arange(100)[::-1])
    np.testing.assert_array_equal(x[100:], np.arange(100, 256))


def test_a_deadlock_is_reported_not_hung(emu):
    x = np.ones(32, np.float32)
    err = emu.ftemu_selftest_broken(0, x)
    assert err != 0 and "deadlock" in emu.message() and "deadlock_kernel" in emu.message(), emu.message()
    assert "__shfl_xor_sync" in emu.message() and "__syncthreads" in emu.message()


def test_divergent_barrier(emu):
    """A __syncthreads() inside a branch: caught by FASTTRAN_EMU_CHECK=barriers; plain mode lets it
    through as hardware that counts arrivals would."""
    x = np.arange(64, dtype=np.float32)
    err = emu.ftemu_selftest_broken(1, x)
    if "barriers" in mode()[0] or "all" in mode()[0]:
        assert err != 0 and "different barriers" in emu.message(), emu.message()
        assert "divergent_barrier_kernel" in emu.message() and "selftest.cu" in emu.message()
    else:
        assert err == 0, emu.message()
        np.testing.assert_array_equal(x, np.arange(64)[::-1])


def test_a_missing_barrier_gives_wrong_results(emu):
    x = np.arange(128, dtype=np.float32)
    assert emu.ftemu_selftest_broken(2, x) == 0, emu.message()
    correct = (np.arange(128, dtype=np.float32) * 2)[(np.arange(128) + 32) % 128]
    assert not np.array_equal(x, correct), "a read-before-write race went unnoticed"


def test_invalid_launch_configuration(emu):
    assert emu.ftemu_selftest_bad_launch() == 9, emu.message()   # cudaErrorInvalidConfiguration
    assert "block (2048,1,1)" in emu.message()


def test_half_and_bfloat16_conversions(emu):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 2.0 ** -24, 2.0 ** -25,
                         1.5 * 2.0 ** -25, 2.0 ** -14, 3.0e38, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11]]).astype(np.float32)
    n = len(x)
    h, b = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    hf, bf = np.zeros(65536, np.float32), np.zeros(65536, np.float32)
    assert emu.ftemu_selftest_convert(x, h, b, hf, bf, n) == 0, emu.message()
    ref_h = x.astype(np.float16).view(np.uint16)
    ref_b = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(h[~nan], ref_h[~nan])
    np.testing.assert_array_equal(b[~nan], ref_b[~nan])
    assert (h[nan] == 0x7fff).all() and (b[nan] == 0x7fff).all()   # CUDA's canonical NaN
    all16 = np.arange(65536, dtype=np.uint16)
    np.testing.assert_array_equal(hf, all16.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(bf, (all16.astype(np.uint32) << 16).view(np.float32))


def test_wmma_half_and_tf32(emu):
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 16)).astype(np.float16)
    C0 = rng.standard_normal((16, 16)).astype(np.float32)
    C = C0.copy()
    assert emu.ftemu_selftest_wmma_half(A.view(np.uint16).ravel(), np.ascontiguousarray(B.T).view(np.uint16).ravel(),
                                        C.ravel()) == 0, emu.message()
    np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64) + C0, rtol=1e-5, atol=1e-5)
    A32, B32 = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    out = np.zeros((16, 16), np.float32)
    assert emu.ftemu_selftest_wmma_tf32(A32.ravel(), B32.ravel(), out.ravel()) == 0, emu.message()

    def tf32(a):   # round to nearest, ties away, 10 mantissa bits
        u = a.view(np.uint32).astype(np.uint64)
        return ((u + 0x1000) & 0xffffe000).astype(np.uint32).view(np.float32)
    ref = tf32(A32).astype(np.float64) @ tf32(B32).astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert np.abs(out - A32.astype(np.float64) @ B32).max() > 1e-5   # the TF32 rounding is really applied


def test_cublaslt_gelu_bias_epilogue_in_bf16(emu):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    M, N, K = 7, 19, 33
    bf = lambda a: torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    A, B, bias = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((N, K))), bf(rng.standard_normal(N))
    u16 = lambda t: t.view(torch.int16).numpy().view(np.uint16).ravel().copy()
    D, aux = np.zeros(M * N, np.uint16), np.zeros(M * N, np.uint16)
    assert emu.ftemu_selftest_lt_gelu_bias(u16(A), u16(B), u16(bias), D, aux, M, N, K) == 0, emu.message()
    pre = A.double() @ B.double().T + bias.double()
    got_aux = torch.from_numpy(aux.view(np.int16)).view(torch.bfloat16).double().reshape(M, N)
    got = torch.from_numpy(D.view(np.int16)).view(torch.bfloat16).double().reshape(M, N)
    ref = torch.nn.functional.gelu(pre.to(torch.bfloat16).double(), approximate="tanh")
    assert (got_aux - pre).abs().max() <= 1e-2 * pre.abs().max()
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_cublas_gemm_ex_fp16_and_an_operand_out_of_bounds(emu):
    rng = np.random.default_rng(3)
    m, n, k = 5, 9, 13
    A, B = rng.standard_normal((k, m)).astype(np.float16), rng.standard_normal((n, k)).astype(np.float16)
    C = np.zeros(m * n, np.uint16)
    # column-major A (m x k) and B (k x n): their transposes row-major
    assert emu.ftemu_selftest_gemm_ex(A.view(np.uint16).ravel(), B.view(np.uint16).ravel(), C, m, n, k, 0) == 0
    ref = (B.astype(np.float64) @ A.astype(np.float64)).astype(np.float16)   # (C^T) row-major = B^T... as n x m
    np.testing.assert_allclose(C.view(np.float16).reshape(n, m).astype(np.float32), ref.astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    err = emu.ftemu_selftest_gemm_ex(A.view(np.uint16).ravel(), B.view(np.uint16).ravel(), C, m, n, k, 1)
    assert err == 700 and "operand B" in emu.message(), emu.message()   # cudaErrorIllegalAddress


def run_mode(env_extra, code):
    env = dict(os.environ, FASTTRAN_CUDA_EMU="1", **env_extra)
    return subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=120)


OOB = """
import ctypes, fasttran, os, sys
lib = ctypes.CDLL(os.path.join(os.path.dirname(fasttran.__file__), "libfasttran_cuda_emu.so"))
lib.ftemu_selftest_message.restype = ctypes.c_char_p
fasttran.cuda_available()
for kind, n in ((0, 1024), (1, 1024), (1, 1023), (0, 1023)):
    err = lib.ftemu_selftest_out_of_bounds(kind, n)
    print(kind, err, lib.ftemu_selftest_message().decode() if err else "")
"""


def test_guard_pages_catch_reads_and_writes_past_the_end(emu):
    if emu.ftemu_selftest_sanitized():
        pytest.skip("built with AddressSanitizer, which reports out-of-bounds accesses itself")
    r = run_mode({"FASTTRAN_EMU_CHECK": "memory"}, OOB)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("0 700") and "read" in lines[0] and "0 bytes past the end of a device allocation of " \
        "4096 bytes" in lines[0] and "past_end_kernel" in lines[0], r.stdout
    # an allocation whose size is a multiple of 16 ends right at the guard page: the write faults
    assert lines[1].startswith("1 700") and "wrote" in lines[1] and "0 bytes past the end" in lines[1], r.stdout
    # otherwise the few bytes between its end and the page are checked after the launch
    assert lines[2].startswith("1 700") and "write_past_end_kernel wrote outside a device allocation of 4092 " \
        "bytes" in lines[2] and "byte +0 after its end" in lines[2], r.stdout
    # and reading them gives the poison (NaN): not an error by itself, but never a plausible value
    assert lines[3].strip() == "0 0", r.stdout


def test_seeded_mode_randomises_and_reproduces():
    code = """
import ctypes, fasttran, os, numpy as np
lib = ctypes.CDLL(os.path.join(os.path.dirname(fasttran.__file__), "libfasttran_cuda_emu.so"))
fasttran.cuda_available()
x = np.arange(128, dtype=np.float32)
lib.ftemu_selftest_broken(2, x.ctypes.data_as(ctypes.c_void_p))
print(int(x.sum()))
"""
    sums = {seed: run_mode({"FASTTRAN_EMU_SEED": seed}, code).stdout.strip() for seed in ("1", "2", "3", "1")}
    assert all(v for v in sums.values()), sums
    runs = [run_mode({"FASTTRAN_EMU_SEED": "7"}, code).stdout for _ in range(2)]
    assert runs[0] == runs[1]   # one seed, one schedule


def test_a_bad_check_mode_is_refused():
    r = run_mode({"FASTTRAN_EMU_CHECK": "barier"}, "import fasttran; print(fasttran.build_info()['cuda'])")
    assert "unknown mode 'barier'" in r.stdout, r.stdout + r.stderr


def test_wmma_operands_must_be_aligned_as_on_a_gpu(emu):
    """load/store_matrix_sync: pointer 32-byte aligned, ldm a multiple of 16 bytes (CUDA's rules;
    a GPU faults or computes garbage otherwise), and dynamic shared memory 128-byte aligned"""
    assert emu.ftemu_selftest_wmma_operand(16, 16) == 0, emu.message()     # 32 bytes in
    assert emu.ftemu_selftest_wmma_operand(0, 24) == 0, emu.message()      # ldm 48 bytes
    assert emu.ftemu_selftest_wmma_operand(8, 16) != 0
    assert "misaligned pointer" in emu.message() and "wmma::load_matrix_sync" in emu.message()
    assert emu.ftemu_selftest_wmma_operand(0, 12) != 0
    assert "bad leading dimension" in emu.message()
