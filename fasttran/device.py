"""Where work runs: one small value, parsed once where a device enters the API (Encoder, Trainer,
TopLayers, Model, ActivationCache) and passed down; nothing below compares device strings.

A Device *is* its canonical name -- "cpu" or "cuda:N" -- so it prints, compares, hashes and goes
into JSON as that string did, and it carries what the code below needs: `index` (the C core's
device index: -1 for the CPU, the CUDA ordinal otherwise), `is_cuda`, and the few buffer
operations that differ between host memory (NumPy arrays) and device memory (fasttran Tensors).
"""
import numpy as np

from . import _C
from .errors import InputError, InputTypeError


class Device(str):
    """A parsed device; make one with Device.parse (or parse_device)."""
    kind = None
    index = -1
    is_cuda = False

    @staticmethod
    def parse(spec, what="device"):
        """'cpu', 'cuda', 'cuda:N', a Device or anything with .type / .index (torch.device) -> Device;
        anything else an InputError (InputTypeError for a non-string) naming `what`."""
        if isinstance(spec, Device):
            return spec
        if not isinstance(spec, str) and hasattr(spec, "type") and hasattr(spec, "index"):   # torch.device
            spec = spec.type if spec.index is None else f"{spec.type}:{spec.index}"
        if not isinstance(spec, str):
            raise InputTypeError(f"{what} must be a string like 'cpu' or 'cuda:0', got {type(spec).__name__}")
        d = spec.strip().lower()
        if d == "cpu":
            return CPU
        kind, _, num = d.partition(":")
        if kind == "cuda" and (num == "" or num.isdigit()):
            return CudaDevice(int(num or 0))
        raise InputError(f"unknown {what} {spec!r}: {what} must be 'cpu', 'cuda' or 'cuda:N'")

    def __repr__(self):
        return f"Device({str.__str__(self)!r})"

    def __reduce__(self):
        return (Device.parse, (str(self),))


class CpuDevice(Device):
    kind = "cpu"

    def __new__(cls):
        return super().__new__(cls, "cpu")

    def array(self, a):
        """`a` as a float32 buffer here (a copy only where needed)"""
        return np.ascontiguousarray(a, dtype=np.float32)

    def empty(self, shape):
        """an uninitialised float32 buffer here"""
        return np.empty(shape, np.float32)

    def views(self, flat, table):
        """[(name, view)] of a flat buffer laid out by `table` ([(name, shape, offset)])"""
        a = np.asarray(flat)
        return [(n, a[o:o + int(np.prod(s))].reshape(s)) for n, s, o in table]

    def write(self, view, src):
        """host float32 `src` into the buffer `view` here"""
        view[...] = src


class CudaDevice(Device):
    kind = "cuda"
    is_cuda = True

    def __new__(cls, index):
        self = super().__new__(cls, f"cuda:{int(index)}")
        self.index = int(index)
        return self

    def array(self, a):
        if isinstance(a, _C.Tensor) and a.device == self:
            return a
        return _C.Tensor.from_dlpack(np.ascontiguousarray(a, dtype=np.float32)).to(self)

    def empty(self, shape):
        return _C.device_zeros(int(np.prod(shape)), self.index).view(0, tuple(shape))

    def views(self, flat, table):
        return [(n, flat.view(o, s)) for n, s, o in table]

    def write(self, view, src):
        _C.device_write(view, src)


CPU = CpuDevice()
parse_device = Device.parse
