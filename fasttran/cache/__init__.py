"""The activation cache (``fasttran.ActivationCache``), in four parts:

  layout.py         the inputs kept per example, the build plan (length-sorted batches = shards),
                    row sizes, fingerprints of inputs and model
  tiers.py          where each shard lives (host memory, memory-mapped disk file, nowhere)
  persist.py        the cache directory: manifest, index and shard files, written atomically and
                    checked against each other on read
  torch_adapter.py  a torch Dataset over a cache
  activation.py     ActivationCache itself: build, open, get, batches, stats
  parallel.py       a build split over the ranks of a process group (fasttran.distributed)

Reading happens in C (csrc/cache/store.c and reader.c, bound as _C.CacheStore / CacheReader).
"""
from .. import _C
from .activation import ActivationCache
from .layout import model_fingerprint
from .persist import FORMAT, VERSION
from .torch_adapter import CacheDataset

GlobalBatch = _C.GlobalBatch   # where a rank's slice sits in its global batch (batches(rank=, world_size=))

__all__ = ["ActivationCache", "CacheDataset", "GlobalBatch", "model_fingerprint", "FORMAT", "VERSION"]
