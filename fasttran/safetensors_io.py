"""safetensors files for trainer checkpoints: named arrays, written atomically (temp file,
fsync, rename) and verified on read (size and CRC-32C recorded by the writer's caller, then a
bounds-checked header). The encoder's weights use the C reader/writer (csrc/io/safetensors.c);
heads and optimizer states are small and written here."""
import json
import struct

import numpy as np

from . import _C
from .cache import _atomic_write
from .errors import CheckpointError

_DT = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int32): "I32",
       np.dtype(np.int64): "I64"}
_NP = {v: k for k, v in _DT.items()}


def write_safetensors(path, tensors, metadata=None):
    """Write {name: array} to `path`; returns {"bytes": n, "crc32c": c} for the caller to record."""
    header, off, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _DT:
            raise CheckpointError(f"cannot store tensor {name!r} of dtype {a.dtype}")
        header[name] = {"dtype": _DT[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        blobs.append(a.reshape(-1).view(np.uint8))
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    size, crc = _atomic_write(path, [struct.pack("<Q", len(h)), h, *blobs])
    return {"bytes": size, "crc32c": crc}


def read_safetensors(path, expect=None):
    """{name: array} from `path`; with `expect` ({"bytes", "crc32c"}) the file must match it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    if expect is not None:
        if len(data) != expect["bytes"]:
            raise CheckpointError(f"{path} is truncated or altered: {len(data)} bytes, expected {expect['bytes']}")
        if _C.crc32c(data) != expect["crc32c"]:
            raise CheckpointError(f"{path} is corrupt: its CRC-32C does not match the one recorded when it was written")
    if len(data) < 8:
        raise CheckpointError(f"{path} is truncated ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise CheckpointError(f"{path}: bad header: {e}") from None
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _NP.get(info.get("dtype"))
        a, b = info.get("data_offsets", [0, -1])
        shape = info.get("shape", [])
        if dt is None or not 0 <= a <= b <= len(data) - base or (b - a) != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name!r} has a bad dtype, shape or offsets")
        out[name] = np.frombuffer(data, dt, (b - a) // dt.itemsize, base + a).reshape(shape).copy()
    return out
