"""Data parallelism over torch.distributed: the process group fasttran runs in, its collectives,
and each rank's share of the machine's CPUs.

    g = fasttran.distributed.init()            # on every rank (collective the first time)
    g.rank, g.world_size, g.local_rank, g.is_main, g.device
    g.all_reduce_(grads)                       # in place, zero-copy: NumPy arrays via torch.from_numpy
    h = g.all_reduce_(bucket, async_op=True)   # ... more work ...; h.wait()
    g.broadcast_object(obj), g.all_gather_object(obj), g.barrier("end of epoch 1")
    g.wait_all("cache build", result)          # after work of uneven length: waits while the others live

The group: torch's default process group when one exists (torchrun + the user's
init_process_group, accelerate, Ray Train), else one started from the environment torchrun and
Slurm + torchrun set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE):
gloo on the CPU, NCCL when fasttran and torch see a GPU (one process per GPU, LOCAL_RANK picks it).
Without either, init() returns a one-process group whose collectives return at once, and torch is
never imported: importing fasttran never imports torch.

Threads: a rank's default thread count is its share of its machine's CPUs -- the CPUs it may use
(affinity mask, cgroup quota) divided among the ranks on the same machine that may use them -- so
two ranks on two cores take one thread each. FASTTRAN_NUM_THREADS or fasttran.set_num_threads
choose another count; OMP_NUM_THREADS does not (torchrun sets it to 1 for every worker).

A rank that diverges gets an error, not a hang. Every collective is numbered; before it the
ranks exchange a fixed-size tag (number, operation, what it is for, bytes) on a gloo group of
fasttran's own whose timeout is the group's `timeout` (default 60 s, FASTTRAN_DIST_TIMEOUT):
  * different tags: CollectiveError on every rank at once, naming what each rank called;
  * a rank that does not arrive within the timeout: CollectiveTimeoutError saying where each
    rank was last seen -- every rank publishes the collective it enters, a heartbeat each second
    and its exit in the job's key-value store (the one the process group was made with).
`wait_all` ends phases of uneven length (a cache build's parts): it goes through the store and
waits as long as the missing ranks live, failing at once when one reports a failure, enters
another collective or exits, and after the timeout when its heartbeat stops.
"""
import atexit
import os
import pickle
import re
import socket
import struct
import sys
import threading
import time
import uuid

import numpy as np

from .errors import (CollectiveError, CollectiveTimeoutError, InputError, InputTypeError, MissingDependencyError,
                     NoGPUError)

DEFAULT_TIMEOUT = 60.0   # seconds: a collective some rank never reaches fails after this long
_HEARTBEAT = 1.0         # seconds between a rank's heartbeats in the store

_group = None
_lock = threading.Lock()


def _torch():
    """(torch, torch.distributed), or MissingDependencyError naming the install command."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise MissingDependencyError(
            "a process group of several ranks needs PyTorch (torch.distributed: gloo on CPUs, NCCL on GPUs): "
            f"pip install torch ({e})") from None
    if not dist.is_available():
        raise MissingDependencyError("this torch build has no torch.distributed: install a standard build "
                                     "(pip install torch)")
    return torch, dist


def _env_int(name):
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise InputError(f"environment variable {name}={v!r} is not an integer") from None


def _default_timeout(timeout):
    if timeout is None:
        env = os.environ.get("FASTTRAN_DIST_TIMEOUT", "").strip()
        if not env:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(env)
        except ValueError:
            raise InputError(f"FASTTRAN_DIST_TIMEOUT={env!r} is not a number of seconds") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InputError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _torch_group_running():
    """torch's default process group exists (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def launched():
    """True when this process is one of several ranks: a process group exists, or the
    environment says WORLD_SIZE > 1 (torchrun, Slurm + torchrun). Not a collective."""
    if _group is not None:
        return _group.world_size > 1
    if _torch_group_running():
        return sys.modules["torch.distributed"].get_world_size() > 1
    try:
        return (_env_int("WORLD_SIZE") or 1) > 1
    except InputError:
        return False


def is_main():
    """True on rank 0, and outside any process group. Not a collective: safe in code that only
    some ranks run (progress bars, printing)."""
    if _group is not None:
        return _group.is_main
    if _torch_group_running():
        return sys.modules["torch.distributed"].get_rank() == 0
    try:
        return (_env_int("RANK") or 0) == 0
    except InputError:
        return True


def init(backend=None, timeout=None):
    """This process's group (a :class:`Group`); collective the first time, so every rank calls
    it (fasttran's distributed parts call it for you). Joins torch's default process group when
    one exists, else starts one from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; `backend` "gloo" or "nccl", or FASTTRAN_DIST_BACKEND; default NCCL when fasttran
    and torch see a GPU), else returns the one-process group (a backend asked for starts a real
    group even for one rank). `timeout`: seconds before a collective some rank
    never reaches fails (default 60, or FASTTRAN_DIST_TIMEOUT). Later calls return the same
    group."""
    global _group
    with _lock:
        if _group is not None:
            return _group
        timeout = _default_timeout(timeout)
        backend = backend or os.environ.get("FASTTRAN_DIST_BACKEND") or None
        if backend is not None and backend not in ("gloo", "nccl"):
            raise InputError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
        world = _env_int("WORLD_SIZE")
        if not _torch_group_running() and (world is None or world == 1) and backend is None:
            _group = Group(timeout=timeout)
            _apply_threads(_group, None)
            return _group
        torch, dist = _torch()
        created = False
        if dist.is_initialized() and backend is not None and str(dist.get_backend()) != backend:
            raise InputError(f"backend={backend!r} was asked for, but the process group already running uses "
                             f"{str(dist.get_backend())!r}; fasttran joins the running group")
        if not dist.is_initialized():
            missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:
                raise InputError(f"no process group to join: {', '.join(missing)} not set in the environment. Start "
                                 "the ranks with torchrun (torchrun --nproc-per-node=N ...), or call "
                                 "torch.distributed.init_process_group first")
            backend = _choose_backend(backend, torch, dist)
            kw = {}
            if backend == "nccl":
                dev = torch.device("cuda", _cuda_index(torch, _env_int("LOCAL_RANK") or 0,
                                                       _env_int("LOCAL_WORLD_SIZE") or 1))
                torch.cuda.set_device(dev)
                kw["device_id"] = dev
            from datetime import timedelta
            kw.update(_attempt_store(dist, timedelta(seconds=timeout)))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **kw)
            created = True
        _group = _TorchGroup(torch, dist, timeout, created)
        return _group


get_group = init


def _attempt_store(dist, timeout):
    """torchrun's static rendezvous (its default; --max-restarts) keeps one key-value store for
    every attempt of a job: a restarted rank could read the address a rank of the failed attempt
    published and wait on a process that is gone. Each attempt gets keys of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _env_int("WORLD_SIZE"),
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"fasttran/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store),
            "rank": _env_int("RANK"), "world_size": _env_int("WORLD_SIZE")}


def shutdown():
    """Leave the group: destroys the process group if init() started it. A later init() joins
    or starts a new one."""
    global _group
    with _lock:
        g, _group = _group, None
    if g is not None:
        g._close()


def _choose_backend(backend, torch, dist):
    from ._info import cuda_available
    if backend is None:
        backend = "nccl" if cuda_available() and torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise MissingDependencyError("backend='nccl' needs a torch built with NCCL (the CUDA builds of "
                                         "pip install torch); use backend='gloo' on CPUs")
        if not torch.cuda.is_available():
            raise NoGPUError("backend='nccl' needs a CUDA GPU per rank, and torch sees none; use backend='gloo'")
    elif backend != "gloo":
        raise InputError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return backend


def _cuda_index(torch, local_rank, local_world):
    """The GPU of a rank: LOCAL_RANK, or 0 when the launcher shows each rank one GPU."""
    n = torch.cuda.device_count()
    if local_rank < n:
        return local_rank
    if n == 1:
        return 0
    raise NoGPUError(f"local rank {local_rank} has no GPU of its own: this machine shows {n} GPU(s) to "
                     f"{local_world} ranks; start one rank per GPU (torchrun --nproc-per-node={n})")


def _apply_threads(group, hosts):
    """Set this rank's thread count to its share of its machine's CPUs (unless chosen)."""
    from . import _C, _info
    group.threads = _C.num_threads()
    if _info.threads_chosen or os.environ.get("FASTTRAN_NUM_THREADS", "").strip() or not hosts:
        return
    mine = hosts[group.rank]
    peers = [h for h in hosts if h[0] == mine[0]]
    if len(peers) < 2:
        cpus_share = mine[2]
    else:   # each CPU of this rank's mask is shared by the ranks of this machine whose masks hold it
        users = {}
        for _, mask, _count in peers:
            for c in mask:
                users[c] = users.get(c, 0) + 1
        share = sum(1.0 / users[c] for c in mine[1])
        cpus_share = mine[2] * share / max(1, len(mine[1]))   # the quota-capped count, in proportion
    n = max(1, int(cpus_share + 1e-9))
    if n != group.threads:
        _C.set_num_threads(n)
    group.threads = _C.num_threads()


class Group:
    """A process group as fasttran uses it: rank, world_size, local_rank / local_world_size
    (ranks on this machine), backend, device (this rank's: "cpu" or "cuda:N"), threads, timeout,
    and the collectives. This base class is the one-process group: its collectives return at
    once."""

    def __init__(self, timeout=DEFAULT_TIMEOUT):
        self.rank, self.world_size, self.local_rank, self.local_world_size = 0, 1, 0, 1
        self.backend, self.device, self.timeout, self.threads = None, "cpu", timeout, None
        self._seq = 0

    @property
    def is_main(self):
        """rank 0: the rank that prints and writes shared files"""
        return self.rank == 0

    def __repr__(self):
        return (f"Group(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"local_world_size={self.local_world_size}, backend={self.backend!r}, device={self.device!r}, "
                f"threads={self.threads}, timeout={self.timeout:g}s)")

    # ---- collectives (one process: nothing to exchange) ------------------------------------------
    def all_reduce_(self, x, op="sum", async_op=False, what=None, check=True):
        """Reduce `x` over the ranks in place (op "sum", "max" or "min") and return it; with
        async_op a :class:`Work` whose wait() returns it. `x`: a C-contiguous writable NumPy
        array (shared with torch through torch.from_numpy: no copy), a fasttran.Tensor (through
        DLPack: CUDA tensors go through NCCL) or a torch tensor. `what` names it in errors (the
        same text on every rank). check=False skips the tag exchange (for the buckets of one
        step after one checked collective)."""
        _check_op(op)
        _check_array(x)
        return Work(x) if async_op else x

    def broadcast_object(self, obj, src=0, what=None):
        """`obj` of rank `src` (a picklable object), on every rank."""
        return obj

    def all_gather_object(self, obj, what=None):
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        return [obj]

    def barrier(self, what=None):
        """Wait until every rank reaches this point."""

    def wait_all(self, what, obj=None, failed=None, poll=None):
        """End a phase whose length differs between ranks: every rank's `obj` (a list), once all
        have arrived. It waits as long as the missing ranks live; it fails at once when a rank
        reports a failure (CollectiveError naming it and its error), enters another collective
        or exits, and after `timeout` seconds (at least 5) without a heartbeat from one. A rank whose work
        failed passes `failed` (the exception): the others learn of it, and it returns None (the
        caller re-raises). `poll()` is called while waiting (progress bars)."""
        return None if failed is not None else [obj]

    def count(self, name, k=1):
        """Add k to the counter `name` the ranks share, and return its value (k=0 reads it).
        Not a collective (progress of work split over the ranks)."""
        counts = self.__dict__.setdefault("_counts", {})
        counts[name] = counts.get(name, 0) + k
        return counts[name]

    # ---- watching the other ranks outside a collective (work the ranks share by other means) -----
    @property
    def one_machine(self):
        """Every rank runs on this machine (so they can share memory)."""
        return True

    def check_peers(self, what, beats, now):
        """While this rank waits for the others outside the group's collectives (`what`: the text
        errors name it by; `beats`: a dict kept between calls; `now`: time.monotonic()): raises
        CollectiveError when a rank exited, failed or went on to a later collective,
        CollectiveTimeoutError when its heartbeat stopped. One process: nothing to watch."""

    def whereabouts(self):
        """Lines saying where each other rank was last seen (for a timeout's message)."""
        return []

    def _close(self):
        pass


def _check_op(op):
    if op not in ("sum", "max", "min"):
        raise InputError(f"op must be 'sum', 'max' or 'min', got {op!r}")


def _check_array(x):
    if isinstance(x, np.ndarray):
        if not (x.flags.c_contiguous and x.flags.writeable):
            raise InputError("all_reduce_ reduces in place into a C-contiguous writable array; this one is "
                             f"{'not C-contiguous' if not x.flags.c_contiguous else 'read-only'} (shape {x.shape}): pass "
                             "the contiguous buffer it views (e.g. the flat gradient table), not a copy")
        return
    from . import _C
    if isinstance(x, _C.Tensor) or type(x).__module__.startswith("torch"):
        return
    raise InputTypeError(f"all_reduce_ takes a NumPy array, a fasttran.Tensor or a torch tensor, got {type(x).__name__}")


class Work:
    """An asynchronous collective in flight: wait() returns its result (the array reduced in
    place), raising the collective's error; is_completed() does not wait."""

    def __init__(self, result, work=None, group=None, about=None, cuda=False):
        self._result, self._work, self._group, self._about, self._cuda = result, work, group, about, cuda
        self._done = work is None

    def is_completed(self):
        return self._done or self._work.is_completed()

    def wait(self):
        if not self._done:
            try:
                self._work.wait()
                if self._cuda:   # the reduced values are read next on fasttran's stream, not torch's
                    self._group._torch.cuda.current_stream().synchronize()
            except Exception as e:
                raise self._group._failure(*self._about, e) from None
            self._done = True
        return self._result

    def __repr__(self):
        what = f" {self._about[1]!r}" if self._about else ""
        return f"Work({'done' if self.is_completed() else 'in flight'}{what})"


# ---- several processes -----------------------------------------------------------------------------

_TAG = struct.Struct("<8sqq32s72s")   # magic, collective number, bytes, operation, what: 128 bytes
_MAGIC = b"FTDIST01"


def _text(b):
    return b.rstrip(b"\0").decode("utf-8", "replace")


class _TorchGroup(Group):
    def __init__(self, torch, dist, timeout, created):
        super().__init__(timeout)
        from datetime import timedelta
        self._torch, self._dist, self._created = torch, dist, created
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        # control messages (tags, objects) on a gloo group with fasttran's timeout; data on the default group
        self._ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:   # pragma: no cover - a torch without it: errors say less
            self._store = None
        ns = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(ns, src=0, group=self._ctrl)
        self._ns = f"fasttran/{ns[0]}/"
        from . import _C
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, (socket.gethostname(), sorted(os.sched_getaffinity(0)), _C.cpu_count()),
                               group=self._ctrl)
        same = [r for r, h in enumerate(hosts) if h[0] == hosts[self.rank][0]]
        self._hosts = [h[0] for h in hosts]
        lr, lw = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
        self.local_rank = lr if lr is not None else same.index(self.rank)
        self.local_world_size = lw if lw is not None else len(same)
        if self.backend == "nccl":
            self.device = f"cuda:{torch.cuda.current_device()}"
        _apply_threads(self, hosts)
        self._seq_lock = threading.Lock()
        self._last = (0, "", "")
        self._stop = threading.Event()
        self._beat = None
        if self._store is not None:
            self._beat = threading.Thread(target=self._heartbeat, name="fasttran-heartbeat", daemon=True)
            self._beat.start()
        atexit.register(self._at_exit)

    # ---- the store: what each rank is doing ------------------------------------------------------
    def _set(self, key, value):
        if self._store is not None:
            try:
                self._store.set(self._ns + key, value)
            except Exception:   # the store's server (rank 0's launcher) is gone: diagnostics only
                pass

    def _get(self, key):
        """The value of key, or None when absent (never blocks)."""
        if self._store is None:
            return None
        try:
            k = self._ns + key
            return self._store.get(k) if self._store.check([k]) else None
        except Exception:
            return None

    def count(self, name, k=1):
        if self._store is None:   # pragma: no cover
            return super().count(name, k)
        return self._store.add(self._ns + f"count/{name}", int(k))

    def _beats(self, r):
        try:
            return self._store.add(self._ns + f"beat/{r}", 0)
        except Exception:
            return None

    def _heartbeat(self):
        key = self._ns + f"beat/{self.rank}"
        while not self._stop.wait(_HEARTBEAT):
            try:
                self._store.add(key, 1)
            except Exception:
                return

    def _at_exit(self):
        seq, op, what = self._last
        self._set(f"exit/{self.rank}", f"{seq}\t{op}\t{what}")
        self._close()

    def _close(self):
        self._stop.set()
        if self._created and self._dist.is_initialized():
            try:
                self._dist.destroy_process_group()
            except Exception:
                pass
            self._created = False

    def _enter(self, op, what, publish=True):
        """Number the collective; publish it in the store (a round trip: not for unchecked ones)."""
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        self._last = (seq, op, what)
        if publish:
            self._set(f"state/{self.rank}", f"{seq}\t{op}\t{what}\t{time.time():.3f}")
        return seq

    def _whereabouts(self, wait_for_beats):
        """One line per other rank: where it was last seen."""
        if self._store is None:
            return ["  (the job's key-value store is not reachable: where the other ranks are is unknown)"]
        others = [r for r in range(self.world_size) if r != self.rank]
        before = {r: self._beats(r) for r in others}
        if wait_for_beats:
            time.sleep(2.5 * _HEARTBEAT)
        lines = []
        for r in others:
            ex, st, fail = (self._get(f"{k}/{r}") for k in ("exit", "state", "fail"))
            if ex is not None:
                seq, op, what = _text(ex).split("\t")[:3]
                lines.append(f"  rank {r} has exited (its last collective: #{seq} {op} {what!r})")
                continue
            if st is None:
                where = "has entered no fasttran collective yet"
            else:
                seq, op, what, t = _text(st).split("\t")[:4]
                where = f"last entered #{seq} {op} {what!r}, {max(0.0, time.time() - float(t)):.0f} s ago"
                if fail is not None:
                    where += " (where it failed too)"
            if wait_for_beats:
                after = self._beats(r)
                alive = before[r] is not None and after is not None and after != before[r]
                where += ("; it is alive" if alive else
                          "; no heartbeat for 2.5 s: its process died or is frozen")
            lines.append(f"  rank {r} {where}")
        return lines

    def _failure(self, op, what, exc):
        """The error for a collective that failed (timed out, or a peer's connection broke)."""
        seq = self._last[0]
        self._set(f"fail/{self.rank}", f"{seq}\t{op}\t{what}")
        text = str(exc)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        # gloo's words without its source location and advice: "Connection closed by peer [host]:port"
        said = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
        said = said.split(". ")[0][:200]
        head = (f"rank {self.rank}: collective #{seq} {op} {what!r} " +
                (f"did not complete within {self.timeout:g} s: a rank did not reach it" if timed_out
                 else f"failed ({said})"))
        lines = self._whereabouts(wait_for_beats=True)
        hint = ("every rank must call the same fasttran collectives in the same order; look for a rank that took "
                "other branches or had another number of batches, or one that died (its log)")
        cls = CollectiveTimeoutError if timed_out else CollectiveError
        return cls("\n".join([head + ". Where the other ranks are:", *lines, hint]))

    def _agree(self, op, what, nbytes=0):
        """The tag exchange before collective `op`: every rank must be at the same one."""
        seq = self._enter(op, what)
        mine = _TAG.pack(_MAGIC, seq, nbytes, op.encode()[:32], what.encode()[:72])
        t = self._torch.frombuffer(bytearray(mine), dtype=self._torch.uint8)
        tags = [self._torch.empty_like(t) for _ in range(self.world_size)]
        try:
            self._dist.all_gather(tags, t, group=self._ctrl)
        except Exception as e:
            raise self._failure(op, what, e) from None
        tags = [bytes(x.numpy()) for x in tags]
        if all(x == mine for x in tags):
            return
        lines = []
        for r, x in enumerate(tags):
            magic, s, nb, o, w = _TAG.unpack(x)
            if magic != _MAGIC:
                lines.append(f"  rank {r}: a collective not made through fasttran.distributed")
            else:
                lines.append(f"  rank {r}: #{s} {_text(o)} {_text(w)!r}" + (f" ({nb} bytes)" if nb else ""))
        self._set(f"fail/{self.rank}", f"{seq}\t{op}\t{what}")
        raise CollectiveError("\n".join(
            [f"the ranks called different collectives at fasttran collective #{seq}:", *lines,
             "every rank must call the same fasttran collectives, in the same order, with the same sizes; look for "
             "a branch only some ranks take (a collective under `if group.is_main:`) or ranks with different "
             "numbers of batches"]))

    # ---- collectives ---------------------------------------------------------------------------------
    def _as_torch(self, x):
        torch = self._torch
        _check_array(x)
        if isinstance(x, np.ndarray):
            return torch.from_numpy(x)   # the same memory: the result lands in x
        if not isinstance(x, torch.Tensor):
            if x.__dlpack_device__()[0] != 1 and not torch.cuda.is_available():
                raise NoGPUError("the data to reduce is in GPU memory, but this PyTorch has no CUDA: install a CUDA "
                                 "build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128), "
                                 "or train on the CPU (device='cpu')")
            x = torch.from_dlpack(x)     # fasttran.Tensor: the same memory (host or device)
        if not x.is_contiguous():
            raise InputError("all_reduce_ needs a contiguous tensor")
        return x

    def all_reduce_(self, x, op="sum", async_op=False, what=None, check=True):
        _check_op(op)
        t = self._as_torch(x)
        what = what or "all_reduce_"
        name = f"all_reduce_ {op} {str(t.dtype).removeprefix('torch.')}"
        if check:
            self._agree(name, what, t.numel() * t.element_size())
        else:   # no round trip at all: the buckets of a step after its checked collective
            self._enter(name, what, publish=False)
        if t.is_cuda:
            if self.backend != "nccl":
                raise InputError(f"a CUDA tensor is reduced over NCCL, but this group's backend is {self.backend!r}: "
                                 "start the ranks with backend='nccl' (one GPU per rank)")
            group = None
        else:
            group = None if self.backend == "gloo" else self._ctrl   # NCCL groups reduce host arrays over gloo
        try:
            work = self._dist.all_reduce(t, op=self._ops[op], group=group, async_op=bool(async_op))
        except Exception as e:
            raise self._failure(name, what, e) from None
        if async_op:
            return Work(x, work, self, (name, what), cuda=t.is_cuda)
        if t.is_cuda:
            self._torch.cuda.current_stream().synchronize()
        return x

    def broadcast_object(self, obj, src=0, what=None):
        if not (isinstance(src, int) and 0 <= src < self.world_size):
            raise InputError(f"src must be a rank in 0..{self.world_size - 1}, got {src!r}")
        what = what or "broadcast_object"
        self._agree(f"broadcast_object from {src}", what)
        box = [obj if self.rank == src else None]
        try:
            self._dist.broadcast_object_list(box, src=src, group=self._ctrl)
        except Exception as e:
            raise self._failure("broadcast_object", what, e) from None
        return box[0]

    def all_gather_object(self, obj, what=None):
        what = what or "all_gather_object"
        self._agree("all_gather_object", what)
        out = [None] * self.world_size
        try:
            self._dist.all_gather_object(out, obj, group=self._ctrl)
        except Exception as e:
            raise self._failure("all_gather_object", what, e) from None
        return out

    def barrier(self, what=None):
        self._agree("barrier", what or "barrier")   # the tag exchange is itself a barrier

    def wait_all(self, what, obj=None, failed=None, poll=None):
        if self._store is None:   # pragma: no cover - no store: a plain gather on the control group
            if failed is not None:
                raise CollectiveError(f"rank {self.rank} failed during {what!r}: {failed}")
            return self.all_gather_object(obj, what)
        seq = self._enter("wait_all", what)
        kind = "ok" if failed is None else "failed"
        payload = obj if failed is None else f"{type(failed).__name__}: {failed}"
        self._store.set(self._ns + f"meet/{seq}/{self.rank}", pickle.dumps((what, kind, payload)))
        if failed is not None:
            self._set(f"fail/{self.rank}", f"{seq}\twait_all\t{what}")
            return None
        keys = [self._ns + f"meet/{seq}/{r}" for r in range(self.world_size)]
        t0 = time.monotonic()
        nap, next_look, next_note = 0.001, t0 + 1.0, t0 + 10 * self.timeout
        beats = {}
        try:
            while not self._store.check(keys):
                if poll is not None:
                    poll()
                now = time.monotonic()
                if now >= next_look:   # once a second: is every missing rank still on its way here?
                    next_look = now + 1.0
                    self._look_for_trouble(seq, what, keys, beats, now)
                if now >= next_note:   # alive but not coming: say so, and keep waiting
                    next_note = now + 10 * self.timeout
                    print(f"fasttran.distributed: rank {self.rank} has waited {now - t0:.0f} s at #{seq} wait_all "
                          f"{what!r}; the ranks not there yet are alive:\n" +
                          "\n".join(self._whereabouts(wait_for_beats=False)), file=sys.stderr, flush=True)
                time.sleep(nap)
                nap = min(0.05, nap * 2)
            values = [pickle.loads(self._store.get(k)) for k in keys]
        except CollectiveError:
            raise
        except Exception as e:   # the store's server (rank 0's process or launcher) is gone
            raise CollectiveError(f"rank {self.rank} lost the job's key-value store while it waited at #{seq} wait_all "
                                  f"{what!r} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}): "
                                  "the process that serves it (rank 0, or torchrun's agent) has exited or died") from None
        if poll is not None:
            poll()
        odd = [(r, w) for r, (w, _, _) in enumerate(values) if w != what]
        if odd:
            raise CollectiveError(f"the ranks called different collectives at fasttran collective #{seq}: this rank "
                                  f"(rank {self.rank}) wait_all {what!r}, " +
                                  ", ".join(f"rank {r} wait_all {w!r}" for r, w in odd))
        bad = [(r, p) for r, (_, k, p) in enumerate(values) if k == "failed"]
        if bad:
            raise CollectiveError("; ".join(f"rank {r} failed during {what!r}: {p}" for r, p in bad))
        return [p for _, _, p in values]

    def _peer_trouble(self, r, where, beats, now, moved_on, failed=True):
        """Rank r, awaited by this rank `where`: an error when it exited, failed in a collective (with
        `failed`), went elsewhere (moved_on(seq, op, what) of its last published collective: the message,
        or None when not), or its heartbeat stopped for the group's timeout. `beats` {rank: (count,
        since)} persists between calls."""
        ex, st = self._get(f"exit/{r}"), self._get(f"state/{r}")
        fail = self._get(f"fail/{r}") if failed else None
        if ex is not None:
            s, op, w = _text(ex).split("\t")[:3]
            raise CollectiveError(f"rank {r} exited (its last collective: #{s} {op} {w!r}) while rank {self.rank} "
                                  f"waited for it {where}")
        if fail is not None:
            s, op, w = _text(fail).split("\t")[:3]
            raise CollectiveError(f"rank {r} failed at #{s} {op} {w!r} while rank {self.rank} waited for it {where}")
        if st is not None:
            s, op, w = _text(st).split("\t")[:3]
            said = moved_on(int(s), op, w)
            if said:
                raise CollectiveError(said)
        b = self._beats(r)
        last = beats.get(r)
        if last is None or b != last[0]:
            beats[r] = (b, now)
        elif now - last[1] > max(self.timeout, 5 * _HEARTBEAT):
            raise CollectiveTimeoutError(
                f"rank {r} stopped responding (no heartbeat for {now - last[1]:.0f} s: its process died or is frozen) "
                f"while rank {self.rank} waited for it {where}")

    @property
    def one_machine(self):
        return len(set(self._hosts)) == 1

    def whereabouts(self):
        return self._whereabouts(wait_for_beats=False)

    def check_peers(self, what, beats, now):
        """While this rank waits for the others outside a collective of the group (the shared-memory
        gradient sums): an error when one exited, failed, went on to a later collective, or stopped."""
        seq = self._last[0]

        def moved_on(s, op, w):
            if s > seq:
                return (f"the ranks diverged: rank {r} went on to #{s} {op} {w!r} while rank {self.rank} waits in "
                        f"{what} (after #{seq}); look for ranks with other numbers of batches, or a collective only "
                        "some ranks call")
        for r in range(self.world_size):
            if r != self.rank:
                self._peer_trouble(r, f"in {what}", beats, now, moved_on)

    def _look_for_trouble(self, seq, what, keys, beats, now):
        def moved_on(s, op, w):
            if s > seq or (s == seq and (op, w) != ("wait_all", what)):
                return (f"the ranks called different collectives at fasttran collective #{seq}: rank {self.rank} "
                        f"wait_all {what!r}, rank {r} #{s} {op} {w!r}")
        for r, k in enumerate(keys):
            if r != self.rank and not self._store.check([k]):
                self._peer_trouble(r, f"at #{seq} wait_all {what!r}", beats, now, moved_on, failed=False)


# ---- data-parallel training ------------------------------------------------------------------------
# How the gradient sums travel: one class per transport, all with the same methods --
#   name            what DataParallel.transport_used reports
#   begin(step)     before the step's model step
#   ready(bucket)   the model hands over gradient bucket `bucket`, final in memory
#   finish(loss)    after the backward: every rank's table holds the summed gradients; returns the
#                   ranks' loss sum
#   in_loop(dp)     what the Trainer's C loop takes as its reduction (Model.train_steps(reduction=)):
#                   None (nothing to reduce), (HostSum, steps, watch) run in C, or an object whose
#                   begin / ready / finish the loop calls back with the GIL
# DataParallel picks one when it attaches to a model and forwards to it.

class OneProcess:
    """The transport of a group of one rank: the sums are the rank's own gradients."""

    def __init__(self, group):
        self.name = group.backend or "one process"

    def in_loop(self, dp):
        return None

    def begin(self, step):
        pass

    def ready(self, bucket):
        pass

    def finish(self, loss):
        return float(loss)


class GroupAllReduce:
    """The process group's all_reduce (gloo over TCP, NCCL for GPU memory): a checked barrier
    starts the step (ranks at different steps fail there), each bucket's sum starts as the backward
    hands it over (asynchronous, in place in `views`, the buckets' views of the flat gradient
    table), finish waits for them and sums the loss."""

    def __init__(self, group, views):
        self.group, self.views, self.name = group, list(views), group.backend
        self._works = []

    def begin(self, step):
        self.group.barrier(what=f"training step {int(step)}")

    def ready(self, bucket):
        self._works.append(self.group.all_reduce_(self.views[bucket], async_op=True, what="gradient bucket",
                                                  check=False))

    def in_loop(self, dp):
        return dp   # torch.distributed exists in Python only: the loop calls dp.begin / ready / finish back

    def finish(self, loss):
        works, self._works = self._works, []
        for w in works:
            w.wait()
        buf = np.array([loss], np.float64)
        self.group.all_reduce_(buf, what="loss", check=False)
        return float(buf[0])


class SharedMemorySum:
    """The ranks of one machine sum their gradient tables in shared memory, in place
    (`host`: a connected fasttran._C.HostSum). The sums themselves are numbered and checked (a
    rank that meets another step's sums fails the step), so begin exchanges nothing; finish waits
    for the sums, watching the group for a rank that exited, failed, moved on or stopped beating."""

    name = "shared_memory"

    def __init__(self, group, host):
        self.group, self.host = group, host
        self.rank = group.rank
        self._steps = np.zeros(1, np.int64)   # the steps begun: the sums' numbering (the C loop counts on in it)
        self._watching = (0, None)            # (step, heartbeats seen while its sums wait)

    @property
    def step(self):
        return int(self._steps[0])

    def begin(self, step):
        self._steps[0] += 1

    def ready(self, bucket):
        self._call("post", bucket, self.step)

    def in_loop(self, dp):
        """the C loop sums in C (HostSum, GIL released), calling watch only while a sum waits"""
        return self.host, self._steps, self.watch

    def _call(self, method, *args):
        """HostSum.<method>(*args); its failure (the ranks' steps disagree) as this rank's CollectiveError"""
        from .errors import FastTranError
        try:
            return getattr(self.host, method)(*args)
        except FastTranError as e:
            raise CollectiveError(f"rank {self.rank}: {e}") from None

    def watch(self, step, waited):
        """Between the slices of a wait for step `step`'s sums (`waited` seconds so far): an error
        when a rank exited, failed, moved on or stopped beating, or after the group's timeout."""
        if self._watching[0] != step:
            self._watching = (step, {})
        what = f"the gradient sums of training step {step} (shared memory)"
        self.group.check_peers(what, self._watching[1], time.monotonic())
        if waited > self.group.timeout:
            raise CollectiveTimeoutError("\n".join(
                [f"rank {self.rank}: {what} did not complete within {self.group.timeout:g} s: a rank did not reach "
                 "them. Where the other ranks are:", *self.group.whereabouts(),
                 "every rank must take the same steps; look for a rank with another number of batches, or one "
                 "that hangs (its log)"]))

    def finish(self, loss):
        loss, step = float(loss), self.step
        start = time.monotonic()
        while True:
            total = self._call("finish", step, loss, 0.5)
            if total is not None:
                return total
            try:
                self.watch(step, time.monotonic() - start)
            except CollectiveError:
                # a rank may have finished these sums and gone on (to the next collective, or out)
                # between our last look at the counters and this look at the store: it set its
                # counter before it went, so a last look at the counters tells which it was
                total = self._call("finish", step, loss, 0.0)
                if total is not None:
                    return total
                raise


class DataParallel:
    """fasttran.Trainer's gradient reduction over a process group: ``Trainer(..., reduction=
    DataParallel())`` on every rank (torchrun, accelerate, Ray Train, Slurm + torchrun).

    Every rank reads the same epoch order and takes its slice of every global batch (the
    Trainer's `batch_size` is the global batch; the slices are contiguous and balanced by their
    examples' cost, not their count, so no rank waits for a longer slice); its step computes its
    slice's share of the global batch's loss (the sum over its examples divided by the global
    batch's count of loss terms), with the dropout masks the global batch draws at its place. As
    the C backward finishes each gradient bucket -- the head, then the top layer down to the
    bottom one -- the model hands it here, and finish() makes every rank's gradient table the sum
    over the ranks. So every rank ends the step with the same summed gradients, and clipping,
    LAMB's trust ratios and float16 loss-scale decisions, which come after, are the same
    everywhere: the ranks take the same step, and the run equals one process at the same global
    batch up to the order of the sums.

    How the sums travel (`transport`):
      * "shared_memory" -- ranks on one machine training on the CPU: the gradient tables live in
        shared memory and each rank sums its part of every bucket over all the tables, in rank
        order, in place (no copies, no sockets: each rank reads and writes its table's size once
        per step). The default where it applies.
      * "group" -- the process group's all_reduce (gloo over TCP, NCCL for GPU memory), started
        per bucket as the backward hands it over (asynchronous, zero-copy views of the flat
        gradient table) while the layers below run without the GIL. Ranks on several machines,
        models in GPU memory, and where shared memory cannot be had.
      * "auto" (default) -- the first that applies; `transport_used` says which, and
        `why_not_shared` why not shared memory.
    Shared memory needs the model's gradient table there: the Trainer makes its model with
    `shared_grads` = this reduction's wish (``DataParallel().shared_grads``); a model made without
    it sums through the group. Each transport is one small class with begin / ready / finish
    (OneProcess, GroupAllReduce, SharedMemorySum), chosen once per fit, when the DataParallel
    attaches to the model (start).

    A step starts with a checked collective (the step's number), so ranks that diverged -- other
    numbers of batches, a rank in another phase -- fail there with CollectiveError naming what each
    did, instead of pairing the wrong reductions; a rank that dies or stops mid-step is found by
    the others within the group's timeout (its exit, its failure or its heartbeat in the store)."""

    def __init__(self, group=None, transport="auto"):
        if transport not in ("auto", "shared_memory", "group"):
            raise InputError(f"transport must be 'auto', 'shared_memory' or 'group', got {transport!r}")
        self.group = group if group is not None else init()
        self.rank, self.world_size = self.group.rank, self.group.world_size
        self.transport = transport
        self._sums = None   # the transport attached to the model of the current fit
        self.transport_used, self.why_not_shared = None, None
        #: seconds this rank spent in the reduction, by part: "begin" (the step's checked collective:
        #: waiting for the other ranks to arrive), "ready" (handing over the buckets, inside the
        #: backward), "finish" (the sums past the backward, and the loss); "steps" counts them
        self.seconds = {"begin": 0.0, "ready": 0.0, "finish": 0.0, "steps": 0}

    @property
    def shared_grads(self):
        """Whether a model made for this reduction should keep its gradient table in shared memory
        (the Trainer asks when it makes its model): ranks that all run on this machine, unless
        transport='group'."""
        return self.transport != "group" and self.world_size > 1 and self.group.one_machine

    def __repr__(self):
        how = self.transport_used or self.transport
        return f"DataParallel(rank {self.rank} of {self.world_size}, {self.group.backend or 'one process'}, {how})"

    def start(self, model, run):
        """Once per fit: `run` (what must be the same on every rank: data, batch size, seed, model) is
        compared across the ranks, and the transport chosen for `model`'s gradient buckets."""
        seen = self.group.all_gather_object(run, what="fit: the run's settings")
        for r, other in enumerate(seen):
            if other != run:
                diff = sorted(k for k in set(run) | set(other) if run.get(k) != other.get(k))
                raise CollectiveError(f"rank {self.rank} and rank {r} start different runs: "
                                      + "; ".join(f"{k}: {run.get(k)!r} here, {other.get(k)!r} there" for k in diff)
                                      + ". Every rank must train the same model on the same data with the same "
                                        "settings")
        self._sums = self._attach(model)
        self.transport_used = self._sums.name

    def _attach(self, model):
        """The transport for `model`: the first of shared memory (unless transport='group') and the
        group that applies; one rank needs none."""
        if self.world_size == 1:
            return OneProcess(self.group)
        if self.transport != "group":
            host, self.why_not_shared = self._connect(model)
            if host is not None:
                return SharedMemorySum(self.group, host)
            if self.transport == "shared_memory":
                raise InputError(f"transport='shared_memory' cannot be used: {self.why_not_shared}; use "
                                 "transport='auto' or 'group'")
        return GroupAllReduce(self.group, [view for _, view in model.buckets()])

    def _connect(self, model):
        """The shared-memory sums among the ranks (all of them on this machine), or (None, why not):
        every rank agrees (two gathers, even where this rank already knows it cannot)."""
        from . import _C
        from .errors import FastTranError
        why, host, mine = None, None, None
        if not self.group.one_machine:
            why = "the ranks are not all on one machine"
        elif model.device.is_cuda:
            why = "the gradients are in GPU memory"
        else:
            try:
                base = model.grads.data_ptr
                buckets = [((view.data_ptr - base) // 4, int(view.shape[0])) for _, view in model.buckets()]
                host = _C.HostSum(self.rank, self.world_size, base, model.grads.nbytes // 4, buckets,
                                  int.from_bytes(os.urandom(8), "little"))
                mine = host.endpoint
            except FastTranError as e:
                why, host = str(e), None
        ends = self.group.all_gather_object((mine, why), what="fit: shared-memory gradient sums")
        if why is None:
            missing = [(r, w) for r, (m, w) in enumerate(ends) if m is None]
            if missing:
                why = f"rank {missing[0][0]}: {missing[0][1]}"
            else:
                try:
                    host.connect(*[list(col) for col in zip(*[m for m, _ in ends])])
                except FastTranError as e:
                    why = str(e)
        oks = self.group.all_gather_object(why, what="fit: shared-memory gradient sums connected")
        bad = [(r, w) for r, w in enumerate(oks) if w is not None]
        if bad:
            return None, f"rank {bad[0][0]}: {bad[0][1]}"
        return host, None

    def _attached(self):
        if self._sums is None:
            raise InputError("DataParallel: start(model, run) attaches it to a model first (the Trainer does)")
        return self._sums

    def begin(self, step):
        """Before a step's model step (the group: a checked collective, so ranks at different steps
        fail here; shared memory: the sums themselves are numbered and checked)."""
        t0 = time.perf_counter()
        self._attached().begin(step)
        self.seconds["begin"] += time.perf_counter() - t0

    def ready(self, bucket):
        """The model hands over gradient bucket `bucket` (final in memory): its sum starts now (the
        group) or at finish (shared memory: the other ranks see it is ready)."""
        t0 = time.perf_counter()
        self._sums.ready(bucket)
        self.seconds["ready"] += time.perf_counter() - t0

    def finish(self, loss):
        """After the step's backward: the buckets' sums are complete; returns the global loss."""
        t0 = time.perf_counter()
        total = self._attached().finish(loss)
        self.seconds["finish"] += time.perf_counter() - t0
        self.seconds["steps"] += 1
        return total

    def in_loop(self):
        """The reduction the Trainer's C loop runs between each step's backward and its optimizer step
        (Model.train_steps(reduction=)): None for one rank; shared memory: (HostSum, steps, watch),
        summed in C with the GIL released (`seconds` does not count those steps); the group: this
        object, its begin / ready / finish called back from the loop."""
        return self._attached().in_loop(self)

    def sum(self, values):
        """Per-epoch counters summed over the ranks (float64)"""
        buf = np.array(values, np.float64)
        self.group.all_reduce_(buf, what="epoch counters")
        return buf
