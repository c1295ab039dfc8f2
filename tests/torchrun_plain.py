"""A plain one-process training script, as a user writes it: nothing in it knows about ranks. Run
alone, or under `torchrun --nproc-per-node=2` (tests/test_distributed_training.py): there the
Trainer goes data-parallel by itself.

    python torchrun_plain.py MODEL_DIR SST2_TSV OUT_DIR"""
import json
import os
import sys

import numpy as np

import fasttran
from fasttran.data import load_sst2

model_dir, tsv, out = sys.argv[1:4]
enc = fasttran.Encoder.from_pretrained(model_dir)
s, y = load_sst2(tsv)
s, y = s[:192], np.array(y[:192])
cache = fasttran.ActivationCache.build(enc, *enc.tokenize(s), positions="mean", show_progress=False)
tr = fasttran.Trainer("classification", epochs=2, batch_size=32, show_progress=False, seed=4)
hist = tr.fit(cache, y)
rank = int(os.environ.get("RANK", "0"))
np.save(os.path.join(out, f"head{rank}.npy"), tr.head.params)
with open(os.path.join(out, f"history{rank}.json"), "w") as f:
    json.dump(hist, f)
