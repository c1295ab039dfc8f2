"""Fused LAMB and AdamW over a list of float32 tensors, updated in place in one C call per step.

Parameters and gradients are NumPy arrays, or any DLPack tensors (torch parameters and their
.grad on CPU or CUDA are used in place, zero-copy):

    >>> opt = fasttran.optim.LAMB(model.named_parameters(), lr=1e-3, weight_decay=0.01)
    >>> loss.backward(); opt.step()          # reads each p.grad, writes p in place

The equations are in csrc/include/fasttran.h (ft_optimizer_step); the CPU kernel in
csrc/cpu/optim.c, the CUDA multi-tensor kernels in csrc/cuda/optim.cu.
"""
import math

import numpy as np

from . import _C
from .errors import InputError, InputTypeError, UnsupportedError

#: parameter names that get no weight decay by default (biases and LayerNorm, as in BERT)
NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "ln_")

_KINDS = {"adamw": 0, "lamb": 1}


def _device_of(t):
    if isinstance(t, np.ndarray):
        return "cpu"
    dev = t.device
    return dev if isinstance(dev, str) else str(dev)


def _as_buffer(obj, what):
    """(buffer for the C call, shape, device): an ndarray as is, anything with __dlpack__ as a
    fasttran.Tensor over the same memory (torch parameters are detached first: same storage)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype != np.float32:
            raise InputTypeError(f"{what} must be float32, got {obj.dtype}")
        if not obj.flags.c_contiguous:
            raise InputTypeError(f"{what} must be C-contiguous (it is used in place)")
        return obj, tuple(obj.shape), "cpu"
    if hasattr(obj, "detach"):
        obj = obj.detach()
    if isinstance(obj, _C.Tensor):
        t = obj
    elif hasattr(obj, "__dlpack__"):
        dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (1, 0)
        stream = _C.device_stream(int(dev[1])) if int(dev[0]) == 2 else None
        try:
            t = _C.Tensor.from_dlpack(obj, stream=stream)
        except (TypeError, BufferError, RuntimeError) as e:
            raise InputTypeError(f"{what}: cannot use this DLPack tensor in place: {e}") from e
    else:
        raise InputTypeError(f"{what} must be a NumPy array or a DLPack tensor, got {type(obj).__name__}")
    if t.dtype != "float32":
        raise InputTypeError(f"{what} must be float32, got {t.dtype}")
    return t, tuple(t.shape), _device_of(t)


def _zeros_like(n, device):
    if device == "cpu":
        return np.zeros(n, np.float32)
    if not device.startswith("cuda"):
        raise UnsupportedError(f"optimizer state on device {device!r} is not supported")
    return _C.device_zeros(n, int(device.split(":")[1]))


class _FusedOptimizer:
    """Shared machinery of LAMB and AdamW: parameter table, state, weight-decay rule, checks."""

    _kind = None

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                 max_grad_norm=None, no_decay=NO_DECAY, check_finite=True):
        if isinstance(params, dict):
            params = list(params.items())
        params = list(params)
        if not params:
            raise InputError("the optimizer got an empty parameter list")
        named = all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params)
        self.names = [p[0] for p in params] if named else [f"param{i}" for i in range(len(params))]
        self.params = [p[1] for p in params] if named else params
        self.lr = lr
        b1, b2 = betas
        for name, v in (("beta1", b1), ("beta2", b2)):
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise InputError(f"{name} must lie in [0, 1), got {v!r}")
        if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
            raise InputError(f"eps must be a finite number > 0, got {eps!r}")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0 and math.isfinite(weight_decay)):
            raise InputError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise InputError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
        self.betas = (float(b1), float(b2))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.bias_correction = bool(bias_correction)
        self.max_grad_norm = max_grad_norm
        self.check_finite = bool(check_finite)
        self.step_count = 0
        self.last_grad_norm = float("nan")
        self.last_kernel_launches = 0

        self._bufs, self.shapes, devices = [], [], set()
        for name, p in zip(self.names, self.params):
            buf, shape, dev = _as_buffer(p, f"parameter {name!r}")
            self._bufs.append(buf)
            self.shapes.append(shape)
            devices.add(dev)
        if len(devices) != 1:
            raise InputError(f"all parameters must be on one device, got {sorted(devices)}")
        self.device = devices.pop()
        self.decays = []
        for name, shape in zip(self.names, self.shapes):
            if callable(no_decay):
                skip = bool(no_decay(name, shape))
            elif named:
                skip = any(s in name for s in (no_decay or ()))
            else:   # no names: 1-D tensors are biases and LayerNorm parameters
                skip = len(shape) <= 1 and no_decay is not None and len(no_decay) > 0
            self.decays.append(0.0 if skip else self.weight_decay)
        # state: all m in one allocation and all v in another, with per-tensor views (llm.c style)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        total = int(self._offsets[-1])
        if self.device == "cpu":
            self._m_all = np.zeros(total, np.float32)
            self._v_all = np.zeros(total, np.float32)
            self._m = [self._m_all[a:b] for a, b in zip(self._offsets[:-1], self._offsets[1:])]
            self._v = [self._v_all[a:b] for a, b in zip(self._offsets[:-1], self._offsets[1:])]
        else:   # device memory: one zeroed allocation per tensor
            self._m = [_zeros_like(n, self.device) for n in sizes]
            self._v = [_zeros_like(n, self.device) for n in sizes]

    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not (
                value > 0 and math.isfinite(value)):
            raise InputError(f"lr must be a finite number > 0, got {value!r}")
        self._lr = float(value)

    def _grad_buffers(self, grads):
        if grads is None:
            grads = [getattr(p, "grad", None) for p in self.params]
            if any(g is None for g in grads):
                missing = [n for n, g in zip(self.names, grads) if g is None]
                raise InputError("step() without gradients reads each parameter's .grad, but these have none: "
                                 + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
        grads = list(grads)
        if len(grads) != len(self._bufs):
            raise InputError(f"got {len(grads)} gradients for {len(self._bufs)} parameters")
        out = []
        for name, shape, g in zip(self.names, self.shapes, grads):
            buf, gshape, dev = _as_buffer(g, f"gradient of {name!r}")
            if gshape != shape:
                raise InputError(f"the gradient of {name!r} has shape {gshape}, the parameter {shape}")
            if dev != self.device:
                raise InputError(f"the gradient of {name!r} is on {dev}, the parameters on {self.device}")
            out.append(buf)
        return out

    def step(self, grads=None, lr=None):
        """Apply one update to every parameter in place, from `grads` (a list aligned with the
        parameters; None: each parameter's .grad). Returns the global gradient norm before
        clipping (NaN when neither clipping nor the finiteness check computed it)."""
        if lr is not None:
            self.lr = lr
        gbufs = self._grad_buffers(grads)
        b1, b2 = self.betas
        norm, _, launches = _C.optimizer_step(
            _KINDS[self._kind], self.lr, b1, b2, self.eps, int(self.bias_correction),
            float(self.max_grad_norm or 0.0), int(self.check_finite), self.step_count + 1,
            self._bufs, gbufs, self._m, self._v, self.decays, None)
        self.step_count += 1
        self.last_grad_norm = norm
        self.last_kernel_launches = launches   # CUDA: fixed per configuration, whatever the tensor count
        return norm

    def state_dict(self):
        """Hyper-parameters, step count, and the moment estimates as NumPy arrays (host copies)."""
        def host(parts):
            return np.concatenate([np.asarray(x if isinstance(x, np.ndarray) else x.numpy(), np.float32).reshape(-1)
                                   for x in parts]) if parts else np.zeros(0, np.float32)
        return {
            "optimizer": self._kind, "step": self.step_count, "lr": self.lr, "betas": list(self.betas),
            "eps": self.eps, "weight_decay": self.weight_decay, "bias_correction": self.bias_correction,
            "max_grad_norm": self.max_grad_norm, "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "exp_avg": host(self._m), "exp_avg_sq": host(self._v),
        }

    def load_state_dict(self, state):
        """Restore what state_dict() returned (the parameter list must have the same shapes)."""
        if state.get("optimizer") != self._kind:
            raise InputError(f"state is for optimizer {state.get('optimizer')!r}, this is {self._kind!r}")
        shapes = [tuple(s) for s in state["shapes"]]
        if shapes != [tuple(s) for s in self.shapes]:
            raise InputError("the state's parameter shapes do not match this optimizer's parameters")
        m = np.asarray(state["exp_avg"], np.float32).reshape(-1)
        v = np.asarray(state["exp_avg_sq"], np.float32).reshape(-1)
        if m.size != self._offsets[-1] or v.size != self._offsets[-1]:
            raise InputError("the state's moment arrays have the wrong size")
        for k, (a, b) in enumerate(zip(self._offsets[:-1], self._offsets[1:])):
            for dst, src in ((self._m[k], m[a:b]), (self._v[k], v[a:b])):
                if isinstance(dst, np.ndarray):
                    dst[:] = src
                else:
                    _C.device_write(dst, np.ascontiguousarray(src))
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        self.betas = tuple(float(b) for b in state["betas"])
        self.eps = float(state["eps"])
        return self

    def __repr__(self):
        n = int(self._offsets[-1])
        clip = f", max_grad_norm={self.max_grad_norm}" if self.max_grad_norm else ""
        return (f"{type(self).__name__}({len(self.params)} tensors, {n:,} parameters on {self.device}, lr={self.lr:g}, "
                f"betas={self.betas}, eps={self.eps:g}, weight_decay={self.weight_decay:g}{clip}, "
                f"step={self.step_count})")

    def _repr_html_(self):
        import html
        return f"<pre>{html.escape(repr(self))}</pre>"


class LAMB(_FusedOptimizer):
    """LAMB (You et al. 2019): Adam moments, then a per-tensor trust ratio ||w|| / ||u|| scales
    the step. Fused: one C call, all tensors, in place. Weight decay is off for biases and
    LayerNorm parameters (`no_decay`: name substrings, or a callable(name, shape) -> bool)."""
    _kind = "lamb"


class AdamW(_FusedOptimizer):
    """AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, fused like LAMB."""
    _kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)


def make_optimizer(name, params, **kw):
    """LAMB or AdamW by name ("lamb" | "adamw")."""
    cls = {"lamb": LAMB, "adamw": AdamW}.get(str(name).lower()) if isinstance(name, str) else None
    if cls is None:
        raise InputError(f"unknown optimizer {name!r}; choose 'lamb' or 'adamw'")
    return cls(params, **kw)


# ---- learning-rate schedules ---------------------------------------------------------------------
SCHEDULES = ("constant", "linear", "cosine")


def schedule_factor(schedule, step, total_steps, warmup_steps=0):
    """Multiplier of the base learning rate at `step` (0-based): linear warmup over
    `warmup_steps`, then constant, linear decay to 0, or cosine decay to 0 at `total_steps`."""
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    done = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return max(0.0, 1.0 - done)
    return 0.5 * (1.0 + math.cos(math.pi * done))
