"""What was built, and what this machine offers at run time."""
import platform

from . import _C

try:
    from ._build_config import BUILD
except ImportError:  # pragma: no cover - only an incomplete in-place build lacks it
    BUILD = {}


def _cuda_runtime():
    count, desc, err = _C.cuda_probe()
    return count, desc, err


def _cuda_backend_installed():
    """The CUDA backend library is installed: the nvcc-built one, or the emulated one when
    FASTTRAN_CUDA_EMU=1 asks for it (test infrastructure)."""
    return bool(_C.cuda_compiled or _C.cuda_emulated)


def cuda_available():
    """True when the CUDA backend was built, loads, and sees at least one device (with
    FASTTRAN_CUDA_EMU=1: the CUDA emulator, a test device that runs on the CPU)."""
    if not _cuda_backend_installed():
        return False
    return _cuda_runtime()[0] > 0


def no_gpu_reason():
    """None when a CUDA device is usable; else why not, in words a user can act on."""
    if not _cuda_backend_installed():
        return ("this fasttran was built without its CUDA backend (no nvcc was found when it was installed, or "
                "FASTTRAN_CUDA=0); reinstall it on a machine with the CUDA toolkit, with FASTTRAN_CUDA=1")
    count, _desc, err = _cuda_runtime()
    if count > 0:
        return None
    err = str(err or "the CUDA runtime reports 0 devices")
    low = err.lower()
    if "cannot load the cuda backend" in low:
        return (f"fasttran's CUDA backend library did not load ({err}); usually its cuBLAS is missing: "
                "pip install nvidia-cublas")
    if "driver version is insufficient" in low or "insufficient driver" in low:
        return ("no NVIDIA driver is loaded on this machine (libcuda.so.1 was not found), or the driver is older "
                f"than the CUDA {BUILD.get('cuda_version') or ''} runtime fasttran was built with; `nvidia-smi` shows "
                f"the driver and its CUDA version (CUDA said: {err})")
    if "no cuda-capable device" in low or "no device" in low:
        import os
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f" or CUDA_VISIBLE_DEVICES={vis!r} hides them" if vis is not None else ""
        return f"the NVIDIA driver sees no GPU (none installed{hidden}; CUDA said: {err})"
    return err


def cuda_attention(device=-1):
    """Which attention the CUDA backend runs, and why: ``runs`` ("cudnn": cuDNN's fused SDPA where it
    takes the configuration, our kernels for the rest; "wmma": our kernels only), ``reason`` (the
    cuDNN version, or why not: not built, its wheel missing, no GPU, the emulator,
    FASTTRAN_CUDA_ATTENTION=wmma), ``build`` (whether libfasttran_cudnn.so was built, or why not),
    the calls cuDNN ran in this process (``cudnn_calls``: forward, forward with statistics,
    backward), the calls that went to our kernels after asking cuDNN (``fallbacks``) and the
    last one's reason (``last_fallback``). device >= 0 also opens cuDNN on that device. None
    without a CUDA backend."""
    if not _cuda_backend_installed():
        return None
    raw = _C.cuda_attention_info(int(device))
    if raw is None:
        return None
    state, fwd, fwd_stats, bwd, fallbacks, last = raw.split("\x1f")
    runs, _, reason = state.partition(": ")
    return {"runs": runs, "reason": reason, "build": BUILD.get("cudnn_attention_build"),
            "cudnn_calls": {"forward": int(fwd), "forward_stats": int(fwd_stats), "backward": int(bwd)},
            "fallbacks": int(fallbacks), "last_fallback": last or None}


def build_info():
    """A dict describing the build (backends, BLAS, compiler flags, CUDA archs) and the
    runtime (threads, CUDA devices, or why CUDA is unavailable)."""
    count, desc, err = _cuda_runtime()
    return {
        "version": _C.version,
        "backends": ["cpu"] + (["cuda (emulated)" if _C.cuda_emulated else "cuda"] if _cuda_backend_installed() else []),
        "blas": _C.blas_name(),
        "cpu_kernels": _C.cpu_isa(),
        # what the kernels may use (FASTTRAN_CPU_ISA restricts it to a CPU generation's set)
        "cpu_features": _C.cpu_features()[0],
        # int8 products (exact int32 sums on every kernel); used_by_encoders False: the exact fallback is
        # slower than float32 here and int8 encoders run their weights dequantized in float32 kernels
        "int8_kernels": dict(zip(("name", "used_by_encoders"), _C.cpu_lowp_kernels()[:2])),
        "bf16_kernels": _C.cpu_lowp_kernels()[2],   # None: no bf16 products (dtype="bfloat16" refused on this CPU)
        "threads": _C.num_threads(),
        "compiler": BUILD.get("compiler"),
        "cflags": BUILD.get("cflags"),
        "numpy_build_version": BUILD.get("numpy_build_version"),
        "python": platform.python_version(),
        "cuda": {
            "compiled": bool(_C.cuda_compiled),
            # FASTTRAN_CUDA_EMU=1 and a FASTTRAN_CUDA=emu build: "cuda" is the CUDA emulator, which
            # runs the CUDA kernels on the CPU to test them; it is not a GPU
            "emulated": bool(_C.cuda_emulated),
            "build_reason": BUILD.get("cuda_build_reason"),
            "version": BUILD.get("cuda_version"),
            "archs": BUILD.get("cuda_archs", []),
            "cublas": BUILD.get("cublas_source"),
            "device_count": count,
            "devices": desc or None,
            "unavailable_reason": err,
            # cuDNN's fused attention or our kernels, and why (cuda_attention)
            "attention": cuda_attention() if count > 0 else None,
        },
    }


threads_chosen = False   # set_num_threads was called


def get_num_threads():
    """Threads used by fasttran's CPU backend (its kernels, row ops and the heads' BLAS).

    The default is ``FASTTRAN_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the CPUs this
    process may run on (its affinity mask, capped by a cgroup CPU quota: a container limited to
    2 CPUs gets 2 threads whatever the host has). In a process group of several ranks per
    machine (fasttran.distributed.init) it is this rank's share of those CPUs instead, unless
    FASTTRAN_NUM_THREADS or set_num_threads chose a count."""
    return _C.num_threads()


def set_num_threads(n):
    """Set the threads used by fasttran's CPU backend, for every thread that calls into it.
    Results do not depend on it: only the speed does.

    A process forked after fasttran ran parallel work runs on one thread (GNU OpenMP's thread
    team does not survive fork(); a team would wait forever for threads that were not copied):
    start worker processes with the "spawn" or "forkserver" method to give them more."""
    from .errors import InputError
    if isinstance(n, bool) or not isinstance(n, int):
        raise InputError(f"set_num_threads takes a positive int, got {n!r}")
    global threads_chosen
    _C.set_num_threads(n)
    threads_chosen = True   # a process group's share (fasttran.distributed) leaves it alone
    if n > 1 and _C.num_threads() == 1:
        import warnings
        warnings.warn("fasttran runs on one thread in this process: it was forked after fasttran ran parallel "
                      "work, and OpenMP's threads do not survive fork(). Start workers with "
                      "multiprocessing.get_context('spawn') or 'forkserver' to use more threads.",
                      RuntimeWarning, stacklevel=2)
