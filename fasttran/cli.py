"""fasttran command line: fine-tune a head on a frozen BERT-family encoder, on files.

workflow (classification; --model defaults to all-MiniLM-L6-v2, see fasttran.models):
  fasttran cache    --input train.tsv --output ctrain        # encoder runs once, features on disk
  fasttran cache    --input dev.tsv   --output cdev
  fasttran train    --input train.tsv --cache ctrain --output ck --eval-input dev.tsv --eval-cache cdev
  fasttran evaluate --input dev.tsv   --cache cdev --checkpoint ck
  fasttran encode   --input texts.tsv --output emb.npy       # sentence embeddings only

extractive QA (SQuAD v1.1 JSON files):
  fasttran cache    --task qa --answers-only --input train.json --output qtrain
  fasttran cache    --task qa --input dev.json --output qdev
  fasttran train    --head qa --input train.json --cache qtrain --output qck
  fasttran evaluate --input dev.json --cache qdev --checkpoint qck    # exact match / F1

Classification inputs are JSON lines ({"text": ..., "label": ...}) or TSV with a header row
naming the text and label columns (GLUE's `sentence` / `label` work as they are).
Ctrl-C stops cleanly (train: after the step in flight, saving the checkpoint)."""
import argparse
import json
import os
import sys

import numpy as np


class _Fmt(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (when it has one)."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if action.option_strings and d is not None and d is not False and d != argparse.SUPPRESS and "%(default)" not in h:
            h += " (default: %(default)s)"
        return h


def _fail(msg):
    sys.exit(f"fasttran: {msg}")


def read_examples(path, text_field=None, label_field="label", limit=None):
    """(texts, labels or None) from a .jsonl/.json-lines or .tsv/.csv-with-tabs file."""
    if not os.path.exists(path):
        _fail(f"input file {path} not found")
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        if path.endswith((".jsonl", ".json")):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    _fail(f"{path}:{n}: not JSON lines ({e}); SQuAD JSON files need --task qa / --head qa")
                if not isinstance(row, dict):
                    _fail(f"{path}:{n}: expected a JSON object per line")
                tf = text_field or next((k for k in ("text", "sentence") if k in row), None)
                if tf not in row:
                    _fail(f"{path}:{n}: no text field (use --text-field)")
                texts.append(row[tf])
                labels.append(row.get(label_field))
                if limit and len(texts) >= limit:
                    break
        else:
            header = f.readline().rstrip("\n").split("\t")
            tf = text_field or next((k for k in ("text", "sentence") if k in header), None)
            if tf not in header:
                _fail(f"{path}: the header {header} has no text column (use --text-field)")
            ti, li = header.index(tf), header.index(label_field) if label_field in header else None
            for n, line in enumerate(f, 2):
                parts = line.rstrip("\n").split("\t")
                if len(parts) != len(header):
                    _fail(f"{path}:{n}: {len(parts)} fields, the header has {len(header)}")
                texts.append(parts[ti])
                labels.append(parts[li] if li is not None else None)
                if limit and len(texts) >= limit:
                    break
    if any(lab is None for lab in labels):
        return texts, None
    try:
        return texts, np.array([int(v) for v in labels], np.int64)
    except (TypeError, ValueError):
        _fail(f"{path}: labels must be integer class ids 0..K-1")


def _encoder(args):
    import fasttran
    model = args.model or fasttran.models.minilm_path()
    device = args.device or ("cuda:0" if fasttran.cuda_available() else "cpu")
    return fasttran.Encoder.from_pretrained(model, device=device)


# ---- QA files ----------------------------------------------------------------------------------
_TASK_FILE = "fasttran-task.json"


def _squad_features(args, enc, settings):
    from .squad import SquadFeatures, load_squad
    examples = load_squad(args.input)
    if args.limit:
        examples = examples[:args.limit]
    if not examples:
        _fail(f"{args.input} holds no questions")
    feats = SquadFeatures(examples, enc.tokenizer, max_length=settings["max_length"],
                          doc_stride=settings["doc_stride"])
    return feats.with_answers() if settings["answers_only"] else feats


def _task_settings(cache_dir):
    try:
        with open(os.path.join(cache_dir, _TASK_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"task": "classification"}


# ---- commands ----------------------------------------------------------------------------------
def cmd_encode(args):
    from .safetensors_io import write_safetensors
    enc = _encoder(args)
    texts, _ = read_examples(args.input, args.text_field, limit=args.limit)
    emb = enc.encode(texts, batch_size=args.batch_size, pooling=args.pooling, layer=args.layer,
                     normalize=args.normalize, show_progress=True)
    if args.output.endswith(".safetensors"):
        write_safetensors(args.output, {"embeddings": emb}, {"model": enc.path or "", "pooling": args.pooling})
    else:
        np.save(args.output, emb)
    print(f"wrote {emb.shape[0]} x {emb.shape[1]} float32 embeddings to {args.output}")


def cmd_cache(args):
    from . import ActivationCache
    from ._C import atomic_write as _atomic_write
    enc = _encoder(args)
    if args.task == "qa":
        settings = {"task": "qa", "max_length": args.max_length or 384, "doc_stride": args.doc_stride,
                    "answers_only": bool(args.answers_only), "limit": args.limit}
        feats = _squad_features(args, enc, settings)
        print(f"{feats!r}", file=sys.stderr)
        ids, mask, types = feats.input_ids, feats.attention_mask, feats.token_type_ids
        positions, dtype = "all", args.dtype or "float16"
    else:
        if args.answers_only:
            _fail("--answers-only is for --task qa")
        texts, _ = read_examples(args.input, args.text_field, limit=args.limit)
        ids, mask, types = enc.tokenize(texts, max_length=args.max_length)
        settings = {"task": "classification"}
        positions, dtype = args.positions, args.dtype or "float32"
    cache = ActivationCache.build(enc, ids, mask, types, layer=args.layer, positions=positions, dtype=dtype,
                                  disk_dir=args.output, batch_size=args.batch_size, rebuild=args.rebuild,
                                  show_progress=True)
    _atomic_write(os.path.join(args.output, _TASK_FILE), [json.dumps(settings).encode()])
    print(cache)


def _open_cache(path, enc, what="--cache"):
    from . import ActivationCache
    from .errors import CacheNotFoundError
    try:
        return ActivationCache.open(path, encoder=enc)
    except CacheNotFoundError as e:
        _fail(f"{what} {path}: {e}")


def _qa_source(args, enc, cache_dir, input_path, for_training, what):
    """(cache, SquadFeatures) of a QA cache directory and the SQuAD file it was built from."""
    from . import ActivationCache
    from .errors import CacheMismatchError
    st = _task_settings(cache_dir)
    if not os.path.isdir(cache_dir):
        _fail(f"{what} {cache_dir} does not exist: build it with `fasttran cache --task qa`")
    if st.get("task") != "qa":
        _fail(f"{what} {cache_dir} is not a QA cache: build it with `fasttran cache --task qa --input FILE.json`")
    if for_training and not st.get("answers_only"):
        _fail(f"{what} {cache_dir} holds every window, also those without the answer; a training cache needs "
              "`fasttran cache --task qa --answers-only`")
    ns = argparse.Namespace(input=input_path, limit=st.get("limit"))
    feats = _squad_features(ns, enc, st)
    try:
        cache = ActivationCache.open(cache_dir, encoder=enc, input_ids=feats.input_ids,
                                     attention_mask=feats.attention_mask, token_type_ids=feats.token_type_ids)
    except CacheMismatchError as e:
        _fail(f"{what} {cache_dir} was not built from {input_path} ({e})")
    return cache, feats


def cmd_train(args):
    from . import Trainer
    if bool(args.eval_input) != bool(args.eval_cache):
        _fail("--eval-input and --eval-cache go together: the cache of the eval file, built with `fasttran cache`")
    enc = _encoder(args)
    if args.head == "qa":
        cache, feats = _qa_source(args, enc, args.cache, args.input, True, "--cache")
        targets = (feats.start_positions, feats.end_positions)
        ev = _qa_source(args, enc, args.eval_cache, args.eval_input, False, "--eval-cache") if args.eval_cache else None
    else:
        if _task_settings(args.cache).get("task") == "qa":
            _fail(f"--cache {args.cache} is a QA cache: use --head qa")
        _, targets = read_examples(args.input, args.text_field, args.label_field, limit=args.limit)
        if targets is None:
            _fail(f"{args.input} has no labels (column/field {args.label_field!r})")
        cache = _open_cache(args.cache, enc)
        if len(cache) != len(targets):
            _fail(f"--cache {args.cache} holds {len(cache)} examples but {args.input} gives {len(targets)} labels"
                  + (" (the same --limit as for `fasttran cache`?)" if args.limit else ""))
        ev = None
        if args.eval_cache:
            ev = (_open_cache(args.eval_cache, enc, "--eval-cache"),
                  read_examples(args.eval_input, args.text_field, args.label_field)[1])
    tr = Trainer(args.head, optimizer=args.optimizer, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                 seed=args.seed, weight_decay=args.weight_decay, schedule=args.schedule, warmup=args.warmup)
    print(f"{tr!r}", file=sys.stderr)
    for r in tr.fit(cache, targets, eval=ev, checkpoint_dir=args.output, resume=args.resume):
        print(json.dumps(r))
    tr.save(args.output)
    print(f"saved to {args.output}")
    if tr._interrupt:   # Ctrl-C: the trainer stopped after the step in flight and saved
        print(f"fasttran: interrupted; continue with the same command and --resume", file=sys.stderr)
        return 130


def cmd_evaluate(args):
    from . import Trainer
    enc = _encoder(args)
    tr = Trainer.load(args.checkpoint)
    if tr.task == "qa":
        cache, feats = _qa_source(args, enc, args.cache, args.input, False, "--cache")
        preds = tr.predict(cache, squad=feats)
        if args.predictions:
            with open(args.predictions, "w") as f:
                json.dump(preds, f)
        from .squad import squad_metrics
        print(json.dumps(squad_metrics(preds, feats.examples)))
        return
    _, labels = read_examples(args.input, args.text_field, args.label_field, limit=args.limit)
    cache = _open_cache(args.cache, enc)
    if args.predictions:
        np.save(args.predictions, tr.predict(cache))
    if labels is None:
        print("no labels in the input: wrote predictions only" if args.predictions else "no labels in the input")
        return
    print(json.dumps(tr.evaluate(cache, labels)))


# ---- compress (issue 31) --------------------------------------------------------------------------------
def cmd_compress(args):
    """Significance table, then the search under the budget; the trade-off and the result."""
    from . import compress
    from .compress.tasks import load_task
    from . import set_num_threads
    if args.threads:
        set_num_threads(args.threads)
    model = compress.TaskModel.load(args.model)
    print(model, file=sys.stderr)

    def data(split, limit=None):
        a, b, y = load_task(args.task, split, args.data, limit)
        return compress.TaskData.from_texts(model, a, y, pairs=b, max_length=args.max_length)
    dev = data("dev", args.limit)
    train = data("train", args.train_limit)
    n_select = args.select or min(500, max(len(train) // 10, 1))
    if n_select >= len(train):
        _fail(f"--select {n_select}: the training split has only {len(train)} examples")
    select, train = train.split(n_select, seed=args.seed)
    print(f"data: {len(train)} train (re-fine-tuning), {len(select)} selection (held out of train: decisions), "
          f"{len(dev)} dev (reported)", file=sys.stderr)
    methods = ("mask", "gradient") if args.significance == "both" else (args.significance,)
    sig = compress.significance(model, select, methods=methods, ffn_group_size_=args.ffn_group_size, seed=args.seed)
    print(sig.table())
    if args.significance_only:
        if args.output:
            os.makedirs(args.output, exist_ok=True)
            from ._C import atomic_write as _atomic_write
            from .compress.model import _jsonable
            _atomic_write(os.path.join(args.output, "significance.json"),
                          [json.dumps(_jsonable(sig.to_dict()), indent=1).encode()])
        return 0
    if args.max_drop is None and args.target_latency is None and args.target_size is None:
        _fail("give a budget: --max-drop POINTS, --target-latency MS and/or --target-size MB "
              "(or --significance-only)")
    res = compress.search(model, train, select, dev, max_drop=args.max_drop, target_latency_ms=args.target_latency,
                          latency_batch=args.latency_batch, target_size_mb=args.target_size, significance=sig,
                          retrain_epochs=args.retrain_epochs, retrain_layers=args.retrain_layers,
                          sign_match=args.sign_match, sign_match_keys=args.sign_match_keys, int8=args.int8,
                          threads=args.threads or 2, seed=args.seed)
    print("\ntrade-off (selection set; * = Pareto-optimal in accuracy, latency and size):")
    front = set(compress.pareto(res.points))
    print(f"  {'stage':<15}{'accuracy':>10}{'ms/batch':>10}{'MB':>8}")
    for i, p in enumerate(res.points):
        print(f"{'*' if i in front else ' '} {p['stage']:<15}{100 * p['accuracy']:>9.2f}%{p['latency_ms']:>10.2f}"
              f"{p['size_bytes'] / 1e6:>8.1f}")
    print()
    print(res.table())
    print("plan (original numbering):", json.dumps(res.plan))
    if args.plot:
        res.plot(args.plot)
        print(f"plot: {args.plot}")
    if args.output:
        compress.save_result(res, args.output)
        print(f"compressed model: {args.output}")
    return 0 if res.met else 3


def _compress_parser(sub):
    k = sub.add_parser("compress", formatter_class=_Fmt,
                       help="compress a fine-tuned model (Trainer.export) under an accuracy / latency / size budget",
                       description="Score every layer, attention head and FFN group (masking and gradient x "
                                   "activation), then prune by increasing significance, re-fine-tune briefly, and "
                                   "try sign-matching attention and int8 weights, under the budget. Exit status 3: "
                                   "the budget cannot be met (the best model found is still reported and saved).")
    k.add_argument("model", help="fine-tuned model directory: Trainer.export(...) or a compressed model")
    k.add_argument("--task", required=True, choices=["sst2", "mrpc", "cola"], help="GLUE task of the model")
    k.add_argument("--data", default=os.environ.get("FASTTRAN_DATA"),
                   help="data directory (sst2/, glue/MRPC, glue/CoLA); sst2 without it: the shipped sample")
    k.add_argument("--max-drop", type=float, default=None, metavar="POINTS",
                   help="largest accuracy drop allowed, in points, on the selection set")
    k.add_argument("--target-latency", type=float, default=None, metavar="MS",
                   help="milliseconds per batch of --latency-batch (CPU, --threads)")
    k.add_argument("--latency-batch", type=int, default=32, help="batch size of the latency budget")
    k.add_argument("--target-size", type=float, default=None, metavar="MB", help="largest model size")
    k.add_argument("--select", type=int, default=None, metavar="N",
                   help="examples held out of the training split to decide on (default: 10%%, at most 500)")
    k.add_argument("--train-limit", type=int, default=20000, metavar="N", help="training examples read")
    k.add_argument("--limit", type=int, default=None, metavar="N", help="dev examples read")
    k.add_argument("--max-length", type=int, default=128, help="tokens per example")
    k.add_argument("--ffn-group-size", type=int, default=None, help="FFN neurons per group (default intermediate/16)")
    k.add_argument("--retrain-epochs", type=int, default=1, help="re-fine-tuning after pruning")
    k.add_argument("--retrain-layers", type=int, default=None, help="top layers re-fine-tuned (default: all)")
    k.add_argument("--sign-match", action=argparse.BooleanOptionalAction, default=True,
                   help="try sign-matching attention on the least significant heads")
    k.add_argument("--sign-match-keys", type=int, default=16, help="keys a sign-matching head attends to")
    k.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                   help="try int8 weights last (the layers' projections and the word embeddings)")
    k.add_argument("--significance", default="both", choices=["both", "mask", "gradient"],
                   help="how parts are scored (the search orders by masking when it is measured): masking runs one "
                        "forward per part over the selection set, gradient x activation one backward in all")
    k.add_argument("--significance-only", action="store_true", help="print the significance table and stop")
    k.add_argument("--threads", type=int, default=None, help="CPU threads (latency is measured with 2 by default)")
    k.add_argument("--seed", type=int, default=0, help="selection split and re-fine-tuning")
    k.add_argument("--output", default=None, help="directory for the compressed model and search.json")
    k.add_argument("--plot", default=None, metavar="FILE.png", help="accuracy against latency and size")
    k.set_defaults(func=cmd_compress)


def _version():
    import fasttran
    info = fasttran.build_info()
    return (f"fasttran {fasttran.__version__} (backends: {', '.join(info['backends'])}; {info['blas'].split(' DYNAMIC')[0]}; "
            f"Python {info['python']})")


def build_parser():
    from .trainer import DEFAULT_LR
    p = argparse.ArgumentParser(prog="fasttran", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_VersionAction, help="show the version and build, then exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="{encode,cache,train,evaluate,compress}")

    def common(sp, batch=64):
        sp.add_argument("--model", default=None,
                        help="checkpoint directory (config.json + model.safetensors), or a Hub id; default: "
                             "all-MiniLM-L6-v2 (installed package or fasttran's model cache)")
        sp.add_argument("--device", default=None, help="cpu or cuda:N (default: a GPU if usable, else cpu)")
        sp.add_argument("--input", required=True, help="JSONL or TSV file of examples (QA: SQuAD JSON)")
        sp.add_argument("--text-field", default=None, help="text field/column (default: text or sentence)")
        sp.add_argument("--label-field", default="label", help="label field/column")
        sp.add_argument("--limit", type=int, default=None, metavar="N", help="use the first N examples (QA: questions)")
        sp.add_argument("--batch-size", type=int, default=batch, help="examples per batch")

    e = sub.add_parser("encode", help="embed texts with a frozen encoder into .npy or .safetensors", formatter_class=_Fmt)
    common(e)
    e.add_argument("--output", required=True, help="OUT.npy or OUT.safetensors")
    e.add_argument("--pooling", default="mean", choices=["mean", "cls"], help="mean of the tokens, or the [CLS] row")
    e.add_argument("--layer", type=int, default=-1, help="layer to pool (-1: the last)")
    e.add_argument("--normalize", action="store_true", help="L2-normalise the embeddings")
    e.set_defaults(func=cmd_encode)

    c = sub.add_parser("cache", help="build a persistent activation cache directory (the encoder runs once)",
                       formatter_class=_Fmt)
    common(c)
    c.add_argument("--output", required=True, help="cache directory")
    c.add_argument("--task", default="classification", choices=["classification", "qa"],
                   help="qa: --input is SQuAD JSON, cut into question + context windows")
    c.add_argument("--positions", default="mean", choices=["cls", "mean", "all"],
                   help="what is kept per example (QA: always every token)")
    c.add_argument("--layer", type=int, default=-1, help="layer whose output is cached (-1: the last)")
    c.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "int8"],
                   help="storage type (default: float32; QA float16)")
    c.add_argument("--max-length", type=int, default=None, help="truncate to N tokens (QA: window length, 384)")
    c.add_argument("--doc-stride", type=int, default=128, help="QA: overlap of consecutive context windows")
    c.add_argument("--answers-only", action="store_true", help="QA: keep only windows holding the answer (training)")
    c.add_argument("--rebuild", action="store_true", help="replace a different cache already in --output")
    c.set_defaults(func=cmd_cache)

    lrs = ", ".join(f"{o}/{h} {v:g}" for (o, h), v in DEFAULT_LR.items())
    t = sub.add_parser("train", help="train a head from a cache; checkpoints to --output", formatter_class=_Fmt)
    common(t, batch=32)
    t.add_argument("--cache", required=True, help="cache directory of --input (fasttran cache)")
    t.add_argument("--output", required=True, help="checkpoint directory (written every epoch and on Ctrl-C)")
    t.add_argument("--head", default="classification", choices=["classification", "classification-pooler", "qa"],
                   help="linear classifier, BERT pooler + classifier, or extractive QA spans")
    t.add_argument("--optimizer", default="lamb", choices=["lamb", "adamw"], help="fused optimizer (C)")
    t.add_argument("--lr", type=float, default=None,
                   help=f"learning rate; default: measured per optimizer/head ({lrs}; benchmarks/defaults_sweep.md)")
    t.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay (not on biases)")
    t.add_argument("--schedule", default="linear", choices=["constant", "linear", "cosine"],
                   help="learning-rate decay after the warmup")
    t.add_argument("--warmup", type=float, default=0.1, help="fraction of all steps (< 1) or a step count")
    t.add_argument("--epochs", type=int, default=3, help="passes over the training cache")
    t.add_argument("--seed", type=int, default=0, help="head init, batch order and dropout")
    t.add_argument("--eval-input", help="evaluate after every epoch on this file (needs --eval-cache)")
    t.add_argument("--eval-cache", help="cache directory of --eval-input (needs --eval-input)")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output")
    t.set_defaults(func=cmd_train)

    v = sub.add_parser("evaluate", help="accuracy/F1 (QA: exact match/F1) of a trained head on a cache",
                       formatter_class=_Fmt)
    common(v)
    v.add_argument("--cache", required=True, help="cache directory of --input")
    v.add_argument("--checkpoint", required=True, help="checkpoint directory (fasttran train --output)")
    v.add_argument("--predictions", help="also write predictions (.npy labels; QA: JSON {id: answer})")
    v.set_defaults(func=cmd_evaluate)
    _compress_parser(sub)
    return p


class _VersionAction(argparse.Action):
    """--version, with the build's backends (computed only when asked: it probes CUDA)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit()


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        from .errors import FastTranError
        try:
            return args.func(args) or 0
        except FastTranError as e:
            sys.exit(f"fasttran {args.command}: {type(e).__name__}: {e}")
    except KeyboardInterrupt:
        print("\nfasttran: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
