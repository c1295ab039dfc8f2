"""Command-line interface: the demo's steps on files.

    fasttran encode   --model DIR --input FILE --output OUT.npy|OUT.safetensors
    fasttran cache    --model DIR --input FILE --output CACHE_DIR
    fasttran train    --model DIR --input FILE --cache CACHE_DIR --output CHECKPOINT_DIR
    fasttran evaluate --model DIR --input FILE --cache CACHE_DIR --checkpoint CHECKPOINT_DIR

Input files are JSON lines ({"text": ..., "label": ...}) or TSV with a header row naming the
text and label columns (GLUE's `sentence` / `label` work as they are)."""
import argparse
import json
import os
import sys

import numpy as np


def read_examples(path, text_field=None, label_field="label"):
    """(texts, labels or None) from a .jsonl/.json-lines or .tsv/.csv-with-tabs file."""
    if not os.path.exists(path):
        sys.exit(f"fasttran: input file {path} not found")
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        if path.endswith((".jsonl", ".json")):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    sys.exit(f"fasttran: {path}:{n}: not JSON: {e}")
                tf = text_field or next((k for k in ("text", "sentence") if k in row), None)
                if tf not in row:
                    sys.exit(f"fasttran: {path}:{n}: no text field (use --text-field)")
                texts.append(row[tf])
                labels.append(row.get(label_field))
        else:
            header = f.readline().rstrip("\n").split("\t")
            tf = text_field or next((k for k in ("text", "sentence") if k in header), None)
            if tf not in header:
                sys.exit(f"fasttran: {path}: the header {header} has no text column (use --text-field)")
            ti, li = header.index(tf), header.index(label_field) if label_field in header else None
            for n, line in enumerate(f, 2):
                parts = line.rstrip("\n").split("\t")
                if len(parts) != len(header):
                    sys.exit(f"fasttran: {path}:{n}: {len(parts)} fields, the header has {len(header)}")
                texts.append(parts[ti])
                labels.append(parts[li] if li is not None else None)
    if any(lab is None for lab in labels):
        return texts, None
    try:
        return texts, np.array([int(v) for v in labels], np.int64)
    except ValueError:
        sys.exit(f"fasttran: {path}: labels must be integers")


def _encoder(args):
    import fasttran
    device = args.device or ("cuda:0" if fasttran.cuda_available() else "cpu")
    return fasttran.Encoder.from_pretrained(args.model, device=device)


def cmd_encode(args):
    from .safetensors_io import write_safetensors
    enc = _encoder(args)
    texts, _ = read_examples(args.input, args.text_field)
    emb = enc.encode(texts, batch_size=args.batch_size, pooling=args.pooling, layer=args.layer,
                     normalize=args.normalize, show_progress=True)
    if args.output.endswith(".safetensors"):
        write_safetensors(args.output, {"embeddings": emb}, {"model": args.model, "pooling": args.pooling})
    else:
        np.save(args.output, emb)
    print(f"wrote {emb.shape[0]} x {emb.shape[1]} float32 embeddings to {args.output}")


def cmd_cache(args):
    from . import ActivationCache
    enc = _encoder(args)
    texts, _ = read_examples(args.input, args.text_field)
    ids, mask, types = enc.tokenize(texts, max_length=args.max_length)
    cache = ActivationCache.build(enc, ids, mask, types, layer=args.layer, positions=args.positions, dtype=args.dtype,
                                  disk_dir=args.output, batch_size=args.batch_size, rebuild=args.rebuild)
    print(cache)


def _open_cache(args, enc):
    from . import ActivationCache
    return ActivationCache.open(args.cache, encoder=enc)


def cmd_train(args):
    from . import Trainer
    enc = _encoder(args)
    _, labels = read_examples(args.input, args.text_field, args.label_field)
    if labels is None:
        sys.exit(f"fasttran: {args.input} has no labels (column/field {args.label_field!r})")
    cache = _open_cache(args, enc)
    ev = None
    if args.eval_input and args.eval_cache:
        ev = (_open_cache(argparse.Namespace(cache=args.eval_cache), enc),
              read_examples(args.eval_input, args.text_field, args.label_field)[1])
    tr = Trainer(args.head, optimizer=args.optimizer, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                 seed=args.seed, weight_decay=args.weight_decay, schedule=args.schedule, warmup=args.warmup)
    for r in tr.fit(cache, labels, eval=ev, checkpoint_dir=args.output, resume=args.resume):
        print(json.dumps(r))
    tr.save(args.output)
    print(f"saved to {args.output}")


def cmd_evaluate(args):
    from . import Trainer
    enc = _encoder(args)
    _, labels = read_examples(args.input, args.text_field, args.label_field)
    cache = _open_cache(args, enc)
    tr = Trainer.load(args.checkpoint, show_progress=False)
    if args.predictions:
        np.save(args.predictions, tr.predict(cache))
    if labels is None:
        print("no labels in the input: wrote predictions only" if args.predictions else "no labels in the input")
        return
    print(json.dumps(tr.evaluate(cache, labels)))


def main(argv=None):
    p = argparse.ArgumentParser(prog="fasttran", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, model=True):
        if model:
            sp.add_argument("--model", required=True, help="checkpoint directory (config.json + model.safetensors)")
            sp.add_argument("--device", default=None, help="cpu or cuda:N (default: the best present)")
        sp.add_argument("--input", required=True, help="JSONL or TSV file of examples")
        sp.add_argument("--text-field", default=None, help="text field/column (default: text or sentence)")
        sp.add_argument("--label-field", default="label")
        sp.add_argument("--batch-size", type=int, default=64)

    e = sub.add_parser("encode", help="embed texts with a frozen encoder into .npy or .safetensors")
    common(e)
    e.add_argument("--output", required=True)
    e.add_argument("--pooling", default="mean", choices=["mean", "cls"])
    e.add_argument("--layer", type=int, default=-1)
    e.add_argument("--normalize", action="store_true")
    e.set_defaults(func=cmd_encode)

    c = sub.add_parser("cache", help="build a persistent activation cache directory")
    common(c)
    c.add_argument("--output", required=True, help="cache directory")
    c.add_argument("--positions", default="mean", choices=["cls", "mean", "all"])
    c.add_argument("--layer", type=int, default=-1)
    c.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"])
    c.add_argument("--max-length", type=int, default=None)
    c.add_argument("--rebuild", action="store_true")
    c.set_defaults(func=cmd_cache)

    t = sub.add_parser("train", help="train a head from a cache; checkpoints to --output")
    common(t)
    t.add_argument("--cache", required=True)
    t.add_argument("--output", required=True, help="checkpoint directory")
    t.add_argument("--head", default="classification", choices=["classification", "classification-pooler"])
    t.add_argument("--optimizer", default="lamb", choices=["lamb", "adamw"])
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--schedule", default="linear", choices=["constant", "linear", "cosine"])
    t.add_argument("--warmup", type=float, default=0.1)
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-input")
    t.add_argument("--eval-cache")
    t.add_argument("--resume", action="store_true")
    t.set_defaults(func=cmd_train, batch_size=32)

    v = sub.add_parser("evaluate", help="accuracy/F1 of a trained head on a cache")
    common(v)
    v.add_argument("--cache", required=True)
    v.add_argument("--checkpoint", required=True)
    v.add_argument("--predictions", help="also write predicted labels (.npy)")
    v.set_defaults(func=cmd_evaluate)

    args = p.parse_args(argv)
    from .errors import FastTranError
    try:
        args.func(args)
    except FastTranError as e:
        sys.exit(f"fasttran {args.command}: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
