"""fasttran.distributed on gloo, several processes on this machine (tests/distributed_util.py):
the group and its collectives (zero-copy, asynchronous), errors instead of hangs for ranks that
diverge, each rank's share of the CPUs, and the reader's slices of global batches."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import fasttran
from distributed_util import run_ranks

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():   # pragma: no cover
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)


# ---- one process -------------------------------------------------------------------------------------

def test_import_keeps_torch_out_and_one_process_group():
    code = ("import sys, numpy as np, fasttran\n"
            "assert 'torch' not in sys.modules\n"
            "g = fasttran.distributed.init()\n"
            "assert (g.rank, g.world_size, g.is_main, g.backend) == (0, 1, True, None), g\n"
            "a = np.arange(4, dtype=np.float32)\n"
            "assert g.all_reduce_(a) is a and g.all_reduce_(a, async_op=True).wait() is a\n"
            "assert g.all_gather_object(3) == [3] and g.broadcast_object('x') == 'x' and g.wait_all('w', 5) == [5]\n"
            "g.barrier('b')\n"
            "assert 'torch' not in sys.modules\n"
            "print(repr(g))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Group(rank=0, world_size=1, local_rank=0") and "timeout=60s" in r.stdout


def test_several_ranks_without_torch_name_the_install():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fasttran\n"
            "try:\n    fasttran.distributed.init()\nexcept fasttran.MissingDependencyError as e:\n    print(e)\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install torch" in r.stdout


def test_bad_arguments():
    g = fasttran.distributed.Group()
    with pytest.raises(fasttran.InputError, match="op must be"):
        g.all_reduce_(np.zeros(2, np.float32), op="avg")
    with pytest.raises(fasttran.InputError, match="C-contiguous"):
        g.all_reduce_(np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(fasttran.InputTypeError, match="NumPy array"):
        g.all_reduce_([1.0, 2.0])
    with pytest.raises(fasttran.InputError, match="timeout"):
        fasttran.distributed._default_timeout(0)


def test_thread_share_arithmetic(monkeypatch):
    """A rank's share: the CPUs it may use, divided among the ranks of its machine whose
    affinity masks hold them (the cgroup-capped count in proportion)."""
    from fasttran import _info, distributed
    set_to = []
    monkeypatch.setattr(fasttran._C, "set_num_threads", set_to.append)
    monkeypatch.setattr(fasttran._C, "num_threads", lambda: set_to[-1] if set_to else 99)
    monkeypatch.setattr(_info, "threads_chosen", False)
    monkeypatch.delenv("FASTTRAN_NUM_THREADS", raising=False)

    def share(rank, hosts):
        g = distributed.Group()
        g.rank = rank
        set_to.clear()
        distributed._apply_threads(g, hosts)
        return g.threads

    eight = list(range(8))
    assert share(0, [("a", eight, 8), ("a", eight, 8)]) == 4                         # torchrun, 2 ranks
    assert share(1, [("a", eight, 8)] * 3) == 2                                       # 3 ranks: 8 // 3
    assert share(0, [("a", eight[:4], 4), ("a", eight[4:], 4)]) == 4                  # bound to their own cores
    assert share(0, [("a", eight, 8), ("b", eight, 8)]) == 8                          # one rank per machine
    assert share(0, [("a", eight, 2), ("a", eight, 2)]) == 1                          # a quota of 2 CPUs, shared
    assert share(0, [("a", [0], 1)] * 4) == 1                                         # never below 1
    monkeypatch.setenv("FASTTRAN_NUM_THREADS", "3")                                   # chosen: left alone
    assert share(0, [("a", eight, 8)] * 2) == 99
    monkeypatch.delenv("FASTTRAN_NUM_THREADS")
    monkeypatch.setattr(_info, "threads_chosen", True)
    assert share(0, [("a", eight, 8)] * 2) == 99


# ---- several processes: the group and its collectives -------------------------------------------------

def _collectives(rank, world):
    import fasttran.distributed as fd
    g = fd.init()
    assert fd.get_group() is g and fd.is_main() == (rank == 0)
    # the flat gradient table of a model: layers are contiguous views, reduced in place, no copy
    table = np.zeros(3 * 1000, np.float32)
    layers = [table[k * 1000:(k + 1) * 1000] for k in range(3)]
    for k, v in enumerate(layers):
        v[:] = (rank + 1) * (k + 1)
    handles = [g.all_reduce_(v, async_op=True, what=f"layer {k}", check=k == 2) for k, v in reversed(list(enumerate(layers)))]
    assert all(h.wait() is v for h, v in zip(handles, reversed(layers)))
    total = sum(range(1, world + 1))
    expect = np.repeat([total * (k + 1) for k in range(3)], 1000).astype(np.float32)
    assert np.array_equal(table, expect)
    m = np.array([rank, -rank], np.float64)
    g.all_reduce_(m, op="max")
    assert m.tolist() == [world - 1, 0]
    t = fasttran.from_dlpack(np.full(5, rank + 1.0, np.float32))   # a fasttran.Tensor: through DLPack
    g.all_reduce_(t)
    assert np.array_equal(np.from_dlpack(t), np.full(5, total, np.float32))
    assert g.broadcast_object({"step": 7} if rank == 1 else None, src=1) == {"step": 7}
    assert g.all_gather_object(rank * 10, what="gather") == [r * 10 for r in range(world)]
    g.barrier("end")
    return repr(g), g.count("c", rank + 1) >= rank + 1


def test_collectives_on_three_ranks():
    out = run_ranks(_collectives, 3)
    for r, (rep, _) in enumerate(out):
        assert rep.startswith(f"Group(rank={r}, world_size=3, local_rank={r}, local_world_size=3, backend='gloo', "
                              "device='cpu', threads=1")


def _mismatch(rank, world, kind):
    import fasttran.distributed as fd
    g = fd.init()
    t0 = time.monotonic()
    try:
        if kind == "ops":
            if rank == 0:
                g.all_reduce_(np.ones(4, np.float32), what="layer 5 gradients")
            else:
                g.barrier("end of epoch 2")
        elif kind == "sizes":
            g.all_reduce_(np.ones(4 + 4 * rank, np.float32), what="gradients")
        elif kind == "absent":
            if rank == 0:
                g.barrier("after the step")
            else:
                time.sleep(9)   # alive, computing elsewhere
                return "slept", 0.0
        elif kind == "exited":
            g.barrier("before")
            if rank == 1:
                return "left", 0.0
            g.barrier("after the step")
    except fasttran.CollectiveError as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_mismatched_collective_names_both_ranks_at_once():
    out = run_ranks(_mismatch, 2, "ops", timeout=60)
    for msg, seconds in out:
        assert msg.startswith("CollectiveError: the ranks called different collectives"), msg
        assert "rank 0: #1 all_reduce_ sum float32 'layer 5 gradients' (16 bytes)" in msg
        assert "rank 1: #1 barrier 'end of epoch 2'" in msg
        assert seconds < 10   # the tags differ: no timeout to wait for


def test_mismatched_sizes_are_an_error_not_a_crash():
    out = run_ranks(_mismatch, 2, "sizes", timeout=60)
    for msg, _ in out:   # gloo itself aborts the process on a size mismatch; the tags catch it first
        assert "(16 bytes)" in msg and "(32 bytes)" in msg, msg


def test_a_rank_that_never_comes_times_out_with_where_it_is():
    out = run_ranks(_mismatch, 2, "absent", timeout=90, env={"FASTTRAN_DIST_TIMEOUT": 4})
    msg, seconds = out[0]
    assert msg.startswith("CollectiveTimeoutError: rank 0: collective #1 barrier 'after the step' did not complete "
                          "within 4 s"), msg
    assert "rank 1 has entered no fasttran collective yet; it is alive" in msg
    assert 4 <= seconds < 20
    assert out[1][0] == "slept"


def test_a_rank_that_left_is_named():
    out = run_ranks(_mismatch, 2, "exited", timeout=90, env={"FASTTRAN_DIST_TIMEOUT": 4})
    msg, seconds = out[0]
    assert "rank 1 has exited (its last collective: #1 barrier 'before')" in msg, msg
    assert seconds < 20


def _default_timeout(rank, world):
    return fasttran.distributed.init().timeout


def test_default_timeout_is_60_s():
    assert run_ranks(_default_timeout, 2, env={"FASTTRAN_DIST_TIMEOUT": None}) == [60.0, 60.0]


def _uneven_phase(rank, world, kind):
    import fasttran.distributed as fd
    g = fd.init()
    t0 = time.monotonic()
    try:
        if kind == "slow":   # longer than the timeout, alive: waited for
            if rank == 1:
                time.sleep(6)
            return g.wait_all("phase", rank * 2), time.monotonic() - t0
        if kind == "failed":
            if rank == 1:
                try:
                    raise ValueError("shard 7 is bad")
                except ValueError as e:
                    g.wait_all("phase", None, failed=e)
                    return "reported", 0.0
            return g.wait_all("phase", rank), time.monotonic() - t0
        if kind == "killed":
            if rank == 1:
                time.sleep(0.5)
                os._exit(3)   # no exit handler runs: only the heartbeat tells
            return g.wait_all("phase", rank), time.monotonic() - t0
    except fasttran.CollectiveError as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


def test_wait_all_waits_for_slow_ranks_and_fails_for_failed_or_dead_ones():
    out = run_ranks(_uneven_phase, 2, "slow", env={"FASTTRAN_DIST_TIMEOUT": 2})   # its heartbeat: 5 s at least
    assert [x[0] for x in out] == [[0, 2], [0, 2]] and out[0][1] >= 5.5
    out = run_ranks(_uneven_phase, 2, "failed")
    assert out[0][0] == "CollectiveError: rank 1 failed during 'phase': ValueError: shard 7 is bad", out
    assert out[0][1] < 10 and out[1][0] == "reported"
    out = run_ranks(_uneven_phase, 2, "killed", check=False, env={"FASTTRAN_DIST_TIMEOUT": 2})
    msg, seconds = out[0].value
    assert msg.startswith("CollectiveTimeoutError: rank 1 stopped responding (no heartbeat for "), msg
    assert 5 <= seconds < 20 and not out[1].ok


def _threads(rank, world, before):
    if before:
        fasttran.set_num_threads(before)
    g = fasttran.distributed.init()
    return g.threads, fasttran.get_num_threads(), fasttran._C.cpu_count()


def test_each_rank_takes_its_share_of_the_cpus():
    # torchrun sets OMP_NUM_THREADS=1 for every worker: the share replaces it
    out = run_ranks(_threads, 2, 0, env={"FASTTRAN_NUM_THREADS": None, "OMP_NUM_THREADS": "1"})
    for threads, now, cpus in out:
        assert threads == now == max(1, cpus // 2)
    assert run_ranks(_threads, 2, 0, env={"FASTTRAN_NUM_THREADS": 3})[0][:2] == (3, 3)
    assert run_ranks(_threads, 2, 3, env={"FASTTRAN_NUM_THREADS": None})[1][:2] == (3, 3)


# ---- the reader's slices of global batches (one process) ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    from conftest import make_checkpoint
    path = make_checkpoint(str(tmp_path_factory.mktemp("tiny")), vocab_size=99, hidden_size=32, num_attention_heads=2,
                           intermediate_size=40, num_hidden_layers=2, max_position_embeddings=64)
    enc = fasttran.Encoder.from_pretrained(path)
    rng = np.random.default_rng(0)
    N = 23
    L = rng.integers(1, 12, N)
    ids = rng.integers(1, 99, (N, L.max())) * (np.arange(L.max())[None] < L[:, None])
    mask = (ids != 0).astype(np.int64)
    return fasttran.ActivationCache.build(enc, ids, mask, positions="all", batch_size=5, max_fraction=0.8)


@pytest.mark.parametrize("kw", [dict(seed=3), dict(seed=3, ragged=True), dict(seed=4, drop_last=True, start=1),
                                dict(shuffle=False, ragged=True), dict(seed=5, sampling="chunked", chunk_bytes=2000)])
def test_slices_of_global_batches_make_the_global_batches(tiny_cache, kw):
    c = tiny_cache
    whole = list(c.batches(8, **kw))
    L = c.lengths
    for world in (1, 2, 3, 11):   # 11: more ranks than examples in a batch: empty slices
        parts = [list(c.batches(8, rank=r, world_size=world, **kw)) for r in range(world)]
        assert [len(p) for p in parts] == [len(whole)] * world   # every rank takes every step
        for s, (ex, batch) in enumerate(whole):
            got = [p[s] for p in parts]
            assert np.array_equal(np.concatenate([g[0] for g in got]), ex)
            sizes = [len(g[0]) for g in got]
            rows = L[c.index_of(ex)]
            cost = np.concatenate([[0], np.cumsum(rows * (6 * c.hidden + rows))])   # the reader's balance
            for r, (ids, b, where) in enumerate(got):
                assert type(where).__name__ == "GlobalBatch"
                assert where.step == s + kw.get("start", 0) and where.size == len(ex)
                assert where.offset == sum(sizes[:r])
                # the slice starts where the costs before it are nearest r / world of the batch's (ties: earlier)
                miss = np.abs(cost * world - cost[-1] * r)
                assert where.offset == int(np.argmin(miss))
                assert where.rows == rows.sum() and where.longest == rows.max()
                assert where.row_offset == rows[:where.offset].sum()
                values = b[0]
                if kw.get("ragged"):
                    assert values.shape == (rows[where.offset:where.offset + len(ids)].sum(), c.hidden)
                    assert np.array_equal(values, batch[0][where.row_offset:where.row_offset + len(values)])
                else:   # padded to the slice's own longest: the same values on the real tokens
                    T = values.shape[1]
                    assert np.array_equal(values, batch[0][where.offset:where.offset + len(ids), :T])
            # so each slice's cost is within one example's of its share
            share = [cost[sum(sizes[:r + 1])] - cost[sum(sizes[:r])] for r in range(world)]
            assert max(abs(x * world - cost[-1]) for x in share) <= world * (cost[1:] - cost[:-1]).max()
    with pytest.raises(fasttran.InputError, match="rank < world_size"):
        c.batches(8, rank=2, world_size=2)
    with pytest.raises(fasttran.InputError, match="go together"):
        c.batches(8, rank=1)


def test_slices_with_a_group(tiny_cache):
    g = fasttran.distributed.Group()
    a = [(ids.tolist(), w) for ids, _, w in tiny_cache.batches(7, seed=1, rank=g)]
    b = [(ids.tolist(), w) for ids, _, w in tiny_cache.batches(7, seed=1, rank=0, world_size=1)]
    assert a == b and len(a) == 4 and a[-1][1].size == 23 - 21


# ---- NCCL: one process per GPU (skipped where this machine has too few) ----------------------------

def _nccl(rank, world):
    import fasttran.distributed as fd
    g = fd.init(backend="nccl")
    assert (g.backend, g.device) == ("nccl", f"cuda:{rank}"), g
    host = np.full(1000, rank + 1.0, np.float32)
    x = fasttran.from_dlpack(host.copy()).to(g.device)          # fasttran's device memory, through DLPack
    assert g.all_reduce_(x) is x
    h = g.all_reduce_(fasttran.from_dlpack(host.copy()).to(g.device), async_op=True, check=False)
    y = h.wait()
    g.all_reduce_(host)                                          # host arrays: over the gloo side group
    total = world * (world + 1) / 2
    return [float(np.asarray(t.to("cpu").numpy())[0]) for t in (x, y)] + [float(host[0]), total]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_reduces_fasttran_device_tensors(world):
    if not fasttran.cuda_available():
        pytest.skip("needs fasttran's CUDA backend and a GPU: " + (fasttran._info.no_gpu_reason() or ""))
    if not torch.cuda.is_available() or torch.cuda.device_count() < world or not torch.distributed.is_nccl_available():
        pytest.skip(f"needs {world} CUDA GPU(s) that torch sees with NCCL (torch sees {torch.cuda.device_count()}; "
                    f"NCCL {'available' if torch.distributed.is_nccl_available() else 'missing in this torch'})")
    for a, b, c, total in run_ranks(_nccl, world, env={"FASTTRAN_NUM_THREADS": 1}):
        assert a == b == c == total
