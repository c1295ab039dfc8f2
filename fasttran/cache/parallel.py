"""A cache build split over the ranks of a process group (fasttran.distributed): what it needs
besides the cache -- the group, the split of the work, the shared directory's check. The build
itself is the cache's own (ActivationCache._build_split in activation.py, which imports this
module; nothing here touches a cache).

Every rank holds the same inputs, hence the same plan. The plan's shards still to build are cut
into world_size contiguous parts of about equal encoder work; each rank encodes its part and
writes those shard files into the cache directory, which every rank sees; rank 0 writes the
manifest once every shard's size, checksum and codec error has come back. The encoder's rows do
not depend on the batch, the padding or the thread count, and a shard is one plan batch however
the plan is split, so every file is the one a one-process build writes, byte for byte; the
manifest differs only in build_seconds (wall time).

Phases (every rank takes each; a failure on any rank ends the build on all with an error naming
the rank and its error -- wait_all, below):
  1. open    rank 0 opens the directory as a one-process build does (creating index and manifest,
             refusing another cache unless rebuild=True), collects the shards done earlier --
             those in the manifest, and those in the journals of an interrupted split build,
             each file checked against its size and checksum -- and leaves a token file; the
             ranks exchange their directory path and a digest of what they build.
  2. check   every rank sees the token (the directory is shared) and builds the same cache.
             A complete cache ends here: every rank opens it, nothing is built or written.
  3. build   each rank encodes its part; after each shard its journal
             (build-journal-<run>-r<rank>.json: the entries and their codec errors) is rewritten
             atomically, so an interrupted build resumes at any world size, or in one process.
  4. manifest  rank 0 writes the complete manifest (shards in plan order, the codec's error
             summed in plan order as one process sums it) and removes the journals; then every
             rank loads the shards it lists.
"""
import os
import time

import numpy as np

from ..errors import InputError
from . import persist


def build_group(group, disk_dir):
    """The group a build is split over, or None for the one-process build. `group`: None (the
    process group when this process was launched as one of several ranks), False, or a
    fasttran.distributed group. A directory holding journals of an interrupted split build is
    resumed through the split path, in one process if need be."""
    from .. import distributed
    if group is False:
        g = None
    elif group is None:   # a cache in memory stays this rank's: no collective, not even init()
        g = distributed.init() if disk_dir is not None and distributed.launched() else None
    elif isinstance(group, distributed.Group):
        g = group
    else:
        raise InputError(f"group must be None, False or a fasttran.distributed group, got {group!r}")
    if g is not None and g.world_size > 1:
        if disk_dir is not None:
            return g
        raise InputError("a build split over the ranks writes shards that every rank reads: pass disk_dir, a "
                         "directory all ranks see (or group=False: each rank builds every shard itself)")
    if disk_dir is not None and persist.journal_names(os.path.abspath(os.fspath(disk_dir))):
        return g if g is not None else distributed.Group()
    return None


def kernels(encoder):
    """What computes this rank's rows with `encoder`: the CPU kernel set, or the CUDA devices.
    Ranks that differ write correct shards whose last bits differ from one another's."""
    from .. import _C
    if encoder is None or not encoder.device.is_cuda:
        return f"cpu {_C.cpu_isa()}"
    return f"{encoder.device} {_C.cuda_probe()[1]}"


def split(lengths, hidden, todo, parts):
    """The shards of `todo` ((plan batch, example positions) pairs) cut into `parts` contiguous
    runs of about equal encoder work (a token of an example of length L -- `lengths[i]` -- costs
    about 6 hidden + L: its projections and attention); part k holds the shards whose middle of
    work falls in the k-th fraction of the total."""
    if not todo:
        return [[] for _ in range(parts)]
    L = np.asarray(lengths).astype(np.float64)
    cost = np.array([float((L[idx] * (6 * hidden + L[idx])).sum()) + 1.0 for _, idx in todo])
    mid = np.cumsum(cost) - cost / 2
    owner = np.minimum(parts - 1, (mid * parts / cost.sum()).astype(np.int64))
    return [[t for t, o in zip(todo, owner) if o == k] for k in range(parts)]


def sees(path, token, wait=10.0):
    """The token is in the directory (listed afresh: a network file system may take a moment)."""
    end = time.monotonic() + wait
    while True:
        try:
            if token in os.listdir(path):
                return True
        except OSError:
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)
