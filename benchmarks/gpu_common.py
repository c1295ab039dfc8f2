"""What the GPU benchmarks share: whether this process has a real GPU for both fasttran and torch
(the CUDA emulator is not one), and the reason when it has not."""
import fasttran


def real_gpu(torch):
    """(True, None) with a GPU for fasttran's CUDA build and torch; else (False, why)."""
    info = fasttran.build_info()["cuda"]
    if not fasttran.cuda_available():
        return False, f"fasttran has no usable CUDA device: {info['unavailable_reason']}"
    if info["emulated"]:
        return False, "the CUDA emulator is not a GPU"
    if not torch.cuda.is_available():
        return False, "torch has no CUDA"
    return True, None


def needs_real_gpu(torch):
    """a pytest skip mark for benchmarks that time a GPU"""
    import pytest
    ok, why = real_gpu(torch)
    return pytest.mark.skipif(not ok, reason=f"needs a real GPU with fasttran's CUDA build and torch on CUDA: {why}")
