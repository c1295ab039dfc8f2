"""fasttran.compress on ModernBERT (random weights, small widths, three layers: test_modernbert.py's
checkpoint writer): a TaskModel evaluates, saves in ModernBertModel's own config and names and loads
back bit for bit, goes to int8 within BERT's error (tests/test_compress.py's bound) and back;
distillation (re-fine-tuning through Trainer.export) waits on the export of ModernBERT task models
(fasttran/export.py) and is refused by that name until then. What runs BERT's post-LN layer code is
refused by name: pruning, sign matching, significance and the search (forward masks and ft_encoder_compress are
post-LN), and the transformers / ONNX export (BERT's layer names)."""
import json
import os

import numpy as np
import pytest

import fasttran
from fasttran import compress
from fasttran.heads import ClassificationHead

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_modernbert import V, make_model   # noqa: E402

C = 64
SMALL = dict(hidden_size=C, num_attention_heads=4, intermediate_size=96, num_hidden_layers=3, local_attention=8,
             global_attn_every_n_layers=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("modernbert_compress") / "m", seed=4, **SMALL)


def task_model(path, seed=1):
    return compress.TaskModel(fasttran.Encoder.from_pretrained(path), ClassificationHead(C, 2, seed=seed))


def task_data(seed, n=16, T=13):
    """ragged, some sequences longer than the 8-token window"""
    from conftest import ragged_ids
    rng = np.random.default_rng(seed)
    ids, mask = ragged_ids(rng, n, T, 3, V)
    return compress.TaskData(ids, mask, None, rng.integers(0, 2, n))


def test_evaluates_saves_in_its_own_layout_and_loads_back(path, tmp_path):
    model = task_model(path)
    data = task_data(0)
    enc = model.encoder
    pooled = enc.forward(data.ids, data.lengths[:, None] > np.arange(data.ids.shape[1])[None, :], pooling="mean")
    logits = model.logits(data)
    np.testing.assert_allclose(logits, model.head.step(pooled)[0], atol=1e-6, rtol=0)
    assert set(model.evaluate(data)) >= {"accuracy", "loss"}
    out = model.save(tmp_path / "m")
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["model_type"] == "modernbert" and cfg["architectures"] == ["ModernBertModel"]
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:   # ModernBertModel's own names
        names = set(f.keys())
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        assert names == set(f.keys())
    back = compress.TaskModel.load(out)
    assert back.encoder.architecture is enc.architecture and back.structure == model.structure
    assert np.array_equal(back.logits(data), logits)
    # transformers reads the saved encoder as its own ModernBertModel, with equal outputs
    m = transformers.AutoModel.from_pretrained(out, attn_implementation="eager").eval()
    ids, mask, _ = data.padded()
    with torch.no_grad():
        ref = m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    real = mask.astype(bool)
    assert np.abs(enc.forward(ids, mask)[real] - ref[real]).max() <= 1e-4


def test_int8_within_berts_error_and_round_trip(path, tmp_path):
    model = task_model(path)
    q = compress.apply(model, {"weights": "int8"})
    assert q is not model and q.weights == "int8" and model.weights == "float32"
    assert q.size_bytes == compress.model.int8_size(model) < model.size_bytes
    data = task_data(12)
    ref, got = model.logits(data), q.logits(data)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 1e-3   # tests/test_compress.py's bound for BERT
    assert not np.array_equal(got, ref)
    back = compress.TaskModel.load(q.save(tmp_path / "q"))
    assert back.weights == "int8" and np.array_equal(back.logits(data), got)
    assert json.loads(open(tmp_path / "q" / "config.json").read())["model_type"] == "modernbert"
    layers_only = compress.quantize(model, embeddings=False)
    assert not layers_only.encoder.int8_embeddings
    assert np.abs(layers_only.logits(data) - ref).max() < 0.05 * np.abs(ref).max() + 1e-3


def test_distillation_goes_through_the_task_export(path):
    """re-fine-tuning (the search's step after pruning) on the teacher's logits goes through
    Trainer.export (fasttran/export.py): while the export of a ModernBERT task model is refused, so is
    this step, by that name; where it runs, the student moves towards the teacher and reads back"""
    from fasttran.compress.search import _retrain
    model = task_model(path)
    student = task_model(path, seed=7)
    train = task_data(10, n=64)
    teacher = model.logits(train)
    try:
        model.encoder.architecture.require("export")
    except fasttran.UnsupportedModelError:
        with pytest.raises(fasttran.UnsupportedModelError, match=r"^export of a task model .* ModernBertModel"):
            _retrain(student, train, 1, None, 1e-3, 16, 0, False, "adamw", teacher)
        return
    before = float(np.mean((student.logits(train) - teacher) ** 2))
    tuned = _retrain(student, train, 3, None, 1e-3, 16, 0, False, "adamw", teacher)
    assert tuned.encoder.architecture is model.encoder.architecture and tuned.structure == student.structure
    assert float(np.mean((tuned.logits(train) - teacher) ** 2)) < 0.5 * before


def test_what_runs_berts_layer_code_is_refused_by_name(path, tmp_path):
    model = task_model(path)
    data = task_data(3)
    plan = {"layers": {"1": "prune"}}
    for call in (lambda: compress.apply(model, plan), lambda: compress.apply(model, dict(plan, weights="int8")),
                 lambda: compress.masks(model, plan), lambda: compress.significance(model, data, show_progress=False),
                 lambda: compress.search(model, data, data, max_drop=1.0, show_progress=False)):
        with pytest.raises(fasttran.UnsupportedModelError, match=r"^pruning, sign matching, .* ModernBertModel .* pre-LN"):
            call()
    for call in (lambda: compress.export_transformers(model, tmp_path / "hf"),
                 lambda: compress.export_onnx(model, str(tmp_path / "m.onnx"))):
        with pytest.raises(fasttran.UnsupportedModelError, match=r"^transformers / ONNX export .* ModernBertModel"):
            call()
    assert not os.path.exists(tmp_path / "hf")
    with pytest.raises(fasttran.FastTranError, match="post-LN"):   # the C side's own refusal
        model.pooled(data.ids, data.ids > 0, None, skip_layers=np.zeros(3, np.uint8))
