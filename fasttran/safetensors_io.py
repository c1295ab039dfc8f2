"""safetensors files for trainer checkpoints and CLI outputs, through the one C reader and writer
(csrc/io/safetensors.c, the same code that reads and writes the encoder's weights): written
atomically (temp file, fsync, rename, fsync of the directory) and verified on read (the size and
CRC-32C the writer's caller recorded, then the bounds-checked header)."""
import os

from . import _C
from .errors import CheckpointError, CheckpointNotFoundError


def write_safetensors(path, tensors, metadata=None):
    """Write {name: array} (names sorted) to `path`; returns {"bytes": n, "crc32c": c} for the
    caller to record."""
    pairs = [(name, tensors[name]) for name in sorted(tensors)]
    meta = None if not metadata else {str(k): str(v) for k, v in metadata.items()}
    size, crc = _C.safetensors_write(os.fspath(path), pairs, meta)
    return {"bytes": size, "crc32c": crc}


def read_safetensors(path, expect=None):
    """{name: array} from `path`; with `expect` ({"bytes", "crc32c"}) the file must match it
    (checked before its header is read). Any problem is a CheckpointError."""
    eb, ec = -1, -1
    if expect is not None:
        try:
            eb, ec = int(expect["bytes"]), int(expect["crc32c"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"the record of {path} ({expect!r}) is not {{'bytes': int, 'crc32c': int}}") from None
        if eb < 0 or not 0 <= ec < 2 ** 32:
            raise CheckpointError(f"the record of {path} ({expect!r}) is out of range")
    try:
        return _C.safetensors_read(os.fspath(path), expect_bytes=eb, expect_crc32c=ec)
    except CheckpointNotFoundError:
        raise CheckpointError(f"{path} is missing") from None


def write_file(path, data):
    """Write the bytes `data` to `path` atomically by the project's one writer (temp file, fsync, rename,
    fsync of the directory); returns {"bytes": n, "crc32c": c} for the caller to record."""
    size, crc = _C.atomic_write(os.fspath(path), [bytes(data)])
    return {"bytes": int(size), "crc32c": int(crc)}


def crc32c(data):
    """CRC-32C (Castagnoli) of the bytes `data`, as file records hold it."""
    return int(_C.crc32c(bytes(data)))
