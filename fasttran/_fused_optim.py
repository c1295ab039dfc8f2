"""The fused optimizers' machinery (fasttran.optim is their public module): parameter groups,
the C tensor table (csrc/python/optim_type.c over ft_optim_table), state, checks, and the classes
LAMB and AdamW themselves.

Over torch tensors an optimizer is an instance of a torch.optim.Optimizer subclass of its class
(fasttran/_torch_optim.py builds them on this module). The dispatch asks `torch_variant(cls)`
for it -- a hook fasttran.optim sets when it is imported, importing _torch_optim only on the first
torch tensor -- so this module imports neither: fasttran.optim and _torch_optim build on it, and
it on nothing of theirs.
"""
import math
import sys

import numpy as np

from . import _C
from .device import parse_device
from .errors import InputError, InputTypeError, UnsupportedError

#: parameter names that get no weight decay by default (biases and LayerNorm, as in BERT)
NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "ln_")

_KINDS = {"adamw": 0, "lamb": 1}
# torch.optim.AdamW's options: accepted so that its call sites run unchanged
_TORCH_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def _number(x):
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)


def _check_hyper(lr, betas, eps, weight_decay, where="", lr_zero=False):
    """(lr, betas, eps, weight_decay) checked and as floats; `where` prefixes messages."""
    if _is_torch_tensor(lr) and lr.numel() == 1:   # torch allows a tensor lr
        lr = float(lr)
    if not _number(lr) or not math.isfinite(lr) or not (lr > 0 or (lr_zero and lr == 0)):
        raise InputError(f"{where}lr must be a finite number {'>=' if lr_zero else '>'} 0, got {lr!r}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise InputError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}") from None
    for name, v in (("beta1", b1), ("beta2", b2)):
        if not (_number(v) and 0.0 <= v < 1.0):
            raise InputError(f"{where}{name} must lie in [0, 1), got {v!r}")
    if not (_number(eps) and eps > 0 and math.isfinite(eps)):
        raise InputError(f"{where}eps must be a finite number > 0, got {eps!r}")
    if not (_number(weight_decay) and weight_decay >= 0 and math.isfinite(weight_decay)):
        raise InputError(f"{where}weight_decay must be a finite number >= 0, got {weight_decay!r}")
    return float(lr), (float(b1), float(b2)), float(eps), float(weight_decay)


def _is_torch_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_tensor(x):
    return isinstance(x, (np.ndarray, _C.Tensor)) or _is_torch_tensor(x) or hasattr(x, "__dlpack__")


def _materialize(params):
    """The parameter argument as a list (generators consumed once): tensors, (name, tensor)
    pairs, or group dicts (whose 'params' are made lists too)."""
    if isinstance(params, dict):   # {name: tensor}
        params = list(params.items())
    if _is_tensor(params):
        raise InputTypeError("params must be an iterable of tensors, (name, tensor) pairs or parameter groups, "
                             f"not one {type(params).__name__}: wrap it in a list")
    out = []
    for x in params:
        if isinstance(x, dict) and "params" in x:
            x = dict(x)
            ps = x["params"]
            if isinstance(ps, set):
                raise InputTypeError("a parameter group's params must be an ordered collection, not a set")
            x["params"] = [ps] if _is_tensor(ps) else list(ps)
        out.append(x)
    return out


def _first_tensor(groups):
    for x in groups:
        for p in (x["params"] if isinstance(x, dict) else [x]):
            return p[1] if isinstance(p, tuple) and len(p) == 2 else p
    return None


_TORCH_CLASSES = {}


def _no_torch_variant(cls):
    raise ImportError("the torch flavour of fasttran's optimizers is reached through fasttran.optim: import it")


#: cls -> its torch.optim.Optimizer subclass; set by fasttran.optim (which imports _torch_optim on first use)
torch_variant = _no_torch_variant


class _Dispatch(type):
    """Optimizers over torch tensors are instances of a subclass that is also a
    torch.optim.Optimizer (made on first use, from fasttran/_torch_optim.py: `torch_variant`)."""

    def __init__(cls, name, bases, ns):
        super().__init__(name, bases, ns)
        import inspect   # help() and IDEs: the constructor's parameters, not __call__'s
        sig = inspect.signature(cls.__init__)
        cls.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])

    def __call__(cls, params, *args, **kwargs):
        if cls._torch_mode:
            return super().__call__(params, *args, **kwargs)
        params = _materialize(params)
        if _is_torch_tensor(_first_tensor(params)):
            tcls = _TORCH_CLASSES.get(cls)
            if tcls is None:
                tcls = _TORCH_CLASSES.setdefault(cls, torch_variant(cls))
            return type.__call__(tcls, params, *args, **kwargs)
        return super().__call__(params, *args, **kwargs)


class _FusedOptimizer(metaclass=_Dispatch):
    """Shared machinery of LAMB and AdamW: parameter groups, the C tensor table, state, checks."""

    _kind = None
    _default_eps = 1e-6
    _torch_mode = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=None, weight_decay=0.01, bias_correction=True,
                 max_grad_norm=None, no_decay=NO_DECAY, check_finite=True, *, foreach=None, fused=None,
                 amsgrad=False, maximize=False, capturable=False, differentiable=False):
        for name, v in zip(_TORCH_FLAGS, (amsgrad, maximize, capturable, differentiable)):
            if v:
                raise UnsupportedError(f"{name}=True is not supported by fasttran's fused {self._kind}; use "
                                       f"torch.optim for it")
        # foreach / fused: torch's implementation choices; this one is always fused
        eps = self._default_eps if eps is None else eps
        lr, betas, eps, weight_decay = _check_hyper(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not (_number(max_grad_norm) and max_grad_norm > 0
                                              and math.isfinite(max_grad_norm)):
            raise InputError(f"max_grad_norm must be None or a finite number > 0, got {max_grad_norm!r}")
        if not (no_decay is None or callable(no_decay) or isinstance(no_decay, (tuple, list))):
            raise InputTypeError("no_decay must be None, a tuple of name substrings, or a callable(name, shape)")
        self.max_grad_norm = max_grad_norm
        self.check_finite = bool(check_finite)
        self.no_decay = no_decay
        self.last_grad_norm = float("nan")
        self.last_kernel_launches = 0
        self._table = None
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bool(bias_correction)}
        groups = params if isinstance(params, list) else _materialize(params)
        if not groups:
            raise InputError("the optimizer got an empty parameter list")
        if self._torch_mode:
            import torch
            torch.optim.Optimizer.__init__(self, groups, defaults)
        else:
            self.defaults = defaults
            self.state = {}
            self.param_groups = []
            for g in (groups if isinstance(groups[0], dict) else [{"params": groups}]):
                self._add_group(g)
        self._build()

    # ---- parameter groups ------------------------------------------------------------------------
    def _add_group(self, group):
        if not isinstance(group, dict):
            raise InputTypeError(f"a parameter group must be a dict, got {type(group).__name__}")
        group = dict(group)
        ps = group.get("params")
        if ps is None:
            raise InputError("a parameter group needs 'params'")
        ps = [ps] if _is_tensor(ps) else list(ps)
        named = [isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in ps]
        if any(named):
            if not all(named):
                raise InputError("give every parameter of a group a name, or none")
            group["param_names"] = [p[0] for p in ps]
            ps = [p[1] for p in ps]
        group["params"] = ps
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        self._check_group(group, len(self.param_groups))
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in ps):
            raise InputError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    def _check_group(self, group, i):
        group["lr"], group["betas"], group["eps"], group["weight_decay"] = _check_hyper(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], where=f"parameter group {i}: ",
            lr_zero=self._table is not None)
        if "lr_scale" in group:   # the group's factor of the lr (fasttran's; 1 where absent)
            sc = group["lr_scale"]
            if not _number(sc) or not (sc > 0 and math.isfinite(sc)):
                raise InputError(f"parameter group {i}: lr_scale must be a finite number > 0 (the group's factor of "
                                 f"the lr), got {sc!r}")
            group["lr_scale"] = float(sc)
        for name in _TORCH_FLAGS:
            if group.get(name):
                raise UnsupportedError(f"parameter group {i}: {name}=True is not supported by fasttran's fused "
                                       f"{self._kind}")

    def add_param_group(self, param_group):
        """Add a group (its own hyper-parameters, defaults filled in); the table is rebuilt, the
        state of the parameters already there kept."""
        self._add_group(param_group)
        self._build()

    def _skip_decay(self, real_name, name, shape):
        nd = self.no_decay
        if callable(nd):
            return bool(nd(name, shape))
        return bool(nd) and real_name is not None and any(s in real_name for s in nd)

    # ---- the table -------------------------------------------------------------------------------
    def _build(self):
        """(Re)build the C table for the current groups; state of known parameters is kept."""
        params, names, decay, sizes = [], [], [], []
        for g in self.param_groups:
            gnames = g.get("param_names")
            sizes.append(len(g["params"]))
            for j, p in enumerate(g["params"]):
                real = gnames[j] if gnames else None
                name = real if real is not None else f"param{len(params)}"
                decay.append(not self._skip_decay(real, name, tuple(p.shape)))
                params.append(p)
                names.append(name)
        table = _C.OptimizerTable(_KINDS[self._kind], params, sizes, decay, names)
        self._params, self._names, self._decay = params, names, decay
        self._views = self._make_views(table)
        self._table = table
        self._adopt()

    def _adopt(self):
        """Copy the state entries that are not the table's own views (from a state dict, an older
        table, an unpickled optimizer) into the table, and point the entries at its views."""
        steps = self._table.get_steps()
        for i, p in enumerate(self._params):
            key = self._key(i, p)
            st = self.state.get(key)
            if not st or "exp_avg" not in st:
                continue
            m, v, s = self._views[i]
            if st["exp_avg"] is not m:
                for dst, src, what in ((m, st["exp_avg"], "exp_avg"), (v, st["exp_avg_sq"], "exp_avg_sq")):
                    self._copy_into(dst, src, f"{what} of {self._names[i]!r}")
                steps[i] = float(st.get("step", 0))
            self.state[key] = {"step": s, "exp_avg": m, "exp_avg_sq": v}
        self._table.set_steps(steps)

    def _new_states(self):
        steps = self._table.get_steps()
        for i, p in enumerate(self._params):
            key = self._key(i, p)
            if steps[i] > 0 and not self.state.get(key):
                m, v, s = self._views[i]
                self.state[key] = {"step": s, "exp_avg": m, "exp_avg_sq": v}

    def _run(self, grads):
        mg = float(self.max_grad_norm or 0.0)
        r = None if self._table is None else self._table.step(self.param_groups, grads, mg, self.check_finite)
        if r is None:   # the parameter set changed (or an unpickled optimizer): rebuild, keep the state
            for i, g in enumerate(self.param_groups):
                self._check_group(g, i)
            self._build()
            r = self._table.step(self.param_groups, grads, mg, self.check_finite)
            if r is None:   # pragma: no cover - the table was just built from these groups
                raise RuntimeError("fasttran.optim: the rebuilt table does not match the parameter groups")
        table = self._table
        if r:   # some tensors made their first update: their state entries appear (as in torch)
            self._new_states()
        self._mark_updated(table)
        self.last_grad_norm = norm = table.grad_norm
        self.last_kernel_launches = table.kernel_launches   # CUDA: fixed per configuration
        return norm

    # ---- NumPy / fasttran.Tensor flavour (the torch flavour overrides these) -----------------------
    def _key(self, i, p):
        return i

    def __getstate__(self):   # pickle / deepcopy: everything but the C table and its views
        return {k: v for k, v in self.__dict__.items() if k not in ("_table", "_views", "_params", "_names", "_decay")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._table = None
        self._build()   # a new table, filled from the (copied) state

    def _make_views(self, table):
        """per tensor (m, v, step) views of the table's state"""
        steps = table.moments()[2].numpy()
        out = []
        for i, (m, v) in enumerate(table.views()):
            if not parse_device(table.device).is_cuda:
                m, v = m.numpy(), v.numpy()
            out.append((m, v, steps[i:i + 1].reshape(())))
        return out

    def _copy_into(self, dst, src, what):
        src = np.asarray(src, dtype=np.float32)
        if src.shape != tuple(dst.shape):
            raise InputError(f"the state's {what} has shape {src.shape}, the parameter {tuple(dst.shape)}")
        if isinstance(dst, np.ndarray):
            dst[...] = src
        else:
            _C.device_write(dst, np.ascontiguousarray(src))

    def _mark_updated(self, table):
        pass

    def step(self, grads=None, lr=None):
        """Update every parameter in place from `grads`, a list aligned with the parameters
        (group after group; None for a tensor without a gradient this step, which keeps its
        state and update count). `lr`: set every group's learning rate first (as torch's
        schedulers do: a group with an 'lr_scale' is then updated at lr x lr_scale). Returns the
        global gradient norm before clipping (NaN when neither clipping nor the finiteness check
        took it)."""
        if grads is None:
            raise InputError("step() needs the gradients: NumPy arrays and fasttran Tensors have no .grad, so pass "
                             "step(grads), a list aligned with the parameters (None where there is none)")
        if lr is not None:
            self.lr = lr
        return self._run(grads)

    def state_dict(self):
        """{'state': {index: {'step', 'exp_avg', 'exp_avg_sq'}}, 'param_groups': [...]}, laid out
        like torch's (the arrays are the live state, as torch's are)."""
        groups, i = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(i, i + len(g["params"])))
            i += len(g["params"])
            groups.append(packed)
        state = {k: {"step": int(s["step"]), "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
                 for k, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore what state_dict() returned (same group sizes and shapes): hyper-parameters,
        moments and update counts. Returns self."""
        if "param_groups" not in state_dict:
            state_dict = self._from_legacy(state_dict)
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(saved, self.param_groups)):
            raise InputError("the state's parameter groups do not match this optimizer's (number of groups or "
                             "of parameters in a group)")
        groups = []
        for i, (g, s) in enumerate(zip(self.param_groups, saved)):
            ng = {k: (tuple(v) if k == "betas" else v) for k, v in s.items() if k != "params"}
            ng["params"] = g["params"]
            if "param_names" in g and "param_names" not in ng:
                ng["param_names"] = g["param_names"]
            self._check_group(ng, i)
            groups.append(ng)
        n = len(self._params)
        state = {}
        for k, st in state_dict["state"].items():
            i = int(k)
            if not 0 <= i < n:
                raise InputError(f"the state has an entry for parameter {k}, this optimizer has {n}")
            state[i] = dict(st)
        self.param_groups = groups
        self.state = state
        self._adopt()
        return self

    def _from_legacy(self, st):
        """the flat state of fasttran 0.1 (one step count, moments concatenated)"""
        if st.get("optimizer") != self._kind:
            raise InputError(f"state is for optimizer {st.get('optimizer')!r}, this is {self._kind!r}")
        shapes = [tuple(s) for s in st["shapes"]]
        if shapes != [tuple(p.shape) for p in self._params]:
            raise InputError("the state's parameter shapes do not match this optimizer's parameters")
        m = np.asarray(st["exp_avg"], np.float32).reshape(-1)
        v = np.asarray(st["exp_avg_sq"], np.float32).reshape(-1)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if m.size != offs[-1] or v.size != offs[-1]:
            raise InputError("the state's moment arrays have the wrong size")
        groups = [dict({k: x for k, x in g.items() if k != "params"}, params=g["params"], lr=float(st["lr"]),
                       betas=tuple(st["betas"]), eps=float(st["eps"])) for g in self.param_groups]
        step = int(st["step"])
        state = {i: {"step": step, "exp_avg": m[a:b].reshape(s), "exp_avg_sq": v[a:b].reshape(s)}
                 for i, (a, b, s) in enumerate(zip(offs[:-1], offs[1:], shapes))} if step > 0 else {}
        return {"state": state, "param_groups": groups}

    # ---- conveniences ------------------------------------------------------------------------------
    @property
    def lr(self):
        """The first group's learning rate; setting it sets every group's (each group's tensors are
        updated at its lr x its 'lr_scale', where it has one)."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        if isinstance(value, bool) or not _number(value) or not (value > 0 and math.isfinite(value)):
            raise InputError(f"lr must be a finite number > 0, got {value!r}")
        for g in self.param_groups:
            g["lr"] = float(value)

    @property
    def betas(self):
        return tuple(self.param_groups[0]["betas"])

    @property
    def eps(self):
        return self.param_groups[0]["eps"]

    @property
    def weight_decay(self):
        return self.param_groups[0]["weight_decay"]

    @property
    def names(self):
        """tensor names in table order ('paramN' where none was given)"""
        return list(self._names)

    @property
    def shapes(self):
        return [tuple(p.shape) for p in self._params]

    @property
    def decays(self):
        """the weight decay each tensor gets, in table order"""
        wd = [g["weight_decay"] for g in self.param_groups for _ in g["params"]]
        return [w if d else 0.0 for w, d in zip(wd, self._decay)]

    @property
    def step_count(self):
        """updates done so far (the most any tensor had)"""
        return max(self._table.get_steps(), default=0)

    @property
    def device(self):
        return self._table.device

    def __repr__(self):
        n = sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)
        clip = f", max_grad_norm={self.max_grad_norm}" if self.max_grad_norm else ""
        groups = f" in {len(self.param_groups)} groups" if len(self.param_groups) > 1 else ""
        return (f"{type(self).__name__}({len(self._params)} tensors{groups}, {n:,} parameters on {self.device}, "
                f"lr={self.lr:g}, betas={self.betas}, eps={self.eps:g}, weight_decay={self.weight_decay:g}{clip}, "
                f"step={self.step_count})")

    def _repr_html_(self):
        import html
        return f"<pre>{html.escape(repr(self))}</pre>"


class LAMB(_FusedOptimizer):
    """LAMB (You et al. 2019): Adam moments, then a per-tensor trust ratio ||w|| / ||u|| scales
    the step. Fused: one C call, all tensors, in place. Defaults: lr 1e-3, betas (0.9, 0.999),
    eps 1e-6, weight_decay 0.01 (not for biases and LayerNorm: `no_decay`), bias correction on,
    no clipping (`max_grad_norm`), non-finite gradients refused (`check_finite`)."""
    __module__ = "fasttran.optim"   # its public home (pickles name it there)
    _kind = "lamb"


class AdamW(_FusedOptimizer):
    """AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, fused like LAMB. Defaults
    as torch.optim.AdamW's: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01."""
    __module__ = "fasttran.optim"
    _kind = "adamw"
    _default_eps = 1e-8
