"""Tempo's memory savings in top-k training: saved-activation bytes of a training step
with each option on alone, Tempo's three together and all four (with FlashAttention's recomputed
probabilities), predicted from the design and measured from the layer
stack's own memory model (the same layout it allocates: tests/test_layer_training.py checks that
report against the allocation), and the largest batch of 512-token sequences that fits a budget.

    python benchmarks/tempo_memory.py [--budget-gib 80] [--json benchmarks/last_tempo_memory.json]

Models: all-MiniLM-L6-v2 (real) and BERT-base (the architecture, random weights; needs torch +
transformers to write it), every layer trained (k = L), dropout 0.1. Predictions per layer, N
tokens, P attention probabilities (sum over sequences of heads * n^2):
inplace_layernorm 2 N C floats; inplace_gelu N I floats less N I bits; recompute_attention_dropout
P bytes; recompute_attention_probs P floats less 2 N NH floats (each row's max and 1/sum). Nothing is run here: the byte counts are the layout's, the same on CPU and CUDA."""
import argparse
import json
import os
import tempfile

import fasttran
from fasttran.finetune import TopLayers

TEMPO = ("inplace_layernorm", "inplace_gelu", "recompute_attention_dropout")
OPTIONS = TEMPO + ("recompute_attention_probs",)


def predicted_saving(option, L, B, T, C, I, NH):
    N, P = B * T, NH * B * T * T
    return L * {"inplace_layernorm": 2 * N * C * 4, "inplace_gelu": N * I * 4 - N * I // 8,
                "recompute_attention_dropout": P, "recompute_attention_probs": 4 * P - 2 * N * NH * 4}[option]


def bert_base(tmp):
    import torch
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    BertModel(BertConfig()).save_pretrained(tmp)
    return tmp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-gib", type=float, default=80.0)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "last_tempo_memory.json"))
    args = ap.parse_args()
    budget = int(args.budget_gib * 2**30)
    rows = []
    print("| model | batch | option | saved activations MiB | saving predicted MiB | saving measured MiB | "
          f"largest batch at 512 in {args.budget_gib:g} GiB |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("MiniLM-L6", fasttran.models.minilm_path()), ("BERT-base", None)):
            enc = fasttran.Encoder.from_pretrained(path or bert_base(tmp), load_tokenizer=False)
            L, C = enc.num_layers, enc.hidden_size
            I, NH = enc.config["intermediate_size"], enc.config["num_attention_heads"]
            off = dict.fromkeys(OPTIONS, False)

            def report(B, T, **opt):
                top = TopLayers(enc, L, hidden_dropout=0.1, attention_dropout=0.1, **dict(off, **opt))
                return sum(top.memory_report(B, T)["activations"].values()), top.largest_batch(512, budget)
            for B, T in ((32, 128), (8, 512)):
                base, base_lb = report(B, T)
                cases = [("none", {})] + [(o, {o: True}) for o in OPTIONS] + [
                    ("Tempo's three", dict.fromkeys(TEMPO, True)), ("all four", dict.fromkeys(OPTIONS, True))]
                for label, opt in cases:
                    act, lb = report(B, T, **opt)
                    pred = sum(predicted_saving(o, L, B, T, C, I, NH) for o in opt)
                    row = dict(model=name, layers=L, batch=B, seq=T, option=label, activations=act,
                               predicted_saving=pred, measured_saving=base - act, largest_batch_512=lb)
                    rows.append(row)
                    print(f"| {name} (k={L}) | {B}x{T} | {label} | {act / 2**20:,.1f} | {pred / 2**20:,.1f} | "
                          f"{(base - act) / 2**20:,.1f} | {lb} |", flush=True)
                    assert pred == base - act, f"{name} {label}: predicted {pred}, measured {base - act}"
    with open(args.json, "w") as f:
        json.dump({"budget_bytes": budget, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
