"""FastTran's Table 1 on one GPU: SQuAD v1.1 with a frozen encoder and a QA head, total time of the
whole pipeline (cache build + every epoch), three ways, same run, same features:

  no_cache    transformers BertModel (bf16 autocast, SDPA) re-run under no_grad on every batch of
              every epoch, head trained with torch's fused AdamW (what FastTran's paper compares to)
  torch_cache a hand-made cache: one bf16 forward of every feature kept in GPU memory, then the same
              head training over it (what a user writes in ten lines)
  fasttran    Encoder(dtype="bfloat16", device="cuda") -> ActivationCache.build(positions="all",
              dtype="bfloat16", device_bytes=...) -> Trainer("qa", device="cuda").fit(...)

Setting (the paper's): the first N SQuAD training features at seq 384, stride 128 (N = 3433, or all
features of the training file with --features 0), BERT-base architecture, 5 epochs, batch 12; the
paper's V100: 155.4 s -> 34.7 s (4.5x). The speed runs use random BERT-base weights (same weights in
all three); --accuracy instead trains MiniLM's real weights (--model, a directory with config,
safetensors and tokenizer) with fasttran on CUDA and on the CPU and reports EM / F1 on the dev set
(the bar: within 0.3 points).

  python3 benchmarks/gpu_table1.py --data DIR [--features 3433] [--epochs 5] [--json OUT]
  python3 benchmarks/gpu_table1.py --data DIR --accuracy --model .minilm-bf16 --epochs 2
DIR holds squad/train-subset-v1.1.json (and squad/dev-v1.1.json for --accuracy). The tokenizer is
--model's (all BERT uncased models share the vocabulary). Without a GPU the script refuses, unless
--smoke (tiny sizes, torch on the CPU, fasttran on the emulator): a check that the script runs.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import fasttran
from fasttran import ActivationCache, Trainer
from fasttran.squad import SquadFeatures, load_squad


def features(data, tokenizer, n, split="train"):
    name = "train-subset-v1.1.json" if split == "train" else "dev-v1.1.json"
    ex = load_squad(os.path.join(data, "squad", name))
    f = SquadFeatures(ex, tokenizer, max_length=384, doc_stride=128)
    if split == "train":
        f = f.with_answers()
    return f


def sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def torch_pipelines(path, ids, mask, types, start, end, epochs, bs, dev, cache):
    """no_cache (cache=False) or torch_cache (cache=True): seconds of the whole pipeline"""
    import torch
    from transformers import BertModel
    model = BertModel.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="sdpa",
                                      add_pooling_layer=False).to(dev).eval()
    head = torch.nn.Linear(model.config.hidden_size, 2).to(dev)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-5, fused=dev == "cuda")
    I, M, Ty = (torch.as_tensor(a, device=dev) for a in (ids, mask, types))
    ctx = (Ty == 1) & (M == 1)
    S, E = torch.as_tensor(start, device=dev), torch.as_tensor(end, device=dev)
    N = len(ids)
    sync(torch)
    t0 = time.perf_counter()
    feats = None
    if cache:   # one bf16 forward of every feature, kept on the device
        with torch.inference_mode():
            feats = torch.cat([model(input_ids=I[a:a + 64], attention_mask=M[a:a + 64],
                                     token_type_ids=Ty[a:a + 64]).last_hidden_state for a in range(0, N, 64)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(N, generator=gen).split(bs):
            idx = idx.to(dev)
            if cache:
                x = feats[idx]
            else:
                with torch.no_grad():
                    x = model(input_ids=I[idx], attention_mask=M[idx], token_type_ids=Ty[idx]).last_hidden_state
            with torch.autocast(dev, dtype=torch.bfloat16):
                z = head(x).float()
            valid = ctx[idx]
            s = z[..., 0].masked_fill(~valid, float("-inf"))
            e = z[..., 1].masked_fill(~valid, float("-inf"))
            loss = (torch.nn.functional.cross_entropy(s, S[idx]) + torch.nn.functional.cross_entropy(e, E[idx])) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    sync(torch)
    return time.perf_counter() - t0


def fasttran_pipeline(path, ids, mask, types, start, end, epochs, bs, device, dtype):
    """(seconds of the pipeline, of its cache build, the trainer, the encoder, seconds loading the
    encoder): the model is loaded before the clock starts, as the torch pipelines load theirs"""
    t_load = time.perf_counter()
    enc = fasttran.Encoder.from_pretrained(path, device=device, dtype=dtype, load_tokenizer=False)
    t0 = time.perf_counter()
    t_load = t0 - t_load
    on_gpu = device != "cpu"
    cache = ActivationCache.build(enc, ids, mask, types, positions="all", dtype="bfloat16", batch_size=64,
                                  device_bytes=(60 << 30) if on_gpu else None, show_progress=False)
    t_cache = time.perf_counter() - t0
    tr = Trainer("qa", device=device, epochs=epochs, batch_size=bs, lr=3e-5, show_progress=False)
    tr.fit(cache, (start, end))
    return time.perf_counter() - t0, t_cache, tr, enc, t_load


def bert_base_dir(tokenizer_dir, root):
    """random BERT-base weights (bf16) with the given model's tokenizer files"""
    import torch
    from transformers import BertConfig, BertModel
    d = os.path.join(root, "bert-base")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
              add_pooling_layer=False).to(torch.bfloat16).save_pretrained(d)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), d)
    return d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--model", default=os.environ.get("FASTTRAN_MINILM_BF16", ".minilm-bf16"),
                   help="tokenizer source (and the weights for --accuracy)")
    p.add_argument("--features", type=int, default=3433, help="first N training features (0: all)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--dev-examples", type=int, default=2000, help="--accuracy: the first N dev questions (0: all)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_common import real_gpu
    gpu = real_gpu(torch)[0]
    if not gpu and not a.smoke:
        sys.exit("gpu_table1.py needs a GPU (torch on CUDA and fasttran's CUDA build); --smoke checks the script")
    dev = "cuda" if gpu else "cpu"
    tok = fasttran.Encoder.from_pretrained(a.model, load_tokenizer=True).tokenizer
    if a.smoke:
        a.features, a.epochs = min(a.features or 16, 16), 1
    ftr = features(a.data, tok, a.features)
    n = min(a.features, len(ftr)) if a.features else len(ftr)
    ids, mask, types = (np.ascontiguousarray(x[:n]) for x in (ftr.input_ids, ftr.attention_mask, ftr.token_type_ids))
    start, end = ftr.start_positions[:n], ftr.end_positions[:n]
    out = {"features": int(n), "seq": int(ids.shape[1]), "epochs": a.epochs, "batch": a.batch,
           "device": torch.cuda.get_device_name(0) if gpu else "cpu (smoke)", "torch": torch.__version__,
           "fasttran": fasttran.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    root = tempfile.mkdtemp()
    if not a.accuracy:
        path = bert_base_dir(a.model, root) if not a.smoke else a.model
        out["no_cache_s"] = torch_pipelines(path, ids, mask, types, start, end, a.epochs, a.batch, dev, cache=False)
        out["torch_cache_s"] = torch_pipelines(path, ids, mask, types, start, end, a.epochs, a.batch, dev, cache=True)
        total, t_cache, _, _, t_load = fasttran_pipeline(path, ids, mask, types, start, end, a.epochs, a.batch,
                                                         "cuda", "bfloat16")
        out.update(fasttran_s=total, fasttran_cache_build_s=t_cache, fasttran_load_s=t_load,
                   speedup_vs_no_cache=out["no_cache_s"] / total,
                   speedup_vs_torch_cache=out["torch_cache_s"] / total)
    else:
        dev_ex = load_squad(os.path.join(a.data, "squad", "dev-v1.1.json"))
        keep = 8 if a.smoke else a.dev_examples
        fdv = SquadFeatures(dev_ex[:keep] if keep else dev_ex, tok, max_length=384, doc_stride=128)
        out["dev_questions"] = len(fdv.examples)
        for name, device, dtype in (("cuda", "cuda", "bfloat16"), ("cpu", "cpu", "float32")):
            total, _, tr, enc, _ = fasttran_pipeline(a.model, ids, mask, types, start, end, a.epochs, a.batch, device,
                                                  dtype)
            cdv = ActivationCache.build(enc, fdv.input_ids, fdv.attention_mask, fdv.token_type_ids, positions="all",
                                        dtype="bfloat16", batch_size=64, show_progress=False)
            m = tr.evaluate(cdv, fdv)
            out[name] = {"seconds": total, "exact_match": m["exact_match"], "f1": m["f1"]}
        out["em_difference"] = abs(out["cuda"]["exact_match"] - out["cpu"]["exact_match"])
        out["f1_difference"] = abs(out["cuda"]["f1"] - out["cpu"]["f1"])
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
