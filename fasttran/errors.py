"""One exception hierarchy. Every error raised by fasttran is a FastTranError and also the
built-in type a caller would expect (ValueError for bad values, TypeError for bad dtypes,
FileNotFoundError for a missing file...), so generic handlers keep working."""


class FastTranError(Exception):
    """Base class of every fasttran error."""


class InputError(FastTranError, ValueError):
    """An argument has a bad value or shape (empty batch, mismatched shapes, bad option)."""


class InputTypeError(FastTranError, TypeError):
    """An array or tensor has a dtype or type fasttran cannot take."""


class InputRangeError(InputError, IndexError):
    """A value is out of range: a token id >= vocab_size, a type id >= type_vocab_size..."""


class CheckpointError(FastTranError, ValueError):
    """A checkpoint file is corrupt, truncated, inconsistent, or does not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint describes a model fasttran does not implement (named in the message)."""


class CheckpointNotFoundError(FastTranError, FileNotFoundError):
    """A checkpoint directory or file does not exist."""


class FastTranIOError(FastTranError, OSError):
    """Reading or writing a file failed (permissions, disk full...)."""


class UnsupportedError(FastTranError, NotImplementedError):
    """An operation is not available in this build or on this backend."""


class BackendError(FastTranError, RuntimeError):
    """The compute backend failed (no CUDA device, CUDA or cuBLAS error)."""


class CacheCorruptError(FastTranIOError):
    """A cache file is truncated, altered or missing: never returned as data."""


class CacheMismatchError(FastTranError, ValueError):
    """A cache was built with another model, other inputs or other settings."""


class CacheNotFoundError(FastTranIOError, FileNotFoundError):
    """No activation cache at the given path (the directory or its manifest.json is missing)."""


class NoGPUError(BackendError, UnsupportedError):
    """A CUDA device was asked for but there is no usable GPU; the message says why (no CUDA
    backend in this build, no NVIDIA driver, a driver older than the CUDA runtime, no device)."""


class MissingDependencyError(FastTranError, ImportError):
    """An optional package is needed for this feature; the message names the pip command."""


class CollectiveError(FastTranError, RuntimeError):
    """A collective of fasttran.distributed failed: the ranks called different collectives, a
    rank reported a failure, or a rank died; the message names the ranks and what each did."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout: a rank never reached it (it
    diverged, hangs, or died); the message says where each rank was last seen."""
