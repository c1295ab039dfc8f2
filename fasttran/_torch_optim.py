"""The torch flavour of fasttran's fused optimizers: torch.optim.Optimizer subclasses over the
same C tensor table (imported by fasttran.optim only when the parameters are torch tensors;
built on fasttran/_fused_optim.py, which never imports this module).

What torch's Optimizer provides is used as is: param_groups, state (keyed by parameter),
zero_grad, state_dict (torch.save / torch.load(weights_only=True) round-trip it: the state is
torch tensors and plain numbers), hooks, schedulers (they write group['lr']). What is ours: step
(one C call over all tensors), add_param_group and load_state_dict (which rebuild or refill the
table), and the state entries themselves, which are views of the table's memory:
state[p] = {'step': 0-d float32 tensor, 'exp_avg': tensor like p, 'exp_avg_sq': tensor like p},
the layout of torch.optim.AdamW, so states load across the two in both directions.
"""
import torch
from torch.optim.optimizer import Optimizer, _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import _fused_optim as _optim
from .errors import InputError


def _profiling():
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


class _TorchFused:
    """Placed before torch.optim.Optimizer in the MRO of the torch flavours."""

    _torch_mode = True
    __init__ = _optim._FusedOptimizer.__init__   # (Optimizer.__init__ is called from it)

    # ---- groups and state ---------------------------------------------------------------------
    def add_param_group(self, param_group):
        Optimizer.add_param_group(self, param_group)   # defaults, names, duplicate checks
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        if self._table is not None:    # after __init__ (which builds once, at the end)
            self._build()

    def load_state_dict(self, state_dict):
        """torch's load_state_dict (checks, hooks, ids mapped to parameters, tensors cast to each
        parameter's device), then the moments and counts copied into the table."""
        Optimizer.load_state_dict(self, state_dict)
        for i, g in enumerate(self.param_groups):
            g["betas"] = tuple(g["betas"])
            self._check_group(g, i)
        if self._table is None:
            self._build()
        else:
            self._adopt()

    def __getstate__(self):
        st = Optimizer.__getstate__(self)
        st["_fasttran"] = {"max_grad_norm": self.max_grad_norm, "check_finite": self.check_finite,
                           "no_decay": self.no_decay}
        return st

    def __setstate__(self, state):
        ours = state.pop("_fasttran", None)
        Optimizer.__setstate__(self, state)
        if ours is not None:   # unpickled / deep-copied: a new table, filled from the state
            self.__dict__.update(ours)
            self._table = None
            self.last_grad_norm = float("nan")
            self.last_kernel_launches = 0
            self._build()

    def _key(self, i, p):
        return p

    def _make_views(self, table):
        m, v, steps = (torch.from_dlpack(x) for x in table.moments())
        out = []
        for i, (p, off) in enumerate(zip(self._params, table.offsets())):
            n = p.numel()
            out.append((m[off:off + n].view(p.shape), v[off:off + n].view(p.shape), steps[i]))
        return out

    def _copy_into(self, dst, src, what):
        if not isinstance(src, torch.Tensor):
            src = torch.as_tensor(src)
        if tuple(src.shape) != tuple(dst.shape):
            raise InputError(f"the state's {what} has shape {tuple(src.shape)}, the parameter {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)

    def _mark_updated(self, table):
        # the kernels wrote the parameters through their addresses: tell autograd, as an
        # in-place torch op would (p._version changes; a graph that saved p sees it)
        updated = table.updated
        if updated:
            torch._C._increment_version(updated)

    # ---- step ----------------------------------------------------------------------------------
    def _plain_step(self, closure=None, grads=None):
        if closure is not None and not callable(closure):   # step(grads): a list of gradients
            closure, grads = None, closure
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._run(grads)
        return loss

    _hooked_step = Optimizer.profile_hook_step(_plain_step)

    def step(self, closure=None, grads=None):
        """One update of every parameter that has a gradient (p.grad; or `grads`, a list
        aligned with the parameters), in place. `closure` re-evaluates the model and returns the
        loss, which step returns. Hooks and the profiler's record_function are honoured; without
        them the step skips their machinery (7 us)."""
        if (_global_optimizer_pre_hooks or _global_optimizer_post_hooks or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _profiling()):
            return self._hooked_step(closure, grads)
        return self._plain_step(closure, grads)

    step.hooked = True   # Optimizer._patch_step_function: nothing to wrap, step() does it


def torch_variant(cls):
    """The torch.optim.Optimizer subclass of a fasttran optimizer class."""
    return type(cls)(cls.__name__, (_TorchFused, Optimizer, cls),
                {"__module__": __name__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


LAMB = torch_variant(_optim.LAMB)
AdamW = torch_variant(_optim.AdamW)
#: fasttran.optim's class -> its torch flavour (fasttran.optim asks here on the first torch tensor)
VARIANTS = {_optim.LAMB: LAMB, _optim.AdamW: AdamW}
