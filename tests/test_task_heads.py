"""The task heads beyond single-label classification -- regression, multi-label, token
classification, and sequence heads pooling token rows themselves -- in C against torch autograd in
float64 on the same weights, inputs and dropout masks (relative error <= 1e-5), and the training
model (fasttran.model.Model) against the same pieces run one by one."""
import numpy as np
import pytest

import fasttran
from fasttran.heads import ClassificationHead, MultiLabelHead, RegressionHead, TokenClassificationHead

from test_heads import assert_matches_autograd, dropout_mask, rel

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _t(a, grad=False):
    return torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=grad)


def _drop(h, seed, step, site, p, base=0):
    if not p:
        return h
    n = h.numel()
    m = dropout_mask(seed, step, site, base + n, p)[base:]
    return h * torch.tensor(m.reshape(h.shape)) / (1.0 - p)


def _sequence_reference(head, x, lengths, seed, step):
    """logits of a sequence head over packed rows x, pooled per example, in torch float64"""
    P = {k: _t(v, True) for k, v in head.tensors.items()}
    xt = _t(x, True)
    ends = np.cumsum(lengths)
    rows = [xt[e - n:e] for n, e in zip(lengths, ends)]
    pooled = torch.stack([r[0] if head.pooling == "cls" else r.mean(0) for r in rows])
    B, C = pooled.shape
    # the input drops, but not before BERT's pooler (transformers' BertForSequenceClassification)
    h = pooled if head.pooler and not head.shape.input_dropout else _drop(pooled, seed, step, 0, head.dropout)
    if head.pooler:
        h = torch.tanh(h @ P["pooler.dense.weight"].T + P["pooler.dense.bias"])
        h = _drop(h, seed, step, 1, head.dropout)
    return P, xt, h @ P["classifier.weight"].T + P["classifier.bias"]


def _check(head, x, lengths, targets, ref_loss_fn, seed=11, step=5):
    grads = np.zeros_like(head.params)
    dx = np.zeros_like(x)
    logits, loss = head.step(x, targets, grads=grads, dx=dx, training=True, seed=seed, step=step, lengths=lengths)
    P, xt, z = _sequence_reference(head, x, lengths, seed, step)
    assert_matches_autograd(head, loss, logits, grads, dx, ref_loss_fn(z), z, P, xt)


@pytest.mark.parametrize("pooler", [False, True])
@pytest.mark.parametrize("K", [1, 3])
def test_regression_head_matches_autograd(pooler, K):
    rng = np.random.default_rng(K)
    B, C = 11, 20
    head = RegressionHead(C, K, pooler=pooler, dropout=0.2, init_std=0.3)
    x = rng.standard_normal((B, C)).astype(np.float32)
    y = (rng.random((B, K)) * 5).astype(np.float32)
    _check(head, x, np.ones(B, np.int32), y if K > 1 else y[:, 0], lambda z: F.mse_loss(z, _t(y)))


@pytest.mark.parametrize("pooler", [False, True])
def test_multilabel_head_matches_autograd(pooler):
    rng = np.random.default_rng(3)
    B, C, K = 9, 16, 5
    head = MultiLabelHead(C, K, pooler=pooler, dropout=0.1, init_std=0.5)
    x = rng.standard_normal((B, C)).astype(np.float32) * 3
    y = (rng.random((B, K)) > 0.6).astype(np.float32)
    _check(head, x, np.ones(B, np.int32), y, lambda z: F.binary_cross_entropy_with_logits(z, _t(y)))
    # one list of label ids per example means the same targets
    ids = [list(np.flatnonzero(r)) for r in y]
    assert np.array_equal(head.check_targets(ids, B), y)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("pooler", [False, True])
def test_sequence_heads_pool_token_rows_and_return_their_gradient(pooling, pooler):
    """x is every token's state (the top layers' output): the head pools in C and its dx goes back
    to every row (mean: an equal share; CLS: the first row only)."""
    rng = np.random.default_rng(4)
    lengths = np.array([3, 1, 7, 2], np.int32)
    C, K = 12, 3
    head = ClassificationHead(C, K, pooler=pooler, dropout=0.25, init_std=0.3, pooling=pooling)
    x = rng.standard_normal((int(lengths.sum()), C)).astype(np.float32)
    y = np.array([0, 2, 1, 2])
    _check(head, x, lengths, y, lambda z: F.cross_entropy(z, torch.tensor(y)))


def test_token_head_matches_autograd_and_ignores_unlabelled_rows():
    rng = np.random.default_rng(5)
    N, C, K = 23, 16, 9
    head = TokenClassificationHead(C, K, dropout=0.2, init_std=0.3)
    x = rng.standard_normal((N, C)).astype(np.float32)
    y = rng.integers(0, K, N).astype(np.int32)
    y[::4] = -1                                   # special tokens, later sub-tokens: no label
    lengths = np.array([10, 13], np.int32)
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    logits2 = np.empty(N * K, np.float32)
    # the loss is the mean over the labelled rows (the head's denominator)
    loss = fasttran._C.head_step(head._cfg, head.params, x, lengths, y, None, logits2, grads, dx, True, 8, 2,
                                 scale=1.0 / head.denominator(y))
    W, b = _t(head.tensors["classifier.weight"], True), _t(head.tensors["classifier.bias"], True)
    xt = _t(x, True)
    z = _drop(xt, 8, 2, 0, 0.2) @ W.T + b
    ref = F.cross_entropy(z, torch.tensor(y, dtype=torch.long), ignore_index=-1)
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-5 * ref.item()
    assert rel(logits2.reshape(N, K), z.detach()) <= 1e-5
    assert rel(head.views(grads)["classifier.weight"], W.grad) <= 1e-5
    assert rel(head.views(grads)["classifier.bias"], b.grad) <= 1e-5
    assert rel(dx, xt.grad) <= 1e-5


def test_a_slice_of_a_batch_draws_the_whole_batchs_dropout_masks():
    """The model places a slice of a global batch by (rows, examples) before it: its masks are the
    whole batch's, so slices' gradients sum to the whole batch's (data-parallel training)."""
    from fasttran.model import Model
    rng = np.random.default_rng(6)
    C, K = 16, 4
    lengths = np.array([3, 5, 2, 6, 1], np.int32)
    x = rng.standard_normal((int(lengths.sum()), C)).astype(np.float32)
    y = np.array([1, 0, 3, 2, 1], np.int32)
    for head in (ClassificationHead(C, K, pooler=True, dropout=0.3, init_std=0.3),
                 TokenClassificationHead(C, K, dropout=0.3, init_std=0.3)):
        t = y if head.task == "classification" else rng.integers(-1, K, len(x)).astype(np.int32)
        den = head.denominator(t)
        whole = Model(head)
        loss, _ = whole.step(x, lengths, t, denominator=den, seed=3, step=9)
        g_whole = np.asarray(whole.grads).copy()
        part = Model(head)
        total, gsum = 0.0, np.zeros_like(g_whole)
        for a, e in ((0, 2), (2, 5)):
            r0, r1 = int(lengths[:a].sum()), int(lengths[:e].sum())
            ts = t[a:e] if head.task == "classification" else t[r0:r1]
            l, _ = part.step(np.ascontiguousarray(x[r0:r1]), lengths[a:e], ts, denominator=den, seed=3, step=9,
                             place=(r0, a, int((lengths[:a].astype(np.int64) ** 2).sum())))
            total += l
            gsum += np.asarray(part.grads)
        assert abs(total - loss) <= 1e-6 * abs(loss)
        assert rel(gsum, g_whole) <= 1e-6, head.task


def test_model_step_equals_its_pieces_run_one_by_one(enc):
    """Model.step over the top layers and a head is the layers' forward, the head's step with dx and
    the layers' backward, bit for bit; its buckets come head first, then the layers top down."""
    from fasttran.finetune import TopLayers
    from fasttran.model import Model
    ids, mask, types = enc.tokenize(["a gripping film", "a dull and slow film", "fine"])
    x = enc.forward(ids, mask, types, output_layers=4)
    lengths = mask.sum(1).astype(np.int32)
    rows = np.ascontiguousarray(np.concatenate([x[b, :n] for b, n in enumerate(lengths)]))
    head = ClassificationHead(enc.hidden_size, 2, dropout=0.1, seed=2)
    y = np.array([1, 0, 1], np.int32)
    top = TopLayers(enc, 2, extra=head.num_parameters)
    model = Model(head, top)
    seen = []
    loss, logits = model.step(rows, lengths, y, seed=4, step=1, ready=seen.append)
    assert seen == [0, 1, 2]
    assert [n for n, _ in model.buckets()] == ["head", "layer 5", "layer 4"]
    g_model = np.asarray(model.grads).copy()
    # the same, one piece at a time, on a second stack with the same weights
    top2 = TopLayers(enc, 2)
    out = top2.forward(rows, lengths, training=True, seed=4, step=1)
    hg = np.zeros_like(head.params)
    dout = np.zeros_like(out)
    lg2, loss2 = head.step(out, y, grads=hg, dx=dout, training=True, seed=4, step=1, lengths=lengths)
    top2.backward(dout)
    assert loss == loss2 and np.array_equal(logits.reshape(3, 2), lg2)
    assert np.array_equal(g_model[:top.num_params], np.asarray(top2.grads))
    assert np.array_equal(g_model[top.num_params:], hg)
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["classifier.weight", "classifier.bias"] and names[0].startswith("encoder.layer.4.")


def test_bad_targets_are_refused():
    C = 8
    with pytest.raises(fasttran.InputTypeError, match="for scores use Trainer\\('regression'\\)"):
        ClassificationHead(C, 2).check_targets(np.array([0.5, 1.0]), 2)
    with pytest.raises(fasttran.InputTypeError, match="regression targets must be numbers"):
        RegressionHead(C).check_targets(np.array(["1.0", "x"]), 2)
    with pytest.raises(fasttran.InputError, match="not a finite number"):
        RegressionHead(C).check_targets(np.array([1.0, np.nan]), 2)
    with pytest.raises(fasttran.InputError, match=r"shape \(2, 3\)"):
        MultiLabelHead(C, 3).check_targets(np.zeros((2, 2)), 2)
    with pytest.raises(fasttran.InputError, match=r"each must lie in \[0, 1\]"):
        MultiLabelHead(C, 2).check_targets(np.array([[0, 2.0], [1, 0]]), 2)
    tok = TokenClassificationHead(C, 3)
    with pytest.raises(fasttran.InputError, match="not aligned"):
        tok.check_targets(np.array([[0, 1, 2, -100], [1, 1, 1, 1]]), np.array([4, 2]))
    with pytest.raises(fasttran.InputError, match="aligned to the tokens"):
        tok.check_targets([np.array([0, 1])], np.array([4]))
    with pytest.raises(fasttran.InputError, match=r"outside \[0, 3\) and not -100"):
        tok.check_targets(np.array([[0, 5]]), np.array([2]))


def test_what_a_user_gets_wrong_is_refused_before_anything_is_written(enc, tmp_path):
    """Through the Trainer as a user meets them: each refused with a message naming it, before a
    step runs or a checkpoint is written."""
    from fasttran import ActivationCache, Trainer
    texts = ["a fine film", "dull", "the plot holds", "what a mess", "gripping", "slow and long"]
    cache = ActivationCache.build(enc, *enc.tokenize(texts), positions="mean", show_progress=False)
    ck = tmp_path / "ck"

    def refused(exc, match, task, targets, eval=None, **kw):
        tr = Trainer(task, epochs=1, show_progress=False, **kw)
        with pytest.raises(exc, match=match):
            tr.fit(cache, targets, eval=eval, checkpoint_dir=str(ck))
        assert tr.global_step == 0 and not ck.exists()

    refused(fasttran.InputTypeError, "for scores use Trainer", "classification", [0.5, 1.5, 2.0, 0.1, 3.2, 1.0])
    refused(fasttran.InputTypeError, "regression targets must be numbers", "regression", ["a", "b", "c", "d", "e", "f"])
    refused(fasttran.InputError, "a label the training data never had", "classification", [0, 1, 0, 1, 0, 1],
            eval=(cache, [0, 1, 2, 1, 0, 1]))
    words = [t.split() for t in texts]
    tok = enc.tokenize_words(words)
    tcache = ActivationCache.build(enc, *tuple(tok)[:3], positions="all", show_progress=False)
    bad = np.full(tok.input_ids.shape, -100)
    bad[:, 1] = 1
    bad[1, -1] = 2   # a label on a padding position of "dull": not aligned to its tokens
    tr = Trainer("token-classification", epochs=1, show_progress=False)
    with pytest.raises(fasttran.InputError, match="not aligned to its tokens"):
        tr.fit(tcache, bad, checkpoint_dir=str(ck))
    assert not ck.exists()
    with pytest.raises(fasttran.InputError, match="positions='all'"):
        Trainer("token-classification", show_progress=False).fit(cache, bad)
    with pytest.raises(fasttran.InputError, match="texts has 6 entries but text_pairs has 2"):
        enc.tokenize(texts, texts[:2])
