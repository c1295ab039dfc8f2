"""examples/quickstart.ipynb runs top to bottom in a Jupyter kernel (nbclient) and shows what it
says it shows; a notebook or script started inside a source checkout imports the installed,
compiled fasttran, not the checkout's uncompiled folder."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import fasttran

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "quickstart.ipynb")


def _run_notebook(nb, cwd, timeout=1200):
    from nbclient import NotebookClient
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
    return nb


def _text(cell):
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif "data" in o and "text/plain" in o["data"]:
            out.append(o["data"]["text/plain"])
    return "".join(out)


def test_quickstart_notebook(minilm_dir):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")
    nb = _run_notebook(nbformat.read(NOTEBOOK, as_version=4), os.path.dirname(NOTEBOOK))
    cells = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    # the compiled package, the one these tests run
    assert os.path.dirname(fasttran.__file__) in _text(cells[0])
    # encoder repr, and embeddings that rank the two dull reviews closest
    assert "Encoder(bert, layers=6, hidden=384" in _text(cells[1])
    sims = _text(cells[2])
    assert "embeddings: (3, 384) float32" in sims
    cos = [float(v) for v in re.findall(r"\) = (-?\d\.\d+)", sims)]
    assert len(cos) == 3 and cos[2] > cos[0] and cos[2] > cos[1], sims   # the two dull reviews closest
    # the cache's repr (text and HTML table)
    assert "ActivationCache(examples=1500, layer=6, positions='mean'" in _text(cells[3])
    assert any("<table>" in o.get("data", {}).get("text/html", "") for o in cells[3]["outputs"])
    # training: one kept progress line per epoch with loss and accuracy, and a dev accuracy that learned
    train = _text(cells[4])
    for e in (1, 2, 3):
        assert re.search(rf"epoch {e}/3: 100%.*loss=\d\.\d+, acc=\d\.\d+, dev_acc=\d\.\d+", train), train[-2000:]
    acc = float(re.search(r"dev accuracy after 3 epochs: (\d\.\d+)", train).group(1))
    assert acc > 0.72, acc
    assert "IProgress not found" not in train
    # the plot and the profile are images; the profile's table names the op kinds
    for c in (cells[5], cells[6]):
        assert any("image/png" in o.get("data", {}) for o in c["outputs"]), c["outputs"]
    prof = _text(cells[6])
    for col in ("forward", "training step", "epoch", "gemm", "attention", "optimizer", "cache read", "other"):
        assert col in prof
    # DLPack into torch
    torch_out = _text(cells[7])
    assert "features in torch: (8, 384) torch.float32" in torch_out
    assert "torch predictions agree with fasttran: True" in torch_out


def _fake_checkout(tmp_path):
    """A source checkout whose fasttran/ has the Python files but no compiled extension."""
    repo = tmp_path / "repo"
    src = os.path.dirname(fasttran.__file__)
    shutil.copytree(src, repo / "fasttran", ignore=shutil.ignore_patterns("*.so", "_build_config.py", "__pycache__"))
    (repo / "setup.py").write_text("# a checkout\n")
    return repo


def test_script_in_a_checkout_imports_the_compiled_package(tmp_path):
    repo = _fake_checkout(tmp_path)
    built = os.path.dirname(os.path.dirname(fasttran.__file__))
    env = dict(os.environ, PYTHONPATH=built)
    code = ("import fasttran, fasttran.cache, sys; print(fasttran.__file__); print(fasttran._C.__file__); "
            "print(fasttran.cache.__file__); print(sys.modules['fasttran'] is fasttran)")
    r = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert all(line.startswith(os.path.join(built, "fasttran")) for line in lines[:3]), lines
    assert lines[3] == "True"
    # with no compiled copy anywhere, the import says what to do
    r = subprocess.run([sys.executable, "-c", "import fasttran"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=""))
    if r.returncode != 0:   # (a compiled fasttran may be installed in this environment's site-packages)
        assert "source folder" in r.stderr and "pip install -e ." in r.stderr


def test_notebook_in_a_checkout_imports_the_compiled_package(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    repo = _fake_checkout(tmp_path)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import fasttran; print(fasttran.__file__); print(fasttran._C.version)")]
    _run_notebook(nb, str(repo), timeout=300)
    out = _text(nb.cells[0])
    assert out.splitlines()[0] == fasttran.__file__, out
    assert out.splitlines()[1] == fasttran.__version__
