"""Runtime behaviour: the GIL is released during forward, Ctrl-C stops a long forward, memory
does not grow over many calls, and build_info describes the build."""
import os
import signal
import threading
import time

import numpy as np
import pytest

import fasttran

CFG = dict(vocab_size=1000, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
           num_hidden_layers=8, type_vocab_size=2, max_position_embeddings=512, model_type="bert")


@pytest.fixture(scope="module")
def enc():
    e = fasttran.Encoder(CFG)   # zero weights: timing and memory only
    return e


def long_batch():
    return np.random.default_rng(0).integers(0, 1000, (32, 512))


def test_gil_released_during_forward(enc):
    ids = long_batch()
    enc.forward(ids[:1])
    done = threading.Event()
    elapsed = []

    def work():
        t = time.perf_counter()
        enc.forward(ids)
        elapsed.append(time.perf_counter() - t)
        done.set()

    th = threading.Thread(target=work)
    ticks = 0
    th.start()
    while not done.is_set():   # runs only if the forward thread does not hold the GIL
        ticks += 1
        time.sleep(0.001)
    th.join()
    assert elapsed[0] > 0.2, "forward too short to show anything"
    # with the GIL held for the whole forward this loop would barely run at all
    assert ticks >= 0.25 * elapsed[0] / 0.001 * 0.2, (ticks, elapsed)


def test_ctrl_c_interrupts_between_layers(enc):
    ids = long_batch()
    timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))
    t = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(20):        # far longer than 0.05 s: the interrupt lands inside a forward
            enc.forward(ids)
    timer.join()
    assert time.perf_counter() - t < 10
    assert enc.forward(ids[:2, :8]).shape == (2, 8, 256)   # still usable afterwards


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_forward_does_not_leak(enc):
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 1000, (4, int(T))) for T in rng.integers(1, 64, 50)]
    for b in batches:   # warm-up: grows the workspace to its largest size
        enc.forward(b, pooling="mean")
        enc.forward(b, output_layers=[0, 2, -1])
    before = rss_bytes()
    for i in range(1000):
        b = batches[i % len(batches)]
        enc.forward(b, np.ones_like(b), output_layers=[0, -1] if i % 2 else -1, pooling=None if i % 3 else "cls")
    grown = rss_bytes() - before
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 1,000 forward calls"


def test_build_info():
    info = fasttran.build_info()
    assert info["backends"][0] == "cpu"
    assert "OpenBLAS" in info["blas"]
    assert info["threads"] >= 1
    assert isinstance(info["cuda"]["compiled"], bool)
    if not fasttran.cuda_available():
        assert info["cuda"]["unavailable_reason"]
        with pytest.raises((fasttran.BackendError, fasttran.UnsupportedError)):
            fasttran.Encoder(CFG, device="cuda")


def test_threads_setting():
    n = fasttran.get_num_threads()
    try:
        fasttran.set_num_threads(1)
        assert fasttran.get_num_threads() == 1
    finally:
        fasttran.set_num_threads(n)
    with pytest.raises(fasttran.InputError):
        fasttran.set_num_threads(0)
