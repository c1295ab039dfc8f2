"""The mistakes a new user makes first, each refused with the documented fasttran error (also the
matching built-in) and a message that says what to do -- on real MiniLM features of real SST-2."""
import os
import re
import shutil

import numpy as np
import pytest

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.data import load_sst2

from conftest import block_import, make_checkpoint, sst2_file


@pytest.fixture(scope="module")
def sst(enc):
    s, y = load_sst2(sst2_file("train"))
    s, y = s[:96], np.array(y[:96])
    return s, y, ActivationCache.build(enc, *enc.tokenize(s), positions="mean", show_progress=False)


def test_errors_are_exported_and_documented():
    for name in ("FastTranIOError", "CacheNotFoundError", "NoGPUError", "MissingDependencyError",
                 "CacheMismatchError", "CheckpointNotFoundError", "InputTypeError"):
        cls = getattr(fasttran, name)
        assert name in fasttran.__all__ and issubclass(cls, fasttran.FastTranError) and cls.__doc__
    assert issubclass(fasttran.FastTranIOError, OSError)
    assert issubclass(fasttran.CacheNotFoundError, FileNotFoundError)
    assert issubclass(fasttran.NoGPUError, RuntimeError) and issubclass(fasttran.NoGPUError, fasttran.BackendError)
    assert issubclass(fasttran.MissingDependencyError, ImportError)


def test_string_labels(sst):
    s, y, cache = sst
    words = np.where(y == 1, "positive", "negative")
    with pytest.raises(fasttran.InputTypeError, match=r"integer class ids.*strings such as \['(positive|negative)'"
                                                      r".*numpy.unique\(labels, return_inverse=True\)") as e:
        Trainer("classification", show_progress=False).fit(cache, words)
    assert isinstance(e.value, TypeError)
    with pytest.raises(fasttran.InputTypeError, match=r"astype\(int\)"):
        Trainer("classification", show_progress=False).fit(cache, y.astype(np.float64))
    with pytest.raises(fasttran.InputTypeError, match="strings"):
        Trainer("classification", show_progress=False).fit(cache, list(words))


def test_array_instead_of_cache(sst):
    s, y, cache = sst
    X = cache.get(cache.example_ids)
    for bad in (X, list(X[:3])):
        with pytest.raises(fasttran.InputTypeError, match=r"must be an ActivationCache, got .*ActivationCache.build\("
                                                         r"encoder, input_ids") as e:
            Trainer("classification", show_progress=False).fit(bad, y)
        assert isinstance(e.value, TypeError)
    tr = Trainer("classification", epochs=1, show_progress=False)
    tr.fit(cache, y)
    with pytest.raises(fasttran.InputTypeError, match="must be an ActivationCache, got ndarray"):
        tr.evaluate(X, y)
    with pytest.raises(fasttran.InputTypeError, match="must be an ActivationCache"):
        tr.predict(X)


def test_missing_cache_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist: build one with ActivationCache.build") as e:
        ActivationCache.open(str(tmp_path / "nope"))
    assert isinstance(e.value, fasttran.CacheNotFoundError) and isinstance(e.value, fasttran.FastTranIOError)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(fasttran.CacheNotFoundError, match="not an activation cache"):
        ActivationCache.open(str(tmp_path / "empty"))


def test_forward_with_text_points_to_encode(enc):
    for bad in (["some text"], "some text", np.array(["some text", "more"])):
        with pytest.raises(fasttran.InputTypeError, match=r"got text.*encoder.encode\(texts\).*encoder.tokenize") as e:
            enc.forward(bad)
        assert isinstance(e.value, TypeError)
    with pytest.raises(fasttran.InputTypeError, match="got text"):
        enc.forward(np.ones((1, 3), np.int64), attention_mask=["a", "b", "c"])


def test_cache_of_another_encoder_is_refused(enc, sst, tmp_path):
    """Same width (384), other weights: without the fingerprint the head would be evaluated on
    meaningless features (accuracy 0.5, silently)."""
    s, y, cache = sst
    other = fasttran.Encoder.from_pretrained(make_checkpoint(
        str(tmp_path / "other"), hidden_size=384, num_hidden_layers=1, num_attention_heads=12, intermediate_size=64,
        vocab_size=enc.config["vocab_size"], max_position_embeddings=512))
    other.tokenizer = enc.tokenizer
    foreign = ActivationCache.build(other, *enc.tokenize(s), positions="mean", show_progress=False)
    assert foreign.hidden == cache.hidden and foreign.fingerprint != cache.fingerprint
    tr = Trainer("classification", epochs=1, show_progress=False)
    tr.fit(cache, y)
    assert tr.features["fingerprint"] == cache.fingerprint
    for call in (lambda: tr.evaluate(foreign, y), lambda: tr.predict(foreign), lambda: tr.fit(foreign, y)):
        with pytest.raises(fasttran.CacheMismatchError, match="trained on features of layer 6.*another encoder") as e:
            call()
        assert isinstance(e.value, ValueError)
    # another layer of the same model is other features too
    layer3 = ActivationCache.build(enc, *enc.tokenize(s), positions="mean", layer=3, show_progress=False)
    with pytest.raises(fasttran.CacheMismatchError, match="layer 3"):
        tr.evaluate(layer3, y)
    # the same features stored differently (float16, on disk, or computed on the fly) are accepted
    same = ActivationCache.build(enc, *enc.tokenize(s), positions="mean", dtype="float16",
                                 disk_dir=str(tmp_path / "c16"), show_progress=False)
    assert ActivationCache.open(str(tmp_path / "c16")).fingerprint == cache.fingerprint
    assert tr.evaluate(same, y)["accuracy"] == pytest.approx(tr.evaluate(cache, y)["accuracy"], abs=0.02)
    tr.evaluate(ActivationCache.uncached(enc, *enc.tokenize(s), positions="mean"), y)
    # the record survives save/load
    tr.save(str(tmp_path / "ck"))
    back = Trainer.load(str(tmp_path / "ck"), show_progress=False)
    with pytest.raises(fasttran.CacheMismatchError):
        back.evaluate(foreign, y)


def test_cuda_without_a_gpu_says_why():
    if fasttran.cuda_available():
        pytest.skip("this machine has a usable GPU")
    cfg = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 64, "max_position_embeddings": 16}
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(fasttran.NoGPUError, match=r"there is no usable GPU: .+\. Use device='cpu'") as e:
            fasttran.Encoder(cfg, device=dev)
        assert isinstance(e.value, RuntimeError) and "driver version is insufficient" not in str(e.value).split("(")[0]
    with pytest.raises(fasttran.NoGPUError, match="no usable GPU"):
        Trainer("classification", device="cuda")
    reason = fasttran._info.no_gpu_reason()
    if not fasttran._C.cuda_compiled:
        assert "built without its CUDA backend" in reason and "FASTTRAN_CUDA=1" in reason


def test_no_gpu_reasons_name_the_cause(monkeypatch):
    """The CUDA runtime's own words, mapped to causes a user can check (each string is what
    cudaGetErrorString / our loader return on such a machine)."""
    from fasttran import _info
    monkeypatch.setattr(_info._C, "cuda_compiled", 1)
    cases = {
        "no usable CUDA device: CUDA driver version is insufficient for CUDA runtime version":
            "no NVIDIA driver is loaded on this machine",
        "no usable CUDA device: no CUDA-capable device is detected": "the NVIDIA driver sees no GPU",
        "cannot load the CUDA backend: libcublas.so.13: cannot open shared object file":
            "pip install nvidia-cublas",
    }
    for err, want in cases.items():
        monkeypatch.setattr(_info, "_cuda_runtime", lambda err=err: (0, "", err))
        assert want in _info.no_gpu_reason()
    monkeypatch.setattr(_info, "_cuda_runtime", lambda: (1, "0: H100", None))
    assert _info.no_gpu_reason() is None


def _in_subprocess(code, env):
    """Run code in a fresh interpreter (huggingface_hub reads HF_* variables when imported)."""
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True)


def test_hub_id_without_network_says_how(tmp_path):
    pytest.importorskip("huggingface_hub")
    r = _in_subprocess("import fasttran\n"
                       "try:\n fasttran.Encoder.from_pretrained('sentence-transformers/all-MiniLM-L6-v2')\n"
                       "except FileNotFoundError as e:\n print(type(e).__name__, e)",
                       {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("CheckpointNotFoundError ")
    assert re.search(r"Hugging Face Hub failed.*huggingface-cli download sentence-transformers/all-MiniLM-L6-v2"
                     r".*fasttran.models.minilm_path\(\)", r.stdout), r.stdout


def test_hub_id_without_huggingface_hub_says_how(monkeypatch):
    block_import(monkeypatch, "huggingface_hub")
    with pytest.raises(fasttran.CheckpointNotFoundError, match=r"looks like a Hugging Face Hub model id.*pip install "
                                                               r"huggingface_hub"):
        fasttran.Encoder.from_pretrained("someone/some-bert")


def test_hub_id_loads_through_huggingface_hub(tmp_path, minilm_dir, enc):
    """A Hub id resolves through huggingface_hub's own cache (populated here by hand, offline,
    in the layout the Hub client writes), and gives the same encoder."""
    pytest.importorskip("huggingface_hub")
    hf = tmp_path / "hf"
    repo = hf / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    shutil.copytree(minilm_dir, snap, ignore=shutil.ignore_patterns("*.md", ".gitattributes"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    out = tmp_path / "emb.npy"
    r = _in_subprocess("import fasttran, numpy as np\n"
                       "e = fasttran.Encoder.from_pretrained('sentence-transformers/all-MiniLM-L6-v2')\n"
                       f"print(e.path); np.save({str(out)!r}, e.encode(['a gripping film', 'a dull film']))",
                       {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf)})
    assert r.returncode == 0, r.stderr
    assert os.path.realpath(r.stdout.strip()) == os.path.realpath(snap)
    assert np.array_equal(np.load(out), enc.encode(["a gripping film", "a dull film"]))


def test_missing_matplotlib_names_the_pip_command(monkeypatch, sst):
    s, y, cache = sst
    tr = Trainer("classification", epochs=1, show_progress=False)
    tr.fit(cache, y)
    block_import(monkeypatch, "matplotlib")
    with pytest.raises(fasttran.MissingDependencyError, match="pip install matplotlib") as e:
        tr.plot()
    assert isinstance(e.value, ImportError)
