"""LAMB for PyTorch written with torch._foreach ops (the fastest plain-PyTorch formulation: one
kernel per op over all tensors), following the same equations as fasttran (You et al. 2019 with
bias correction, per-tensor trust ratio, optional global-norm clipping). The reference that
benchmarks/ measure fasttran's fused LAMB against, and the optimizer of the PyTorch baseline
head in the real-data runs."""
import math

import torch


class ForeachLAMB(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        groups = self.param_groups
        grads_all = [p.grad for g in groups for p in g["params"]]
        clip = 1.0
        if self.max_grad_norm:
            gn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads_all)))
            clip = torch.clamp(self.max_grad_norm / gn, max=1.0)
        for g in groups:
            ps = g["params"]
            b1, b2 = g["betas"]
            if not ps:
                continue
            st = [self.state[p] for p in ps]
            for s, p in zip(st, ps):
                if not s:
                    s["m"] = torch.zeros_like(p)
                    s["v"] = torch.zeros_like(p)
            m = [s["m"] for s in st]
            v = [s["v"] for s in st]
            gr = [p.grad for p in ps]
            if self.max_grad_norm:
                gr = torch._foreach_mul(gr, clip)
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, gr, alpha=1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, gr, gr, value=1 - b2)
            bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, g["eps"])
            u = torch._foreach_div(m, denom)
            torch._foreach_div_(u, bc1)
            if g["weight_decay"]:
                torch._foreach_add_(u, ps, alpha=g["weight_decay"])
            wn = torch._foreach_norm(ps)
            un = torch._foreach_norm(u)
            ratio = [torch.where((a > 0) & (b > 0), a / b, torch.ones_like(a)) for a, b in zip(wn, un)]
            torch._foreach_mul_(u, ratio)
            torch._foreach_add_(ps, u, alpha=-g["lr"])


def param_groups(named, weight_decay, no_decay=("bias", "LayerNorm", "layer_norm", "ln_")):
    """Two groups as fasttran builds them: decay, and no decay for biases/LayerNorm."""
    dec, nodec = [], []
    for n, p in named:
        (nodec if any(s in n for s in no_decay) else dec).append(p)
    return [{"params": dec, "weight_decay": weight_decay}, {"params": nodec, "weight_decay": 0.0}]
