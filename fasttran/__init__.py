"""fasttran: fast fine-tuning of BERT-family encoders with a C/CUDA core.

    >>> import fasttran
    >>> enc = fasttran.Encoder.from_pretrained("path/to/all-MiniLM-L6-v2")
    >>> emb = enc.encode(["a sentence", "another one"])        # (2, 384) float32
"""
from . import errors  # first: the C module looks its exception classes up here
from . import _C
from ._info import build_info, cuda_available, get_num_threads, set_num_threads
from .encoder import Encoder
from .errors import (
    BackendError,
    CheckpointError,
    CheckpointNotFoundError,
    FastTranError,
    InputError,
    InputRangeError,
    InputTypeError,
    UnsupportedError,
    UnsupportedModelError,
)

__version__ = _C.version

__all__ = [
    "Encoder", "build_info", "cuda_available", "get_num_threads", "set_num_threads",
    "FastTranError", "InputError", "InputTypeError", "InputRangeError", "CheckpointError",
    "CheckpointNotFoundError", "UnsupportedModelError", "UnsupportedError", "BackendError",
]
