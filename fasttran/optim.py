"""Fused LAMB and AdamW: every tensor of every parameter group updated in place by one C call per
step, from a tensor table built once (csrc/python/optim_type.c over ft_optim_table).

With torch parameters the optimizers are `torch.optim.Optimizer`s, usable unchanged in PyTorch
code: parameter groups with their own lr / betas / eps / weight_decay, `step(closure)`,
`zero_grad()`, every `torch.optim.lr_scheduler`, hooks, a parameter without a `.grad` skipped,
`state_dict()` that `torch.save` / `torch.load(weights_only=True)` round-trip, and in-place
updates that bump the parameters' version counters as torch's own optimizers do:

    >>> opt = fasttran.optim.AdamW(model.parameters(), lr=2e-5)      # instead of torch.optim.AdamW
    >>> sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=1000)
    >>> loss.backward(); opt.step(); sched.step(); opt.zero_grad()

torch is not imported by fasttran: the torch flavour (fasttran/_torch_optim.py) is chosen when
the parameters are torch tensors (so torch is already loaded). NumPy arrays and fasttran
Tensors (CPU or CUDA) work without torch, with the gradients passed to step():

    >>> opt = fasttran.optim.LAMB({"w": w, "b": b}, lr=1e-3)
    >>> opt.step([dw, db])          # None for a tensor without a gradient this step

Learning rate per group: a group's `lr` is what torch's schedulers and `step(lr=)` write (every
group's); a group may also carry an `lr_scale` (fasttran's; 1 where absent), and its tensors are
updated at lr x lr_scale. So one schedule drives groups at fixed ratios -- layer-wise lr decay, a
head faster than the layers -- and `step(lr=x)` still sets every group's lr to x, as in torch:

    >>> opt = fasttran.optim.LAMB([{"params": layers, "lr_scale": 0.5}, {"params": head}], lr=1e-3)
    >>> opt.step(grads, lr=2e-4)    # the layers at 1e-4, the head at 2e-4

Weight decay: each group's weight_decay applies to its tensors, except named tensors matched by
`no_decay` (name substrings; default biases and LayerNorm, as in BERT; or a callable
(name, shape) -> bool, which sees every tensor; None: decay everything). Names come from
`named_parameters()`, a {name: tensor} dict, or (name, tensor) pairs in a group; unnamed tensors
get their group's weight decay, as in torch. The equations are in csrc/include/fasttran.h
(ft_optimizer_step); the CPU kernel in csrc/cpu/optim.c, the CUDA kernels in csrc/cuda/optim.cu.
The machinery and the classes are in fasttran/_fused_optim.py; this module is their public face.
"""
import math

import numpy as np

from . import _fused_optim
from ._fused_optim import NO_DECAY, AdamW, LAMB  # noqa: F401  (the public names)
from .errors import InputError

__all__ = ["LAMB", "AdamW", "NO_DECAY", "make_optimizer", "flat_state", "load_flat_state", "schedule_factor",
           "SCHEDULES"]


def _torch_variant(cls):
    """The torch.optim.Optimizer subclass of `cls` (LAMB or AdamW): fasttran/_torch_optim.py, imported on
    the first optimizer over torch tensors (torch is loaded by then)."""
    from . import _torch_optim
    return _torch_optim.VARIANTS[cls]


_fused_optim.torch_variant = _torch_variant


def make_optimizer(name, params, **kw):
    """LAMB or AdamW by name ("lamb" | "adamw")."""
    cls = {"lamb": LAMB, "adamw": AdamW}.get(str(name).lower()) if isinstance(name, str) else None
    if cls is None:
        raise InputError(f"unknown optimizer {name!r}; choose 'lamb' or 'adamw'")
    return cls(params, **kw)


# ---- flat state (the Trainer's checkpoint files) -------------------------------------------------
def flat_state(opt):
    """(meta, exp_avg, exp_avg_sq) of an optimizer over NumPy arrays: JSON-able metadata and the
    moments of all tensors concatenated (float32, tensor after tensor)."""
    sd = opt.state_dict()
    sizes = [int(np.prod(s, dtype=np.int64)) for s in opt.shapes]
    m, v, steps = [], [], []
    for i, n in enumerate(sizes):
        st = sd["state"].get(i)
        m.append(np.asarray(st["exp_avg"], np.float32).reshape(-1) if st else np.zeros(n, np.float32))
        v.append(np.asarray(st["exp_avg_sq"], np.float32).reshape(-1) if st else np.zeros(n, np.float32))
        steps.append(int(st["step"]) if st else 0)
    groups = [{k: (list(x) if k == "betas" else x) for k, x in g.items()} for g in sd["param_groups"]]
    meta = {"optimizer": opt._kind, "param_groups": groups, "steps": steps, "names": opt.names,
            "shapes": [list(s) for s in opt.shapes]}
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.float32)   # noqa: E731
    return meta, cat(m), cat(v)


def load_flat_state(opt, meta, exp_avg, exp_avg_sq):
    """Restore what flat_state() returned (or fasttran 0.1's flat state) into `opt`."""
    if "param_groups" not in meta:
        return opt.load_state_dict(dict(meta, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq))
    if meta.get("optimizer") != opt._kind:
        raise InputError(f"state is for optimizer {meta.get('optimizer')!r}, this is {opt._kind!r}")
    shapes = [tuple(s) for s in meta["shapes"]]
    if shapes != opt.shapes:
        raise InputError("the state's parameter shapes do not match this optimizer's parameters")
    m = np.asarray(exp_avg, np.float32).reshape(-1)
    v = np.asarray(exp_avg_sq, np.float32).reshape(-1)
    offs = np.concatenate([[0], np.cumsum([int(np.prod(s, dtype=np.int64)) for s in shapes])]).astype(np.int64)
    if m.size != offs[-1] or v.size != offs[-1]:
        raise InputError("the state's moment arrays have the wrong size")
    state = {i: {"step": int(n), "exp_avg": m[a:b].reshape(s), "exp_avg_sq": v[a:b].reshape(s)}
             for i, (n, a, b, s) in enumerate(zip(meta["steps"], offs[:-1], offs[1:], shapes)) if int(n) > 0}
    return opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


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
