"""fasttran: fast fine-tuning of BERT-family encoders with a C/CUDA core.

    >>> import fasttran
    >>> enc = fasttran.Encoder.from_pretrained("path/to/all-MiniLM-L6-v2")
    >>> emb = enc.encode(["a sentence", "another one"])        # (2, 384) float32
"""
import os as _os
import sys as _sys


def _has_extension(d):
    try:
        return any(n.startswith("_C.") and n.endswith((".so", ".pyd")) for n in _os.listdir(d))
    except OSError:
        return False


def _compiled_copy_elsewhere():
    """The directory of an installed, compiled fasttran further down sys.path, when this one is
    a source checkout's uncompiled folder that shadows it (a notebook or script started in the
    repository folder puts that folder first on sys.path); else None."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _has_extension(here) or not _os.path.isfile(_os.path.join(_os.path.dirname(here), "setup.py")):
        return None
    for entry in _sys.path:
        d = _os.path.join(_os.path.abspath(entry or _os.getcwd()), "fasttran")
        if (_os.path.realpath(d) != _os.path.realpath(here) and _os.path.isfile(_os.path.join(d, "__init__.py"))
                and _has_extension(d)):
            return d
    return None


_elsewhere = _compiled_copy_elsewhere()
if _elsewhere is not None:
    # Import the installed package instead: it becomes sys.modules["fasttran"] (what `import
    # fasttran` returns) and this module's submodule path points at it, so the imports below
    # resolve to the installed, compiled modules as well.
    from importlib import util as _ilu
    _spec = _ilu.spec_from_file_location(__name__, _os.path.join(_elsewhere, "__init__.py"),
                                         submodule_search_locations=[_elsewhere])
    _installed = _ilu.module_from_spec(_spec)
    _sys.modules[__name__] = _installed
    _spec.loader.exec_module(_installed)
    __path__[:] = [_elsewhere]

from . import errors  # first: the C module looks its exception classes up here

# The CPU backend's OpenMP workers spin briefly, then sleep: GOMP_SPINCOUNT=1000 (libgomp's
# default is 300,000; OMP_WAIT_POLICY=passive is 0). A batch-1 forward is dozens of short
# parallel regions, and waking a sleeping worker for each costs more than the region (2 threads,
# MiniLM int8, one SST-2 sentence: 2.9 ms passive, 1.3 ms with the short spin); a spin this short
# wastes little on a machine shared with a busy process (batches of 32 there: as fast as passive,
# benchmarks/RESULTS.md "Steady under load"). OpenMP reads this once, when its runtime loads with
# our module, so it is set just for that moment (and left alone when the user chose a policy or
# a spin count): torch or others imported later keep their own defaults.
_set_wait = "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ
if _set_wait:
    _os.environ["GOMP_SPINCOUNT"] = "1000"
try:
    from . import _C
except ImportError as _e:  # pragma: no cover - depends on how Python was started
    import os as _os
    _src = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if _os.path.exists(_os.path.join(_src, "setup.py")):
        raise ImportError(
            f"fasttran is being imported from its source folder {_src}, which has no compiled "
            "extension. Run from another directory, or with `python -P` (so the installed "
            "package is used), or install in place with `pip install -e .`") from _e
    raise
finally:
    if _set_wait:
        del _os.environ["GOMP_SPINCOUNT"]
from ._info import build_info, cuda_available, get_num_threads, set_num_threads
from .cache import ActivationCache
from .encoder import Encoder
from . import optim
from . import models
from . import metrics, readers, tokens
from .tokens import words_from_tokens
from .heads import ClassificationHead, MultiLabelHead, QAHead, RegressionHead, TokenClassificationHead
from .trainer import Trainer
from .profiling import Profile, profile
from . import distributed   # torch is imported only when a process group is asked for

Tensor = _C.Tensor   # device/host tensor with DLPack export and import (csrc/python/tensor_type.c)


def from_dlpack(obj, stream=None):
    """Wrap any DLPack producer (torch, CuPy, NumPy) as a :class:`Tensor`, zero-copy."""
    return _C.Tensor.from_dlpack(obj, stream=stream)

from .errors import (
    BackendError,
    CacheCorruptError,
    CacheMismatchError,
    CacheNotFoundError,
    CheckpointError,
    CollectiveError,
    CollectiveTimeoutError,
    CheckpointNotFoundError,
    FastTranError,
    FastTranIOError,
    InputError,
    InputRangeError,
    InputTypeError,
    MissingDependencyError,
    NoGPUError,
    UnsupportedError,
    UnsupportedModelError,
)

__version__ = _C.version

__all__ = [
    "Encoder", "ActivationCache", "Trainer", "ClassificationHead", "RegressionHead", "MultiLabelHead",
    "TokenClassificationHead", "QAHead", "optim", "Tensor", "from_dlpack", "build_info", "cuda_available", "get_num_threads", "set_num_threads",
    "FastTranError", "InputError", "InputTypeError", "InputRangeError", "CheckpointError",
    "CheckpointNotFoundError", "UnsupportedModelError", "UnsupportedError", "BackendError", "CacheCorruptError", "CacheMismatchError",
    "FastTranIOError", "CacheNotFoundError", "NoGPUError", "MissingDependencyError", "models", "profile", "Profile",
    "metrics", "readers", "tokens", "words_from_tokens",
    "CollectiveError", "CollectiveTimeoutError", "distributed",
]
