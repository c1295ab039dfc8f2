"""Every op of the backend op list (csrc/backend.h), CUDA against CPU, op by op (after ggml's
test-backend-ops).

The ops are called through the backend tables themselves (ctypes over `_C._backend_address`), by
the parameter names the op list declares (`_C._backend_registry`), so a changed signature breaks
a case by name. Inputs are random in awkward shapes (odd channel counts, T = 1, 7, 509, heavy and
total padding, head sizes 1..17); every output buffer is poisoned with NaN (or -1) before the
op, so an element an op forgets to write fails the comparison. The CPU backend is the reference
(it is checked against PyTorch / float64 elsewhere); each case states its tolerance.

Without a GPU the CUDA side runs on the CUDA emulator: build with FASTTRAN_CUDA=emu and run with
FASTTRAN_CUDA_EMU=1 (CI does, in three modes; see docs/architecture.md). On a GPU the same tests
run unchanged."""
import ctypes
import re
import zlib

import numpy as np
import pytest

import fasttran
from fasttran import _C

REGISTRY = {e[0]: e for e in _C._backend_registry()}
OPS = [name for name, e in REGISTRY.items() if e[1] == "op"]
SIZES = _C._abi_sizes()

# ---- calling a backend table through ctypes ------------------------------------------------------
_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double, "uint64_t": ctypes.c_uint64,
            "size_t": ctypes.c_size_t, "ft_activation": ctypes.c_int, "ft_pooling": ctypes.c_int,
            "ft_dtype": ctypes.c_int, "uintptr_t": ctypes.c_size_t}
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 6}   # ft_dtype
_RETURNS = {"ft_status": ctypes.c_int, "void": None, "size_t": ctypes.c_size_t, "int": ctypes.c_int}


def parse_params(params):
    """'(ft_backend *be, const float *x, int64_t n)' -> [('be', 'ptr'), ('x', 'ptr'), ('n', c_int64)]"""
    out = []
    for p in params.strip()[1:-1].split(","):
        m = re.fullmatch(r"\s*(?:const\s+)?([\w ]+?)\s*(\**)\s*(\w+)\s*", p)
        assert m, f"cannot parse parameter {p!r}"
        base, stars, name = m.groups()
        out.append((name, "ptr" if stars else _SCALARS[base]))
    return out


class OptimGroup(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double), ("bias_correction", ctypes.c_int),
                ("lr_scale", ctypes.c_double)]   # ft_optim_group's fields, in its order


class OptimConfig(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("groups", ctypes.POINTER(OptimGroup)), ("num_groups", ctypes.c_size_t),
                ("max_grad_norm", ctypes.c_double), ("check_finite", ctypes.c_int)]


class OptimTensor(ctypes.Structure):
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("copy", ctypes.c_void_p), ("copy_dtype", ctypes.c_int),
                ("n", ctypes.c_int64), ("step", ctypes.c_int64), ("group", ctypes.c_int32), ("decay", ctypes.c_int32)]


class OptimInfo(ctypes.Structure):
    _fields_ = [("grad_norm", ctypes.c_double), ("clip_scale", ctypes.c_double), ("kernel_launches", ctypes.c_int),
                ("bad_tensor", ctypes.c_int64)]


def test_ctypes_structs_match_the_c_abi():
    assert ctypes.sizeof(OptimConfig) == SIZES["ft_optim_config"]
    assert ctypes.sizeof(OptimTensor) == SIZES["ft_optim_tensor"]
    assert ctypes.sizeof(OptimInfo) == SIZES["ft_optim_info"]
    assert max(e[4] for e in REGISTRY.values()) + 8 <= SIZES["ft_backend"]


class Backend:
    """One backend table: its services and ops as Python callables."""

    def __init__(self, index):
        self.index = index
        self.addr = _C._backend_address(index)
        self.fn, self.params = {}, {}
        for name, (_, kind, ret, params, offset) in REGISTRY.items():
            fptr = ctypes.c_void_p.from_address(self.addr + offset).value
            parsed = parse_params(params)
            self.params[name] = parsed
            argtypes = [ctypes.c_void_p if t == "ptr" else t for _, t in parsed]
            self.fn[name] = ctypes.CFUNCTYPE(_RETURNS[ret], *argtypes)(fptr) if fptr else None
        self.live = []

    def check(self, status, what):
        if status != 0:
            raise AssertionError(f"{what} failed on backend {self.index}: status {status}: {_C._last_error()}")

    def alloc(self, nbytes):
        out = ctypes.c_void_p()
        self.check(self.fn["alloc"](self.addr, max(int(nbytes), 1), ctypes.byref(out)), "alloc")
        self.live.append(out.value)
        return out.value

    def upload(self, array):
        a = np.ascontiguousarray(array)
        ptr = self.alloc(a.nbytes)
        if a.nbytes:
            self.check(self.fn["upload"](self.addr, ptr, a.ctypes.data, a.nbytes), "upload")
        return ptr

    def download(self, ptr, shape, dtype):
        a = np.empty(shape, dtype)
        if a.nbytes:
            self.check(self.fn["download"](self.addr, a.ctypes.data, ptr, a.nbytes), "download")
        return a

    def sync(self):
        self.check(self.fn["synchronize"](self.addr), "synchronize")

    def free_all(self):
        for p in self.live:
            self.fn["free"](self.addr, p)
        self.live = []


# ---- argument kinds of a case ----------------------------------------------------------------------
class In:            # an input buffer
    def __init__(self, a): self.a = np.ascontiguousarray(a)


class Out:           # an output buffer, poisoned before the op and compared after
    def __init__(self, shape, dtype=np.float32, tol=1e-5, init=None):
        self.shape, self.dtype, self.tol, self.init = shape, np.dtype(dtype), tol, init


class Alias:         # the same buffer as another argument
    def __init__(self, name): self.name = name


class Scratch:       # scratch sized by one of the backend's own *_scratch_bytes services
    def __init__(self, B, T, NH, service="attention_scratch_bytes"): self.bt, self.service = (B, T, NH), service


class ScratchSize:   # the size in bytes of the Scratch argument `name`
    def __init__(self, name): self.name = name


class Packed:        # the backend's packed copy of the weight argument `name` (N, K), made by pack_weight
    def __init__(self, name, N, K): self.name, self.N, self.K = name, N, K


class PackedLP:      # the backend's reduced-precision packed copy (int8 / bf16) of weight argument `name` (N, K):
    # int8 values with their per-row scales (argument `scale`), or float32 weights packed in bf16
    def __init__(self, name, N, K, scale=None): self.name, self.N, self.K, self.scale = name, N, K, scale


class Host:          # an argument the op reads from host memory (attention's sequence table)
    def __init__(self, a): self.a = np.ascontiguousarray(a)


class Struct:        # host memory built from the device addresses of the other arguments
    def __init__(self, build, compare=None): self.build, self.compare = build, compare


def poison(shape, dtype):
    a = np.empty(shape, dtype)
    a.view(np.uint8)[...] = 0xFF     # NaN as float, -1 as int
    return a


def run_case(be, op, args):
    """Run `op` on backend `be` with the case's arguments; returns {name: output array}."""
    ptrs, outs, structs, sizes = {}, {}, {}, {}
    extra = {k: v for k, v in args.items() if k.startswith("_")}
    for name, v in list(extra.items()) + list(args.items()):
        if name in ptrs:
            continue
        if isinstance(v, In):
            ptrs[name] = be.upload(v.a)
        elif isinstance(v, Out):
            init = poison(v.shape, v.dtype) if v.init is None else np.asarray(v.init, v.dtype).reshape(v.shape)
            ptrs[name] = be.upload(init)
            outs[name] = v
        elif isinstance(v, Scratch):
            # a service with a storage type takes the case's (float32 unless the case says)
            dt = (args.get("dt", 0),) if be.params[v.service][1][0] == "dt" else ()
            sizes[name] = be.fn[v.service](be.addr, *dt, *v.bt)
            ptrs[name] = be.alloc(sizes[name])
        elif isinstance(v, Host):
            ptrs[name] = v.a.ctypes.data
    for name, v in args.items():
        if isinstance(v, Alias):
            ptrs[name] = ptrs[v.name]
        elif isinstance(v, Packed):
            ptrs[name] = be.alloc(be.fn["packed_weight_bytes"](be.addr, v.N, v.K))
            be.check(be.fn["pack_weight"](be.addr, ptrs[name], ptrs[v.name], v.N, v.K), "pack_weight")
        elif isinstance(v, PackedLP):
            wt = DTYPE_CODES["int8"] if v.scale else DTYPE_CODES["bfloat16"]
            ptrs[name] = be.alloc(be.fn["packed_weight_lp_bytes"](be.addr, wt, v.N, v.K))
            if v.scale:
                be.check(be.fn["pack_weight_i8"](be.addr, ptrs[name], ptrs[v.name], ptrs[v.scale], v.N, v.K),
                         "pack_weight_i8")
            else:
                be.check(be.fn["pack_weight_bf16"](be.addr, ptrs[name], ptrs[v.name], v.N, v.K), "pack_weight_bf16")
    call = []
    for name, t in be.params[op]:
        if name == "be":
            call.append(be.addr)
            continue
        if name == "dt" and name not in args:   # the encoder ops' storage type: float32 unless the case says
            call.append(0)
            continue
        if name == "window" and name not in args:   # attention: every key unless the case says
            call.append(0)
            continue
        assert name in args, f"the case for {op} has no argument {name!r}"
        v = args[name]
        if isinstance(v, Struct):
            structs[name] = v.build(ptrs)
            call.append(ctypes.addressof(structs[name]))
        elif v is None:
            call.append(None)
        elif isinstance(v, ScratchSize):
            call.append(sizes[v.name])
        elif name in ptrs:
            call.append(ptrs[name])
        else:
            call.append(v)
    unknown = set(args) - {n for n, _ in be.params[op]} - set(extra)
    assert not unknown, f"the case for {op} names arguments the op does not have: {sorted(unknown)}"
    be.check(be.fn[op](*call), op)
    be.sync()
    got = {name: be.download(ptrs[name], v.shape, v.dtype) for name, v in outs.items()}
    for name, v in args.items():
        if isinstance(v, Struct) and v.compare:
            got[name] = v.compare(structs[name])
    be.free_all()
    return got


def compare(op, args, ref, got):
    for name, v in args.items():
        if isinstance(v, Out):
            a, b = got[name], ref[name]
            assert a.shape == b.shape
            if v.dtype.kind == "f":
                bad = ~np.isclose(a, b, rtol=v.tol, atol=v.tol, equal_nan=False)
                assert np.isfinite(b).all(), f"{op}: the CPU reference wrote non-finite values into {name}"
            else:
                bad = a != b
            assert not bad.any(), (f"{op}: {name} differs at {int(bad.sum())} of {a.size} elements "
                                   f"(first at {np.argwhere(bad)[0].tolist()}: cuda {a[bad][0]!r}, cpu {b[bad][0]!r}; "
                                   f"max abs diff {np.nanmax(np.abs(a.astype(np.float64) - b)) if a.size else 0:.3g})")
        elif isinstance(v, Struct) and v.compare:
            for key, (x, y, tol) in _pairs(got[name], ref[name]).items():
                assert abs(x - y) <= tol * (1 + abs(y)), f"{op}: {name}.{key} cuda {x} cpu {y}"


def _pairs(a, b):
    return {k: (a[k][0], b[k][0], a[k][1]) for k in a}


# ---- the cases: op -> list of (id, builder(rng) -> args) ---------------------------------------------
CASES = {op: [] for op in OPS}


def case(op, ident):
    def deco(fn):
        CASES[op].append((f"{op}-{ident}", fn))
        return fn
    return deco


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _gemm(ta, tb, M, N, K, alpha=1.0, beta=0.0, pad=0):
    def build(rng):
        ar, ac = (K, M) if ta else (M, K)
        br, bc = (N, K) if tb else (K, N)
        lda, ldb, ldc = ac + pad, bc + pad, N + pad
        A = np.zeros((ar, lda), np.float32); A[:, :ac] = f32(rng, ar, ac)
        B = np.zeros((br, ldb), np.float32); B[:, :bc] = f32(rng, br, bc)
        C0 = f32(rng, M, ldc) if beta else None
        tol = 2e-5 * max(1.0, np.sqrt(K))
        return dict(trans_a=int(ta), trans_b=int(tb), M=M, N=N, K=K, alpha=alpha, A=In(A), lda=lda, B=In(B), ldb=ldb,
                    beta=beta, C=Out((M, ldc), tol=tol, init=C0), ldc=ldc)   # beta = 0: C is not read (poisoned)
    return build


for (ta, tb, M, N, K, al, bt, pad) in [(0, 0, 1, 1, 1, 1.0, 0.0, 0), (0, 1, 7, 509, 17, 1.0, 0.0, 0),
                                       (1, 0, 33, 5, 64, 0.5, 1.0, 3), (1, 1, 3, 129, 130, 1.0, 0.0, 0),
                                       (0, 1, 130, 96, 1, 2.0, 1.0, 1), (0, 0, 64, 64, 768, 1.0, 0.0, 0),
                                       # large enough for the CPU's AMX gemm (ft_cpu_gemm_on_amx): every
                                       # transpose, short row blocks and panels, k past a step of 32
                                       (0, 0, 97, 75, 333, 0.5, 1.0, 3), (0, 1, 97, 75, 333, 1.0, 0.0, 0),
                                       (1, 0, 97, 75, 333, 1.0, 0.0, 0), (1, 1, 97, 75, 333, -1.5, 0.5, 1)]:
    case("gemm", f"{'NT'[ta]}{'NT'[tb]}-{M}x{N}x{K}" + ("-beta" if bt else "") + ("-ld" if pad else ""))(
        _gemm(ta, tb, M, N, K, al, bt, pad))


def _gemm_prec(prec, ta, tb, M, N, K, alpha=1.0, beta=0.0, pad=0):
    inner = _gemm(ta, tb, M, N, K, alpha, beta, pad)

    def build(rng):
        return dict(inner(rng), prec=DTYPE_CODES[prec])
    return build


for prec in ("bfloat16", "float16"):
    for (ta, tb, M, N, K, al, bt, pad) in [(0, 1, 7, 509, 17, 1.0, 0.0, 0), (1, 0, 33, 5, 64, 0.5, 1.0, 3),
                                           (0, 0, 97, 75, 333, 0.5, 1.0, 3), (1, 1, 97, 75, 333, -1.5, 0.5, 1)]:
        case("gemm_prec", f"{prec}-{'NT'[ta]}{'NT'[tb]}-{M}x{N}x{K}" + ("-beta" if bt else "") + ("-ld" if pad else ""))(
            _gemm_prec(prec, ta, tb, M, N, K, al, bt, pad))
case("gemm_prec", "float32-NT-7x509x17")(_gemm_prec("float32", 0, 1, 7, 509, 17))


def test_gemm_prec_rounds_the_products_inputs_on_the_cpu():
    """The CPU reference of gemm_prec against float64: the products of A and B rounded to bf16 /
    fp16 (nearest even), summed in float32; and visibly not the float32 product. fp16 overflows
    to inf as a tensor core's conversion does."""
    be = Backend(-1)
    rng = np.random.default_rng(3)
    import torch
    # 37 x 29 x 300: rounded copies and a float32 GEMM; 97 x 75 x 333 (and its transposes): on a CPU
    # with AMX, the tiles' own bf16 products (ft_cpu_gemm_on_amx)
    for (M, N, K, ta, tb) in ((37, 29, 300, 0, 1), (97, 75, 333, 0, 1), (97, 75, 333, 1, 0), (75, 97, 333, 0, 0)):
        A = f32(rng, *((K, M) if ta else (M, K)))
        B = f32(rng, *((N, K) if tb else (K, N)))
        opA, opB = (A.T if ta else A), (B.T if tb else B)
        for prec, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            r = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(tdt).double().numpy()
            want = r(opA) @ r(opB)
            got = run_case(be, "gemm_prec", dict(prec=DTYPE_CODES[prec], trans_a=ta, trans_b=tb, M=M, N=N, K=K,
                                                 alpha=1.0, A=In(A), lda=A.shape[1], B=In(B), ldb=B.shape[1], beta=0.0,
                                                 C=Out((M, N)), ldc=N))["C"]
            assert np.abs(got - want).max() < 1e-4, (M, N, K, prec, np.abs(got - want).max())
            exact = opA.astype(np.float64) @ opB.astype(np.float64)
            assert np.abs(got - exact).max() > 1e-3   # the inputs were rounded
    big = np.full((1, 2), 7e4, np.float32)
    got = run_case(be, "gemm_prec", dict(prec=DTYPE_CODES["float16"], trans_a=0, trans_b=1, M=1, N=1, K=2, alpha=1.0,
                                         A=In(big), lda=2, B=In(np.ones((1, 2), np.float32)), ldb=2, beta=0.0,
                                         C=Out((1, 1)), ldc=1))["C"]
    assert np.isinf(got).all()


def test_cpu_bf16_rounding_of_edge_values():
    """The CPU's rounding of operands to bf16 (gemm_prec's and mixed-precision attention's copies,
    an inline vectorised loop) at the edges, through a K = 1 product by 1.0: ties to even both
    ways, the largest floats rounding to infinity, infinities, subnormals, zero (not -0: the GEMM's
    sum adds +0), and a NaN (signalling or quiet) staying NaN."""
    be = Backend(-1)
    bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,
                     0x7F800000, 0xFF800000, 0x00000001, 0x00008000, 0x00018000, 0x00000000, 0x7F800001,
                     0x7FC00000, 0xFFFFFFFF], np.uint32)
    a = bits.view(np.float32).reshape(-1, 1)
    got = run_case(be, "gemm_prec", dict(prec=DTYPE_CODES["bfloat16"], trans_a=0, trans_b=0, M=len(a), N=1, K=1,
                                         alpha=1.0, A=In(a), lda=1, B=In(np.ones((1, 1), np.float32)), ldb=1, beta=0.0,
                                         C=Out((len(a), 1), init=np.zeros((len(a), 1))), ldc=1))["C"].ravel()
    import torch
    with np.errstate(over="ignore", invalid="ignore"):
        want = torch.from_numpy(a.ravel().copy()).to(torch.bfloat16).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == 3
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), (got, want)


for n, sc in ((1, 2.0), (1000, 0.125), (70001, 65536.0)):
    case("scale", f"{n}-x{sc:g}")(lambda rng, n=n, sc=sc: dict(x=Out((n,), tol=0, init=f32(rng, n)), n=n, s=sc))


def _embed(N, C, V=50, P=520, TV=3, types=True):
    def build(rng):
        return dict(out=Out((N, C)), ids=In(rng.integers(0, V, N).astype(np.int32)),
                    types=In(rng.integers(0, TV, N).astype(np.int32)) if types else None,
                    positions=In(rng.integers(0, P, N).astype(np.int32)),
                    word=In(f32(rng, V, C)), pos=In(f32(rng, P, C)), type=In(f32(rng, TV, C)),
                    gamma=In(1 + 0.1 * f32(rng, C)), beta=In(0.1 * f32(rng, C)), N=N, C=C, eps=1e-12)
    return build


for N, C, ty in [(1, 1, True), (14, 33, True), (509, 72, False), (15, 384, True), (6, 1025, True), (0, 16, True)]:
    case("embed_ln_forward", f"{N}x{C}" + ("" if ty else "-notypes"))(_embed(N, C, types=ty))


def _pack(N, K):
    def build(rng):
        return dict(packed=Out((0,)), w=In(f32(rng, N, K)), N=N, K=K)
    return build


def _linear(M, K, N, act, bias, packed):
    def build(rng):
        w = f32(rng, N, K, scale=1 / np.sqrt(K))
        return dict(out=Out((M, N), tol=2e-5), x=In(f32(rng, M, K)), w=In(w), w_packed=Packed("w", N, K) if packed else
                    Packed("w", N, K), bias=In(f32(rng, N)) if bias else None, M=M, K=K, N=N, act=act)
    return build


for M, K, N, act, bias in [(1, 1, 1, -1, True), (7, 33, 17, 0, True), (509, 72, 216, -1, True), (33, 384, 1536, 0, True),
                           (13, 1536, 384, -1, False), (5, 64, 130, 1, True), (3, 40, 9, 2, True), (0, 8, 8, -1, True)]:
    case("linear_forward", f"{M}x{K}x{N}-act{act}" + ("" if bias else "-nobias"))(_linear(M, K, N, act, bias, True))


def _linear_ln(M, K, N, bias):
    def build(rng):
        return dict(out=Out((M, N), tol=2e-5), x=In(f32(rng, M, K)), w=In(f32(rng, N, K, scale=1 / np.sqrt(K))),
                    w_packed=Packed("w", N, K), bias=In(f32(rng, N)) if bias else None, residual=In(f32(rng, M, N)),
                    gamma=In(1 + 0.1 * f32(rng, N)), beta=In(0.1 * f32(rng, N)), M=M, K=K, N=N, eps=1e-12)
    return build


for M, K, N, bias in [(1, 1, 1, True), (7, 33, 17, True), (509, 72, 72, True), (33, 1536, 384, False), (0, 8, 8, True)]:
    case("linear_residual_ln_forward", f"{M}x{K}x{N}" + ("" if bias else "-nobias"))(_linear_ln(M, K, N, bias))


def _scatter(N, C, rows):
    def build(rng):
        index = rng.permutation(rows)[:N].astype(np.int32)
        return dict(dst=Out((rows, C), tol=0, init=np.zeros((rows, C), np.float32)), src=In(f32(rng, N, C)),
                    index=In(index), N=N, C=C)
    return build


for N, C, rows in [(1, 1, 1), (7, 33, 12), (509, 72, 600), (0, 4, 3)]:
    case("scatter_rows", f"{N}x{C}-into{rows}")(_scatter(N, C, rows))


def _broadcast(N, C):
    return lambda rng: dict(dst=Out((N, C), tol=0), bias=In(f32(rng, C)), N=N, C=C)


for N, C in [(1, 1), (7, 33), (509, 1), (3, 2305)]:
    case("broadcast_rows", f"{N}x{C}")(_broadcast(N, C))


def _lengths(rng, B, T, padding):
    if padding == "none":
        return np.full(B, T)
    if padding == "heavy":
        return np.maximum(1, (rng.random(B) * 0.2 * T).astype(int))
    if padding == "total":
        lens = rng.integers(0, T + 1, B)
        lens[0] = 0
        return lens
    return rng.integers(1, T + 1, B)     # "ragged"


def _attention(lengths, NH, hs, padded_queries=0, window=0):
    """packed sequences: sequence b has lengths[b] real tokens (its keys) and lengths[b] +
    padded_queries query rows (padded rows the caller asked for); window > 0: local attention"""
    def build(rng):
        lens = np.asarray(lengths, np.int64)
        nq = lens + padded_queries * (lens > 0)
        first = np.concatenate([[0], np.cumsum(nq)[:-1]])
        seqs = np.stack([first, lens, nq], axis=1).astype(np.int32)
        N, C, T = int(nq.sum()), NH * hs, int(max(nq.max(), 1))
        args = dict(ctx=Out((N, C), tol=2e-5), qkv=In(f32(rng, N, 3 * C)), seqs=Host(seqs), seqs_dev=In(seqs),
                    B=len(lens), C=C, NH=NH, scratch=Scratch(len(lens), T, NH))
        if window:
            args["window"] = window
        return args
    return build


for lens, NH, hs, pq in [([1], 1, 1, 0), ([7, 2], 3, 5, 0), ([3, 7, 1], 2, 17, 4), ([509, 50], 3, 8, 0),
                         ([33, 12, 30, 1], 4, 16, 2), ([64], 12, 3, 0), ([5, 12, 3, 9, 1], 1, 13, 1)]:
    case("attention_forward", "-".join(map(str, lens)) + f"-{NH}h{hs}" + (f"-pad{pq}" if pq else ""))(
        _attention(lens, NH, hs, pq))
# local attention (ModernBERT's windows): sequences shorter and longer than the window, padded queries
# beyond every key's reach, a window of 2 (one key each side)
for lens, NH, hs, pq, win in [([300, 70, 1], 2, 8, 0, 128), ([200, 33], 3, 16, 80, 64), ([40, 9], 1, 5, 3, 2),
                              ([130], 4, 4, 0, 7)]:
    case("attention_forward", "-".join(map(str, lens)) + f"-{NH}h{hs}" + (f"-pad{pq}" if pq else "") + f"-win{win}")(
        _attention(lens, NH, hs, pq, win))


def _rotary(N, NH, hs, theta, P=9000):
    def build(rng):
        C = NH * hs
        return dict(qkv=Out((N, 3 * C), tol=2e-6, init=f32(rng, N, 3 * C)), positions=In(rng.integers(0, P, N).astype(np.int32)),
                    N=N, C=C, NH=NH, theta=theta)
    return build


for N, NH, hs, theta in [(1, 1, 2, 10000.0), (37, 3, 8, 160000.0), (300, 12, 64, 10000.0), (5, 2, 34, 500.0), (0, 2, 4, 1e4)]:
    case("rotary_forward", f"{N}-{NH}h{hs}-theta{theta:g}")(_rotary(N, NH, hs, theta))


def _gated(N, K, act):
    return lambda rng: dict(out=Out((N, K), tol=1e-5), h=In(f32(rng, N, 2 * K, scale=2.0)), N=N, K=K, act=act)


for N, K, act in [(1, 1, 0), (7, 150, 0), (33, 37, 1), (509, 3, 2), (5, 1152, 0), (0, 8, 0)]:
    case("gated_act_forward", f"{N}x{K}-act{act}")(_gated(N, K, act))


def _rotary_backward(N, NH, hs, theta, P=9000):
    def build(rng):
        C = NH * hs
        return dict(dqkv=Out((N, 3 * C), tol=2e-6, init=f32(rng, N, 3 * C)),
                    positions=In(rng.integers(0, P, N).astype(np.int32)), N=N, C=C, NH=NH, theta=theta)
    return build


for N, NH, hs, theta in [(1, 1, 2, 10000.0), (37, 3, 8, 160000.0), (300, 12, 64, 10000.0), (5, 2, 34, 500.0), (0, 2, 4, 1e4)]:
    case("rotary_backward", f"{N}-{NH}h{hs}-theta{theta:g}")(_rotary_backward(N, NH, hs, theta))


def _add(n):
    def build(rng):
        y, x = f32(rng, n), f32(rng, n)
        return dict(y=Out((n,), tol=0.0, init=y), x=In(x), n=n)
    return build


for n in [1, 7, 70001, 0]:
    case("add", f"{n}")(_add(n))


def test_cpu_add_is_the_float32_sum():
    rng = np.random.default_rng(5)
    y, x = f32(rng, 1000), f32(rng, 1000)
    got = run_case(Backend(-1), "add", dict(y=Out((1000,), init=y), x=In(x), n=1000))["y"]
    assert np.array_equal(got, y + x)


def _gated_backward(N, K, act):
    return lambda rng: dict(dh=Out((N, 2 * K), tol=2e-5), dout=In(f32(rng, N, K)), h=In(f32(rng, N, 2 * K, scale=2.0)),
                            N=N, K=K, act=act)


for N, K, act in [(1, 1, 0), (7, 150, 0), (33, 37, 1), (509, 3, 2), (5, 1152, 0), (9, 77, 3), (0, 8, 0)]:
    case("gated_act_backward", f"{N}x{K}-act{act}")(_gated_backward(N, K, act))


def _residual_ln(N, C, with_y, bias):
    def build(rng):
        return dict(x=Out((N, C), tol=1e-5, init=f32(rng, N, C)), h=Out((N, C), tol=2e-5),
                    y=In(f32(rng, N, C)) if with_y else None, gamma=In(1 + 0.1 * f32(rng, C)),
                    beta=In(0.1 * f32(rng, C)) if bias else None, N=N, C=C, eps=1e-5)
    return build


for N, C, with_y, bias in [(1, 1, True, False), (14, 33, True, True), (509, 72, False, False), (6, 768, True, False),
                           (0, 16, True, False)]:
    case("residual_ln_forward", f"{N}x{C}" + ("" if with_y else "-noy") + ("" if bias else "-nobias"))(
        _residual_ln(N, C, with_y, bias))


def _embed_rotary(N, C, V=50):
    """a rotary model's embeddings: no position or type table, a LayerNorm without bias"""
    def build(rng):
        return dict(out=Out((N, C)), ids=In(rng.integers(0, V, N).astype(np.int32)), types=None,
                    positions=In(np.arange(N, dtype=np.int32)), word=In(f32(rng, V, C)), pos=None, type=None,
                    gamma=In(1 + 0.1 * f32(rng, C)), beta=None, N=N, C=C, eps=1e-5)
    return build


for N, C in [(1, 1), (14, 33), (300, 768)]:
    case("embed_ln_forward", f"{N}x{C}-rotary")(_embed_rotary(N, C))


def _bias_act(N, K, act):
    return lambda rng: dict(h=Out((N, K), init=f32(rng, N, K, scale=2.0), tol=1e-5), bias=In(f32(rng, K)), N=N, K=K,
                            act=act)


for N, K, act in [(1, 1, 0), (7, 150, 0), (33, 37, 1), (509, 3, 2), (5, 1537, 3)]:
    case("bias_act_forward", f"{N}x{K}-act{act}")(_bias_act(N, K, act))


def _bias_res_ln(N, C, alias):
    def build(rng):
        res, y = f32(rng, N, C), f32(rng, N, C)
        args = dict(out=Out((N, C), tol=1e-5), residual=In(res), y=In(y), bias=In(f32(rng, C)),
                    gamma=In(1 + 0.1 * f32(rng, C)), beta=In(0.1 * f32(rng, C)), N=N, C=C, eps=1e-12)
        if alias:   # out written over one of its inputs
            args["out"] = Out((N, C), tol=1e-5, init=res if alias == "residual" else y)
            args[alias] = Alias("out")
        return args
    return build


for N, C, alias in [(1, 1, None), (7, 33, None), (509, 72, "residual"), (3, 384, "y"), (2, 1025, None), (0, 8, None)]:
    case("bias_residual_ln_forward", f"{N}x{C}" + (f"-alias-{alias}" if alias else ""))(_bias_res_ln(N, C, alias))


def _pool(lengths, C, cls):
    def build(rng):
        lens = np.asarray(lengths, np.int32)
        first = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
        count = np.minimum(lens, 1) if cls else lens
        N = max(int(lens.sum()), 1)
        return dict(out=Out((len(lens), C)), h=In(f32(rng, N, C)), first=In(first), count=In(count.astype(np.int32)),
                    B=len(lens), C=C)
    return build


for lens, C, cls in [([1], 1, True), ([7, 0, 3], 33, False), ([509, 20], 72, False), ([5, 4, 1, 2], 130, True),
                     ([9, 2], 257, False), ([2] * 70000, 3, False), ([1] * 70000, 2, True)]:
    case("pool_forward", f"{len(lens)}seq-{C}-{'cls' if cls else 'mean'}")(_pool(lens, C, cls))


def _dropout(n, p, alias):
    def build(rng):
        x = f32(rng, n)
        args = dict(y=Out((n,), tol=0), x=In(x), n=n, p=p, key=int(rng.integers(0, 2**63)))
        if alias:
            args["y"] = Out((n,), tol=0, init=x)
            args["x"] = Alias("y")
        return args
    return build


for n, p, alias in [(1, 0.5, False), (1000, 0.0, False), (4099, 0.1, True), (70001, 0.5, False), (33, 0.99, False)]:
    case("dropout", f"{n}-p{p}" + ("-inplace" if alias else ""))(_dropout(n, p, alias))


def _tanh_bwd(n, alias):
    def build(rng):
        dy = f32(rng, n)
        args = dict(dx=Out((n,)), dy=In(dy), y=In(np.tanh(f32(rng, n)).astype(np.float32)), n=n)
        if alias:
            args["dx"] = Out((n,), init=dy)
            args["dy"] = Alias("dx")
        return args
    return build


for n, alias in [(1, False), (999, True), (65537, False)]:
    case("tanh_backward", f"{n}" + ("-inplace" if alias else ""))(_tanh_bwd(n, alias))


def _xent(N, K, valid_rows, grads, empty_row=False):
    def build(rng):
        logits = f32(rng, N, K, scale=3.0)
        valid = None
        if valid_rows:
            valid = (rng.random((valid_rows, K)) > 0.4).astype(np.float32)
            valid[:, 0] = 1
            if empty_row:
                valid[-1] = 0
        labels = np.empty(N, np.int32)
        for r in range(N):
            ok = np.nonzero(valid[r % valid_rows])[0] if valid is not None else np.arange(K)
            labels[r] = rng.choice(ok) if len(ok) else 0
        return dict(loss=Out((N,)), dlogits=Out((N, K)) if grads else None, logits=In(logits),
                    valid=In(valid) if valid is not None else None, valid_rows=valid_rows or 1, labels=In(labels),
                    N=N, K=K, scale=1.0 / max(N, 1))
    return build


for N, K, vr, g, empty in [(1, 1, 0, True, False), (9, 3, 0, True, False), (6, 384, 3, True, True),
                           (4, 509, 2, False, False), (33, 2, 0, True, False), (2, 1030, 1, True, False),
                           (0, 5, 0, True, False)]:
    case("softmax_xent", f"{N}x{K}" + (f"-valid{vr}" if vr else "") + ("" if g else "-nograd") +
         ("-emptyrow" if empty else ""))(_xent(N, K, vr, g, empty))


def _xent_ignored(N, K):
    def build(rng):
        labels = rng.integers(0, K, N).astype(np.int32)
        labels[::3] = -1   # token labels of positions that carry none
        return dict(loss=Out((N,)), dlogits=Out((N, K)), logits=In(f32(rng, N, K, scale=3.0)), valid=None,
                    valid_rows=1, labels=In(labels), N=N, K=K, scale=0.5)
    return build


for N, K in [(1, 2), (10, 9), (300, 17)]:
    case("softmax_xent", f"{N}x{K}-ignored-rows")(_xent_ignored(N, K))


def _elementwise_loss(n, op):
    def build(rng):
        target = rng.random(n).astype(np.float32) if op == "bce_logits_loss" else f32(rng, n, scale=2.0)
        pred = f32(rng, n, scale=6.0)
        if n > 3:
            pred[:3] = [80.0, -80.0, 0.0]   # saturated logits: no overflow in exp
        names = ("dpred", "pred") if op == "mse_loss" else ("dlogits", "logits")
        return {"loss": Out((n,), tol=1e-5), names[0]: Out((n,), tol=1e-5), names[1]: In(pred), "target": In(target),
                "n": n, "scale": 0.25}
    return build


for n in (1, 7, 70001):
    for op in ("mse_loss", "bce_logits_loss"):
        case(op, f"{n}")(_elementwise_loss(n, op))
case("mse_loss", "0")(_elementwise_loss(0, "mse_loss"))
case("bce_logits_loss", "0")(_elementwise_loss(0, "bce_logits_loss"))


def _span(lengths, grads):
    def build(rng):
        B, N = len(lengths), int(sum(lengths))
        first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
        valid = (rng.random(N) > 0.3).astype(np.float32)
        labels = np.zeros((2, B), np.int32)
        for b, (f, n) in enumerate(zip(first, lengths)):
            valid[f + n - 1] = 0.0
            if b == B - 1 and B > 1:
                valid[f:f + n] = 0.0   # a sequence without context: no loss, no gradient
                continue
            ok = np.flatnonzero(valid[f:f + n])
            if not len(ok):
                valid[f] = 1.0
                ok = np.array([0])
            labels[:, b] = rng.choice(ok, 2)
        return dict(loss=Out((2, B)), dlogits=Out((2, N)) if grads else None, logits=In(f32(rng, 2, N, scale=3.0)),
                    valid=In(valid), first=In(first), count=In(np.asarray(lengths, np.int32)), labels=In(labels), B=B,
                    N=N, scale=1.0 / (2 * B))
    return build


for lens, g in [((1,), True), ((5, 1, 9), True), ((384, 200, 17, 384), True), ((7, 300), False)]:
    case("span_xent", f"{len(lens)}seq-{sum(lens)}rows" + ("" if g else "-nograd"))(_span(lens, g))


def _sum(N, K, axis):
    return lambda rng: dict(out=Out((K,) if axis == 0 else (N,), tol=1e-5), x=In(f32(rng, N, K)), N=N, K=K, axis=axis)


for N, K, axis in [(1, 1, 0), (509, 7, 0), (3, 2049, 0), (1, 1, 1), (7, 509, 1), (2049, 3, 1), (0, 5, 0), (0, 5, 1),
                   (4, 0, 1)]:
    case("sum_axis", f"{N}x{K}-axis{axis}")(_sum(N, K, axis))


def _optim(kind, sizes, clip, copy, bias_correction=True, step=3):
    FT_F16, FT_BF16 = 1, 2

    def build(rng):
        args = {}
        for i, n in enumerate(sizes):
            args[f"_p{i}"] = Out((n,), tol=2e-6, init=f32(rng, n))
            args[f"_g{i}"] = In(f32(rng, n, scale=0.5 + i))
            args[f"_m{i}"] = Out((n,), tol=2e-6, init=f32(rng, n, scale=0.01))
            args[f"_v{i}"] = Out((n,), tol=2e-6, init=np.abs(f32(rng, n, scale=0.01)))
            if copy:
                args[f"_c{i}"] = Out((n,), np.uint16, tol=0)
        # two parameter groups (the second: another lr and no bias correction), per-tensor step counts
        groups = (OptimGroup * 2)(OptimGroup(1e-2, 0.9, 0.999, 1e-6, 0.01, int(bias_correction), 1.0),
                                  OptimGroup(3e-3, 0.8, 0.99, 1e-8, 0.1, 0, 1.0))
        cfg = OptimConfig(kind=kind, groups=groups, num_groups=2, max_grad_norm=clip, check_finite=1)
        cfg._groups = groups   # kept alive with the config

        def tensors(ptrs):
            arr = (OptimTensor * len(sizes))()
            for i, n in enumerate(sizes):
                arr[i] = OptimTensor(ptrs[f"_p{i}"], ptrs[f"_g{i}"], ptrs[f"_m{i}"], ptrs[f"_v{i}"],
                                     ptrs.get(f"_c{i}"), (FT_BF16 if copy == "bf16" else FT_F16), n, step + i % 4,
                                     i % 2, int(i % 3 != 2))
            return arr

        return dict(cfg=Struct(lambda ptrs: cfg), t=Struct(tensors), count=len(sizes),
                    info=Struct(lambda ptrs: OptimInfo(),
                                lambda s: {"grad_norm": (s.grad_norm, 1e-5), "clip_scale": (s.clip_scale, 1e-5)}),
                    **args)
    return build


for kind, sizes, clip, copy in [(1, [1], 0.0, None), (1, [7, 16385, 3, 100], 5.0, "bf16"),
                                (0, [1, 2, 16384 * 2 + 5], 0.0, None), (0, [64, 33], 1.0, "f16"),
                                (1, [13] * 40, 0.5, None)]:
    case("optim_step", f"{'lamb' if kind else 'adamw'}-{len(sizes)}t" + (f"-clip{clip}" if clip else "") +
         (f"-{copy}" if copy else ""))(_optim(kind, sizes, clip, copy))


# ---- training of encoder layers --------------------------------------------------------------------
def _res_ln_train(N, C, p, keep_in, alias):
    def build(rng):
        res, y = f32(rng, N, C), f32(rng, N, C)
        args = dict(out=Out((N, C)), ln_in=Out((N, C)) if keep_in else None, stats=Out((N, 2), tol=2e-5),
                    residual=In(res), y=In(y), bias=In(f32(rng, C)), gamma=In(1 + 0.1 * f32(rng, C)),
                    beta=In(0.1 * f32(rng, C)), N=N, C=C, eps=1e-12, p=p, key=int(rng.integers(0, 2**63)))
        if alias:
            args["out"] = Out((N, C), init=res if alias == "residual" else y)
            args[alias] = Alias("out")
        return args
    return build


for N, C, p, keep_in, alias in [(1, 1, 0.0, True, None), (7, 33, 0.1, True, None), (509, 72, 0.5, False, "y"),
                                (3, 384, 0.0, False, "residual"), (0, 8, 0.1, True, None)]:
    case("residual_ln_train_forward", f"{N}x{C}-p{p}" + ("-keep" if keep_in else "") + (f"-alias-{alias}" if alias else ""))(
        _res_ln_train(N, C, p, keep_in, alias))


def _ln_backward(N, C, from_output, alias):
    def build(rng):
        x = f32(rng, N, C, scale=2.0) + f32(rng, N, 1)
        gamma, beta = 1 + 0.3 * f32(rng, C), 0.1 * f32(rng, C)
        mean = x.mean(axis=1, dtype=np.float64)
        rstd = 1 / np.sqrt(x.var(axis=1, dtype=np.float64) + 1e-12)
        stats = np.stack([mean, rstd], axis=1).astype(np.float32)
        out = ((x - mean[:, None]) * rstd[:, None] * gamma + beta).astype(np.float32)
        dy = f32(rng, N, C)
        tol = 5e-5 * max(1.0, np.sqrt(N) / 8)
        args = dict(dx=Out((N, C), tol=5e-5), dgamma=Out((C,), tol=tol), dbeta=Out((C,), tol=tol), dy=In(dy),
                    saved=In(out if from_output else x), stats=In(stats), gamma=In(gamma), beta=In(beta), N=N, C=C,
                    saved_is_output=int(from_output))
        if alias:
            args["dx"] = Out((N, C), tol=5e-5, init=dy)
            args["dy"] = Alias("dx")
        return args
    return build


for N, C, fo, alias in [(1, 1, False, False), (7, 33, True, False), (509, 72, False, True), (130, 384, True, True),
                        (65, 3, False, False), (0, 4, True, False)]:
    case("layernorm_backward", f"{N}x{C}" + ("-from-output" if fo else "") + ("-inplace" if alias else ""))(
        _ln_backward(N, C, fo, alias))


def _embed_train(N, C, V=50, P=520, TV=3, table="both"):
    """table: "both" (positions and types), "notypes" (DistilBERT: no type table), "rotary" (words only)"""
    def build(rng):
        return dict(out=Out((N, C), tol=5e-5), sum=Out((N, C), tol=1e-6), stats=Out((N, 2), tol=5e-5),
                    ids=In(rng.integers(0, V, N).astype(np.int32)),
                    types=In(rng.integers(0, TV, N).astype(np.int32)) if table == "both" else None,
                    positions=In(rng.integers(0, P, N).astype(np.int32)) if table != "rotary" else None,
                    word=In(f32(rng, V, C)), pos=In(f32(rng, P, C)) if table != "rotary" else None,
                    type=In(f32(rng, TV, C)) if table == "both" else None, gamma=In(1 + 0.1 * f32(rng, C)),
                    beta=In(0.1 * f32(rng, C)) if table != "rotary" else None, N=N, C=C, eps=1e-12)
    return build


for N, C, table in [(1, 1, "both"), (14, 33, "both"), (509, 72, "notypes"), (15, 384, "both"), (6, 1025, "rotary"),
                    (0, 16, "both")]:
    case("embed_train_forward", f"{N}x{C}-{table}")(_embed_train(N, C, table=table))


def _embed_backward(N, C, V, P, TV, tables):
    def build(rng):
        tol = 1e-5 * max(1.0, np.sqrt(N))
        return dict(dword=Out((V, C), tol=tol), dpos=Out((P, C), tol=tol) if "pos" in tables else None,
                    dtype=Out((TV, C), tol=tol) if "type" in tables else None, dsum=In(f32(rng, N, C)),
                    ids=In(rng.integers(0, V, N).astype(np.int32)),   # V small against N: rows repeat
                    types=In(rng.integers(0, TV, N).astype(np.int32)) if "type" in tables else None,
                    positions=In(rng.integers(0, P, N).astype(np.int32)) if "pos" in tables else None,
                    N=N, C=C, n_word=V, n_pos=P, n_type=TV)
    return build


for N, C, V, P, TV, tables in [(1, 1, 1, 1, 1, "pos type"), (37, 33, 5, 9, 2, "pos type"), (509, 72, 60, 512, 0, "pos"),
                               (130, 384, 1000, 0, 0, ""), (0, 16, 4, 4, 2, "pos type")]:
    case("embed_backward", f"{N}x{C}-rows{V}-{tables.replace(' ', '-') or 'words'}")(_embed_backward(N, C, V, P, TV, tables))


def _act_train(N, K, act, keep_pre, bits, alias):
    def build(rng):
        h = f32(rng, N, K, scale=2.0)
        nbits = (N * K + 7) // 8
        args = dict(f=Out((N, K)), pre=Out((N, K)) if keep_pre else None, bits=Out((nbits,), np.uint8) if bits else None,
                    h=In(h), bias=In(f32(rng, K)), N=N, K=K, act=act)
        if alias:
            args["f"] = Out((N, K), init=h)
            args["h"] = Alias("f")
        return args
    return build


for N, K, act, pre, bits, alias in [(1, 1, 0, True, True, False), (7, 150, 0, True, False, False),
                                    (33, 37, 1, False, True, True), (5, 19, 2, True, True, False),
                                    (3, 1537, 3, False, False, True)]:
    case("bias_act_train_forward", f"{N}x{K}-act{act}" + ("-pre" if pre else "") + ("-bits" if bits else "") +
         ("-inplace" if alias else ""))(_act_train(N, K, act, pre, bits, alias))


def _act_backward(N, K, act, from_output, alias):
    def build(rng):
        Cin = 24   # the forward GEMM x = inp w^T + bias, for the in-place GELU's flat band
        inp, w, bias = f32(rng, N, Cin, scale=0.5), f32(rng, K, Cin, scale=0.5), f32(rng, K)
        inp[::3] = 0.0                                           # a third of the rows: x = bias, and
        bias[::2] = -0.7518 + 0.01 * f32(rng, len(bias[::2]))   # half of those next to GELU's minimum
        x = (inp @ w.T + bias).astype(np.float32)
        xmin = -0.7524614220710163 if act == 1 else -0.7517915246935645
        if act == 0:
            from math import erf
            f = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))))(x.astype(np.float64)).astype(np.float32)
        elif act == 1:
            v = x.astype(np.float64)
            f = (0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))).astype(np.float32)
        elif act == 2:
            f = np.maximum(x, 0)
        else:
            f = np.tanh(x)
        bits = np.packbits((x < xmin).ravel(), bitorder="little")
        df = f32(rng, N, K)
        args = dict(dh=Out((N, K), tol=2e-5), df=In(df), saved=In(f if from_output else x),
                    bits=In(bits) if from_output else None, w=In(w), bias=In(bias), N=N, K=K, C=Cin, act=act)
        args["in"] = In(inp)
        if alias:
            args["dh"] = Out((N, K), tol=2e-5, init=df)
            args["df"] = Alias("dh")
        return args
    return build


for N, K, act, fo, alias in [(1, 1, 0, False, False), (7, 150, 0, True, False), (33, 37, 1, True, True),
                             (5, 19, 2, True, False), (3, 1537, 3, False, True), (64, 64, 1, False, False),
                             (9, 77, 3, True, False)]:
    case("bias_act_backward", f"{N}x{K}-act{act}" + ("-from-output" if fo else "") + ("-inplace" if alias else ""))(
        _act_backward(N, K, act, fo, alias))


def _packed(rng, lengths):
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    seqs = np.stack([first, lengths, lengths], axis=1).astype(np.int32)
    return seqs, int(np.sum(lengths)), int(max(lengths) if len(lengths) else 0)


# mixed precision's products (prec): CUDA and the CPU round the same operands; an fp32 ulp of
# difference before a rounding can move an operand by one ulp of bf16 / fp16, hence the wider bounds
PREC_TOL = {"float32": 1.0, "bfloat16": 500.0, "float16": 60.0}


def _attn_train(lengths, NH, hs, p, keep_mask, kept="probs", prec="float32"):
    """kept: what the forward keeps for the backward: "probs", "stats" (the rows' softmax max and
    1/sum: the probabilities are recomputed) or both (the two); prec: the products' precision"""
    def build(rng):
        lens = np.asarray(lengths, np.int32)
        seqs, N, T = _packed(rng, lens)
        C = NH * hs
        total = int(NH * np.sum(lens.astype(np.int64) ** 2))
        return dict(prec=DTYPE_CODES[prec], ctx=Out((N, C), tol=2e-5 * PREC_TOL[prec]),
                    probs=Out((total,), tol=2e-6) if kept != "stats" else None,
                    stats=Out((N, NH, 2), tol=2e-6) if kept != "probs" else None,
                    dmask=Out((total,), np.uint8) if keep_mask else None, qkv=In(f32(rng, N, 3 * C)), seqs=Host(seqs),
                    B=len(lens), C=C, NH=NH, p=p, key=int(rng.integers(0, 2**63)),
                    scratch=Scratch(len(lens), T, NH, "attention_train_scratch_bytes"),
                    scratch_bytes=ScratchSize("scratch"))
    return build


for lens, NH, hs, p, keep, kept in [([1], 1, 1, 0.0, False, "probs"), ([7, 3, 5], 3, 5, 0.1, True, "probs"),
                                    ([33, 1, 17], 2, 17, 0.5, False, "probs"), ([128, 64], 4, 16, 0.1, False, "probs"),
                                    ([9, 0, 12], 12, 3, 0.0, False, "probs"), ([70, 45, 3], 2, 40, 0.1, True, "probs"),
                                    ([100], 3, 64, 0.0, False, "probs"), ([1], 1, 1, 0.0, False, "stats"),
                                    ([70, 0, 45, 3], 2, 40, 0.1, True, "stats"), ([33, 1, 17], 2, 17, 0.5, False, "both"),
                                    ([128, 64], 4, 16, 0.0, False, "stats")]:
    case("attention_train_forward", "-".join(map(str, lens)) + f"-{NH}h{hs}-p{p}" + ("-mask" if keep else "")
         + ("" if kept == "probs" else f"-{kept}-recompute"))(_attn_train(lens, NH, hs, p, keep, kept))
# local attention (ModernBERT's windows; no dropout): sequences longer and shorter than the window
for lens, NH, hs, win, kept in [([70, 9, 45], 2, 8, 16, "probs"), ([130, 3], 3, 16, 64, "both"), ([40, 1, 7], 1, 5, 2, "stats"),
                                ([100], 4, 4, 7, "stats")]:
    def _win_build(rng, _b=_attn_train(lens, NH, hs, 0.0, False, kept), _w=win):
        return dict(_b(rng), window=_w)
    case("attention_train_forward", "-".join(map(str, lens)) + f"-{NH}h{hs}-win{win}-{kept}")(_win_build)
for prec in ("bfloat16", "float16"):
    for lens, NH, hs, p, keep, kept in [([7, 3, 5], 3, 5, 0.1, True, "probs"), ([70, 0, 45, 3], 2, 40, 0.1, True, "both"),
                                        ([100], 3, 64, 0.0, False, "stats")]:
        case("attention_train_forward", f"{prec}-" + "-".join(map(str, lens)) + f"-{NH}h{hs}-p{p}"
             + ("-mask" if keep else "") + ("" if kept == "probs" else f"-{kept}-recompute"))(
            _attn_train(lens, NH, hs, p, keep, kept, prec))


def _attn_backward(lengths, NH, hs, p, keep_mask, recompute=False, prec="float32"):
    """recompute: no probabilities, the rows' softmax statistics (from float64 scores of the same
    qkv) instead; prec: the products' precision"""
    def build(rng):
        lens = np.asarray(lengths, np.int32)
        seqs, N, T = _packed(rng, lens)
        C = NH * hs
        qkv = f32(rng, N, 3 * C)
        probs, stats = [], np.zeros((N, NH, 2), np.float32)
        for first, n in zip(seqs[:, 0], lens):
            if recompute and n:
                q = qkv[first:first + n, :C].reshape(n, NH, hs).transpose(1, 0, 2).astype(np.float64)
                k = qkv[first:first + n, C:2 * C].reshape(n, NH, hs).transpose(1, 0, 2).astype(np.float64)
                s = q @ k.transpose(0, 2, 1) / np.sqrt(hs)
                m = s.max(axis=-1)
                stats[first:first + n, :, 0] = m.T
                stats[first:first + n, :, 1] = (1 / np.exp(s - m[..., None]).sum(axis=-1)).T
            elif not recompute:
                e = np.exp(rng.standard_normal((NH, n, n)) * 2)
                probs.append((e / e.sum(axis=-1, keepdims=True)).ravel())
        total = int(NH * np.sum(lens.astype(np.int64) ** 2))
        probs = np.concatenate(probs).astype(np.float32) if probs else np.zeros(0, np.float32)
        dmask = (rng.random(total) > p).astype(np.uint8)
        return dict(prec=DTYPE_CODES[prec], dqkv=Out((N, 3 * C), tol=5e-5 * PREC_TOL[prec]), dctx=In(f32(rng, N, C)),
                    qkv=In(qkv),
                    probs=None if recompute else In(probs), stats=In(stats) if recompute else None,
                    dmask=In(dmask) if keep_mask else None, seqs=Host(seqs), B=len(lens), C=C, NH=NH,
                    p=p, key=int(rng.integers(0, 2**63)), scratch=Scratch(len(lens), T, NH, "attention_train_scratch_bytes"),
                    scratch_bytes=ScratchSize("scratch"))
    return build


for lens, NH, hs, p, keep, rec in [([1], 1, 1, 0.0, False, False), ([7, 3, 5], 3, 5, 0.1, True, False),
                                   ([33, 1, 17], 2, 17, 0.5, False, False), ([128, 64], 4, 16, 0.1, False, False),
                                   ([9, 0, 12], 12, 3, 0.2, True, False), ([70, 45, 3], 2, 40, 0.1, True, False),
                                   ([100], 3, 64, 0.0, False, False), ([65, 31], 2, 33, 0.3, False, False),
                                   ([1], 1, 1, 0.0, False, True), ([70, 0, 45, 3], 2, 40, 0.1, True, True),
                                   ([65, 31], 2, 33, 0.3, False, True), ([128, 64], 4, 16, 0.0, False, True)]:
    case("attention_backward", "-".join(map(str, lens)) + f"-{NH}h{hs}-p{p}" + ("-mask" if keep else "")
         + ("-recompute" if rec else ""))(_attn_backward(lens, NH, hs, p, keep, rec))


def _attn_backward_window(lengths, NH, hs, window, recompute):
    """local attention's backward: probabilities (or statistics) of the windowed forward in float64"""
    def build(rng):
        lens = np.asarray(lengths, np.int32)
        seqs, N, T = _packed(rng, lens)
        C = NH * hs
        qkv = f32(rng, N, 3 * C)
        probs, stats = [], np.zeros((N, NH, 2), np.float32)
        for first, n in zip(seqs[:, 0], lens):
            if not n:
                continue
            _, P, m, l = _attention64(qkv[first:first + n], NH, hs, window)
            stats[first:first + n, :, 0] = m.T
            stats[first:first + n, :, 1] = (1 / l).T
            probs.append(P.ravel())
        probs = np.concatenate(probs).astype(np.float32) if probs else np.zeros(0, np.float32)
        return dict(prec=0, dqkv=Out((N, 3 * C), tol=5e-5), dctx=In(f32(rng, N, C)), qkv=In(qkv),
                    probs=None if recompute else In(probs), stats=In(stats) if recompute else None, dmask=None,
                    seqs=Host(seqs), B=len(lens), C=C, NH=NH, window=window, p=0.0, key=0,
                    scratch=Scratch(len(lens), T, NH, "attention_train_scratch_bytes"), scratch_bytes=ScratchSize("scratch"))
    return build


def _attention64(qkv, NH, hs, window):
    """one sequence's attention in float64: ctx (n, C), P (NH, n, n), the rows' max and sum of exp"""
    n, C = qkv.shape[0], NH * hs
    q = qkv[:, :C].reshape(n, NH, hs).transpose(1, 0, 2).astype(np.float64)
    k = qkv[:, C:2 * C].reshape(n, NH, hs).transpose(1, 0, 2).astype(np.float64)
    v = qkv[:, 2 * C:].reshape(n, NH, hs).transpose(1, 0, 2).astype(np.float64)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hs)
    if window:
        i = np.arange(n)
        s = np.where(np.abs(i[:, None] - i[None, :]) <= window // 2, s, -np.inf)
    m = s.max(axis=-1)
    e = np.exp(s - m[..., None])
    l = e.sum(axis=-1)
    P = e / l[..., None]
    return (P @ v).transpose(1, 0, 2).reshape(n, C), P, m, l


for lens, NH, hs, win, rec in [([70, 9, 45], 2, 8, 16, False), ([70, 9, 45], 2, 8, 16, True), ([130, 3], 3, 16, 64, True),
                               ([40, 1, 7], 1, 5, 2, True), ([100], 4, 4, 7, False)]:
    case("attention_backward", "-".join(map(str, lens)) + f"-{NH}h{hs}-win{win}" + ("-recompute" if rec else ""))(
        _attn_backward_window(lens, NH, hs, win, rec))
for prec in ("bfloat16", "float16"):
    for lens, NH, hs, p, keep, rec in [([7, 3, 5], 3, 5, 0.1, True, False), ([70, 0, 45, 3], 2, 40, 0.1, True, True),
                                       ([65, 31], 2, 33, 0.3, False, False), ([100], 3, 64, 0.0, False, True)]:
        case("attention_backward", f"{prec}-" + "-".join(map(str, lens)) + f"-{NH}h{hs}-p{p}"
             + ("-mask" if keep else "") + ("-recompute" if rec else ""))(_attn_backward(lens, NH, hs, p, keep, rec, prec))


def _pool_backward(lengths, C, cls):
    def build(rng):
        lens = np.asarray(lengths, np.int32)
        first = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
        N = int(lens.sum()) + 3   # three rows that belong to no sequence
        count = np.minimum(lens, 1) if cls else lens
        return dict(dh=Out((N, C)), dout=In(f32(rng, len(lens), C)), first=In(first), count=In(count.astype(np.int32)),
                    B=len(lens), N=N, C=C)
    return build


for lens, C, cls in [([1], 1, False), ([5, 1, 0, 9], 33, False), ([7, 3], 384, True), ([2] * 70000, 2, False)]:
    case("pool_backward", f"{len(lens)}seq-{C}" + ("-cls" if cls else ""))(_pool_backward(lens, C, cls))


class GatherRow(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("row", ctypes.c_int64), ("scale", ctypes.c_float), ("unused", ctypes.c_int32)]


def _decode_rows(n_src, rows, C, codec):
    """cache_decode_rows: every dst row from a random source row of a shard in device memory (or zeros),
    in a shuffled table order; the decoded bits must be the CPU decoder's exactly (tol 0)."""
    code = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 6}[codec]

    def build(rng):
        x = f32(rng, n_src, C, scale=3.0)
        x[0, :3] = [6.1e-5, -1e-7, 0.0][:C]   # an f16 subnormal, an underflow, a zero
        if codec == "float32":
            src, esize, scales = x, 4, np.zeros(n_src, np.float32)
        elif codec == "float16":
            src, esize, scales = x.astype(np.float16).view(np.uint16), 2, np.zeros(n_src, np.float32)
        elif codec == "bfloat16":
            src, esize, scales = (x.view(np.uint32) >> 16).astype(np.uint16), 2, np.zeros(n_src, np.float32)
        else:
            amax = np.abs(x).max(1)
            scales = (amax / 127).astype(np.float32)
            src, esize = np.clip(np.round(x / np.maximum(scales, 1e-30)[:, None]), -127, 127).astype(np.int8), 1
        order = rng.permutation(rows)
        pick = rng.integers(0, n_src, rows)
        zero = rng.random(rows) < 0.2

        def table(ptrs):
            t = (GatherRow * max(rows, 1))()
            for k, r in enumerate(order):
                s = int(pick[r])
                t[k] = GatherRow(None if zero[r] else ptrs["_src"] + s * C * esize, int(r), float(scales[s]), 0)
            return t
        return dict(dst=Out((rows, C), tol=0.0), rows=Struct(table), rows_dev=In(np.zeros(max(rows, 1) * 24, np.uint8)),
                    n=rows, C=C, codec=code, stream=0, _src=In(src))
    return build


for n_src, rows, C, codec in [(5, 9, 33, "float32"), (3, 7, 1, "float32"), (40, 64, 384, "float16"),
                              (9, 17, 37, "bfloat16"), (11, 30, 129, "int8"), (1, 1, 768, "int8")]:
    case("cache_decode_rows", f"{rows}from{n_src}x{C}-{codec}")(_decode_rows(n_src, rows, C, codec))


# ---- compressed models (fasttran.compress): head modes, masked FFN groups, gradient x activation -------
EXACT, SIGN_MATCH, OFF = 0, 1, 2
SIGN_MATCH_IDS = set()   # attention_heads_forward cases the CUDA backend refuses by design (sign matching: CPU only)


def _attention_heads(lengths, NH, hs, modes, keys=4, padded_queries=0):
    base = _attention(lengths, NH, hs, padded_queries)

    def build(rng):
        args = base(rng)
        args.update(modes=Host(np.asarray(modes, np.uint8)), sign_keys=keys)
        return args
    return build


for lens, NH, hs, modes, keys, pq in [([7, 2], 3, 5, [EXACT, OFF, EXACT], 4, 0),
                                      ([33, 12, 30, 1], 4, 16, [OFF, OFF, OFF, OFF], 4, 2),
                                      ([3, 7, 1], 2, 17, [SIGN_MATCH, EXACT], 2, 4),
                                      ([509, 50], 3, 70, [SIGN_MATCH, OFF, SIGN_MATCH], 31, 0),
                                      ([64, 5, 0], 4, 32, [SIGN_MATCH] * 4, 64, 1)]:
    ident = "-".join(map(str, lens)) + f"-{NH}h{hs}-" + "".join("xso"[m] for m in modes) + f"-k{keys}" + \
        (f"-pad{pq}" if pq else "")
    case("attention_heads_forward", ident)(_attention_heads(lens, NH, hs, modes, keys, pq))
    if SIGN_MATCH in modes:
        SIGN_MATCH_IDS.add(f"attention_heads_forward-{ident}")


def _zero_columns(N, ld, col, ncols):
    def build(rng):
        return dict(x=Out((N, ld), tol=0.0, init=f32(rng, N, ld)), N=N, ld=ld, col=col, ncols=ncols)
    return build


for N, ld, col, ncols in [(1, 1, 0, 1), (7, 33, 5, 11), (300, 1536, 1280, 256), (3, 10, 4, 0)]:
    case("zero_columns", f"{N}x{ld}-{col}+{ncols}")(_zero_columns(N, ld, col, ncols))


def _group_dot(N, W, group, lda, ldo):
    def build(rng):
        G = W // group
        return dict(out=Out((N, ldo), tol=1e-5, init=np.full((N, ldo), 7.0, np.float32)), ldo=ldo,
                    a=In(f32(rng, N, lda)), lda=lda, b=In(f32(rng, N, lda)), ldb=lda, N=N, W=W, group=group)
    return build


for N, W, group, lda, ldo in [(1, 1, 1, 1, 1), (9, 384, 32, 384, 12), (40, 1536, 96, 1536, 20), (5, 21, 7, 30, 3),
                              (17, 384, 384, 384, 2)]:
    case("group_dot", f"{N}x{W}-g{group}-ld{lda}-ldo{ldo}")(_group_dot(N, W, group, lda, ldo))


# pack_weight writes a layout of the backend's own choosing (none at all on CUDA): it is checked
# through the linear ops above, which read what it wrote
BACKEND_SPECIFIC = {"pack_weight", "pack_weight_i8", "pack_weight_bf16"}
CASES["pack_weight"].append(("pack_weight-via-linear_forward", None))


# ---- reduced precision (int8 / bf16), CPU only (the CUDA backend refuses these ops, saying so). Their
# exactness and bounds against NumPy / float64 on every kernel path: tests/test_lowp.py ----
CPU_ONLY = {"quantize_weight", "quantize_rows", "pack_weight_i8", "pack_weight_bf16", "gemm_i8", "linear_lp_forward",
            "linear_lp_residual_ln_forward", "embed_i8_ln_forward"}
HAS_BF16 = _C.cpu_lowp_kernels()[2] is not None
CASES["pack_weight_i8"].append(("pack_weight_i8-via-linear_lp_forward", None))
CASES["pack_weight_bf16"].append(("pack_weight_bf16-via-linear_lp_forward", None))


def _int8_weight(rng, N, K):
    w = f32(rng, N, K, scale=1 / np.sqrt(K))
    scale = (np.abs(w).max(1) / 127).astype(np.float32)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


for N, K in [(1, 1), (7, 33), (130, 257)]:
    case("quantize_weight", f"{N}x{K}")(lambda rng, N=N, K=K: dict(
        q=Out((N, K), np.int8), scale=Out((N,), tol=0.0), w=In(f32(rng, N, K)), N=N, K=K))
    case("quantize_rows", f"{N}x{K}")(lambda rng, N=N, K=K: dict(
        q=Out((N, K), np.uint8), scale=Out((N,), tol=0.0), zero_point=Out((N,), np.int32), x=In(f32(rng, N, K)), M=N,
        K=K))


def _gemm_i8(M, N, K, zp, pad):
    def build(rng):
        q, s = _int8_weight(rng, N, K)
        A = rng.integers(0, 256, (M, K + pad), dtype=np.uint8)
        return dict(C=Out((M, N + pad), np.int32, init=np.zeros((M, N + pad), np.int32)), A=In(A),
                    zero_point=In(rng.integers(0, 256, M).astype(np.int32)) if zp else None,
                    w_packed=PackedLP("_q", N, K, scale="_s"), M=M, N=N, K=K, lda=K + pad, ldc=N + pad, _q=In(q), _s=In(s))
    return build


for M, N, K, zp, pad in [(1, 1, 1, True, 0), (7, 509, 17, False, 3), (97, 75, 333, True, 1), (130, 96, 768, True, 0)]:
    case("gemm_i8", f"{M}x{N}x{K}" + ("-zp" if zp else "") + ("-ld" if pad else ""))(_gemm_i8(M, N, K, zp, pad))


def _linear_lp(wt, M, K, N, act, bias, residual=False):
    def build(rng):
        x = f32(rng, M, K)
        if wt == "int8":
            q, s = _int8_weight(rng, N, K)
            w, extra = PackedLP("_q", N, K, scale="_s"), dict(_q=In(q), _s=In(s))
        else:
            w, extra = PackedLP("_w", N, K), dict(_w=In(f32(rng, N, K, scale=1 / np.sqrt(K))))
        args = dict(wt=DTYPE_CODES[wt], out=Out((M, N)), x=In(x), w_packed=w,
                    bias=In(f32(rng, N)) if bias else None, M=M, K=K, N=N, **extra)
        if residual:
            args.update(residual=In(f32(rng, M, N)), gamma=In(f32(rng, N)), beta=In(f32(rng, N)), eps=1e-12)
        else:
            args["act"] = act
        return args
    return build


for wt in ("int8",) + (("bfloat16",) if HAS_BF16 else ()):
    for M, K, N, act, bias in [(1, 1, 1, -1, True), (7, 33, 17, 0, True), (70, 150, 72, 1, False),
                               (9, 72, 72, 2, True), (5, 40, 33, 3, True), (130, 384, 1152, -1, True)]:
        case("linear_lp_forward", f"{wt}-{M}x{K}x{N}-act{act}" + ("" if bias else "-nobias"))(
            _linear_lp(wt, M, K, N, act, bias))
    for M, K, N, bias in [(1, 1, 1, True), (7, 33, 17, True), (70, 150, 72, False), (61, 1536, 384, True)]:
        case("linear_lp_residual_ln_forward", f"{wt}-{M}x{K}x{N}" + ("" if bias else "-nobias"))(
            _linear_lp(wt, M, K, N, -1, bias, residual=True))


def _embed_i8(N, C, V=50, P=40, types=True):
    def build(rng):
        q, s = _int8_weight(rng, V, C)
        return dict(out=Out((N, C)), ids=In(rng.integers(0, V, N).astype(np.int32)),
                    types=In(rng.integers(0, 2, N).astype(np.int32)) if types else None,
                    positions=In(rng.integers(0, P, N).astype(np.int32)), word=In(q), word_scale=In(s),
                    pos=In(f32(rng, P, C)), type=In(f32(rng, 2, C)), gamma=In(f32(rng, C)), beta=In(f32(rng, C)),
                    N=N, C=C, eps=1e-12)
    return build


for N, C, types in [(1, 1, True), (14, 33, False), (60, 384, True)]:
    case("embed_i8_ln_forward", f"{N}x{C}" + ("" if types else "-notypes"))(_embed_i8(N, C, types=types))


# ---- the tests ---------------------------------------------------------------------------------------
def test_every_op_has_cases_and_a_cpu_implementation():
    cpu = Backend(-1)
    missing = [op for op in OPS if not CASES[op]]
    assert not missing, f"ops without a case in tests/test_backend_ops.py: {missing}"
    absent = [op for op in OPS if cpu.fn[op] is None]
    assert not absent, f"ops the CPU backend does not implement: {absent}"


ALL_CASES = [pytest.param(op, ident, build, id=ident) for op in OPS for ident, build in CASES[op] if build]


@pytest.mark.parametrize("op,ident,build", ALL_CASES)
def test_cpu_op_writes_every_output(op, ident, build):
    """The reference itself: runs, finite, every output element written (poisoned before)."""
    args = build(np.random.default_rng(zlib.crc32(ident.encode())))
    got = run_case(Backend(-1), op, args)
    for name, v in args.items():
        if isinstance(v, Out) and v.dtype.kind == "f":
            assert np.isfinite(got[name]).all(), f"{op}: {name} has unwritten (NaN) or non-finite elements"


@pytest.mark.parametrize("op", ["attention_train_forward", "attention_backward"])
def test_cpu_attention_training_never_uses_more_scratch_than_it_was_given(op):
    """The scratch is sized for the thread count of the moment (two score blocks per
    worker); another Python thread may raise the count before the op runs. The op takes the size
    it was given and runs no more workers than that holds: with room for one worker and three
    threads it gives the same result (the guard pages of a tight allocation would catch a write
    past it under ASan), and with no room at all it refuses."""
    build = dict(CASES[op])[f"{op}-128-64-4h16-p0.1"]
    be = Backend(-1)
    old = fasttran.get_num_threads()
    try:
        fasttran.set_num_threads(1)
        ref = run_case(be, op, build(np.random.default_rng(7)))
        fasttran.set_num_threads(3)
        args = build(np.random.default_rng(7))
        one_worker = 2 * 128 * 128 * 4   # two score blocks (cpu/train_layer.c ATTN_BLOCKS)
        args["scratch"] = In(np.zeros(one_worker // 4, np.float32))
        args["scratch_bytes"] = one_worker
        got = run_case(be, op, args)
        for name in got:
            assert np.array_equal(got[name], ref[name]), name
        args["scratch_bytes"] = one_worker - 4
        with pytest.raises(AssertionError, match="holds no worker"):
            run_case(be, op, args)
    finally:
        fasttran.set_num_threads(old)


def _act64(x, act):
    from math import erf
    if act == 0:
        return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
    if act == 1:
        return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    return np.maximum(x, 0) if act == 2 else np.tanh(x)


def _devices():
    return [-1] + ([0] if fasttran.cuda_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("act", [0, 1, 2, 3])
def test_gated_act_backward_against_float64(device, act):
    """dh of out = act(a) g against float64: central differences of the float64 forward"""
    rng = np.random.default_rng(act)
    N, K = 6, 41
    h, dout = f32(rng, N, 2 * K, scale=2.0), f32(rng, N, K)
    a, g = h[:, :K].astype(np.float64), h[:, K:].astype(np.float64)
    eps = 1e-6
    dact = (_act64(a + eps, act) - _act64(a - eps, act)) / (2 * eps)
    want = np.concatenate([dout * g * dact, dout * _act64(a, act)], axis=1)
    got = run_case(Backend(device), "gated_act_backward", dict(dh=Out((N, 2 * K)), dout=In(dout), h=In(h), N=N, K=K,
                                                                act=act))["dh"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", _devices())
def test_rotary_backward_is_the_transposed_rotation_in_float64(device):
    """<rotary(x), y> = <x, rotary_backward(y)> in float64 (the backward is the forward's transpose),
    and V's columns pass through untouched"""
    rng = np.random.default_rng(3)
    N, NH, hs, theta = 29, 3, 16, 160000.0
    C = NH * hs
    x, y = f32(rng, N, 3 * C), f32(rng, N, 3 * C)
    pos = rng.integers(0, 8000, N).astype(np.int32)
    be = Backend(device)
    fx = run_case(be, "rotary_forward", dict(qkv=Out((N, 3 * C), init=x), positions=In(pos), N=N, C=C, NH=NH,
                                             theta=theta))["qkv"]
    by = run_case(be, "rotary_backward", dict(dqkv=Out((N, 3 * C), init=y), positions=In(pos), N=N, C=C, NH=NH,
                                              theta=theta))["dqkv"]
    assert np.array_equal(by[:, 2 * C:], y[:, 2 * C:])
    # float64 rotation by minus the angle
    h2 = hs // 2
    inv = 1.0 / theta ** (np.arange(h2) * 2.0 / hs)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    c, s_ = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    qk = y[:, :2 * C].astype(np.float64).reshape(N, 2 * NH, hs)
    u, v = qk[..., :h2], qk[..., h2:]
    want = np.concatenate([u * c + v * s_, v * c - u * s_], axis=-1).reshape(N, 2 * C)
    np.testing.assert_allclose(by[:, :2 * C], want, rtol=0, atol=2e-3)   # float32 angles of positions up to 8000
    lhs = float((fx.astype(np.float64) * y).sum())
    rhs = float((x.astype(np.float64) * by).sum())
    assert abs(lhs - rhs) <= 1e-4 * (abs(lhs) + np.abs(x).sum())


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("window,recompute", [(16, False), (16, True), (2, True), (7, False), (0, True)])
def test_windowed_training_attention_against_float64(device, window, recompute):
    """attention_train_forward (ctx, kept probabilities or statistics) and attention_backward (dQ, dK,
    dV) with a window against float64 (the gradient of <ctx, dctx> by hand), sequences longer and
    shorter than the window"""
    rng = np.random.default_rng(window + recompute)
    lens, NH, hs = np.array([45, 5, 30], np.int32), 2, 8
    seqs, N, T = _packed(rng, lens)
    C = NH * hs
    qkv, dctx = f32(rng, N, 3 * C), f32(rng, N, C)
    total = int(NH * np.sum(lens.astype(np.int64) ** 2))
    be = Backend(device)
    fwd = run_case(be, "attention_train_forward", dict(
        prec=0, ctx=Out((N, C)), probs=None if recompute else Out((total,)), stats=Out((N, NH, 2)) if recompute else None,
        dmask=None, qkv=In(qkv), seqs=Host(seqs), B=3, C=C, NH=NH, window=window, p=0.0, key=0,
        scratch=Scratch(3, T, NH, "attention_train_scratch_bytes"), scratch_bytes=ScratchSize("scratch")))
    bwd = run_case(be, "attention_backward", dict(
        prec=0, dqkv=Out((N, 3 * C)), dctx=In(dctx), qkv=In(qkv), probs=None if recompute else In(fwd["probs"]),
        stats=In(fwd["stats"]) if recompute else None, dmask=None, seqs=Host(seqs), B=3, C=C, NH=NH, window=window,
        p=0.0, key=0, scratch=Scratch(3, T, NH, "attention_train_scratch_bytes"), scratch_bytes=ScratchSize("scratch")))
    at = 0
    for first, n in zip(seqs[:, 0], lens):
        rows = slice(first, first + n)
        ctx, P, m, l = _attention64(qkv[rows], NH, hs, window)
        np.testing.assert_allclose(fwd["ctx"][rows], ctx, rtol=1e-4, atol=1e-5)
        if recompute:
            np.testing.assert_allclose(fwd["stats"][rows, :, 0], m.T, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(fwd["stats"][rows, :, 1], 1 / l.T, rtol=1e-5)
        else:
            got = fwd["probs"][at:at + NH * n * n].reshape(NH, n, n)
            np.testing.assert_allclose(got, P, rtol=1e-5, atol=1e-7)
            assert (got[P == 0] == 0).all()   # exactly 0 outside each row's reach
        at += NH * n * n
        # backward in float64: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = dS K / sqrt(hs), dK = dS^T Q / sqrt(hs)
        x = qkv[rows].astype(np.float64)
        q, k, v = (x[:, j * C:(j + 1) * C].reshape(n, NH, hs).transpose(1, 0, 2) for j in range(3))
        do = dctx[rows].astype(np.float64).reshape(n, NH, hs).transpose(1, 0, 2)
        dP = do @ v.transpose(0, 2, 1)
        dS = P * (dP - (P * dP).sum(-1, keepdims=True))
        grads = [dS @ k / np.sqrt(hs), dS.transpose(0, 2, 1) @ q / np.sqrt(hs), P.transpose(0, 2, 1) @ do]
        want = np.concatenate([g.transpose(1, 0, 2).reshape(n, C) for g in grads], axis=1)
        np.testing.assert_allclose(bwd["dqkv"][rows], want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("op", ["attention_train_forward", "attention_backward"])
def test_windowed_training_attention_refuses_dropout(device, op):
    build = dict(CASES[op])[f"{op}-70-9-45-2h8-win16" + ("-probs" if op == "attention_train_forward" else "")]
    args = build(np.random.default_rng(0))
    args["p"] = 0.1
    with pytest.raises(AssertionError, match="dropout on local attention"):
        run_case(Backend(device), op, args)


cuda = pytest.mark.skipif(not fasttran.cuda_available(),
                          reason="no CUDA device and no emulator (build with FASTTRAN_CUDA=emu, run with "
                                 "FASTTRAN_CUDA_EMU=1): " + str(fasttran.build_info()["cuda"]["unavailable_reason"]))


@cuda
def test_every_op_has_a_cuda_implementation():
    gpu = Backend(0)
    absent = [op for op in OPS if gpu.fn[op] is None]
    assert not absent, f"ops the CUDA backend does not implement: {absent}"


@cuda
@pytest.mark.parametrize("op", sorted(CPU_ONLY - BACKEND_SPECIFIC))
def test_cuda_refuses_the_cpus_reduced_precision_ops_with_the_reason(op):
    build = CASES[op][0][1]
    with pytest.raises(AssertionError, match="run on the CPU backend only"):
        run_case(Backend(0), op, build(np.random.default_rng(0)))


@cuda
@pytest.mark.parametrize("op,ident,build", [c for c in ALL_CASES if c.values[0] not in CPU_ONLY])
def test_cuda_op_matches_cpu(op, ident, build):
    if op == "attention_heads_forward" and ident in SIGN_MATCH_IDS:
        pytest.skip("sign-matching attention runs on the CPU only (test_cuda_refuses_sign_matching)")
    args = build(np.random.default_rng(zlib.crc32(ident.encode())))
    ref = run_case(Backend(-1), op, args)
    got = run_case(Backend(0), op, args)
    compare(op, args, ref, got)



@cuda
@pytest.mark.parametrize("prec", ["float32", "bfloat16"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_cuda_recomputed_probabilities_are_the_kept_ones_bit_for_bit(p, prec):
    """The fused kernels recompute P from the same bits of Q K^T with the forward's own expression
    and the statistics the forward used: the backward from kept probabilities and the backward from
    the statistics give the same dqkv, bit for bit (several key tiles, a partial one, hs 40), with
    float32 products and with bf16 ones on the tensor cores."""
    lens, NH, hs = [70, 0, 45, 3], 2, 40
    gpu = Backend(0)
    fwd = dict(_attn_train(lens, NH, hs, p, False, "both", prec)(np.random.default_rng(11)))
    got = run_case(gpu, "attention_train_forward", fwd)
    rng = np.random.default_rng(12)
    common = dict(prec=DTYPE_CODES[prec], dqkv=Out((sum(lens), 3 * NH * hs)), dctx=In(f32(rng, sum(lens), NH * hs)), qkv=fwd["qkv"],
                  dmask=None, seqs=fwd["seqs"], B=len(lens), C=NH * hs, NH=NH, p=p, key=fwd["key"],
                  scratch=fwd["scratch"], scratch_bytes=fwd["scratch_bytes"])
    kept = run_case(gpu, "attention_backward", dict(common, probs=In(got["probs"]), stats=None))
    rec = run_case(gpu, "attention_backward", dict(common, probs=None, stats=In(got["stats"])))
    assert np.array_equal(kept["dqkv"], rec["dqkv"]), np.abs(kept["dqkv"] - rec["dqkv"]).max()


def _round_to(x, prec):
    """x rounded to bf16 / fp16 (nearest even), as float64"""
    x = np.asarray(x, np.float32)
    if prec == "float16":
        return x.astype(np.float16).astype(np.float64)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def _attention_model(qkv, dctx, lens, NH, hs, p, mask, prec):
    """float64 model of mixed-precision training attention: the operands of Q K^T, dropout(P) V,
    dO V^T, dropout(P)^T dO, dS K and dS^T Q rounded to prec, nothing else rounded. -> ctx, dqkv"""
    C = NH * hs
    ctx, dqkv = np.zeros((len(qkv), C)), np.zeros((len(qkv), 3 * C))
    r = (lambda x: _round_to(x, prec)) if prec != "float32" else (lambda x: np.asarray(x, np.float64))
    first, base, ks = 0, 0, 1 / (1 - p)
    for n in lens:
        for h in range(NH):
            cols = slice(h * hs, (h + 1) * hs)
            q, k, v = (qkv[first:first + n, o * C:(o + 1) * C][:, cols] for o in range(3))
            do = dctx[first:first + n, cols]
            s = r(q) @ r(k).T / np.sqrt(hs)
            P = np.exp(s - s.max(axis=1, keepdims=True)) if n else s
            P = P / P.sum(axis=1, keepdims=True) if n else P
            keep = mask[base:base + n * n].reshape(n, n) * ks
            pd = r(P * keep)
            ctx[first:first + n, cols] = pd @ r(v)
            dp = (r(do) @ r(v).T) * keep
            ds = r(P * (dp - (dp * P).sum(axis=1, keepdims=True)))
            dqkv[first:first + n, cols] = ds @ r(k) / np.sqrt(hs)
            dqkv[first:first + n, C:2 * C][:, cols] = ds.T @ r(q) / np.sqrt(hs)
            dqkv[first:first + n, 2 * C:][:, cols] = pd.T @ r(do)
            base += n * n
        first += n
    return ctx, dqkv


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("prec", ["bfloat16", "float16"])
def test_mixed_precision_training_attention_rounds_the_products_inputs(device, prec):
    """Mixed-precision training attention (prec bf16 / fp16, the layers' matmul_precision) against a
    float64 model that rounds the inputs of its six products to prec and nothing else (softmax,
    dropout, D and dS in full precision): both backends agree with it to a small fraction of the
    precision's own effect, which is visible (the float32 op is far from the model); forward and
    backward, kept and recomputed probabilities."""
    be = Backend(-1 if device == "cpu" else 0)
    lens, NH, hs, p = [70, 0, 45, 3], 2, 40, 0.1
    rng = np.random.default_rng(21)
    N, C = sum(lens), NH * hs
    qkv, dctx = f32(rng, N, 3 * C), f32(rng, N, C)
    seqs, _, T = _packed(rng, np.asarray(lens, np.int32))
    total = NH * sum(n * n for n in lens)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
    # measured (emulator and CPU): 5e-8 (bf16) and 3e-6 (fp16) from the model, 3e-3 and 4e-4 for float32
    bound = {"bfloat16": 1e-5, "float16": 2e-5}[prec]
    for kept in ("probs", "stats"):
        outs = {}
        for pr in (prec, "float32"):
            fwd = run_case(be, "attention_train_forward", dict(
                prec=DTYPE_CODES[pr], ctx=Out((N, C)), probs=Out((total,)) if kept == "probs" else None,
                stats=Out((N, NH, 2)) if kept == "stats" else None, dmask=Out((total,), np.uint8), qkv=In(qkv),
                seqs=Host(seqs), B=len(lens), C=C, NH=NH, p=p, key=77,
                scratch=Scratch(len(lens), T, NH, "attention_train_scratch_bytes"), scratch_bytes=ScratchSize("scratch")))
            bwd = run_case(be, "attention_backward", dict(
                prec=DTYPE_CODES[pr], dqkv=Out((N, 3 * C)), dctx=In(dctx), qkv=In(qkv),
                probs=In(fwd["probs"]) if kept == "probs" else None, stats=In(fwd["stats"]) if kept == "stats" else None,
                dmask=In(fwd["dmask"]), seqs=Host(seqs), B=len(lens), C=C, NH=NH, p=p, key=77,
                scratch=Scratch(len(lens), T, NH, "attention_train_scratch_bytes"), scratch_bytes=ScratchSize("scratch")))
            outs[pr] = (fwd["ctx"], bwd["dqkv"], fwd["dmask"])
        assert np.array_equal(outs[prec][2], outs["float32"][2])   # the same dropout
        model = _attention_model(qkv, dctx, lens, NH, hs, p, outs[prec][2], prec)
        for i, what in ((0, "ctx"), (1, "dqkv")):
            near, far = rel(outs[prec][i], model[i]), rel(outs["float32"][i], model[i])
            assert near < bound and far > 10 * bound, (kept, what, near, far)


@cuda
def test_cuda_per_sequence_training_attention_variant():
    """The training attention's kept variant (FASTTRAN_CUDA_TRAIN_ATTENTION=per_sequence: cuBLAS a
    sequence at a time, the fused kernels' predecessor, read once per process) matches the CPU on
    the same cases in a fresh process; an unknown variant is refused by the ops with the names
    they take."""
    import os
    import subprocess
    import sys

    def sub(variant, *k):
        env = dict(os.environ, FASTTRAN_CUDA_TRAIN_ATTENTION=variant)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", *k],
                              env=env, capture_output=True, text=True, timeout=600)
    # (local attention runs on the fused kernels only: per_sequence refuses windows by name)
    r = sub("per_sequence", "cuda_op_matches_cpu and (attention_train_forward or attention_backward) and not recompute "
            "and not win")
    assert r.returncode == 0 and " 0 passed" not in r.stdout and "passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    r = sub("flash", "cuda_op_matches_cpu and attention_backward-1-1h1")
    assert r.returncode != 0 and "FASTTRAN_CUDA_TRAIN_ATTENTION=flash is not a variant: use fused" in r.stdout, \
        r.stdout[-3000:]


# ---- half precision (CUDA only): the encoder ops in float16 / bfloat16 against float64 ------------
# The CPU computes in float32 only (it refuses another storage type), so the reference here is
# float64 over the very inputs the op was given (already rounded to the storage type); the
# tolerance is that of values stored in the type, a few roundings deep.
def to_half(a, dt):
    """float array -> the storage type's bits (uint16), rounded to nearest even"""
    a = np.ascontiguousarray(a, np.float32)
    if dt == "float16":
        return a.astype(np.float16).view(np.uint16)
    u = a.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_half(bits, dt):
    if dt == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


HALF_TOL = {"float16": 1.5e-3, "bfloat16": 1.2e-2}


def _ln(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * gamma + beta


def _act64(x, act):
    from scipy.special import erf
    if act == 0:
        return 0.5 * x * (1 + erf(x / np.sqrt(2)))
    if act == 1:
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    if act == 2:
        return np.maximum(x, 0)
    return np.tanh(x)


class HalfIn:
    """an input rounded to the storage type: .bits go to the device, .x (float64) to the reference"""
    def __init__(self, a, dt):
        self.bits, self.x = to_half(a, dt), from_half(to_half(a, dt), dt)


def _half_attention(lengths, NH, hs, pq, dt, window=0):
    lens = np.asarray(lengths, np.int64)
    nq = lens + pq * (lens > 0)
    first = np.concatenate([[0], np.cumsum(nq)[:-1]])
    seqs = np.stack([first, lens, nq], axis=1).astype(np.int32)
    N, C, T = int(nq.sum()), NH * hs, int(max(nq.max(), 1))

    def build(rng):
        qkv = HalfIn(rng.standard_normal((N, 3 * C)) * 1.5, dt)
        ref = np.zeros((N, C))
        for b in range(len(lens)):
            f, k, q = seqs[b]
            for h in range(NH):
                Q = qkv.x[f:f + q, h * hs:(h + 1) * hs]
                K = qkv.x[f:f + k, C + h * hs:C + (h + 1) * hs]
                V = qkv.x[f:f + k, 2 * C + h * hs:2 * C + (h + 1) * hs]
                if k == 0:
                    continue
                s = Q @ K.T / np.sqrt(hs)
                if window:   # local attention: keys |i - j| <= window / 2; a row reaching none gives zeros
                    i, j = np.arange(q)[:, None], np.arange(k)[None, :]
                    s = np.where(np.abs(i - j) <= window // 2, s, -np.inf)
                mx = s.max(1, keepdims=True)
                p = np.exp(s - np.where(np.isfinite(mx), mx, 0))
                tot = p.sum(1, keepdims=True)
                ref[f:f + q, h * hs:(h + 1) * hs] = (p / np.where(tot > 0, tot, 1)) @ V
        # the table on the device (as the encoder passes it) or only on the host (copied into scratch)
        args = dict(dt=DTYPE_CODES[dt], ctx=Out((N, C), np.uint16), qkv=In(qkv.bits), seqs=Host(seqs),
                    seqs_dev=In(seqs) if len(lens) % 2 else None, B=len(lens), C=C, NH=NH,
                    scratch=Scratch(len(lens), T, NH))
        if window:
            args["window"] = window
        return args, {"ctx": ref}
    return build


def _half_linear(M, K, N, act, bias, dt, residual=False):
    def build(rng):
        x = HalfIn(rng.standard_normal((M, K)), dt)
        w = HalfIn(rng.standard_normal((N, K)) / np.sqrt(K), dt)
        b = HalfIn(rng.standard_normal(N) * 0.5, dt) if bias else None
        y = x.x @ w.x.T + (b.x if bias else 0)
        args = dict(dt=DTYPE_CODES[dt], out=Out((M, N), np.uint16), x=In(x.bits), w=In(w.bits), w_packed=None,
                    bias=In(b.bits) if bias else None, M=M, K=K, N=N)
        if residual:
            r, g, be = HalfIn(rng.standard_normal((M, N)), dt), HalfIn(1 + 0.2 * rng.standard_normal(N), dt), \
                HalfIn(0.2 * rng.standard_normal(N), dt)
            args.update(residual=In(r.bits), gamma=In(g.bits), beta=In(be.bits), eps=1e-12)
            return args, {"out": _ln(y + r.x, g.x, be.x, 1e-12)}
        args["act"] = act
        return args, {"out": y if act < 0 else _act64(y, act)}
    return build


def _half_embed(N, C, dt, V=50, P=520, TV=3):
    def build(rng):
        word, pos, typ = (HalfIn(rng.standard_normal((n, C)), dt) for n in (V, P, TV))
        g, be = HalfIn(1 + 0.1 * rng.standard_normal(C), dt), HalfIn(0.1 * rng.standard_normal(C), dt)
        ids, positions, types = rng.integers(0, V, N), rng.integers(0, P, N), rng.integers(0, TV, N)
        ref = _ln(word.x[ids] + typ.x[types] + pos.x[positions], g.x, be.x, 1e-12)
        return dict(dt=DTYPE_CODES[dt], out=Out((N, C), np.uint16), ids=In(ids.astype(np.int32)),
                    types=In(types.astype(np.int32)), positions=In(positions.astype(np.int32)), word=In(word.bits),
                    pos=In(pos.bits), type=In(typ.bits), gamma=In(g.bits), beta=In(be.bits), N=N, C=C,
                    eps=1e-12), {"out": ref}
    return build


def _half_pool(lengths, C, cls, dt):
    def build(rng):
        lens = np.asarray(lengths, np.int32)
        first = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
        count = (np.minimum(lens, 1) if cls else lens).astype(np.int32)
        h = HalfIn(rng.standard_normal((max(int(lens.sum()), 1), C)), dt)
        ref = np.stack([h.x[f:f + n].mean(0) if n else np.zeros(C) for f, n in zip(first, count)])
        return dict(dt=DTYPE_CODES[dt], out=Out((len(lens), C)), h=In(h.bits), first=In(first), count=In(count),
                    B=len(lens), C=C), {"out": ref}
    return build


def _half_scatter(N, C, rows, dt):
    def build(rng):
        src = HalfIn(rng.standard_normal((N, C)), dt)
        index = rng.permutation(rows)[:N]
        ref = np.zeros((rows, C))
        ref[index] = src.x
        return dict(dt=DTYPE_CODES[dt], dst=Out((rows, C), init=np.zeros((rows, C), np.float32)), src=In(src.bits),
                    index=In(index.astype(np.int32)), N=N, C=C), {"dst": ref}
    return build



def _half_rotary(N, NH, hs, theta, dt, P=9000):
    """RoPE in the storage type: the op's float32 frequencies and angles (rotary_forward's contract, as
    transformers has them), cos / sin and the rotation in float64 over the rounded inputs"""
    def build(rng):
        C, h2 = NH * hs, hs // 2
        qkv = HalfIn(rng.standard_normal((N, 3 * C)), dt)
        pos = rng.integers(0, P, N).astype(np.int32)
        e = np.arange(0, hs, 2, dtype=np.float32) / np.float32(hs)
        inv = (np.float32(1.0) / np.power(theta, e.astype(np.float64)).astype(np.float32)).astype(np.float32)
        a = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)   # (N, h2) float32 angles
        ref = qkv.x.copy()
        for head in range(2 * NH):   # Q's heads, then K's; V untouched
            u, v = qkv.x[:, head * hs:head * hs + h2], qkv.x[:, head * hs + h2:(head + 1) * hs]
            ref[:, head * hs:head * hs + h2] = u * np.cos(a) - v * np.sin(a)
            ref[:, head * hs + h2:(head + 1) * hs] = v * np.cos(a) + u * np.sin(a)
        return dict(dt=DTYPE_CODES[dt], qkv=Out((N, 3 * C), np.uint16, init=qkv.bits), positions=In(pos), N=N, C=C,
                    NH=NH, theta=theta), {"qkv": ref}
    return build


def _half_gated(N, K, act, dt):
    def build(rng):
        h = HalfIn(rng.standard_normal((N, 2 * K)) * 2.0, dt)
        return dict(dt=DTYPE_CODES[dt], out=Out((N, K), np.uint16), h=In(h.bits), N=N, K=K, act=act), \
            {"out": _act64(h.x[:, :K], act) * h.x[:, K:]}
    return build


def _half_residual_ln(N, C, with_y, bias, dt):
    """x += y stored in the type, then h = LN(x) over the stored x"""
    def build(rng):
        x, y = HalfIn(rng.standard_normal((N, C)), dt), HalfIn(rng.standard_normal((N, C)), dt)
        g, b = HalfIn(1 + 0.1 * rng.standard_normal(C), dt), HalfIn(0.1 * rng.standard_normal(C), dt)
        x1 = from_half(to_half(x.x + y.x, dt), dt) if with_y else x.x
        return dict(dt=DTYPE_CODES[dt], x=Out((N, C), np.uint16, init=x.bits), h=Out((N, C), np.uint16),
                    y=In(y.bits) if with_y else None, gamma=In(g.bits), beta=In(b.bits) if bias else None, N=N, C=C,
                    eps=1e-5), {"x": x1, "h": _ln(x1, g.x, b.x if bias else 0.0, 1e-5)}
    return build


def _half_embed_rotary(N, C, dt, V=50):
    """a rotary model's embeddings: no position or type table, a LayerNorm without bias"""
    def build(rng):
        word, g = HalfIn(rng.standard_normal((V, C)), dt), HalfIn(1 + 0.1 * rng.standard_normal(C), dt)
        ids = rng.integers(0, V, N)
        return dict(dt=DTYPE_CODES[dt], out=Out((N, C), np.uint16), ids=In(ids.astype(np.int32)), types=None,
                    positions=In(np.arange(N, dtype=np.int32)), word=In(word.bits), pos=None, type=None,
                    gamma=In(g.bits), beta=None, N=N, C=C, eps=1e-5), {"out": _ln(word.x[ids], g.x, 0.0, 1e-5)}
    return build

HALF_CASES = []
for dt in ("bfloat16", "float16"):
    for lens, NH, hs, pq in [([1], 1, 1, 0), ([7, 2], 3, 5, 0), ([3, 70, 1], 2, 17, 4), ([131, 40], 2, 32, 0),
                             ([0, 33, 12, 0], 4, 16, 2), ([65], 2, 64, 0), ([20, 9], 1, 128, 3), ([40], 1, 100, 0)]:
        HALF_CASES.append((f"attention_forward-{dt}-" + "-".join(map(str, lens)) + f"-{NH}h{hs}-pad{pq}",
                           "attention_forward", _half_attention(lens, NH, hs, pq, dt), dt))
    for lens, NH, hs, pq, win in [([300, 70, 1], 2, 16, 0, 128), ([200, 33], 1, 64, 90, 64), ([40, 9], 1, 8, 3, 2)]:
        HALF_CASES.append((f"attention_forward-{dt}-" + "-".join(map(str, lens)) + f"-{NH}h{hs}-pad{pq}-win{win}",
                           "attention_forward", _half_attention(lens, NH, hs, pq, dt, win), dt))
    for M, K, N, act, bias in [(1, 1, 1, -1, True), (7, 33, 17, 0, True), (70, 72, 216, -1, True), (33, 64, 150, 0, True),
                               (13, 150, 72, -1, False), (5, 64, 130, 1, True), (3, 40, 9, 2, True), (4, 24, 8, 3, False),
                               (0, 8, 8, -1, True)]:
        HALF_CASES.append((f"linear_forward-{dt}-{M}x{K}x{N}-act{act}" + ("" if bias else "-nobias"), "linear_forward",
                           _half_linear(M, K, N, act, bias, dt), dt))
    for M, K, N, bias in [(1, 1, 1, True), (7, 33, 17, True), (70, 150, 72, True), (9, 72, 72, False)]:
        HALF_CASES.append((f"linear_residual_ln_forward-{dt}-{M}x{K}x{N}" + ("" if bias else "-nobias"),
                           "linear_residual_ln_forward", _half_linear(M, K, N, -1, bias, dt, residual=True), dt))
    for N, C in [(1, 1), (14, 33), (60, 384), (3, 1025)]:
        HALF_CASES.append((f"embed_ln_forward-{dt}-{N}x{C}", "embed_ln_forward", _half_embed(N, C, dt), dt))
    for lens, C, cls in [([1], 1, True), ([7, 0, 3], 33, False), ([50, 20], 72, False), ([5, 4, 1, 2], 130, True)]:
        HALF_CASES.append((f"pool_forward-{dt}-{len(lens)}seq-{C}-{'cls' if cls else 'mean'}", "pool_forward",
                           _half_pool(lens, C, cls, dt), dt))
    for N, C, rows in [(1, 1, 1), (7, 33, 12), (0, 4, 3)]:
        HALF_CASES.append((f"scatter_rows-{dt}-{N}x{C}-into{rows}", "scatter_rows", _half_scatter(N, C, rows, dt), dt))
    # ModernBERT's ops (pre-LN layers: RoPE, GeGLU, the residual + LayerNorm, embeddings without positions)
    for N, NH, hs, theta in [(1, 1, 2, 10000.0), (37, 3, 8, 160000.0), (300, 12, 64, 10000.0), (5, 2, 34, 500.0)]:
        HALF_CASES.append((f"rotary_forward-{dt}-{N}-{NH}h{hs}-theta{theta:g}", "rotary_forward",
                           _half_rotary(N, NH, hs, theta, dt), dt))
    for N, K, act in [(1, 1, 0), (7, 150, 0), (33, 37, 1), (509, 3, 2), (5, 1152, 0)]:
        HALF_CASES.append((f"gated_act_forward-{dt}-{N}x{K}-act{act}", "gated_act_forward", _half_gated(N, K, act, dt), dt))
    for N, C, with_y, bias in [(1, 1, True, False), (14, 33, True, True), (509, 72, False, False), (6, 768, True, False)]:
        HALF_CASES.append((f"residual_ln_forward-{dt}-{N}x{C}" + ("" if with_y else "-noy") + ("" if bias else "-nobias"),
                           "residual_ln_forward", _half_residual_ln(N, C, with_y, bias, dt), dt))
    for N, C in [(1, 1), (14, 33), (300, 768)]:
        HALF_CASES.append((f"embed_ln_forward-{dt}-{N}x{C}-rotary", "embed_ln_forward", _half_embed_rotary(N, C, dt), dt))


@cuda
@pytest.mark.parametrize("ident,op,build,dt", [pytest.param(*c, id=c[0]) for c in HALF_CASES])
def test_cuda_half_op_matches_float64(ident, op, build, dt):
    """Every output element within the type's tolerance of float64 over the rounded inputs
    (outputs poisoned before: an element never written fails)"""
    args, ref = build(np.random.default_rng(zlib.crc32(ident.encode())))
    got = run_case(Backend(0), op, args)
    for name, want in ref.items():
        out = args[name]
        a = from_half(got[name], dt) if out.dtype == np.uint16 else got[name].astype(np.float64)
        tol = HALF_TOL[dt] * (1 + np.abs(want))
        bad = ~(np.abs(a - want) <= tol)
        assert not bad.any(), (f"{ident}: {name} off at {int(bad.sum())} of {a.size} (first {np.argwhere(bad)[0].tolist()}: "
                               f"got {a[bad][0]!r}, float64 {want[bad][0]!r})")


@cuda
@pytest.mark.parametrize("op", ["linear_forward", "attention_forward", "pool_forward", "rotary_forward",
                                "gated_act_forward", "residual_ln_forward"])
def test_cpu_refuses_half_precision_with_the_reason(op):
    args, _ = dict((c[1], c) for c in HALF_CASES)[op][2](np.random.default_rng(0))
    with pytest.raises(AssertionError, match="the CPU backend computes in float32, not bfloat16|not float16"):
        run_case(Backend(-1), op, args)


@cuda
def test_cuda_refuses_sign_matching():
    """CUDA runs exact and masked heads; a sign-matching head is refused with the reason, not computed
    some other way."""
    ident = sorted(SIGN_MATCH_IDS)[0]
    args = dict(CASES["attention_heads_forward"])[ident](np.random.default_rng(0))
    with pytest.raises(AssertionError, match="sign-matching attention, which runs on the CPU only"):
        run_case(Backend(0), "attention_heads_forward", args)


# ---- LAMB on CUDA in groups of tensors (cuda/optim.cu) ---------------------------------------------
# sizes: past a chunk (16384) and several chunks, one element, all-zero weights (trust ratio 1)
LAMB_SIZES = [7, 16385, 3, 100, 40000, 1, 16384 * 2 + 5, 64, 129]
LAMB_ZERO = 3   # this tensor starts at zero
FT_F16, FT_BF16 = 1, 2   # ft_dtype


def lamb_sits_out(step, i):   # steps 2 and 3: a third of the tensors have no gradient
    return step in (2, 3) and i % 3 == 1


def lamb_steps(be, clip, copy, steps=5, sizes=LAMB_SIZES):
    """`steps` LAMB steps through backend `be`'s optim_step over persistent buffers: two parameter
    groups (the second without weight decay or bias correction), decay on or off per tensor, per-tensor
    update counts, some tensors sitting two steps out (the table changes, then stays for a step). Returns the final weights,
    moments and copies and, per step, (grad_norm, clip_scale, kernel_launches, tensors in the step)."""
    rng = np.random.default_rng(11)
    host = []
    for i, n in enumerate(sizes):
        p = np.zeros(n, np.float32) if i == LAMB_ZERO else f32(rng, n)
        host.append((p, f32(rng, n, scale=0.01), np.abs(f32(rng, n, scale=0.01))))
    try:
        return _lamb_steps(be, clip, copy, steps, sizes, rng, host)
    finally:
        be.free_all()


def _lamb_steps(be, clip, copy, steps, sizes, rng, host):
    bufs = [tuple(be.upload(a) for a in h) for h in host]
    grad = [be.alloc(4 * n) for n in sizes]
    cbuf = [be.upload(np.zeros(n, np.uint16)) if copy else None for n in sizes]
    groups = (OptimGroup * 2)(OptimGroup(1e-2, 0.9, 0.999, 1e-6, 0.01, 1, 1.0),
                              OptimGroup(3e-3, 0.8, 0.99, 1e-8, 0.0, 0, 1.0))
    cfg = OptimConfig(kind=1, groups=groups, num_groups=2, max_grad_norm=clip, check_finite=int(clip > 0))
    counts = [2 + i % 3 for i in range(len(sizes))]
    infos = []
    for s in range(steps):
        active = [i for i in range(len(sizes)) if not lamb_sits_out(s, i)]
        arr = (OptimTensor * len(active))()
        for j, i in enumerate(active):
            g = f32(rng, sizes[i], scale=0.5 + i)
            be.check(be.fn["upload"](be.addr, grad[i], g.ctypes.data, g.nbytes), "upload")
            counts[i] += 1
            p, m, v = bufs[i]
            arr[j] = OptimTensor(p, grad[i], m, v, cbuf[i], FT_BF16 if copy == "bf16" else FT_F16, sizes[i],
                                 counts[i], i % 2, int(i % 3 != 2))
        info = OptimInfo()
        be.check(be.fn["optim_step"](be.addr, ctypes.addressof(cfg), arr, len(active), ctypes.byref(info)),
                 "optim_step")
        infos.append((info.grad_norm, info.clip_scale, info.kernel_launches, len(active)))
    be.sync()
    out = {f"{what}{i}": be.download(b, (n,), np.float32)
           for i, (n, bb) in enumerate(zip(sizes, bufs)) for what, b in zip("pmv", bb)}
    if copy:
        out.update({f"c{i}": be.download(b, (n,), np.uint16) for i, (n, b) in enumerate(zip(sizes, cbuf))})
    return out, infos


@cuda
@pytest.mark.parametrize("clip,copy", [(0.0, None), (1.0, "bf16"), (50.0, "f16")])
def test_cuda_lamb_in_groups_is_bit_for_bit_one_pass(monkeypatch, clip, copy):
    """LAMB on CUDA cut into groups of tensors (launch q: apply of group q - 1 + moments of group
    q): any group size gives the same bits -- a tensor per group, tensors larger than a group, a
    few tensors per group, all in one -- with groups + 1 launches, and matches the CPU's LAMB."""
    be = Backend(0)
    nbytes = [n * (16 + (2 if copy else 0)) for n in LAMB_SIZES]
    runs = {}
    for gb in (None, 1, 16 * 20000, 16 * 70000):
        if gb is None:
            monkeypatch.delenv("FASTTRAN_CUDA_OPT_GROUP_BYTES", raising=False)
        else:
            monkeypatch.setenv("FASTTRAN_CUDA_OPT_GROUP_BYTES", str(gb))
        runs[gb] = lamb_steps(be, clip, copy)
        for s, (_, _, launches, count) in enumerate(runs[gb][1] if gb else []):   # default: the device's L2
            active = [b for i, b in enumerate(nbytes) if not lamb_sits_out(s, i)]
            groups, acc = 0, 0   # the greedy cut: whole tensors, at most gb bytes unless a tensor alone is more
            for b in active:
                if acc and acc + b > gb:
                    acc = 0
                if not acc:
                    groups += 1
                acc += b
            assert launches == groups + 1 + (2 if clip else 0), (gb, s, launches, groups)
    assert runs[1][1][0][2] == len(LAMB_SIZES) + 1 + (2 if clip else 0)   # a group per tensor
    base_out, base_info = runs[None]
    for gb, (out, info) in runs.items():
        assert np.array_equal([x[:2] for x in info], [x[:2] for x in base_info], equal_nan=True), gb
        for k in base_out:
            assert np.array_equal(out[k].view(np.uint8), base_out[k].view(np.uint8)), (gb, k)
    ref, ref_info = lamb_steps(Backend(-1), clip, copy)
    for k in ref:
        if k.startswith("c"):   # the half copy of a weight within float32 rounding of the CPU's
            assert np.mean(base_out[k] != ref[k]) < 0.01, k
        else:
            assert np.allclose(base_out[k], ref[k], rtol=2e-5, atol=2e-6), k
    for (gn, cs, _, _), (rgn, rcs, _, _) in zip(base_info, ref_info):
        assert (np.isnan(gn) and np.isnan(rgn)) or abs(gn - rgn) <= 1e-5 * rgn
        assert abs(cs - rcs) <= 1e-5


@cuda
def test_cuda_lamb_group_size_knob_is_checked(monkeypatch):
    monkeypatch.setenv("FASTTRAN_CUDA_OPT_GROUP_BYTES", "lots")
    with pytest.raises(AssertionError, match="FASTTRAN_CUDA_OPT_GROUP_BYTES=lots is not a positive number"):
        lamb_steps(Backend(0), 0.0, None, steps=1, sizes=[5])
