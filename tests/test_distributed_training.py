"""Data-parallel training (fasttran.distributed.DataParallel through the Trainer's reduction hook)
on gloo ranks of one machine, against one process at the same global batch: the same weights to
fp32 rounding of the summation order after a step, bitwise the same on every rank after every step,
dropout on and an uneven last batch included; top layers and head; checkpoints written by rank 0
and resumed at another world size; a rank that diverges fails within the timeout, naming it; the
Trainer's C loop (the reduction between backward and optimizer inside csrc/train/loop.c) gives the
per-step loop's bits, and a rank that fails or is stopped inside it does not hang the others."""
import hashlib
import json
import os

import numpy as np
import pytest

from distributed_util import run_ranks

pytest.importorskip("torch")

# 29 examples, global batch 8: 3 full batches and one of 5 (three ranks: slices of 1, 2, 2; with
# batch 7 and 2 examples left, a slice of 0)
N_EXAMPLES = 29


def _data(tiny_dir):
    """a tiny random BERT's layer-(L-1) features of N_EXAMPLES random sequences, and labels"""
    import fasttran
    enc = fasttran.Encoder.from_pretrained(tiny_dir)
    rng = np.random.default_rng(0)
    L = rng.integers(2, 14, N_EXAMPLES)
    ids = rng.integers(1, 99, (N_EXAMPLES, L.max())) * (np.arange(L.max())[None] < L[:, None])
    mask = (ids != 0).astype(np.int64)
    y = rng.integers(0, 3, N_EXAMPLES)
    return enc, ids, mask, y


def _trainer(reduction, head, batch_size, **kw):
    import fasttran
    args = dict(optimizer="adamw", lr=3e-3, epochs=2, batch_size=batch_size, seed=5, show_progress=False,
                train_layers=1, dropout=0.2, layer_dropout=0.1, num_labels=3, reduction=reduction)
    args.update(kw)
    return fasttran.Trainer(head, **args)


def _run_parts(tiny_dir, world, transport, head, batch_size, **kw):
    """a rank's encoder, reduction (None for one process), trainer, cache and targets"""
    from fasttran.distributed import DataParallel
    enc, ids, mask, y = _data(tiny_dir)
    red = DataParallel(transport=transport) if world > 1 else None
    tr = _trainer(red, head, batch_size, **kw)
    cache = tr.cache_for(enc, ids, mask, show_progress=False)
    targets = y
    if head == "token-classification":
        targets = np.where(mask == 1, np.random.default_rng(1).integers(-100, 3, mask.shape), -100)
        targets[:, 0] = -100
        targets = np.where(targets < 0, -100, targets)
    return enc, red, tr, cache, targets


def train_and_record(rank, world, tiny_dir, head, batch_size, steps=None, ckpt=None, resume=False, transport="auto",
                     **kw):
    """fit on this rank (world 1: one process, no reduction); the flat parameter table after every
    step (its sha256, and the arrays of the first and last steps)"""
    enc, red, tr, cache, targets = _run_parts(tiny_dir, world, transport, head, batch_size, **kw)
    record = {"hashes": [], "first": None, "last": None}
    step = tr._optimizer_step

    def recorded(total, warm):
        out = step(total, warm)
        p = np.asarray(tr.model.params).copy()
        record["hashes"].append(hashlib.sha256(p.tobytes()).hexdigest())
        if record["first"] is None:
            record["first"] = p
        record["last"] = p
        return out
    tr._optimizer_step = recorded
    hist = tr.fit(cache, targets, checkpoint_dir=ckpt, resume=resume, stop_at_step=steps)
    record["loss_curve"] = [l for _, l in tr.loss_curve]
    record["history"] = hist
    record["step"] = tr.global_step
    record["transport"] = red.transport_used if red is not None else None
    return record


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import make_checkpoint
    return make_checkpoint(str(tmp_path_factory.mktemp("tiny")), vocab_size=99, hidden_size=32, num_attention_heads=4,
                           intermediate_size=48, num_hidden_layers=3, max_position_embeddings=64)


@pytest.mark.parametrize("transport", ["shared_memory", "group"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("head", ["classification", "token-classification"])
def test_ranks_equal_one_process_and_each_other(tiny_dir, world, head, transport):
    one = train_and_record(0, 1, tiny_dir, head, 8)
    ranks = run_ranks(train_and_record, world, tiny_dir, head, 8, transport=transport, timeout=300)
    assert [r["transport"] for r in ranks] == [transport if transport == "shared_memory" else "gloo"] * world
    for r in ranks[1:]:   # every rank's weights are rank 0's, bit for bit, after every step
        assert r["hashes"] == ranks[0]["hashes"]
        assert r["loss_curve"] == ranks[0]["loss_curve"]
    assert len(ranks[0]["hashes"]) == len(one["hashes"]) == 8   # 4 global batches x 2 epochs, the last of 5
    # after one step: one process's weights to fp32 rounding of the gradient sums' order. The ranks add
    # their slices' partial sums, one process all rows in one GEMM: the summed gradients differ by
    # |dg| <= gamma_n sum_i |g_i| (gamma_n ~ n 2^-24, n the rows summed). AdamW's first step moves a
    # weight by lr g / (|g| + eps), whose slope is at most 1 / eps, so |dw| <= lr |dg| / eps: about
    # lr 1e-4 here (measured 3.5e-7 at 2 ranks, 4.6e-7 at 3; most weights bit for bit); asserted: lr 1e-3
    d1 = np.abs(ranks[0]["first"] - one["first"])
    assert np.median(d1) == 0.0 and d1.max() <= 1e-3 * 3e-3, (np.median(d1), d1.max())
    assert np.allclose(ranks[0]["loss_curve"][:1], one["loss_curve"][:1], rtol=1e-6)
    # and the whole run (dropout on, the uneven last batch) follows one process
    assert np.allclose(ranks[0]["loss_curve"], one["loss_curve"], rtol=1e-3)


@pytest.fixture(scope="module", params=["roberta", "distilbert"])
def tiny_arch_dir(request, tmp_path_factory):
    """a tiny random RoBERTa / DistilBERT (their own config keys, names, positions and token types)"""
    pytest.importorskip("transformers")
    from test_architectures import make_model
    kw = {"roberta": dict(vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                          num_hidden_layers=3, max_position_embeddings=66),
          "distilbert": dict(vocab_size=99, dim=32, n_heads=4, hidden_dim=48, n_layers=3, max_position_embeddings=64)}
    return make_model(tmp_path_factory.mktemp(request.param), request.param, seed=2, **kw[request.param])


def test_other_architectures_ranks_equal_one_process(tiny_arch_dir):
    """the top layer and head of a RoBERTa / DistilBERT over two ranks: as BERT's (above)"""
    one = train_and_record(0, 1, tiny_arch_dir, "classification", 8)
    ranks = run_ranks(train_and_record, 2, tiny_arch_dir, "classification", 8, transport="shared_memory", timeout=300)
    assert ranks[1]["hashes"] == ranks[0]["hashes"] and ranks[1]["loss_curve"] == ranks[0]["loss_curve"]
    assert len(ranks[0]["hashes"]) == len(one["hashes"]) == 8
    d1 = np.abs(ranks[0]["first"] - one["first"])
    assert np.median(d1) == 0.0 and d1.max() <= 1e-3 * 3e-3, (np.median(d1), d1.max())
    assert np.allclose(ranks[0]["loss_curve"], one["loss_curve"], rtol=1e-3)


def test_modernbert_ranks_equal_one_process(tmp_path):
    """ModernBERT's top layer (pre-LN, RoPE, GeGLU, a local window shorter than the sequences) and
    head over two ranks, as BERT's above; no dropout (its layers refuse it)"""
    pytest.importorskip("transformers")
    from test_modernbert import make_model
    d = make_model(tmp_path / "mb", seed=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                   num_hidden_layers=3, local_attention=8, max_position_embeddings=64)
    kw = dict(dropout=0.0, layer_dropout=0.0)
    one = train_and_record(0, 1, d, "classification", 8, **kw)
    ranks = run_ranks(train_and_record, 2, d, "classification", 8, transport="shared_memory", timeout=300, **kw)
    assert ranks[1]["hashes"] == ranks[0]["hashes"] and ranks[1]["loss_curve"] == ranks[0]["loss_curve"]
    assert len(ranks[0]["hashes"]) == len(one["hashes"]) == 8
    d1 = np.abs(ranks[0]["first"] - one["first"])
    assert np.median(d1) == 0.0 and d1.max() <= 1e-3 * 3e-3, (np.median(d1), d1.max())
    assert np.allclose(ranks[0]["loss_curve"], one["loss_curve"], rtol=1e-3)


def unshared_table(rank, world, tiny_dir, transport):
    """a model whose gradient table is made outside shared memory (gradient tables are shared only
    once a DataParallel of several ranks exists): `transport` "auto" sums through the group;
    "shared_memory" refuses, saying why"""
    import fasttran
    from fasttran.distributed import DataParallel
    enc, ids, mask, y = _data(tiny_dir)
    red = DataParallel(transport=transport)
    fasttran._C.shared_grads(False)
    tr = _trainer(red, "classification", 8, epochs=1)
    try:
        tr.fit(tr.cache_for(enc, ids, mask, show_progress=False), y)
    except fasttran.InputError as e:
        return "refused: " + str(e)
    return red.transport_used, red.why_not_shared, repr(red)


def test_shared_memory_falls_back_to_the_group_or_says_why_not(tiny_dir):
    auto = run_ranks(unshared_table, 2, tiny_dir, "auto", timeout=300)
    for used, why, rep in auto:
        assert used == "gloo" and "not in shared memory" in why and rep.endswith(", gloo, gloo)"), (used, why, rep)
    forced = run_ranks(unshared_table, 2, tiny_dir, "shared_memory", timeout=300)
    for said in forced:
        assert said.startswith("refused: transport='shared_memory' cannot be used: rank 0: the gradient table is not "
                               "in shared memory"), said


def test_empty_slices_of_an_uneven_last_batch_do_not_hang(tiny_dir):
    """batch 7 over 29 examples: the last global batch holds 1 example, so 2 of 3 ranks hold none"""
    one = train_and_record(0, 1, tiny_dir, "classification", 7, epochs=1)
    ranks = run_ranks(train_and_record, 3, tiny_dir, "classification", 7, epochs=1, timeout=300)
    assert all(r["hashes"] == ranks[0]["hashes"] for r in ranks) and len(one["hashes"]) == 5
    assert np.allclose(ranks[0]["loss_curve"], one["loss_curve"], rtol=1e-4)


def test_checkpoints_written_by_rank_0_resume_at_another_world_size(tiny_dir, tmp_path):
    full = run_ranks(train_and_record, 2, tiny_dir, "classification", 8, timeout=300)[0]
    ck = str(tmp_path / "ck")
    part = run_ranks(train_and_record, 2, tiny_dir, "classification", 8, steps=3, ckpt=ck, timeout=300)
    assert part[0]["step"] == 3 and os.path.exists(os.path.join(ck, "trainer.json"))
    # the same world size: bit for bit
    same = run_ranks(train_and_record, 2, tiny_dir, "classification", 8, ckpt=ck + "2", timeout=300)[0]
    assert same["hashes"] == full["hashes"]
    import shutil
    shutil.copytree(ck, ck + "3")
    back = run_ranks(train_and_record, 2, tiny_dir, "classification", 8, ckpt=ck, resume=True, timeout=300)
    assert back[0]["hashes"] == full["hashes"][3:] and back[1]["hashes"] == back[0]["hashes"]
    # three ranks and one process continue it too (other summation orders: within rounding)
    three = run_ranks(train_and_record, 3, tiny_dir, "classification", 8, ckpt=ck + "3", resume=True, timeout=300)
    assert three[0]["step"] == 8 and np.allclose(three[0]["last"], full["last"], atol=1e-4)


def diverge(rank, world, tiny_dir):
    """rank 1 trains on one example fewer: the ranks' runs differ"""
    from fasttran.distributed import DataParallel
    enc, ids, mask, y = _data(tiny_dir)
    n = N_EXAMPLES - (rank == 1)
    tr = _trainer(DataParallel(), "classification", 8)
    tr.fit(tr.cache_for(enc, ids[:n], mask[:n], show_progress=False), y[:n])


def skip_a_step(rank, world, tiny_dir, transport="auto"):
    """rank 1 skips the start of its second step: a missing collective (the group), a step's sums
    handed over twice (shared memory)"""
    from fasttran.distributed import DataParallel
    enc, ids, mask, y = _data(tiny_dir)

    class Skipping(DataParallel):
        def begin(self, step):
            if self.rank == 1 and step == 1:
                return
            super().begin(step)
    tr = _trainer(Skipping(transport=transport), "classification", 8)
    tr.fit(tr.cache_for(enc, ids, mask, show_progress=False), y)


@pytest.mark.parametrize("fn,args,says", [
    (diverge, (), "start different runs: examples: 29 here, 28 there"),
    (skip_a_step, ("group",), "barrier 'training step 1' did not complete within 20 s"),
    (skip_a_step, ("shared_memory",), "rank 1: gradient bucket 0 is handed over for step 1, whose sums were already made")])
def test_ranks_that_diverge_fail_within_the_timeout_naming_it(tiny_dir, fn, args, says):
    import time
    t0 = time.monotonic()
    out = run_ranks(fn, 2, tiny_dir, *args, check=False, timeout=120, env={"FASTTRAN_DIST_TIMEOUT": "20"})
    assert time.monotonic() - t0 < 90
    assert not any(o.ok for o in out), out
    assert any(says in (o.message or "") for o in out), [o.message for o in out]


def _torchrun(tmp_path, tiny_dir, cache, ck, out, kill_at):
    import subprocess
    import sys
    from distributed_util import free_port
    # a generous collective timeout: on a loaded machine a rank may take long to start (the default's 60 s
    # is the time a live job's collective may take, not a cold start's)
    env = dict(os.environ, FASTTRAN_NUM_THREADS="1", FASTTRAN_DIST_TIMEOUT="300")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        f"--master-port={free_port()}", "--max-restarts=1", os.path.join(os.path.dirname(__file__), "restart_job.py"), tiny_dir,
                        str(cache), str(ck), str(out), str(kill_at)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [__import__("json").loads(line) for line in open(out)]


def test_a_killed_rank_resumes_from_the_last_checkpoint_under_torchrun(tiny_dir, tmp_path):
    """torchrun --max-restarts=1: rank 1 killed with SIGKILL at step 5 (mid-epoch; the last checkpoint:
    step 4); the job starts again, opens the cache without building it, resumes, and ends with the
    weights of an uninterrupted run, bit for bit."""
    cache = tmp_path / "cache"
    whole = _torchrun(tmp_path, tiny_dir, cache, tmp_path / "ck1", tmp_path / "whole.jsonl", -1)
    killed = _torchrun(tmp_path, tiny_dir, cache, tmp_path / "ck2", tmp_path / "killed.jsonl", 5)
    assert [k["attempt"] for k in killed] == [1]   # the first attempt died; the restart finished
    assert killed[0]["step"] == whole[0]["step"] == 12
    assert killed[0]["params"] == whole[0]["params"]
    assert killed[0]["shards"] == whole[0]["shards"]   # the cache's files: not written again


def sst2_epoch(rank, world, n):
    """one epoch of MiniLM's top layer + head on the first n real SST-2 sentences, dropout on; the
    dev accuracy on all 872 dev sentences"""
    import fasttran
    from fasttran.data import load_sst2
    from fasttran.distributed import DataParallel
    from conftest import sst2_file
    enc = fasttran.Encoder.from_pretrained(fasttran.models.minilm_path())
    s, y = load_sst2(sst2_file("train"))
    sd, yd = load_sst2(sst2_file("dev"))
    tr = fasttran.Trainer("classification", optimizer="adamw", lr=2e-4, epochs=1, batch_size=32, seed=1,
                          train_layers=1, show_progress=False, reduction=DataParallel() if world > 1 else None)
    cache = tr.cache_for(enc, *enc.tokenize(s[:n]), show_progress=False)
    dev = tr.cache_for(enc, *enc.tokenize(sd), show_progress=False)
    tr.fit(cache, np.array(y[:n]))
    return tr.evaluate(dev, np.array(yd))["accuracy"], tr.predict(dev)


def test_an_epoch_on_sst2_gives_the_dev_accuracy_of_one_process(minilm_dir):
    n = 650   # 20 full global batches and one of 10
    acc1, pred1 = sst2_epoch(0, 1, n)
    for world in (2, 3):
        (acc, pred), *rest = run_ranks(sst2_epoch, world, n, timeout=600)
        assert acc == acc1, (world, acc, acc1)
        assert (pred != pred1).sum() <= 2   # predictions at the decision boundary may flip on rounding
        assert all(np.array_equal(p, pred) for _, p in rest)


def test_torchrun_train_command_equals_one_process(minilm_dir, tmp_path):
    """`torchrun --nproc-per-node=2 -m fasttran train` on a cache made by `fasttran cache`: one set of
    epoch lines (rank 0 prints), the one-process run's dev accuracy, a checkpoint that loads"""
    import json
    import subprocess
    import sys
    from distributed_util import free_port
    from fasttran.data import sst2_path
    m = ["--model", minilm_dir, "--device", "cpu"]   # (gloo: host memory; also where the CUDA emulator is on)
    env = dict(os.environ, FASTTRAN_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)

    def fasttran(*args, ranks=1):
        pre = [sys.executable, "-m", "fasttran"] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "fasttran"]
        r = subprocess.run(pre + list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]

    train, dev = sst2_path("train"), sst2_path("dev")
    fasttran("cache", *m, "--input", train, "--limit", "300", "--output", "c", "--layer", "5", "--positions", "all",
             ranks=2)
    fasttran("cache", *m, "--input", dev, "--limit", "200", "--output", "cd", "--layer", "5", "--positions", "all")
    args = [*m, "--input", train, "--cache", "c", "--eval-input", dev, "--eval-cache", "cd", "--epochs", "2",
            "--train-layers", "1", "--optimizer", "adamw", "--lr", "2e-4"]
    one = fasttran("train", *args, "--output", "ck1")
    two = fasttran("train", *args, "--output", "ck2", ranks=2)
    assert len(two) == len(one) == 2
    assert [r["eval_accuracy"] for r in two] == [r["eval_accuracy"] for r in one]
    assert abs(two[-1]["train_loss"] - one[-1]["train_loss"]) <= 1e-4 * one[-1]["train_loss"]
    import fasttran as ft
    assert ft.Trainer.load(str(tmp_path / "ck2")).global_step == 20


def test_a_plain_script_under_torchrun_is_data_parallel(minilm_dir, tmp_path):
    """Trainer's default reduction: under torchrun a script that never mentions ranks trains
    data-parallel -- each rank about half the examples, the weights one process's at the same global
    batch (to float32 rounding of the sums) -- and rank 0 says so in one line."""
    import subprocess
    import sys
    from conftest import sst2_file
    from distributed_util import free_port
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_plain.py")
    env = dict(os.environ, FASTTRAN_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    args = [minilm_dir, sst2_file("train")]
    one = subprocess.run([sys.executable, script, *args, str(tmp_path / "one")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "data-parallel" not in one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}"]
    two = subprocess.run(torchrun + [script, *args, str(tmp_path / "two")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stderr.count("training data-parallel") == 1, two.stderr[-3000:]
    ref = np.load(tmp_path / "one" / "head0.npy")
    for r in (0, 1):
        got = np.load(tmp_path / "two" / f"head{r}.npy")
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), r
    hist = [json.load(open(tmp_path / "two" / f"history{r}.json")) for r in (0, 1)]
    for e in range(2):
        mine = [h[e]["examples_this_rank"] for h in hist]
        assert sum(mine) == hist[0][e]["examples"] == 192 and min(mine) >= 0.4 * 192, mine


# ---- the C training loop (csrc/train/loop.c) under DataParallel ------------------------------------
def loop_run(rank, world, tiny_dir, head, batch_size, transport="auto", fail=None, steps=None, **kw):
    """fit on this rank with the trainer's own loop (the C loop unless FASTTRAN_PY_LOOP=1): the final
    flat parameter table, the loss curve, the history, which loop ran and the transport. fail (rank 1
    only): "raise" -- an error in the loop's bookkeeping after 20 steps; "sigint" -- Ctrl-C then;
    "repeat" -- its shared-memory sums numbered from the start again."""
    import signal
    enc, red, tr, cache, targets = _run_parts(tiny_dir, world, transport, head, batch_size, **kw)
    refusals = []
    refusal = tr._c_loop_refusal

    def recorded(c):   # (called once the reduction is attached, before the first step)
        refusals.append(refusal(c))
        if fail == "repeat" and rank == 1:   # rank 1 numbers its steps from 0 again: step 1's sums repeated
            red._sums._steps[0] = -1
        return refusals[-1]
    tr._c_loop_refusal = recorded
    if fail in ("raise", "sigint") and rank == 1:
        tr._build(enc, cache, targets)
        correct = tr.head.correct

        def failing(logits, t):
            if tr.global_step >= 20:
                if fail == "raise":
                    raise RuntimeError("rank 1 fails in the loop")
                os.kill(os.getpid(), signal.SIGINT)
            return correct(logits, t)
        tr.head.correct = failing
    hist = tr.fit(cache, targets, stop_at_step=steps)
    return {"params": np.asarray(tr.model.params).copy(), "loss_curve": [l for _, l in tr.loss_curve],
            "history": [{k: v for k, v in h.items() if "seconds" not in k} for h in hist], "step": tr.global_step,
            "loop": "python" if refusals[0] else "c", "refusal": refusals[0],
            "transport": red.transport_used if red is not None else None}


@pytest.mark.parametrize("transport", ["shared_memory", "group"])
@pytest.mark.parametrize("train_layers", [0, 1])
def test_c_loop_equals_the_per_step_loop_under_data_parallel(tiny_dir, transport, train_layers):
    """the C loop with the reduction between backward and optimizer: the per-step loop's bits on every
    rank -- weights, losses, epoch records -- for a frozen head and a trained top layer, dropout on"""
    kw = dict(transport=transport, train_layers=train_layers, timeout=300)
    c = run_ranks(loop_run, 2, tiny_dir, "classification", 8, **kw)
    py = run_ranks(loop_run, 2, tiny_dir, "classification", 8, env={"FASTTRAN_PY_LOOP": "1"}, **kw)
    assert [r["loop"] for r in c] == ["c", "c"] and [r["loop"] for r in py] == ["python", "python"], \
        [r["refusal"] for r in c]
    assert [r["transport"] for r in c] == [r["transport"] for r in py] == [
        transport if transport == "shared_memory" else "gloo"] * 2
    for a, b in zip(c, py):
        assert np.array_equal(a["params"], b["params"])
        assert a["loss_curve"] == b["loss_curve"] and a["history"] == b["history"] and a["step"] == b["step"] == 8
    assert np.array_equal(c[0]["params"], c[1]["params"])


def test_c_loop_with_empty_slices_and_per_token_rows_equals_the_per_step_loop(tiny_dir):
    """three ranks, batch 7 over 29 examples (the last global batch: 1 example, two empty slices),
    a token head (slices balanced by rows, dropout keys placed by rows and squares): as the per-step
    loop, bit for bit"""
    kw = dict(epochs=1, timeout=300)
    c = run_ranks(loop_run, 3, tiny_dir, "token-classification", 7, **kw)
    py = run_ranks(loop_run, 3, tiny_dir, "token-classification", 7, env={"FASTTRAN_PY_LOOP": "1"}, **kw)
    assert [r["loop"] for r in c] == ["c"] * 3 and [r["loop"] for r in py] == ["python"] * 3
    for a, b in zip(c, py):
        assert np.array_equal(a["params"], b["params"]) and a["loss_curve"] == b["loss_curve"]
        assert a["history"] == b["history"]


def test_c_loop_ranks_equal_one_process(tiny_dir):
    """two ranks through the C loop against one process (also the C loop): after one step the weights
    to fp32 rounding of the gradient sums' order (the bound of test_ranks_equal_one_process_and_each_other),
    the whole run's losses within 1e-3"""
    one_step = loop_run(0, 1, tiny_dir, "classification", 8, steps=1)
    ranks = run_ranks(loop_run, 2, tiny_dir, "classification", 8, steps=1, timeout=300)
    assert one_step["loop"] == "c" and [r["loop"] for r in ranks] == ["c", "c"]
    d1 = np.abs(ranks[0]["params"] - one_step["params"])
    assert np.median(d1) == 0.0 and d1.max() <= 1e-3 * 3e-3, (np.median(d1), d1.max())
    one = loop_run(0, 1, tiny_dir, "classification", 8)
    ranks = run_ranks(loop_run, 2, tiny_dir, "classification", 8, timeout=300)
    assert np.array_equal(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["loss_curve"] == ranks[1]["loss_curve"]
    assert np.allclose(ranks[0]["loss_curve"], one["loss_curve"], rtol=1e-3)


@pytest.mark.parametrize("transport", ["shared_memory", "group"])
@pytest.mark.parametrize("fail", ["raise", "sigint"])
def test_a_rank_that_stops_inside_the_c_loop_does_not_hang_the_other(tiny_dir, transport, fail):
    """batch 1 (29 steps an epoch; 2 ranks: one example and an empty slice a step): rank 1 raises, or
    gets Ctrl-C, in the C loop's bookkeeping after step 20; rank 0, waiting in step 21's sums (in C for
    shared memory), learns that rank 1 left within the timeout and fails naming it"""
    import time
    t0 = time.monotonic()
    out = run_ranks(loop_run, 2, tiny_dir, "classification", 1, transport=transport, fail=fail, check=False,
                    timeout=120, env={"FASTTRAN_DIST_TIMEOUT": "20"})
    assert time.monotonic() - t0 < 100
    assert not out[0].ok and out[0].error_type in ("CollectiveError", "CollectiveTimeoutError"), out
    assert "rank 1" in out[0].message, out[0].message
    if fail == "raise":
        assert not out[1].ok and "rank 1 fails in the loop" in out[1].message, out
    else:   # Ctrl-C: rank 1 stops cleanly after the step in flight
        assert out[1].ok and out[1].value["loop"] == "c" and out[1].value["step"] == 20, out


def test_sums_that_disagree_inside_the_c_loop_are_a_collective_error(tiny_dir):
    """the shared-memory sums in C refuse a step whose sums were already made (the per-step loop's
    CollectiveError, "rank 1: ..."); the other rank learns that rank 1 left"""
    out = run_ranks(loop_run, 2, tiny_dir, "classification", 8, transport="shared_memory", fail="repeat", check=False,
                    timeout=120, env={"FASTTRAN_DIST_TIMEOUT": "20"})
    assert out[1].error_type == "CollectiveError" and out[1].message.startswith(
        "rank 1: gradient bucket 0 is handed over for step 0, whose sums were already made"), out
    assert out[0].error_type == "CollectiveError" and "rank 1" in out[0].message, out
