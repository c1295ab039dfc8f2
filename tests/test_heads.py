"""Head forward/backward in C against torch autograd on the same weights and inputs (relative
error <= 1e-5 in fp32), including dropout, whose masks are reproduced here from the hash the C
core documents (an independent re-implementation of core/rng.h)."""
import numpy as np
import pytest

import fasttran
from fasttran.heads import ClassificationHead, QAHead

torch = pytest.importorskip("torch")

M64 = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def dropout_mask(seed, step, site, n, p):
    key = mix64(mix64(seed ^ 0x5851F42D4C957F2D) ^ mix64((step * 0x2545F4914F6CDD1D + site) & M64))
    thr = min(int(p * 4294967296.0), 0xFFFFFFFF)
    return np.array([(mix64((key + i) & M64) >> 32) >= thr for i in range(n)], dtype=bool)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def assert_matches_autograd(head, loss, logits, grads, dx, ref, z, P, xt):
    """fasttran's loss, logits, parameter gradients and d x against torch's (ref = its loss, not yet
    backpropagated; z its logits; P its parameters by name; xt its input), relative error <= 1e-5"""
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel(logits, z.detach()) <= 1e-5
    for name, g in head.views(grads).items():
        assert rel(g, P[name].grad) <= 1e-5, name
    assert rel(dx, xt.grad) <= 1e-5


@pytest.mark.parametrize("pooler", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_classification_head_matches_autograd(pooler, dropout):
    B, C, K = 13, 24, 3
    rng = np.random.default_rng(0)
    head = ClassificationHead(C, K, pooler=pooler, dropout=dropout, seed=1, init_std=0.3)
    x = rng.standard_normal((B, C)).astype(np.float32)
    y = rng.integers(0, K, B)
    grads = np.zeros_like(head.params)
    dx = np.zeros_like(x)
    seed, step = 1234, 7
    logits, loss = head.step(x, y, grads=grads, dx=dx, training=True, seed=seed, step=step)

    P = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in head.tensors.items()}
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    scale = 1.0 / (1.0 - dropout)
    h = xt
    if dropout and not pooler:   # BERT's pooler reads the row undropped (BertForSequenceClassification)
        h = h * torch.tensor(dropout_mask(seed, step, 0, B * C, dropout).reshape(B, C)) * scale
    if pooler:
        h = torch.tanh(h @ P["pooler.dense.weight"].T + P["pooler.dense.bias"])
        if dropout:
            h = h * torch.tensor(dropout_mask(seed, step, 1, B * C, dropout).reshape(B, C)) * scale
    z = h @ P["classifier.weight"].T + P["classifier.bias"]
    assert_matches_autograd(head, loss, logits, grads, dx, torch.nn.functional.cross_entropy(z, torch.tensor(y)), z,
                            P, xt)
    # eval mode: no dropout, and no gradient needed
    lg, l2 = head.step(x, y)
    hp = torch.tensor(x, dtype=torch.float64)
    if pooler:
        hp = torch.tanh(hp @ P["pooler.dense.weight"].T + P["pooler.dense.bias"])
    ze = (hp @ P["classifier.weight"].T + P["classifier.bias"]).detach()
    assert rel(lg, ze) <= 1e-5


def test_dropout_masks_drop_the_right_fraction_and_differ_by_step():
    a = dropout_mask(5, 1, 0, 20000, 0.1)
    b = dropout_mask(5, 2, 0, 20000, 0.1)
    assert abs(1 - a.mean() - 0.1) < 0.01 and (a != b).mean() > 0.1


def test_qa_head_matches_autograd():
    B, T, C = 5, 17, 16
    rng = np.random.default_rng(2)
    head = QAHead(C, dropout=0.2, seed=3, init_std=0.3)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    valid = np.zeros((B, T), np.float32)
    for b in range(B):                       # context spans of different lengths
        valid[b, 3 + b: T - b] = 1
    starts = np.array([3 + b + (b % 3) for b in range(B)])
    ends = np.array([T - b - 1 - (b % 2) for b in range(B)])
    y = np.stack([starts, ends])
    grads = np.zeros_like(head.params)
    dx = np.zeros_like(x)
    logits, loss = head.step(x, valid, y, grads=grads, dx=dx, training=True, seed=9, step=4)

    W = torch.tensor(head.tensors["qa_outputs.weight"], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(head.tensors["qa_outputs.bias"], dtype=torch.float64, requires_grad=True)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(dropout_mask(9, 4, 0, B * T * C, 0.2).reshape(B, T, C))
    h = xt * mask / 0.8
    z = h @ W.T + bias                       # (B, T, 2)
    off = torch.tensor(valid == 0)
    s = z[..., 0].masked_fill(off, float("-inf"))
    e = z[..., 1].masked_fill(off, float("-inf"))
    ref = (torch.nn.functional.cross_entropy(s, torch.tensor(starts)) +
           torch.nn.functional.cross_entropy(e, torch.tensor(ends))) / 2
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-5 * ref.item()
    assert rel(logits[0], z[..., 0].detach()) <= 1e-5 and rel(logits[1], z[..., 1].detach()) <= 1e-5
    assert rel(grads[:2 * C].reshape(2, C), W.grad) <= 1e-5
    # the bias gradient is exactly 0 in theory (softmax over positions is shift-invariant)
    assert np.abs(grads[2 * C:]).max() <= 1e-6 and np.abs(bias.grad.numpy()).max() <= 1e-12
    assert rel(dx, xt.grad) <= 1e-5


def test_head_bad_input():
    head = ClassificationHead(8, 3)
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(fasttran.InputError, match=r"label 3 at position 2 is outside \[0, 3\)"):
        head.step(x, np.array([0, 1, 3, 2]))
    with pytest.raises(fasttran.InputError, match="labels has 2 entries but there are 4 examples"):
        head.step(x, np.array([0, 1]))
    with pytest.raises(fasttran.InputError, match=r"\(rows, 8\), got shape \(4, 7\)"):
        head.step(np.zeros((4, 7), np.float32))
    with pytest.raises(fasttran.InputTypeError, match="float32"):
        head.step(np.zeros((4, 8)))
    with pytest.raises(fasttran.InputTypeError, match="integer class ids, got float64"):
        head.step(x, np.array([0.0, 1, 1, 2]))
    with pytest.raises(fasttran.InputError, match="num_labels"):
        ClassificationHead(8, 1)
    with pytest.raises(fasttran.InputError, match="dropout"):
        ClassificationHead(8, 2, dropout=1.0)
    qa = QAHead(8)
    valid = np.ones((2, 5), np.float32)
    valid[:, :2] = 0
    with pytest.raises(fasttran.InputRangeError, match="start position 1 of the batch is 0, which is not a context"):
        qa.step(np.zeros((2, 5, 8), np.float32), valid, np.array([[3, 0], [4, 4]]))
    with pytest.raises(fasttran.InputRangeError, match="end position 0 of the batch is 5, outside"):
        qa.step(np.zeros((2, 5, 8), np.float32), valid, np.array([[3, 3], [5, 4]]))
