"""Shared fixtures: the real MiniLM checkpoint, real SST-2 sentences, random-weight
checkpoints written by transformers, and transformers reference forwards."""
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("FASTTRAN_DATA", os.path.join(ROOT, "..", "shared", "data"))
_SKIPS = {}   # reason -> number of tests skipped for it (summarised in one line each)


def data_skip(what, path, how):
    """Skip a test that needs real data which is not there; summarised once at the end."""
    reason = f"{what} not found at {path}; {how}"
    _SKIPS.setdefault(reason, 0)
    pytest.skip(reason)


def pytest_runtest_logreport(report):
    """Count the skipped tests per data reason (a module fixture skips once for all its tests)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        msg = str(report.longrepr[2]).removeprefix("Skipped: ")
        if msg in _SKIPS:
            _SKIPS[msg] += 1


def sst2_file(split):
    """Real SST-2 `split` (train/dev): $FASTTRAN_DATA/sst2/<split>.tsv when present, else the
    sample fasttran ships (all 872 dev sentences; 4,000 train sentences)."""
    from fasttran.data import sst2_path
    path = os.path.join(DATA, "sst2", f"{split}.tsv")
    return path if os.path.exists(path) else sst2_path(split)


def squad_file(name):
    path = os.path.join(DATA, "squad", name)
    if not os.path.exists(path):
        data_skip("real SQuAD v1.1 data", path,
                  "set FASTTRAN_DATA to a directory holding squad/train-subset-v1.1.json and squad/dev-v1.1.json")
    return path


def glue_file(task, split):
    """Real GLUE `task` (MRPC, STS-B, CoLA) `split` (train/dev) TSV from $FASTTRAN_DATA/glue."""
    path = os.path.join(DATA, "glue", task, f"{split}.tsv")
    if not os.path.exists(path):
        data_skip(f"real GLUE {task} data", path, f"set FASTTRAN_DATA to a directory holding glue/{task}/{split}.tsv")
    return path


def conll_file(split):
    """Real CoNLL-2003 `split` (train/valid) from $FASTTRAN_DATA/conll2003."""
    path = os.path.join(DATA, "conll2003", f"{split}.txt")
    if not os.path.exists(path):
        data_skip("real CoNLL-2003 data", path, f"set FASTTRAN_DATA to a directory holding conll2003/{split}.txt")
    return path


def pytest_sessionfinish(session, exitstatus):
    """Objects the tests left in reference cycles (a trainer and its model, say) are collected
    while the process still runs: their C objects (device memory among them) are freed by their
    own deallocators, so a leak check at exit (compute-sanitizer, LeakSanitizer) reports only
    memory that nothing can free."""
    import gc
    gc.collect()


def pytest_terminal_summary(terminalreporter):
    for reason, n in _SKIPS.items():
        terminalreporter.write_line(f"fasttran: skipped {n} test(s): {reason}", yellow=True)


@pytest.fixture(scope="session")
def minilm_dir():
    import fasttran
    try:
        return fasttran.models.minilm_path()
    except fasttran.FastTranError as e:
        data_skip("the all-MiniLM-L6-v2 model", fasttran.models.cache_dir(), f"({e})")


@pytest.fixture(scope="session")
def enc(minilm_dir):
    """The real all-MiniLM-L6-v2 encoder, loaded once for the session (a module may define its own)."""
    import fasttran
    return fasttran.Encoder.from_pretrained(minilm_dir)


def block_import(monkeypatch, prefix):
    """Make `import <prefix>...` fail as if the package were not installed."""
    import builtins
    real = builtins.__import__

    def blocked(name, *a, **kw):
        if name.startswith(prefix):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", blocked)


@pytest.fixture(scope="session")
def sst2_sentences():
    from fasttran.data import load_sst2
    return load_sst2(sst2_file("dev"))[0]


def ragged_ids(rng, n, T, low, high):
    """n random sequences of token ids in [low, high) padded to T with 0 -- the first T long, the rest
    1..T -- and their attention mask"""
    lens = rng.integers(1, T + 1, n)
    lens[0] = T
    ids = rng.integers(low, high, (n, T))
    mask = (np.arange(T)[None, :] < lens[:, None]).astype(np.int64)
    ids[mask == 0] = 0
    return ids, mask


def make_checkpoint(path, dtype="float32", pooler=True, wrapper=None, seed=0, **cfg):
    """Write a random-weight BERT checkpoint with transformers (safetensors) into `path`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    config = BertConfig(**cfg)
    if wrapper == "classifier":   # tensor names get the "bert." prefix
        model = BertForSequenceClassification(config)
    else:
        model = BertModel(config, add_pooling_layer=pooler)
    # larger than the 0.02 default so layers actually mix tokens and errors would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 2 and "embeddings" not in name:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
    model = model.to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype])
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def checkpoint(tmp_path):
    def make(**kw):
        d = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        return str(make_checkpoint(str(d), **kw))
    return make


def hf_hidden_states(path, ids, mask=None, types=None, double=False):
    """transformers BertModel hidden states (all layers) for the checkpoint in `path`, in float32
    weights (or float64 with double=True)."""
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    if double:
        model = model.double()
    kw = {"input_ids": torch.as_tensor(ids, dtype=torch.long)}
    if mask is not None:
        kw["attention_mask"] = torch.as_tensor(mask, dtype=torch.long)
    if types is not None:
        kw["token_type_ids"] = torch.as_tensor(types, dtype=torch.long)
    with torch.no_grad():
        out = model(**kw, output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]


def assert_matches_hf(enc, path, ids, mask=None, types=None, tol=1e-4):
    """Every layer: real tokens within tol of transformers fp32 and of float64; padded positions
    within tol of float64, or no further than 1.5x transformers' own fp32 is from float64 where
    that is more (padded rows are ill-conditioned: MiniLM's outlier channel reaches ~6 there, and
    transformers' fp32 is 1e-4 to 2e-4 off float64 on SST-2 batches; fasttran's AVX-512 path
    measured 1.02e-4 on one)."""
    ours = enc.forward(ids, mask, types, output_layers=list(range(enc.num_layers + 1)))
    ref32 = hf_hidden_states(path, ids, mask, types)
    ref64 = hf_hidden_states(path, ids, mask, types, double=True)
    valid = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    for layer, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        assert a.dtype == np.float32 and a.shape == b.shape
        assert np.all(np.isfinite(a))
        err32 = np.abs(a - b)[valid].max() if valid.any() else 0.0
        err64 = np.abs(a - c)[valid].max() if valid.any() else 0.0
        assert err32 <= tol, f"layer {layer}: max abs error {err32:.2e} vs transformers fp32 on real tokens"
        assert err64 <= tol, f"layer {layer}: max abs error {err64:.2e} vs transformers float64 on real tokens"
        if not valid.all():
            pad64 = np.abs(a - c)[~valid].max()
            hf_pad64 = np.abs(b.astype(np.float64) - c)[~valid].max()
            assert pad64 <= max(tol, 1.5 * hf_pad64), (
                f"layer {layer}: max abs error {pad64:.2e} vs transformers float64 at padded positions "
                f"(transformers fp32: {hf_pad64:.2e})")
    return ours
