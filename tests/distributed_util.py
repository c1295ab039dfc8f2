"""Multi-process tests on one machine: run a function on N ranks of a process group, each a
fresh Python process with the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), and collect what each
returns or raises. A hard timeout kills every rank, so a hung collective fails the test instead of
hanging CI.

    results = run_ranks(fn, 2, arg, timeout=120)          # [fn(0, 2, arg), fn(1, 2, arg)]
    outcomes = run_ranks(fn, 2, check=False)               # Outcome per rank: .ok, .value / .error

`fn` is a module-level function of a module in tests/ (the ranks import it by name), called as
fn(rank, world_size, *args, **kwargs); arguments and results are pickled. Ranks run with
FASTTRAN_NUM_THREADS=1 unless `env` (every rank) or `rank_env` (one rank) says otherwise; a value
None removes a variable."""
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback

TESTS = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Outcome:
    """What one rank did: ok and value, or the error (type name, message, traceback), its
    output, and how long it ran."""

    def __init__(self, rank, ok, value=None, error_type=None, message=None, trace=None, output="", seconds=0.0):
        self.rank, self.ok, self.value = rank, ok, value
        self.error_type, self.message, self.trace, self.output, self.seconds = error_type, message, trace, output, seconds

    def __repr__(self):
        if self.ok:
            return f"Outcome(rank {self.rank}: ok, {self.seconds:.1f} s)"
        return f"Outcome(rank {self.rank}: {self.error_type}: {self.message[:200]}, {self.seconds:.1f} s)"


class RanksFailed(AssertionError):
    pass


def _tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def run_ranks(fn, world_size, *args, timeout=120, env=None, rank_env=None, check=True, **kwargs):
    """Run fn on world_size ranks; see the module docstring. `rank_env` {rank: env} adds to one
    rank's environment. Returns the values (check=True: a rank that raised fails the test with its
    traceback) or the Outcomes (check=False)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fasttran-ranks-") as tmp:
        job = os.path.join(tmp, "job.pkl")
        with open(job, "wb") as f:
            pickle.dump((fn.__module__, fn.__qualname__, args, kwargs), f)
        procs, t0 = [], time.monotonic()
        for r in range(world_size):
            e = dict(os.environ)
            e.update(RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world_size),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FASTTRAN_NUM_THREADS="1")
            for k, v in list((env or {}).items()) + list((rank_env or {}).get(r, {}).items()):
                if v is None:
                    e.pop(k, None)
                else:
                    e[k] = str(v)
            out = open(os.path.join(tmp, f"out{r}.txt"), "w")
            code = f"import sys; sys.path.insert(0, {TESTS!r}); import distributed_util as u; u._child({job!r}, {tmp!r})"
            procs.append((subprocess.Popen([sys.executable, "-c", code], cwd=TESTS, env=e, stdout=out,
                                           stderr=subprocess.STDOUT), out))
        ended = [None] * world_size
        while any(x is None for x in ended) and time.monotonic() - t0 < timeout:
            for r, (p, _) in enumerate(procs):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = time.monotonic() - t0
            time.sleep(0.05)
        hung = [r for r, x in enumerate(ended) if x is None]
        for r in hung:
            procs[r][0].kill()
        for p, out in procs:
            p.wait()
            out.close()
        outputs = [_tail(os.path.join(tmp, f"out{r}.txt")) for r in range(world_size)]
        if hung:
            raise RanksFailed(f"rank(s) {hung} of {world_size} did not finish within {timeout} s (hung?); killed. "
                              + "".join(f"\n--- rank {r} output:\n{outputs[r]}" for r in hung))
        outcomes = []
        for r in range(world_size):
            res = os.path.join(tmp, f"result{r}.pkl")
            if not os.path.exists(res):
                outcomes.append(Outcome(r, False, error_type="died", output=outputs[r], seconds=ended[r],
                                        message=f"exit status {procs[r][0].returncode}, no result"))
                continue
            with open(res, "rb") as f:
                kind, *rest = pickle.load(f)
            if kind == "ok":
                outcomes.append(Outcome(r, True, rest[0], output=outputs[r], seconds=ended[r]))
            else:
                outcomes.append(Outcome(r, False, None, *rest, output=outputs[r], seconds=ended[r]))
    if not check:
        return outcomes
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RanksFailed("\n".join(f"rank {o.rank} failed: {o.error_type}: {o.message}\n{o.trace or ''}\n"
                                    f"--- its output:\n{o.output}" for o in bad))
    return [o.value for o in outcomes]


def _child(job, tmp):
    rank = int(os.environ["RANK"])
    with open(job, "rb") as f:
        module, name, args, kwargs = pickle.load(f)
    try:
        import importlib
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        result = ("ok", fn(rank, int(os.environ["WORLD_SIZE"]), *args, **kwargs))
    except BaseException as e:   # noqa: BLE001 - reported to the parent
        result = ("error", type(e).__name__, str(e), traceback.format_exc())
    path = os.path.join(tmp, f"result{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
