"""A cache build split over the ranks of a process group (fasttran.distributed).

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
import hashlib
import json
import os
import time
import uuid

import numpy as np

from ..errors import CacheCorruptError, CacheMismatchError, FastTranIOError, InputError
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


def _digest(cache):
    """What a rank builds: model, settings, example ids and input fingerprints."""
    from .layout import model_fingerprint
    h = hashlib.sha256(model_fingerprint(cache.encoder).encode())
    h.update(json.dumps(cache._settings(), sort_keys=True).encode())
    h.update(np.ascontiguousarray(cache.example_ids).tobytes())
    h.update(np.ascontiguousarray(cache._fps).tobytes())
    return h.hexdigest()


def _kernels(cache):
    """What computes this rank's rows: the CPU kernel set, or the CUDA devices. Ranks that differ
    write correct shards whose last bits differ from one another's."""
    from .. import _C
    if cache.encoder is None or not cache.encoder.device.is_cuda:
        return f"cpu {_C.cpu_isa()}"
    return f"{cache.encoder.device} {_C.cuda_probe()[1]}"


def split(cache, todo, parts):
    """The shards of `todo` cut into `parts` contiguous runs of about equal encoder work (a
    token of an example of length L costs about 6 hidden + L: its projections and attention);
    part k holds the shards whose middle of work falls in the k-th fraction of the total."""
    if not todo:
        return [[] for _ in range(parts)]
    L = cache._lengths.astype(np.float64)
    cost = np.array([float((L[idx] * (6 * cache.hidden + L[idx])).sum()) + 1.0 for _, idx in todo])
    mid = np.cumsum(cost) - cost / 2
    owner = np.minimum(parts - 1, (mid * parts / cost.sum()).astype(np.int64))
    return [[t for t, o in zip(todo, owner) if o == k] for k in range(parts)]


def _open_as_main(cache, path, rebuild, run):
    """Phase 1 on rank 0: the directory opened as a one-process build opens it, the verified
    shards of earlier journals, and the token the other ranks look for."""
    cache._open_dir_for_build(path, rebuild)
    man = cache._manifest
    listed = {e["file"] for e in man["shards"]}
    journal, seen = [], set(listed)
    if not man["complete"]:
        for e in persist.read_journal_entries(path, man):
            b = persist.shard_batch(e)
            if e["file"] in seen or b >= cache._n_plan_batches:
                continue
            ex, rows = cache._shard_plan(b)
            if not len(ex) or e["rows"] != rows:
                continue
            entry = {k: e[k] for k in ("file", "bytes", "crc32c", "rows")}
            try:   # the whole file: size, checksum, header, examples
                persist.open_shard(path, entry, man, ex, cache.example_ids[ex], rows, verify=True)
            except (CacheCorruptError, FastTranIOError):
                continue
            journal.append(e)
            seen.add(e["file"])
    token = f".fasttran-shared-{run}"
    with open(os.path.join(path, token), "w"):
        pass
    return {"manifest": man, "journal": journal, "token": token, "run": run}


def _sees(path, token, wait=10.0):
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


def build(cache, g, disk_dir, rebuild, show_progress):
    """Build `cache` (set up, no shard yet) into disk_dir, split over group `g`."""
    from .activation import add_error
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(disk_dir))
    # 1. open
    opened, err = None, None
    if g.is_main:
        try:
            opened = _open_as_main(cache, path, rebuild, uuid.uuid4().hex[:12])
        except BaseException as e:
            err = e
    got = g.wait_all("cache build: open the directory", {"path": path, "digest": _digest(cache), "opened": opened,
                                                          "kernels": _kernels(cache)}, failed=err)
    if err is not None:
        raise err
    main = got[0]["opened"]
    kinds = sorted({x["kernels"] for x in got})
    if len(kinds) > 1 and g.is_main:
        import warnings
        warnings.warn("the ranks compute with different kernels (" + "; ".join(
            f"{k}: ranks {[r for r, x in enumerate(got) if x['kernels'] == k]}" for k in kinds) + "): the cache is "
            "correct, but its rows differ in the last bits from a build on one kind of machine", RuntimeWarning,
            stacklevel=3)
    # 2. check
    problem = None
    if any(x["path"] != path for x in got):
        problem = ("the ranks passed different disk_dir paths (" + ", ".join(f"rank {r}: {x['path']}" for r, x in
                                                                            enumerate(got)) + ")")
    elif got[0]["digest"] != _digest(cache):
        problem = (f"rank {g.rank} builds another cache than rank 0 (other inputs, model or settings); every rank must "
                   "call build with the same arguments")
    elif not g.is_main and not _sees(path, main["token"]):
        problem = (f"rank {g.rank} does not see the files rank 0 wrote into {path}: the directory is not shared "
                   "between the ranks (another machine's local disk?)")
    problems = g.wait_all("cache build: check the directory", problem)
    if g.is_main:
        try:
            os.unlink(os.path.join(path, main["token"]))
        except OSError:
            pass
    problems = [p for p in problems if p]
    if problems:
        cls = CacheMismatchError if "another cache" in problems[0] else InputError
        raise cls(f"a cache build split over {g.world_size} ranks: {problems[0]}. A split build writes one cache "
                  "into one directory that every rank sees; pass group=False to build one cache per rank")
    cache.path, man = path, main["manifest"]
    cache._manifest, cache._err, cache._build_seconds = man, man["error"], man["build_seconds"]
    if man["complete"]:   # built already: open it
        cache._load_shards(man["shards"])
        return
    # 3. build this rank's part
    done = {e["file"] for e in man["shards"]} | {e["file"] for e in main["journal"]}
    todo = cache._todo(done)
    part = split(cache, todo, g.world_size)[g.rank]
    counter = f"cache build {main['run']}"
    bar = None
    if show_progress is not False and todo:
        from .._progress import progress
        bar = progress(total=len(todo), desc="build cache", unit="batch", delay=0 if show_progress else 2.0)

    def show():
        if bar is not None:
            n = g.count(counter, 0)
            if n != bar.n:
                bar.update(n - bar.n)

    mine, err = [], None
    journal = persist.journal_name(main["run"], g.rank)
    try:
        for b, idx in part:
            vals, sc, e = cache._encode_shard(idx)
            entry = cache._write_shard(b, idx, vals, sc)
            entry["error"] = [float(x) for x in e]
            mine.append(entry)
            persist.write_journal(path, journal, man, mine)
            g.count(counter, 1)
            show()
    except BaseException as e:   # Ctrl-C too: the other ranks stop at the next phase, naming it
        err = e
    try:
        got = g.wait_all("cache build: shards", mine, failed=err, poll=show)
    finally:
        if bar is not None:
            bar.close()
    if err is not None:
        raise err
    # 4. the manifest
    final = None
    if g.is_main:
        try:
            extra = sorted(main["journal"] + [e for entries in got for e in entries], key=persist.shard_batch)
            final = dict(man)
            final["shards"] = sorted(man["shards"] + [{k: e[k] for k in ("file", "bytes", "crc32c", "rows")}
                                                      for e in extra], key=persist.shard_batch)
            error = man["error"]
            for e in extra:   # plan order: the sums a one-process build makes, to the bit
                error = add_error(error, e["error"])
            final.update(error=error, complete=True, build_seconds=man["build_seconds"] + time.perf_counter() - t0)
            persist.write_manifest(path, final)
            persist.remove_journals(path)
        except BaseException as e:
            err = e
    final = g.wait_all("cache build: manifest", final, failed=err)
    if err is not None:
        raise err
    final = final[0]
    cache._manifest, cache._err, cache._build_seconds = final, final["error"], final["build_seconds"]
    cache._load_shards(final["shards"])
