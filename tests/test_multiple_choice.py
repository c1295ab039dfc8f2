"""The multiple-choice head (fasttran.heads.MultipleChoiceHead, csrc/train/head_choice.c): its step
against torch autograd in float64 (pooled rows and token rows, dropout), training from the cache on
real sentences with each question's choices kept together, top-layer training, export to
transformers' AutoModelForMultipleChoice within 1e-4, and the mistakes it refuses."""
import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.errors import InputError, UnsupportedError
from fasttran.heads import HEADS, TASKS

from conftest import sst2_file
from test_heads import dropout_mask, rel

torch = pytest.importorskip("torch")
F = torch.nn.functional
MC = HEADS["MultipleChoiceHead"]


def _t(a, grad=False):
    return torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=grad)


def _drop(h, seed, step, site, p):
    if not p:
        return h
    m = dropout_mask(seed, step, site, h.numel(), p)
    return h * torch.tensor(m.reshape(h.shape)) / (1.0 - p)


def _reference(head, x, lengths, y, seed, step):
    """BertForMultipleChoice's head in torch float64: pooler on each choice's first row, one score
    per choice, softmax cross-entropy over each question's choices"""
    P = {k: _t(v, True) for k, v in head.tensors.items()}
    xt = _t(x, True)
    ends = np.cumsum(lengths)
    pooled = torch.stack([xt[e - n] for n, e in zip(lengths, ends)])
    h = _drop(pooled, seed, step, 0, head.dropout) if head.shape.input_dropout else pooled
    h = torch.tanh(h @ P["pooler.dense.weight"].T + P["pooler.dense.bias"])
    h = _drop(h, seed, step, 1, head.dropout)
    z = (h @ P["classifier.weight"].T + P["classifier.bias"]).reshape(-1, head.num_choices)
    return P, xt, z, F.cross_entropy(z, torch.as_tensor(y, dtype=torch.long))


def test_registered_by_its_own_file():
    assert TASKS["multiple-choice"][0] is MC and fasttran._C.HEAD_KINDS["choice"][0] == 4
    head = MC(16, 4)
    assert [n for n, _ in head.named_parameters()] == ["pooler.dense.weight", "pooler.dense.bias", "classifier.weight",
                                                      "classifier.bias"]
    assert head.tensors["classifier.weight"].shape == (1, 16) and head.group_size == 4
    assert "MultipleChoiceHead(kind='choice'" in repr(head)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("rows", [False, True])
def test_step_matches_autograd(dropout, rows):
    rng = np.random.default_rng(3)
    G, Q, C = 3, 5, 12
    head = MC(C, G, dropout=dropout, init_std=0.3)
    lengths = rng.integers(1, 5, Q * G).astype(np.int32) if rows else np.ones(Q * G, np.int32)
    x = rng.standard_normal((int(lengths.sum()), C)).astype(np.float32)
    y = rng.integers(0, G, Q)
    grads, dx = np.zeros_like(head.params), np.zeros_like(x)
    scores, loss = head.step(x, y, grads=grads, dx=dx, training=True, seed=7, step=2, lengths=lengths)
    assert scores.shape == (Q, G)
    P, xt, z, ref = _reference(head, x, lengths, y, 7, 2)
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel(scores, z.detach()) <= 1e-5
    for name, g in head.views(grads).items():
        if name == "classifier.bias":   # a softmax over a question's choices ignores a shared offset: 0
            assert abs(float(g[0])) <= 1e-6 and abs(float(P[name].grad[0])) <= 1e-12
        else:
            assert rel(g, P[name].grad) <= 1e-5, name
    assert rel(dx, xt.grad) <= 1e-5


def test_refuses_what_is_not_whole_questions():
    head = MC(8, 4)
    x = np.zeros((6, 8), np.float32)
    with pytest.raises(InputError, match="whole questions"):
        head.step(x, [0])
    with pytest.raises(InputError, match="outside"):
        head.step(np.zeros((4, 8), np.float32), [4])
    with pytest.raises(InputError, match="num_choices"):
        MC(8, 1)


@pytest.fixture(scope="module")
def choices(enc):
    """A question with 4 real SST-2 sentences as choices, one positive: the answer"""
    from fasttran.data import load_sst2
    s, y = load_sst2(sst2_file("train"))
    s, y = list(s[:600]), np.asarray(y[:600])
    pos, neg = [t for t, l in zip(s, y) if l == 1], [t for t, l in zip(s, y) if l == 0]
    rng = np.random.default_rng(0)
    G, Q = 4, 64
    firsts, seconds, answers = [], [], []
    for q in range(Q):
        k = int(rng.integers(0, G))
        opts = [str(neg[int(rng.integers(0, len(neg)))]) for _ in range(G)]
        opts[k] = str(pos[int(rng.integers(0, len(pos)))])
        firsts += ["Which review is positive?"] * G
        seconds += opts
        answers.append(k)
    return enc.tokenize(firsts, seconds), np.array(answers), G


def test_trains_from_the_cache_with_questions_kept_together(enc, choices):
    inputs, answers, G = choices
    cache = ActivationCache.build(enc, *inputs, positions="cls", show_progress=False)
    tr = Trainer("multiple-choice", epochs=6, batch_size=8, show_progress=False)
    hist = tr.fit(cache, answers)
    assert isinstance(tr.head, MC) and tr.head.num_choices == G
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    res = tr.evaluate(cache, answers)
    assert res["accuracy"] > 0.6   # chance is 0.25
    assert tr.predict(cache).shape == (len(answers),)
    # a question's choices in one batch: shuffling moves questions, never splits them
    order = cache.epoch_order(3, group=G).reshape(-1, G)
    assert np.array_equal(order - order[:, :1], np.tile(np.arange(G), (len(order), 1)))
    assert not np.array_equal(order[:, 0], np.arange(0, len(cache), G))
    with pytest.raises(UnsupportedError, match="one process"):
        cache.batches(8, group=G, rank=0, world_size=2)
    with pytest.raises(InputError, match="not whole groups"):
        ActivationCache.build(enc, *(a[:5] for a in inputs), positions="cls", show_progress=False).epoch_order(
            0, group=G)


@pytest.mark.parametrize("k", [0, 1])
def test_exports_to_automodel_for_multiple_choice(enc, choices, tmp_path, k):
    transformers = pytest.importorskip("transformers")
    inputs, answers, G = choices
    inputs, answers = tuple(a[:16 * G] for a in inputs), answers[:16]
    tr = Trainer("multiple-choice", epochs=1, batch_size=4, show_progress=False, train_layers=k, pooling="cls")
    cache = tr.cache_for(enc, *inputs, show_progress=False) if k else ActivationCache.build(
        enc, *inputs, positions="cls", show_progress=False)
    tr.fit(cache, answers)
    tr.export(tmp_path / "m")
    ours = tr._outputs(cache)
    m = transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path / "m").eval()
    assert type(m).__name__ == "BertForMultipleChoice"
    ids, mask, types = (torch.as_tensor(np.asarray(a)).reshape(len(answers), G, -1) for a in inputs)
    with torch.no_grad():
        theirs = m(input_ids=ids, attention_mask=mask, token_type_ids=types).logits.numpy()
    assert ours.shape == theirs.shape == (16, G)
    assert float(np.abs(ours.astype(np.float64) - theirs).max()) <= 1e-4
    # the checkpoint's head comes back as what it was
    tr.save(tmp_path / "ckpt")
    back = Trainer.load(tmp_path / "ckpt")
    assert isinstance(back.head, MC) and back.head.num_choices == G
