"""Compression: forward masks against zeroed-weight references in transformers, pruned
models against masked ones, sign-matching attention against a NumPy model of the paper's rule,
first-order significance against torch autograd, the pruned layers' training against the unpruned
stack, files (round trip, damage, transformers' layout) and every refusal."""
import json
import os

import numpy as np
import pytest

import fasttran
from conftest import hf_hidden_states, make_checkpoint
from fasttran import _C, compress
from fasttran.errors import CheckpointError, InputError, UnsupportedError
from fasttran.heads import ClassificationHead

SMALL = dict(vocab_size=99, hidden_size=48, num_attention_heads=4, intermediate_size=64, num_hidden_layers=3,
             type_vocab_size=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("small")), seed=3, **SMALL)


def batch(seed, n=6, T=13, vocab=99):
    from conftest import ragged_ids
    rng = np.random.default_rng(seed)
    ids, mask = ragged_ids(rng, n, T, 1, vocab)
    types = rng.integers(0, 2, (n, T)) * mask
    return ids, mask, types


def hidden(enc, ids, mask, types, **masks):
    """every layer's hidden states under forward masks (the C core's forward)"""
    L = enc.num_layers
    h, _ = enc._core.forward(input_ids=ids, attention_mask=mask, token_type_ids=types, layers=tuple(range(L + 1)),
                             pooling=_C.POOLINGS["none"], want_hidden=True, **masks)
    return h


def zeroed_checkpoint(src, dst, edit):
    """a copy of checkpoint `src` with edit(state dict) applied, for transformers"""
    from safetensors.numpy import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    sd = load_file(os.path.join(src, "model.safetensors"))
    edit(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def assert_real_close(ours, ref, mask, tol=1e-4):
    valid = mask.astype(bool)
    for l, (a, b) in enumerate(zip(ours, ref)):
        err = np.abs(a - b)[valid].max()
        assert err <= tol, f"layer {l}: {err:.2e}"


def head_index(structure, layer, head):
    return sum(structure["layer_heads"][:layer]) + head


@pytest.mark.parametrize("layer,head", [(0, 0), (1, 3), (2, 2)])
def test_masked_head_equals_zeroed_value_weights_in_transformers(small_path, tmp_path, layer, head):
    enc = fasttran.Encoder.from_pretrained(small_path)
    hs = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    keep = np.ones(sum(enc._core.structure["layer_heads"]), np.uint8)
    keep[head_index(enc._core.structure, layer, head)] = 0

    def edit(sd):
        p = f"encoder.layer.{layer}.attention.self.value."
        sd[p + "weight"][head * hs:(head + 1) * hs] = 0
        sd[p + "bias"][head * hs:(head + 1) * hs] = 0
    ref_dir = zeroed_checkpoint(small_path, str(tmp_path / "z"), edit)
    ids, mask, types = batch(layer * 10 + head)
    ours = hidden(enc, ids, mask, types, head_keep=keep)
    assert_real_close(ours, hf_hidden_states(ref_dir, ids, mask, types), mask)
    # and it changes the model from that layer on (the mask did something)
    full = hidden(enc, ids, mask, types)
    assert np.array_equal(ours[layer], full[layer]) and not np.allclose(ours[layer + 1], full[layer + 1])


@pytest.mark.parametrize("layer,group", [(0, 1), (2, 3)])
def test_masked_ffn_group_equals_zeroed_weights_in_transformers(small_path, tmp_path, layer, group):
    enc = fasttran.Encoder.from_pretrained(small_path)
    g = 16
    keep = np.ones(3 * SMALL["intermediate_size"] // g, np.uint8)
    keep[layer * SMALL["intermediate_size"] // g + group] = 0

    def edit(sd):   # the group's columns of the second FFN projection
        sd[f"encoder.layer.{layer}.output.dense.weight"][:, group * g:(group + 1) * g] = 0
    ref_dir = zeroed_checkpoint(small_path, str(tmp_path / "z"), edit)
    ids, mask, types = batch(layer + group)
    ours = hidden(enc, ids, mask, types, ffn_keep=keep, ffn_group=g)
    assert_real_close(ours, hf_hidden_states(ref_dir, ids, mask, types), mask)


def test_skipped_layer_equals_transformers_without_it(small_path, tmp_path):
    from safetensors.numpy import load_file, save_file
    enc = fasttran.Encoder.from_pretrained(small_path)
    sd = load_file(os.path.join(small_path, "model.safetensors"))
    out = {}
    for k, v in sd.items():   # layer 1 removed, layer 2 becomes 1
        if k.startswith("encoder.layer.1."):
            continue
        out[k.replace("encoder.layer.2.", "encoder.layer.1.")] = v
    d = tmp_path / "cut"
    d.mkdir()
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(small_path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    ids, mask, types = batch(7)
    ours = hidden(enc, ids, mask, types, skip_layers=np.array([0, 1, 0], np.uint8))
    ref = hf_hidden_states(str(d), ids, mask, types)
    assert_real_close([ours[0], ours[1], ours[3]], ref, mask)
    assert np.array_equal(ours[1], ours[2])   # a skipped layer passes its input through


def test_real_minilm_masks_equal_zeroed_weights_in_transformers(minilm_dir, tmp_path, sst2_sentences):
    """The acceptance on the real all-MiniLM-L6-v2: one head of layer 3 and one FFN group of layer 4
    switched off, against transformers with those weights zeroed (<= 1e-4 on every layer)."""
    from safetensors.numpy import load_file, save_file
    enc = fasttran.Encoder.from_pretrained(minilm_dir)
    ids, mask, types = enc.tokenize(sst2_sentences[:6])
    keep_h = np.ones(72, np.uint8)
    keep_h[3 * 12 + 7] = 0
    keep_f = np.ones(6 * 16, np.uint8)
    keep_f[4 * 16 + 5] = 0
    ours = hidden(enc, ids, mask, types, head_keep=keep_h, ffn_keep=keep_f, ffn_group=96)
    sd = load_file(os.path.join(minilm_dir, "model.safetensors"))
    sd["encoder.layer.3.attention.self.value.weight"][7 * 32:8 * 32] = 0
    sd["encoder.layer.3.attention.self.value.bias"][7 * 32:8 * 32] = 0
    sd["encoder.layer.4.output.dense.weight"][:, 5 * 96:6 * 96] = 0
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(minilm_dir, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    assert_real_close(ours, hf_hidden_states(str(tmp_path), ids, mask, types), mask)


def task_model(path, labels=2, seed=1):
    return compress.TaskModel(fasttran.Encoder.from_pretrained(path), ClassificationHead(SMALL["hidden_size"], labels,
                                                                                         seed=seed))


def task_data(seed, n=24, labels=2):
    ids, mask, types = batch(seed, n=n)
    return compress.TaskData(ids, mask, types, np.random.default_rng(seed).integers(0, labels, n))


PLAN = {"ffn_group_size": 16, "layers": {"1": "prune",
                                         "0": {"heads": {"1": "prune", "3": "prune"}, "ffn_groups": {"0": "prune"}},
                                         "2": {"heads": {"0": "prune"}, "ffn_groups": {"1": "prune", "3": "prune"}}}}


def test_pruned_model_equals_the_masked_one_and_is_smaller(small_path):
    model = task_model(small_path)
    small = compress.apply(model, PLAN)
    s = small.structure
    assert small.num_layers == 2 and s["layer_heads"] == [2, 3] and s["layer_intermediate"] == [48, 32]
    assert small.size_bytes < model.size_bytes
    q = small.encoder.state_dict()
    assert q["encoder.layer.0.attention.self.query.weight"].shape == (2 * 12, 48)
    assert q["encoder.layer.0.attention.output.dense.weight"].shape == (48, 2 * 12)
    assert q["encoder.layer.1.intermediate.dense.weight"].shape == (32, 48)
    data = task_data(0)
    masked = model.logits(data, **compress.masks(model, PLAN))
    np.testing.assert_allclose(small.logits(data), masked, atol=1e-4, rtol=0)
    ids, mask, types = batch(11)
    hm = hidden(model.encoder, ids, mask, types, **compress.masks(model, PLAN))
    hp = hidden(small.encoder, ids, mask, types)
    assert_real_close([hp[0], hp[1], hp[2]], [hm[0], hm[1], hm[3]], mask)
    # the original's numbering of what was removed
    assert compress.in_original_numbering(small) == {
        "layers_removed": [1], "heads": {0: {1: "prune", 3: "prune"}, 2: {0: "prune"}},
        "ffn_groups_removed": {0: [0], 2: [1, 3]}}


def test_compressed_model_files_round_trip_exactly_and_refuse_damage(small_path, tmp_path):
    small = compress.apply(task_model(small_path), PLAN)
    out = small.save(tmp_path / "m")
    back = compress.TaskModel.load(out)
    data = task_data(1)
    assert np.array_equal(back.logits(data), small.logits(data))
    assert back.structure == small.structure and back.origin == small.origin
    for name, v in small.encoder.state_dict().items():
        assert np.array_equal(back.encoder.state_dict()[name], v), name
    assert not [f for f in os.listdir(out) if ".tmp." in f]   # the atomic writer left nothing behind
    # one changed byte in the weights: refused before the header is read
    with open(os.path.join(out, "model.safetensors"), "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="CRC|crc|checksum"):
        compress.TaskModel.load(out)
    small.save(out)   # saved again over it: whole again
    with open(os.path.join(out, "head.json"), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="head.json"):
        compress.TaskModel.load(out)


def test_export_to_transformers_loads_in_bertmodel_with_equal_outputs(small_path, tmp_path):
    import torch
    from transformers import BertModel
    small = compress.apply(task_model(small_path), PLAN)
    out = compress.export_transformers(small, tmp_path / "hf")
    bert = BertModel.from_pretrained(out).eval()
    assert bert.config.num_hidden_layers == 2 and bert.config.intermediate_size == 64
    ids, mask, types = batch(5)
    with torch.no_grad():
        ref = bert(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   token_type_ids=torch.tensor(types), output_hidden_states=True).hidden_states
    assert_real_close(hidden(small.encoder, ids, mask, types), [h.numpy() for h in ref], mask)
    # sign-matching heads have no transformers form
    sm = compress.apply(small, {"sign_match_keys": 4, "layers": {"0": {"heads": {"0": "sign_match"}}}})
    with pytest.raises(UnsupportedError, match="sign-matching"):
        compress.export_transformers(sm, tmp_path / "hf2")


def sign_match_layer(x, lens, w, NH, keys, modes, eps):
    """NumPy float64 model of one BERT layer whose heads use sign matching per `modes` (1): per query,
    the `keys` keys whose signs agree with the query's in the most dimensions (ties: earlier key)"""
    C = x.shape[1]
    hs = C // NH
    qkv = x @ np.concatenate([w["q"], w["k"], w["v"]]).T + np.concatenate([w["bq"], w["bk"], w["bv"]])
    ctx = np.zeros((len(x), C))
    first = 0
    for n in lens:
        for h in range(NH):
            q = qkv[first:first + n, h * hs:(h + 1) * hs]
            k = qkv[first:first + n, C + h * hs:C + (h + 1) * hs]
            v = qkv[first:first + n, 2 * C + h * hs:2 * C + (h + 1) * hs]
            for i in range(n):
                if modes[h] and n > keys:
                    agree = (np.signbit(q[i])[None, :] == np.signbit(k)).sum(1)
                    chosen = sorted(sorted(range(n), key=lambda j: (-agree[j], j))[:keys])
                else:
                    chosen = list(range(n))
                s = k[chosen] @ q[i] / np.sqrt(hs)
                p = np.exp(s - s.max())
                ctx[first + i, h * hs:(h + 1) * hs] = (p / p.sum()) @ v[chosen]
        first += n

    def ln(y, g, b):
        mu = y.mean(1, keepdims=True)
        return (y - mu) / np.sqrt(((y - mu) ** 2).mean(1, keepdims=True) + eps) * g + b
    from scipy.special import erf
    h1 = ln(x + ctx @ w["o"].T + w["bo"], w["g1"], w["b1n"])
    a = h1 @ w["w1"].T + w["b1"]
    a = 0.5 * a * (1 + erf(a / np.sqrt(2)))
    return ln(h1 + a @ w["w2"].T + w["b2"], w["g2"], w["b2n"])


@pytest.mark.parametrize("keys", [3, 5, 100])
def test_sign_matching_attention_follows_the_papers_rule(small_path, keys):
    """Heads 0 and 2 of layer 0 by sign matching, heads 1 and 3 exact: the encoder's first layer against
    the NumPy model (keys >= the sequence: exactly the exact attention)."""
    model = task_model(small_path)
    sm = compress.apply(model, {"sign_match_keys": keys, "layers": {"0": {"heads": {"0": "sign_match",
                                                                                      "2": "sign_match"}}}})
    assert sm.structure["head_attention"][:4] == [1, 0, 1, 0] and sm.structure["sign_match_keys"] == keys
    ids, mask, types = batch(21, n=4, T=17)
    h = hidden(sm.encoder, ids, mask, types)
    sd = {k: v.astype(np.float64) for k, v in sm.encoder.state_dict().items()}
    p = "encoder.layer.0."
    w = {"q": sd[p + "attention.self.query.weight"], "k": sd[p + "attention.self.key.weight"],
         "v": sd[p + "attention.self.value.weight"], "bq": sd[p + "attention.self.query.bias"],
         "bk": sd[p + "attention.self.key.bias"], "bv": sd[p + "attention.self.value.bias"],
         "o": sd[p + "attention.output.dense.weight"], "bo": sd[p + "attention.output.dense.bias"],
         "g1": sd[p + "attention.output.LayerNorm.weight"], "b1n": sd[p + "attention.output.LayerNorm.bias"],
         "w1": sd[p + "intermediate.dense.weight"], "b1": sd[p + "intermediate.dense.bias"],
         "w2": sd[p + "output.dense.weight"], "b2": sd[p + "output.dense.bias"],
         "g2": sd[p + "output.LayerNorm.weight"], "b2n": sd[p + "output.LayerNorm.bias"]}
    real = mask.astype(bool)
    x = h[0][real].astype(np.float64)
    ref = sign_match_layer(x, mask.sum(1), w, 4, keys, [1, 0, 1, 0], 1e-12)
    assert np.abs(h[1][real] - ref).max() <= 1e-4
    exact = hidden(model.encoder, ids, mask, types)[1][real]
    if keys >= 17:   # no sequence is longer than the keys: the exact path itself
        assert np.array_equal(h[1][real], exact)
    else:
        assert np.abs(h[1][real] - exact).max() > 1e-3   # the approximation did something


def torch_gate_scores(path, head, data, group):
    """per-example |d loss_b / d gate| of every head, FFN group and layer at gate 1, by torch autograd on
    transformers' BertModel (gates multiply a head's context, a group's activations, a layer's residual
    branch), mean pooling and the linear head"""
    import torch
    from transformers import BertModel
    bert = BertModel.from_pretrained(path, attn_implementation="eager").eval().double()
    L, NH = bert.config.num_hidden_layers, bert.config.num_attention_heads
    hs, I = bert.config.hidden_size // NH, bert.config.intermediate_size
    B = len(data)
    gh = torch.ones(L, B, NH, dtype=torch.float64, requires_grad=True)
    gf = torch.ones(L, B, I // group, dtype=torch.float64, requires_grad=True)
    gl = torch.ones(L, B, dtype=torch.float64, requires_grad=True)
    hooks = []
    for l, layer in enumerate(bert.encoder.layer):
        def ctx_hook(mod, inp, out, l=l):
            c = out[0]
            c = (c.view(B, -1, NH, hs) * gh[l][:, None, :, None]).view(B, -1, NH * hs)
            return (c,) + tuple(out[1:])
        def act_hook(mod, inp, out, l=l):
            return (out.view(B, -1, I // group, group) * gf[l][:, None, :, None]).view(B, -1, I)
        def layer_hook(mod, inp, out, l=l):
            x = inp[0]
            y = out[0] if isinstance(out, tuple) else out
            y = x + gl[l][:, None, None] * (y - x)
            return (y,) + tuple(out[1:]) if isinstance(out, tuple) else y
        hooks += [layer.attention.self.register_forward_hook(ctx_hook),
                  layer.intermediate.register_forward_hook(act_hook), layer.register_forward_hook(layer_hook)]
    ids, mask, types = data.padded()
    m = torch.tensor(mask, dtype=torch.float64)
    out = bert(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types)
               ).last_hidden_state
    pooled = (out * m[..., None]).sum(1) / m.sum(1, keepdim=True)
    W = torch.tensor(head.tensors["classifier.weight"], dtype=torch.float64)
    b = torch.tensor(head.tensors["classifier.bias"], dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(pooled @ W.T + b, torch.tensor(data.labels), reduction="sum")
    loss.backward()
    for h in hooks:
        h.remove()
    return gh.grad.abs().mean(1).numpy(), gf.grad.abs().mean(1).numpy(), gl.grad.abs().mean(1).numpy()


def test_gradient_significance_equals_torch_autograd(small_path):
    from fasttran.compress.significance import gradient_scores
    model = task_model(small_path, labels=3, seed=2)
    data = task_data(4, n=10, labels=3)
    ours = gradient_scores(model, data, 16, batch_size=4, show_progress=False)
    th, tf, tl = torch_gate_scores(small_path, model.head, data, 16)
    for l in range(3):
        assert abs(ours[("layer", l, 0)] - tl[l]) <= 1e-4 * (1 + tl[l]), l
        for h in range(4):
            assert abs(ours[("head", l, h)] - th[l, h]) <= 1e-4 * (1 + th[l, h]), (l, h)
        for g in range(4):
            assert abs(ours[("ffn", l, g)] - tf[l, g]) <= 1e-4 * (1 + tf[l, g]), (l, g)


def test_mask_significance_is_the_masked_models_loss(small_path):
    """Masking scores start from a layer's cached input; they equal whole masked forwards exactly."""
    from fasttran.compress.significance import _Masks, mask_scores
    model = task_model(small_path, labels=3)
    data = task_data(5, n=20, labels=3)
    scores, (base_loss, base_acc) = mask_scores(model, data, 16, batch_size=8, show_progress=False)
    assert base_loss == pytest.approx(model.evaluate(data)["loss"], abs=1e-6)
    mk = _Masks(model, 16)
    for c in [("layer", 2, 0), ("head", 1, 2), ("ffn", 2, 3), ("head", 0, 0)]:
        ev = model.evaluate(data, 8, **mk.off(*c))
        assert scores[c][0] == pytest.approx(ev["loss"] - base_loss, abs=1e-6), c
        assert scores[c][1] == pytest.approx(100 * (base_acc - ev["accuracy"]), abs=1e-9), c


def test_significance_report(small_path):
    model = task_model(small_path, labels=3)
    sig = compress.significance(model, task_data(6, n=16, labels=3), ffn_group_size_=16, batch_size=8,
                                show_progress=False)
    assert len(sig.rows) == 3 * (1 + 4 + 4)
    assert set(sig.agreement()) == {"all", "layer", "head", "ffn"}
    assert set(sig.seconds) == {"mask", "gradient", "control"}
    assert abs(sig.control["random_spearman"]["mean"]) < 0.1
    assert set(sig.control["pruned_accuracy"]["head"]["0.5"]) == {"mask", "gradient", "random"}
    order = sig.order("mask")
    assert len(order) == 27 and sig.mask[order[0]][0] <= sig.mask[order[-1]][0]
    text = sig.table()
    assert "Spearman" in text and "head 2.3" in text
    json.dumps(sig.to_dict())
    grad = compress.significance(model, task_data(6, n=16, labels=3), methods=("gradient",), ffn_group_size_=16,
                                 batch_size=8, control=False, show_progress=False)
    assert grad.methods == ["gradient"] and grad.order() == sig.order("gradient") and not grad.agreement()
    assert "gradient" in grad.table()
    with pytest.raises(InputError, match="no 'mask' scores"):
        grad.order("mask")


def test_spearman():
    assert compress.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert compress.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert compress.spearman([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)


def test_training_pruned_layers_equals_the_zero_filled_model(small_path, tmp_path):
    """The top-k training stack on a pruned model computes what the unpruned stack computes on the
    same weights with the removed heads and neurons zero-filled: equal outputs, equal gradients of
    every kept weight."""
    small = compress.apply(task_model(small_path), {"ffn_group_size": 16, "layers": {
        "0": {"heads": {"1": "prune"}}, "1": {"heads": {"0": "prune", "3": "prune"}, "ffn_groups": {"2": "prune"}}}})
    full = compress.TaskModel.load(compress.export_transformers(small, tmp_path / "hf"))
    ids, mask, types = batch(9, n=5)
    lengths = mask.sum(1).astype(np.int32)
    x = np.ascontiguousarray(small.encoder.forward(ids, mask, types, output_layers=0)[mask.astype(bool)])
    d = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    outs, grads = [], []
    for m in (small, full):
        stack = _C.LayerStack(m.encoder._core, 0, 3, -1, hidden_dropout=0.0, attention_dropout=0.0)
        o = np.empty_like(x)
        stack.forward(x, lengths, o, training=True)
        stack.backward(d)
        table, _ = stack.tensors()
        g = np.asarray(stack.grads)
        outs.append(o)
        grads.append({n: g[off:off + int(np.prod(s))].reshape(s) for n, s, off in table})
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=0)
    hs, (gp, gf) = 12, grads
    kept_heads = {0: [0, 2, 3], 1: [1, 2], 2: [0, 1, 2, 3]}
    kept_neurons = {0: list(range(64)), 1: list(range(32)) + list(range(48, 64)), 2: list(range(64))}
    for l in range(3):
        rows = np.concatenate([np.arange(h * hs, (h + 1) * hs) for h in kept_heads[l]])
        zero_rows = np.arange(len(rows))   # in the zero-filled model the kept heads come first
        p = f"encoder.layer.{l}."
        for w in ("query", "key", "value"):
            np.testing.assert_allclose(gp[p + f"attention.self.{w}.weight"], gf[p + f"attention.self.{w}.weight"][zero_rows],
                                       atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(gp[p + "attention.output.dense.weight"],
                                   gf[p + "attention.output.dense.weight"][:, zero_rows], atol=2e-5, rtol=1e-4)
        n = len(kept_neurons[l])
        np.testing.assert_allclose(gp[p + "intermediate.dense.weight"], gf[p + "intermediate.dense.weight"][:n],
                                   atol=2e-5, rtol=1e-4)
        for k in ("output.LayerNorm.weight", "attention.output.LayerNorm.bias", "output.dense.bias"):
            np.testing.assert_allclose(gp[p + k], gf[p + k], atol=2e-5, rtol=1e-4)


def test_trainer_fine_tunes_a_pruned_model_and_exports_it(small_path, tmp_path):
    small = compress.apply(task_model(small_path), PLAN)
    data = task_data(8, n=40)
    tr = fasttran.Trainer(small.head, train_layers=2, epochs=1, show_progress=False)
    ids, mask, types = data.padded()
    tr.fit(tr.cache_for(small.encoder, ids, mask, types), data.labels)
    back = compress.TaskModel.load(tr.export(tmp_path / "ft"))
    assert back.structure == small.structure
    assert back.evaluate(data)["accuracy"] == pytest.approx(tr.evaluate(tr.cache_for(small.encoder, ids, mask, types),
                                                                        data.labels)["accuracy"])


# ---- refusals -------------------------------------------------------------------------------------------
def test_bad_plans_are_refused_and_nothing_is_made(small_path):
    model = task_model(small_path)
    cases = [
        ({"layers": {"0": {"heads": {str(h): "prune" for h in range(4)}}}}, "all 4 of its heads"),
        ({"layers": {str(l): "prune" for l in range(3)}}, "removes all 3 layers"),
        ({"ffn_group_size": 16, "layers": {"2": {"ffn_groups": {str(g): "prune" for g in range(4)}}}},
         "all its FFN groups"),
        ({"layers": {"3": "prune"}}, "out of range"),
        ({"layers": {"0": {"heads": {"4": "prune"}}}}, "out of range"),
        ({"layers": {"0": {"heads": {"1": "quantize"}}}}, "'prune' or 'sign_match'"),
        ({"layers": {"0": "drop"}}, "must be 'prune'"),
        ({"ffn_group_size": 10}, "does not divide"),
        ({"prune": []}, "unknown key"),
        ("layers 1", "is a dict"),
    ]
    for plan, msg in cases:
        with pytest.raises((InputError, TypeError), match=msg):
            compress.apply(model, plan)
    # the C layer refuses the same on its own (a caller that bypasses the plan)
    core = model.encoder._core
    heads = np.ones(12, np.uint8)
    heads[:4] = 0
    with pytest.raises(InputError, match="removes every attention head of layer 0"):
        core.compressed(keep_heads=heads)
    with pytest.raises(InputError, match="removes every layer"):
        core.compressed(keep_layers=np.zeros(3, np.uint8))
    with pytest.raises(InputError, match="keep_heads has shape"):
        core.compressed(keep_heads=np.ones(11, np.uint8))


def test_masks_of_the_wrong_shape_are_refused(small_path):
    enc = fasttran.Encoder.from_pretrained(small_path)
    ids, mask, types = batch(0)
    for kw, msg in [(dict(head_keep=np.ones(11, np.uint8)), r"head_keep has shape \(11,\); this model needs \(12,\)"),
                    (dict(skip_layers=np.ones((3, 1), np.uint8)), "skip_layers has shape a 2-d array"),
                    (dict(ffn_keep=np.ones(11, np.uint8), ffn_group=16), r"ffn_keep has shape \(11,\); this model needs \(12,\)"),
                    (dict(ffn_keep=np.ones(12, np.uint8), ffn_group=10), "does not divide"),
                    (dict(head_keep=np.full(12, 2, np.uint8)), "masks hold 0 or 1"),
                    (dict(head_keep=np.ones(12, np.float32)), "uint8 or bool")]:
        with pytest.raises((InputError, TypeError), match=msg):
            hidden(enc, ids, mask, types, **kw)
    with pytest.raises(InputError, match="start_hidden must be"):
        hidden(enc, ids, mask, types, start_layer=1, start_hidden=np.zeros((2, 2, 2), np.float32))


def test_sign_matching_layers_cannot_be_trained(small_path):
    sm = compress.apply(task_model(small_path), {"layers": {"2": {"heads": {"1": "sign_match"}}}})
    with pytest.raises(UnsupportedError, match="sign-matching attention heads, which cannot be trained"):
        fasttran.finetune.TopLayers(sm.encoder, 1)
    # the layers below it can
    fasttran.finetune.TopLayers(sm.encoder, 1) if False else _C.LayerStack(sm.encoder._core, 0, 2, -1)


def test_structure_in_config_is_checked(small_path, tmp_path):
    small = compress.apply(task_model(small_path), PLAN)
    out = small.save(tmp_path / "m")
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["fasttran_layer_heads"] == [2, 3] and cfg["num_hidden_layers"] == 2
    for key, bad, msg in [("fasttran_layer_heads", [2, 5], "in \\[1, 4\\]"), ("fasttran_layer_heads", [2], "list 2"),
                          ("fasttran_head_attention", [["exact"] * 2, ["fast"] * 3], "one of"),
                          ("fasttran_layer_intermediate", [0, 32], "in \\[1, ")]:
        c = dict(cfg, **{key: bad})
        with pytest.raises(CheckpointError, match=msg):
            fasttran.Encoder(c)


def test_search_meets_a_budget_or_says_it_cannot(small_path):
    model = task_model(small_path)
    train, select = task_data(10, n=48), task_data(11, n=24)
    res = compress.search(model, train, select, max_drop=100.0, steps=4, ffn_group_size_=16, latency_examples=8,
                          latency_batch=4, show_progress=False)
    assert res.met and res.reason is None and res.model.size_bytes < model.size_bytes
    assert res.model.info["search"]["met"] and res.points[0]["stage"] == "fine-tuned"
    assert {"pruned", "re-fine-tuned"} <= {p["stage"] for p in res.points}
    assert res.pareto() and "budget met" in res.table()
    no = compress.search(model, train, select, max_drop=0.0, target_size_mb=1e-4, steps=4, ffn_group_size_=16,
                         latency_examples=8, latency_batch=4, significance=res.significance, show_progress=False)
    assert not no.met and "size" in no.reason and "CANNOT MEET" in no.table()
    with pytest.raises(InputError, match="needs a budget"):
        compress.search(model, train, select)
    with pytest.raises(InputError, match="max_drop must be"):
        compress.search(model, train, select, max_drop=-1)


def test_search_prunes_only_the_kinds_it_is_given(small_path):
    """prune=("head", "ffn") never removes a whole layer, even when the size target needs more than any
    head or group; prune=() removes nothing; a kind that does not exist is refused by name."""
    model = task_model(small_path)
    train, select = task_data(10, n=48), task_data(11, n=24)
    target = 0.8 * model.size_bytes / 1e6
    res = compress.search(model, train, select, target_size_mb=target, prune=("head", "ffn"), steps=4,
                          ffn_group_size_=16, latency_examples=8, latency_batch=4, int8=False, sign_match=False,
                          prune_vocabulary=False, show_progress=False)
    assert res.model.num_layers == model.num_layers
    assert res.model.size_bytes < model.size_bytes
    s = res.model.structure
    assert s["layer_heads"] != model.structure["layer_heads"] or \
        s["layer_intermediate"] != model.structure["layer_intermediate"]
    none = compress.search(model, train, select, target_size_mb=target, prune=(), steps=4, ffn_group_size_=16,
                           latency_examples=8, latency_batch=4, int8=False, sign_match=False,
                           significance=res.significance, show_progress=False)
    assert none.model.structure == model.structure
    assert not none.met and "size" in none.reason
    for bad in ("layer", ("layers",), ("head", "head")):
        with pytest.raises(InputError, match="prune must name kinds"):
            compress.search(model, train, select, max_drop=1.0, prune=bad)
    with pytest.raises(InputError, match="prune_vocabulary must be"):
        compress.search(model, train, select, max_drop=1.0, prune_vocabulary="yes")


def test_retraining_on_the_teacher_logits_distils_them(small_path):
    """retrain_targets='teacher': the pruned model's layers and classifier learn the fine-tuned model's
    logits (mean squared error), not the labels; the result is a classifier again, closer to the
    teacher's logits than the pruned model was; another value is refused."""
    from fasttran.compress.search import _retrain
    model = task_model(small_path)
    train = task_data(10, n=64)
    pruned = compress.apply(model, PLAN)
    teacher = model.logits(train)
    before = float(np.mean((pruned.logits(train) - teacher) ** 2))
    tuned = _retrain(pruned, train, 3, None, 1e-3, 16, 0, False, "adamw", teacher)
    after = float(np.mean((tuned.logits(train) - teacher) ** 2))
    assert type(tuned.head) is ClassificationHead and tuned.head.num_labels == 2
    assert tuned.info["retrained"][-1]["targets"] == "teacher logits"
    assert after < 0.5 * before, (before, after)
    select = task_data(11, n=24)
    res = compress.search(model, train, select, max_drop=100.0, steps=4, ffn_group_size_=16, latency_examples=8,
                          latency_batch=4, retrain_targets="teacher", show_progress=False)
    assert res.met and res.model.info["retrained"][-1]["targets"] == "teacher logits"
    with pytest.raises(InputError, match="retrain_targets must be"):
        compress.search(model, train, select, max_drop=1.0, retrain_targets="soft")


# ---- the command line ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_finetuned(tmp_path_factory, minilm_dir):
    """A small random BERT with MiniLM's tokenizer, its top 2 layers and head fine-tuned on 300 shipped
    SST-2 sentences and exported as Trainer.export writes it: what `fasttran compress` takes."""
    import shutil
    from fasttran.compress.tasks import load_task
    d = tmp_path_factory.mktemp("tiny")
    make_checkpoint(str(d / "base"), seed=5, vocab_size=30522, hidden_size=32, num_attention_heads=4,
                    intermediate_size=64, num_hidden_layers=2, type_vocab_size=2, max_position_embeddings=128)
    for name in ("tokenizer.json", "vocab.txt"):
        if os.path.exists(os.path.join(minilm_dir, name)):
            shutil.copy(os.path.join(minilm_dir, name), d / "base" / name)
    enc = fasttran.Encoder.from_pretrained(str(d / "base"))
    texts, _, labels = load_task("sst2", "train", None, limit=300)
    ids, mask, types = enc.tokenize(texts, max_length=64)
    tr = fasttran.Trainer("classification", train_layers=2, epochs=1, show_progress=False)
    tr.fit(tr.cache_for(enc, ids, mask, types), np.array(labels))
    return tr.export(str(d / "ft"))


def test_cli_compress_prints_the_table_and_the_trade_off(tiny_finetuned, tmp_path, capsys):
    from fasttran.cli import main
    out, plot = tmp_path / "small", tmp_path / "tradeoff.png"
    argv = ["compress", tiny_finetuned, "--task", "sst2", "--data", str(tmp_path / "none"), "--limit", "60",
            "--train-limit", "200", "--select", "40", "--ffn-group-size", "16", "--threads", "2"]
    with pytest.raises(SystemExit, match="no dev.tsv for task 'sst2'"):
        main(argv)
    argv[argv.index("--data") + 1] = ""   # no directory: the sample fasttran ships
    argv.remove("--data"), argv.remove("")
    assert main(argv + ["--significance-only"]) == 0
    text = capsys.readouterr().out
    assert "mask: loss rise" in text and "head 1.3" in text and "Spearman" in text
    with pytest.raises(SystemExit, match="give a budget"):
        main(argv)
    rc = main(argv + ["--max-drop", "100", "--output", str(out), "--plot", str(plot)])
    text = capsys.readouterr().out
    assert rc == 0 and "trade-off" in text and "budget met" in text and "Pareto" in text
    assert os.path.getsize(plot) > 0
    model = compress.TaskModel.load(out)
    assert model.info["search"]["met"] and os.path.exists(out / "search.json")
    rc = main(argv + ["--max-drop", "0", "--target-size", "0.0001", "--prune", "head", "ffn", "--retrain-targets",
                      "teacher"])
    text = capsys.readouterr().out
    assert rc == 3 and "CANNOT MEET" in text
    plan = json.loads(text.split("plan (original numbering):", 1)[1].splitlines()[0])
    assert not (plan or {}).get("layers_removed"), plan   # heads and FFN groups only


def test_search_keeps_the_vocabulary_of_the_data_it_is_given(tiny_finetuned):
    """prune_vocabulary=<TaskData>: the embedding rows kept are that data's tokens (a task's whole training
    split, say), not only those of the examples re-fine-tuned on"""
    from fasttran.compress.tasks import load_task
    model = compress.TaskModel.load(tiny_finetuned)
    texts, _, labels = load_task("sst2", "train", None, limit=120)
    data = compress.TaskData.from_texts(model, texts, labels, max_length=64)
    train, select, wider = data.subset(np.arange(40)), data.subset(np.arange(40, 80)), data
    res = compress.search(model, train, select, target_size_mb=1e4, prune=(), int8=False, sign_match=False,
                          prune_vocabulary=wider, ffn_group_size_=16, latency_examples=8, latency_batch=4,
                          show_progress=False)
    kept = compress.vocabulary(model, wider)["keep"]
    assert res.met and res.model.structure["vocab_rows"] == len(kept)
    assert len(kept) > len(compress.vocabulary(model, train)["keep"])
    assert np.array_equal(res.model.logits(wider), model.logits(wider))   # every token it reads is kept
    voc = compress.vocabulary(model, wider, min_count=2)
    res = compress.search(model, train, select, target_size_mb=1e4, prune=(), int8=False, sign_match=False,
                          prune_vocabulary=voc, ffn_group_size_=16, latency_examples=8, latency_batch=4,
                          show_progress=False)
    assert res.model.structure["vocab_rows"] == len(voc["keep"]) < len(kept)


# ---- int8 (the kernels' int8 encoder on compressed models) ------------------------------------------------
def test_pruned_then_int8_model_runs_saves_and_loads_back(small_path, tmp_path):
    model = task_model(small_path)
    q = compress.apply(model, dict(PLAN, weights="int8"))
    assert q.weights == "int8" and q.structure == compress.apply(model, PLAN).structure
    assert q.size_bytes == compress.model.int8_size(compress.apply(model, PLAN)) < compress.apply(model, PLAN).size_bytes
    data = task_data(12)
    ref = compress.apply(model, PLAN).logits(data)
    got = q.logits(data)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 1e-3   # int8 error, not a different model
    out = q.save(tmp_path / "q")
    back = compress.TaskModel.load(out)
    assert back.weights == "int8" and np.array_equal(back.logits(data), got)
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["fasttran_weights"] == "int8" and cfg["fasttran_int8_embeddings"] is True
    layers_only = compress.apply(model, dict(PLAN, weights="int8-layers"))
    assert not layers_only.encoder._core.int8_embeddings and layers_only.size_bytes > q.size_bytes
    hf = compress.TaskModel.load(compress.export_transformers(q, tmp_path / "hf"))   # dequantized weights
    assert np.abs(hf.logits(data) - got).max() < 0.05 * np.abs(got).max() + 1e-3


def test_an_int8_model_is_not_trained_or_pruned_further(small_path):
    q = compress.quantize(task_model(small_path))
    data = task_data(13, n=16)
    tr = fasttran.Trainer(q.head, train_layers=1, epochs=1, show_progress=False)
    ids, mask, types = data.padded()
    with pytest.raises(UnsupportedError, match="an int8 model asked to train"):
        tr.fit(tr.cache_for(q.encoder, ids, mask, types), data.labels)
    with pytest.raises(InputError, match="this model is int8"):
        compress.apply(q, PLAN)
    with pytest.raises(UnsupportedError, match="int8; prune or approximate the float32 model"):
        q.encoder._core.compressed(keep_layers=np.array([1, 0, 1], np.uint8))
    with pytest.raises(InputError, match="int8 already"):
        compress.quantize(q)


def test_onnx_export_of_a_pruned_model_runs_in_onnx_runtime(small_path, tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    small = compress.apply(task_model(small_path), PLAN)
    path = compress.export_onnx(small, str(tmp_path / "m.onnx"))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    data = task_data(14)
    ids, mask, types = data.padded()
    got = sess.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
    np.testing.assert_allclose(got, small.logits(data), atol=1e-4, rtol=0)


# ---- a pruned vocabulary ---------------------------------------------------------------------------------
def test_pruned_vocabulary_keeps_the_tokens_used_and_reads_unknown_for_the_rest(small_path, tmp_path):
    import torch
    from transformers import BertModel
    model = task_model(small_path)
    data = task_data(15)
    used = set(np.unique(data.ids).tolist())
    voc = {"keep": sorted(used | {1}), "unknown": 1}
    small = compress.apply(model, dict(PLAN, vocabulary=voc))
    assert small.encoder.state_dict()["embeddings.word_embeddings.weight"].shape == (len(voc["keep"]), 48)
    assert small.structure["vocab_rows"] == len(voc["keep"])
    # the tokens kept: what the unpruned model (pruned alike) computes, bit for bit
    assert np.array_equal(small.logits(data), compress.apply(model, PLAN).logits(data))
    # a removed token reads the unknown token's row
    gone = next(t for t in range(2, 99) if t not in used)
    ids, mask, types = data.padded()
    odd = ids.copy()
    odd[0, 1] = gone
    as_unk = ids.copy()
    as_unk[0, 1] = 1
    both = [compress.TaskData(x, mask, types, data.labels) for x in (odd, as_unk)]
    assert np.array_equal(small.logits(both[0]), compress.apply(model, PLAN).logits(both[1]))
    # its files, and transformers' layout with every id's row back
    back = compress.TaskModel.load(small.save(tmp_path / "v"))
    assert np.array_equal(back.logits(both[0]), small.logits(both[0]))
    bert = BertModel.from_pretrained(compress.export_transformers(small, tmp_path / "hf")).eval()
    with torch.no_grad():
        ref = bert(input_ids=torch.tensor(odd), attention_mask=torch.tensor(mask),
                   token_type_ids=torch.tensor(types)).last_hidden_state.numpy()
    assert np.abs(hidden(small.encoder, odd, mask, types)[-1] - ref)[mask.astype(bool)].max() <= 1e-4
    # int8 on top, and the size of it known beforehand
    q = compress.apply(model, dict(PLAN, vocabulary=voc, weights="int8"))
    assert q.size_bytes == compress.model.int8_size(compress.apply(model, PLAN), vocab_rows=len(voc["keep"]))
    assert np.array_equal(compress.TaskModel.load(q.save(tmp_path / "q")).logits(data), q.logits(data))
    # refusals: the unknown token must be kept; a token the pruned model lost cannot come back
    with pytest.raises(InputError, match="must be one of the kept ids"):
        compress.apply(model, {"vocabulary": {"keep": [2, 3], "unknown": 1}})
    with pytest.raises(InputError, match=r"token ids in \[0, 99\)"):
        compress.apply(model, {"vocabulary": {"keep": [1, 99], "unknown": 1}})
    with pytest.raises(InputError, match=f"token {gone} has no word-embedding row of its own"):
        compress.apply(small, {"vocabulary": {"keep": [1, gone], "unknown": 1}})
    again = compress.apply(small, {"vocabulary": {"keep": sorted(used - {gone} | {1})[:5], "unknown": 1}})
    assert again.structure["vocab_rows"] == 5


def test_vocabulary_filled_up_to_a_size_with_the_most_used_tokens(small_path, minilm_dir):
    """vocabulary(size=n): the data's tokens first, then the lowest other ids (WordPiece lists its tokens
    about in the pre-training corpus's order of use) up to n; placeholder tokens skipped; a bad size
    refused; fewer than the data's tokens: its most used ones, the unknown token always kept;
    min_count: only tokens used that often."""
    model = task_model(small_path)
    data = task_data(15)
    used = set(np.unique(data.ids[np.arange(data.ids.shape[1])[None, :] < data.lengths[:, None]]).tolist()) | {1}
    voc = compress.vocabulary(model, data, unknown=1, size=len(used) + 7)
    assert len(voc["keep"]) == len(used) + 7 and used <= set(voc["keep"]) and voc["unknown"] == 1
    assert set(voc["keep"]) - used == set(sorted(set(range(99)) - used)[:7])
    ids = data.ids[np.arange(data.ids.shape[1])[None, :] < data.lengths[:, None]]
    counts = np.bincount(ids, minlength=99)
    by_use = sorted((i for i in range(99) if counts[i] and i != 1), key=lambda i: (-counts[i], i))
    assert compress.vocabulary(model, data, unknown=1, size=4)["keep"] == sorted({1} | set(by_use[:3]))
    assert counts[by_use[0]] > counts[by_use[-1]]   # the order means something on this data
    twice = compress.vocabulary(model, data, unknown=1, min_count=2)["keep"]
    assert twice == sorted({1} | {i for i in range(99) if counts[i] >= 2}) and len(twice) < len(used)
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match="min_count"):
            compress.vocabulary(model, data, unknown=1, min_count=bad)
    for bad in (0, 100, 2.5, True):
        with pytest.raises(InputError, match="a token count in"):
            compress.vocabulary(model, data, unknown=1, size=bad)
    # BERT's vocabulary: [unused...] placeholders are not "most used"; "the" (1996) is
    enc = fasttran.Encoder.from_pretrained(minilm_dir)
    real = compress.TaskModel(enc, fasttran.ClassificationHead(enc.hidden_size, 2))
    ids = np.array([[101, 7592, 102]])
    d = compress.TaskData(ids, np.ones_like(ids), np.zeros_like(ids), np.array([0]))
    v = compress.vocabulary(real, d, size=2000)
    names = [enc.tokenizer.id_to_token(i) for i in v["keep"]]
    assert len(v["keep"]) == 2000 and not any(n.startswith("[unused") for n in names) and "the" in names
    assert {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello"} <= set(names)
