"""The dense layer before a head's classifier in each architecture's shape (fasttran.heads.DenseShape,
csrc/train/head_dense.c): tanh (BERT's pooler), ReLU (DistilBERT's pre_classifier), exact GELU
(ELECTRA's classification head), and ModernBERT's prediction head (dense without bias + GELU +
LayerNorm without bias), pooled or on every token -- forward, loss and every gradient in C against
torch autograd in float64 on the same weights, inputs and dropout masks (relative error <= 1e-5);
on CUDA (or its emulator) the Trainer equals the CPU one."""
import numpy as np
import pytest

import fasttran
from fasttran import _C
from fasttran.heads import (ClassificationHead, DenseShape, QAHead, RegressionHead, TokenClassificationHead,
                            make_head)
from fasttran.heads.choice import MultipleChoiceHead

from test_heads import assert_matches_autograd, rel
from test_task_heads import _drop, _t

torch = pytest.importorskip("torch")
F = torch.nn.functional

SHAPES = {
    "bert": DenseShape(),
    "distilbert": DenseShape(act="relu"),
    "electra": DenseShape(act="gelu", input_dropout=True),
    "roberta": DenseShape(input_dropout=True),
    "modernbert": DenseShape(act="gelu", bias=False, norm="layernorm", norm_eps=1e-5),
    "tanh+ln": DenseShape(act="tanh", norm="layernorm+bias", norm_eps=1e-3),
    "relu+ln, no bias": DenseShape(act="relu", bias=False, norm="layernorm", norm_eps=1e-2, input_dropout=True),
}
ACTS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu}


def randomize(head, rng):
    """every tensor random (LayerNorm weights around 1, biases non-zero): each gradient is exercised"""
    state = {}
    for name, t in head.tensors.items():
        v = rng.normal(0.0, 0.3, t.shape)
        state[name] = (1.0 + v if name.endswith("norm.weight") else v).astype(np.float32)
    head.load_state_dict(state)


def _in_drop(head, h, seed, step):
    """the dense layer's input: dropped (site 0) only where the shape says (RoBERTa's, ELECTRA's heads)"""
    return _drop(h, seed, step, 0, head.dropout) if head.shape.input_dropout else h


def dense_ref(P, h, shape, seed, step, p):
    """the shape's dense layer in torch float64 (then the hidden dropout, site 1)"""
    z = h @ P["pooler.dense.weight"].T
    if shape.bias:
        z = z + P["pooler.dense.bias"]
    z = ACTS[shape.act](z)
    if shape.norm:
        z = F.layer_norm(z, (z.shape[1],), P["pooler.norm.weight"], P.get("pooler.norm.bias"), shape.norm_eps)
    return _drop(z, seed, step, 1, p)


def pooled_ref(head, x, lengths, seed, step):
    P = {k: _t(v, True) for k, v in head.tensors.items()}
    xt = _t(x, True)
    ends = np.cumsum(lengths)
    pooled = torch.stack([xt[e - n] if head.pooling == "cls" else xt[e - n:e].mean(0) for n, e in zip(lengths, ends)])
    h = dense_ref(P, _in_drop(head, pooled, seed, step), head.shape, seed, step, head.dropout)
    return P, xt, h @ P["classifier.weight"].T + P["classifier.bias"]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("pooling,dropout", [("cls", 0.0), ("mean", 0.3)])
def test_sequence_head_dense_shapes_match_autograd(shape, pooling, dropout):
    rng = np.random.default_rng(1)
    C, K = 16, 3
    head = ClassificationHead(C, K, pooler=True, dropout=dropout, pooling=pooling, shape=SHAPES[shape])
    randomize(head, rng)
    names = ["pooler.dense.weight"] + ["pooler.dense.bias"] * SHAPES[shape].bias + \
        ["pooler.norm.weight"] * (SHAPES[shape].norm is not None) + ["pooler.norm.bias"] * (SHAPES[shape].norm ==
                                                                                         "layernorm+bias")
    assert list(head.tensors) == names + ["classifier.weight", "classifier.bias"]
    lengths = np.array([3, 1, 5, 2, 4], np.int32)
    x = rng.standard_normal((int(lengths.sum()), C)).astype(np.float32)
    y = np.array([0, 2, 1, 1, 0])
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    logits, loss = head.step(x, y, grads=grads, dx=dx, training=True, seed=7, step=3, lengths=lengths)
    P, xt, z = pooled_ref(head, x, lengths, 7, 3)
    assert_matches_autograd(head, loss, logits, grads, dx, F.cross_entropy(z, torch.tensor(y)), z, P, xt)


@pytest.mark.parametrize("shape", ["distilbert", "modernbert"])
def test_regression_head_dense_shape_matches_autograd(shape):
    rng = np.random.default_rng(2)
    head = RegressionHead(12, 2, pooler=True, dropout=0.2, pooling="cls", shape=SHAPES[shape])
    randomize(head, rng)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    y = rng.standard_normal((6, 2)).astype(np.float32)
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    logits, loss = head.step(x, y, grads=grads, dx=dx, training=True, seed=3, step=1)
    P, xt, z = pooled_ref(head, x, np.ones(6, np.int32), 3, 1)
    assert_matches_autograd(head, loss, logits, grads, dx, F.mse_loss(z, _t(y)), z, P, xt)


@pytest.mark.parametrize("shape", ["bert", "distilbert", "electra", "modernbert"])
def test_multiple_choice_dense_shapes_match_autograd(shape):
    rng = np.random.default_rng(3)
    C, G = 12, 3
    head = MultipleChoiceHead(C, G, dropout=0.25, shape=SHAPES[shape])
    randomize(head, rng)
    lengths = np.array([2, 4, 1, 3, 3, 2], np.int32)   # 2 questions of 3 choices
    x = rng.standard_normal((int(lengths.sum()), C)).astype(np.float32)
    y = np.array([2, 0])
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    scores, loss = head.step(x, y, grads=grads, dx=dx, training=True, seed=5, step=2, lengths=lengths)
    P, xt, z = pooled_ref(head, x, lengths, 5, 2)
    z = z.reshape(-1, G)
    ref = F.cross_entropy(z, torch.tensor(y))
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel(scores, z.detach()) <= 1e-5
    for name, g in head.views(grads).items():
        if name == "classifier.bias":   # zero up to rounding: a softmax over the choices
            assert abs(g).max() <= 1e-6
            continue
        assert rel(g, P[name].grad) <= 1e-5, name
    assert rel(dx, xt.grad) <= 1e-5


def per_token_ref(head, x, seed, step, out_name):
    P = {k: _t(v, True) for k, v in head.tensors.items()}
    xt = _t(x, True)
    h = dense_ref(P, _in_drop(head, xt, seed, step), head.shape, seed, step, head.dropout)
    return P, xt, h @ P[out_name + ".weight"].T + P[out_name + ".bias"]


@pytest.mark.parametrize("shape", ["modernbert", "electra", "tanh+ln"])
def test_token_head_with_a_dense_layer_on_every_token_matches_autograd(shape):
    rng = np.random.default_rng(4)
    N, C, K = 19, 16, 5
    head = TokenClassificationHead(C, K, dropout=0.2, shape=SHAPES[shape])
    assert head.shape.per_token and head.dense
    randomize(head, rng)
    x = rng.standard_normal((N, C)).astype(np.float32)
    y = rng.integers(0, K, N).astype(np.int32)
    y[::3] = -1
    lengths = np.array([8, 11], np.int32)
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    logits = np.empty(N * K, np.float32)
    loss = _C.head_step(head._cfg, head.params, x, lengths, y, None, logits, grads, dx, True, 8, 2,
                        scale=1.0 / head.denominator(y))
    P, xt, z = per_token_ref(head, x, 8, 2, "classifier")
    ref = F.cross_entropy(z, torch.tensor(y, dtype=torch.long), ignore_index=-1)
    assert_matches_autograd(head, loss, logits.reshape(N, K), grads, dx, ref, z, P, xt)


@pytest.mark.parametrize("shape", ["modernbert", "distilbert"])
def test_qa_head_with_a_dense_layer_on_every_token_matches_autograd(shape):
    rng = np.random.default_rng(5)
    B, T, C = 3, 7, 12
    head = QAHead(C, dropout=0.1, shape=SHAPES[shape])
    randomize(head, rng)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    valid = np.ones((B, T), np.float32)
    valid[:, :2] = 0   # the question
    y = np.array([[2, 3, 4], [5, 3, 6]])
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    logits, loss = head.step(x, valid, y, grads=grads, dx=dx, training=True, seed=4, step=9)
    P, xt, z = per_token_ref(head, x.reshape(B * T, C), 4, 9, "qa_outputs")
    z = z.T.reshape(2, B, T)
    zm = z.masked_fill(torch.tensor(valid == 0)[None], float("-inf"))
    ref = (F.cross_entropy(zm[0], torch.tensor(y[0])) + F.cross_entropy(zm[1], torch.tensor(y[1]))) / 2
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel(logits, z.detach()) <= 1e-5
    for name, g in head.views(grads).items():
        if name == "qa_outputs.bias":   # zero up to rounding: a softmax over each sequence's rows
            assert abs(g).max() <= 1e-6
            continue
        assert rel(g, P[name].grad) <= 1e-5, name
    assert rel(dx.reshape(B * T, C), xt.grad) <= 1e-5


def test_berts_shape_is_the_pooler_head_bit_for_bit():
    """the default shape runs the ops the pooler head always ran: the same bits"""
    rng = np.random.default_rng(6)
    a = ClassificationHead(16, 3, pooler=True, dropout=0.2, seed=4)
    b = ClassificationHead(16, 3, pooler=True, dropout=0.2, seed=4, shape=DenseShape())
    assert a._cfg == b._cfg and "shape" not in a.config()
    x = rng.standard_normal((9, 16)).astype(np.float32)
    ga, gb = np.zeros_like(a.params), np.zeros_like(b.params)
    la, _ = a.step(x, np.arange(9) % 3, grads=ga, training=True, seed=1, step=1)
    lb, _ = b.step(x, np.arange(9) % 3, grads=gb, training=True, seed=1, step=1)
    assert np.array_equal(la, lb) and np.array_equal(ga, gb)


def test_shapes_round_trip_through_the_config():
    for shape in SHAPES.values():
        head = ClassificationHead(8, 2, pooler=True, shape=shape)
        back = fasttran.heads.Head.from_config(head.config())
        assert back.shape == shape and back._cfg == head._cfg
    tok = TokenClassificationHead(8, 3, shape=SHAPES["modernbert"])
    assert fasttran.heads.Head.from_config(tok.config())._cfg == tok._cfg
    assert ClassificationHead(8, 2, pooler=True, shape=SHAPES["modernbert"]).tensors["pooler.norm.weight"].min() == 1.0


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(fasttran.InputError, match="activation must be one of .*'silu'"):
        DenseShape(act="silu")
    with pytest.raises(fasttran.InputError, match="norm must be one of"):
        DenseShape(norm="rmsnorm")
    with pytest.raises(fasttran.InputError, match="norm_eps"):
        DenseShape(norm="layernorm", norm_eps=0)
    with pytest.raises(fasttran.InputError, match="pass pooler=True"):
        ClassificationHead(8, 2, pooler=False, shape=SHAPES["electra"])
    with pytest.raises(fasttran.InputError, match="pooler=True"):
        make_head("classification", 8, num_labels=2, shape=SHAPES["electra"])
    with pytest.raises(fasttran.InputError, match="unknown dense-shape fields"):
        ClassificationHead(8, 2, pooler=True, shape={"activation": "gelu"})
    with pytest.raises(fasttran.InputError, match="input_dropout are True or False"):
        DenseShape(input_dropout=1)
    with pytest.raises(fasttran.InputError, match="dense activation"):   # the C check, at the boundary
        _C.head_tensors((1, 8, 2, 0.1, 0, 1, 7, 0, 0, 0.0, 0))
    with pytest.raises(fasttran.InputError, match="dense_input_dropout must be 0 or 1"):
        _C.head_tensors((1, 8, 2, 0.1, 0, 1, 0, 0, 0, 0.0, 0, 2))


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    from conftest import make_checkpoint
    from test_random_models import AWKWARD, batch
    enc = fasttran.Encoder.from_pretrained(make_checkpoint(str(tmp_path_factory.mktemp("m") / "m"), **AWKWARD))
    ids, mask, types = batch(np.random.default_rng(0), 24, 13, pad_frac=0.5)
    return fasttran.ActivationCache.build(enc, ids, mask, types, positions="all", batch_size=8, show_progress=False)


@pytest.mark.skipif(not fasttran.cuda_available(), reason="no usable CUDA device (nor the emulator)")
@pytest.mark.parametrize("task,shape", [("classification", "modernbert"), ("classification", "distilbert"),
                                        ("multiple-choice", "electra"), ("token-classification", "modernbert"),
                                        ("qa", "modernbert")])
def test_cuda_trainer_with_a_shaped_head_matches_the_cpu(features, task, shape):
    """the shapes' ops on the CUDA backend: a head trained there equals the CPU-trained one within fp32
    rounding, loss by loss"""
    from test_cuda_training import close, qa_targets
    cache = features
    rng = np.random.default_rng(8)
    C = cache.hidden
    if task == "qa":
        y = qa_targets(cache, rng)
        make = lambda: QAHead(C, dropout=0.1, shape=SHAPES[shape])   # noqa: E731
    elif task == "token-classification":
        y = [rng.integers(0, 3, n) for n in cache.lengths]
        make = lambda: TokenClassificationHead(C, 3, dropout=0.1, shape=SHAPES[shape])   # noqa: E731
    elif task == "multiple-choice":
        y = rng.integers(0, 2, len(cache) // 2)
        make = lambda: MultipleChoiceHead(C, 2, dropout=0.1, shape=SHAPES[shape])   # noqa: E731
    else:
        y = rng.integers(0, 3, len(cache))
        make = lambda: ClassificationHead(C, 3, pooler=True, dropout=0.1, pooling="mean", shape=SHAPES[shape])  # noqa
    kw = dict(epochs=2, batch_size=6, show_progress=False, lr=0.01, optimizer="adamw")
    cpu = fasttran.Trainer(make(), **kw)
    cpu.fit(cache, y)
    gpu = fasttran.Trainer(make(), device="cuda", **kw)
    gpu.fit(cache, y)
    for (s1, l1), (s2, l2) in zip(gpu.loss_curve, cpu.loss_curve):
        assert s1 == s2 and abs(l1 - l2) <= 1e-4 * max(1.0, abs(l2))
    for name, t in gpu.head.tensors.items():
        if name in ("classifier.bias", "qa_outputs.bias") and task in ("multiple-choice", "qa"):
            continue   # zero gradients up to rounding: Adam follows each backend's noise
        assert close(t, cpu.head.tensors[name]), (name, np.abs(t - cpu.head.tensors[name]).max())
