"""fasttran command line: fine-tune BERT-family encoders with the activation cache, on files.

workflow (--model defaults to all-MiniLM-L6-v2, see fasttran.models):
  fasttran cache    --input train.tsv --output ctrain        # encoder runs once, features on disk
  fasttran cache    --input dev.tsv   --output cdev
  fasttran train    --input train.tsv --cache ctrain --output ck --eval-input dev.tsv --eval-cache cdev
  fasttran evaluate --input dev.tsv   --cache cdev --checkpoint ck
  fasttran export   --checkpoint ck --output model-dir        # loads in transformers' AutoModelFor*
  fasttran encode   --input texts.tsv --output emb.npy       # sentence embeddings only

all of it in one command on a task's files (GLUE, CoNLL-2003, SQuAD), keeping the best epoch:
  fasttran finetune --task mrpc --data DIR [--train-layers 2]   # DIR/MRPC/ or DIR/glue/MRPC/ -> ./finetuned-mrpc

tasks (--task on cache, train and evaluate; the cache remembers it):
  classification   one text, a class (TSV / JSONL; GLUE's SST-2 and CoLA files as GLUE ships them)
  pair             two texts, a class ([CLS] a [SEP] b [SEP]; GLUE's MRPC, RTE, QNLI, MNLI files)
  regression       one or two texts, a score (GLUE's STS-B): MSE, Pearson, Spearman
  multi-label      labels separated by commas in the label column: micro / macro F1
  token            a label per word (CoNLL column files): entity precision / recall / F1
  qa               extractive QA on SQuAD v1.1 JSON (cache --answers-only for training)

the top layers too: cache every token's state at layer L-K, then train K layers with the head
  fasttran cache    --input train.tsv --output c4 --layer 4 --positions all     # MiniLM: L = 6
  fasttran train    --input train.tsv --cache c4 --output ck --train-layers 2 [--precision bfloat16] [--tempo all]

extractive QA (SQuAD v1.1 JSON files):
  fasttran cache    --task qa --answers-only --input train.json --output qtrain
  fasttran cache    --task qa --input dev.json --output qdev
  fasttran train    --head qa --input train.json --cache qtrain --output qck
  fasttran evaluate --input dev.json --cache qdev --checkpoint qck    # exact match / F1

several processes (torchrun; `python -m fasttran` is this command): a cache build is split over the
ranks and writes the files one process writes; training takes a slice of every global batch
(--batch-size) per rank and sums the gradients (equal to one process at that batch); only rank 0
prints and writes the checkpoint
  torchrun --nproc-per-node=4 -m fasttran cache --input train.tsv --output ctrain
  torchrun --nproc-per-node=4 --max-restarts=1 -m fasttran train --input train.tsv --cache ctrain
           --output ck --resume --checkpoint-every 200   # a restarted job continues from its last checkpoint

Inputs are JSON lines ({"text": ..., "text_pair": ..., "label": ...}) or TSV (GLUE's files as they
are: byte-order marks, a header or none, label names such as `entailment`; other TSV files name
their columns in a header), or CoNLL column files for --task token.
Ctrl-C stops cleanly (train: after the step in flight, saving the checkpoint)."""
import argparse
import json
import os
import sys

import numpy as np

from .cli_io import CLI_TASKS as _TASKS
from .cli_io import Fmt as _Fmt
from .cli_io import common_options as _common
from .cli_io import encoder as _encoder
from .cli_io import fail as _fail
from .cli_io import inputs as _inputs
from .cli_io import read_data as _read_data
from .cli_io import squad_features as _squad_features
from .cli_io import targets as _targets


def read_examples(path, text_field=None, label_field="label", limit=None):
    """(texts, labels or None) of a classification file (JSONL or TSV): what `fasttran encode` reads."""
    ex = _read_data(argparse.Namespace(text_field=text_field, pair_field=None, label_field=label_field, limit=limit),
                    path, "classification", labelled=None)
    return ex.texts, ex.labels


# ---- QA files ----------------------------------------------------------------------------------
_TASK_FILE = "fasttran-task.json"


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
    from . import ActivationCache, distributed
    from ._C import atomic_write as _atomic_write
    group = _join_group(args)
    enc = _encoder(args)
    if args.task == "qa":
        settings = {"task": "qa", "max_length": args.max_length or 384, "doc_stride": args.doc_stride,
                    "answers_only": bool(args.answers_only), "limit": args.limit}
        feats = _squad_features(args, enc, settings)
        if distributed.is_main():
            print(f"{feats!r}", file=sys.stderr)
        ids, mask, types = feats.input_ids, feats.attention_mask, feats.token_type_ids
        positions, dtype = "all", args.dtype or "float16"
    else:
        if args.answers_only:
            _fail("--answers-only is for --task qa")
        ex = _read_data(args, args.input, args.task, labelled=None)
        if distributed.is_main():
            print(f"{ex!r}", file=sys.stderr)
        ids, mask, types, _ = _inputs(enc, ex, args.max_length)
        settings = {"task": args.task, "text_field": args.text_field, "pair_field": args.pair_field,
                    "label_field": args.label_field, "max_length": args.max_length, "limit": args.limit}
        positions = "all" if args.task == "token" else args.positions
        dtype = args.dtype or "float32"
    cache = ActivationCache.build(enc, ids, mask, types, layer=args.layer, positions=positions, dtype=dtype,
                                  disk_dir=args.output, batch_size=args.batch_size, rebuild=args.rebuild,
                                  show_progress=True, group=group)
    if group is None or group.is_main:
        _atomic_write(os.path.join(args.output, _TASK_FILE), [json.dumps(settings).encode()])
    print(cache)


# ---- several ranks (torchrun --nproc-per-node=N -m fasttran ...) --------------------------------------
def _join_group(args):
    """The process group when this process is one of several ranks (else None); a rank on a
    GPU machine computes on its own GPU unless --device says otherwise."""
    from . import distributed
    from .device import parse_device
    if not distributed.launched():
        return None
    group = distributed.init()
    if args.device is None and parse_device(group.device).is_cuda:
        args.device = group.device
    return group


def _quiet_unless_main():
    """Standard output of ranks other than 0 goes nowhere (errors still reach stderr), so a
    command run by N ranks prints its results once."""
    import contextlib
    from . import distributed
    if distributed.is_main():
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(open(os.devnull, "w"))


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


def _task_of(args, cache_dir):
    """the --task of a command: given, else the one the cache was built for"""
    st = _task_settings(cache_dir)
    given = getattr(args, "task", None)
    if given and st.get("task") not in (None, given) and not (given == "classification" and st["task"] == "pair"):
        _fail(f"--cache {cache_dir} was built for --task {st['task']}, not {given}")
    return given or st.get("task", "classification")


def _labelled_source(args, enc, cache_dir, input_path, task, label_names, what, labelled=True):
    """(cache, targets, Examples) of a non-QA cache directory and the file it was built from (read
    with the columns and --limit the cache was built with)"""
    st = _task_settings(cache_dir)
    args = argparse.Namespace(**dict(vars(args), **{k: st[k] for k in ("text_field", "pair_field", "label_field",
                                                                        "limit") if st.get(k) is not None}))
    ex = _read_data(args, input_path, task, label_names=label_names, labelled=labelled)
    cache = _open_cache(cache_dir, enc, what)
    ids, mask, types, tok_labels = _inputs(enc, ex, _task_settings(cache_dir).get("max_length"))
    if len(cache) != len(ex):
        _fail(f"{what} {cache_dir} holds {len(cache)} examples but {input_path} gives {len(ex)}"
              + (" (the same --limit as for `fasttran cache`?)" if args.limit else ""))
    if cache.positions == "all" and not np.array_equal(cache.lengths, mask.sum(1)):
        _fail(f"{what} {cache_dir} was not built from {input_path} (its examples' token counts differ)")
    return cache, _targets(ex, tok_labels), ex


_TEMPO_ALL = ("inplace_gelu", "inplace_layernorm", "recompute_attention_dropout", "recompute_attention_probs")


def _tempo(arg):
    if not arg:
        return None
    names = _TEMPO_ALL if arg == "all" else [t.strip() for t in arg.split(",") if t.strip()]
    bad = [n for n in names if n not in _TEMPO_ALL]
    if bad:
        _fail(f"--tempo: unknown option(s) {bad}; choose from {', '.join(_TEMPO_ALL)} or 'all'")
    return {n: True for n in names}


def cmd_train(args):
    from . import Trainer
    if bool(args.eval_input) != bool(args.eval_cache):
        _fail("--eval-input and --eval-cache go together: the cache of the eval file, built with `fasttran cache`")
    group = _join_group(args)
    enc = _encoder(args)
    if args.train_embeddings and args.train_layers != enc.num_layers:
        _fail(f"--train-embeddings trains the embeddings under every layer: it needs --train-layers {enc.num_layers} "
              f"(every layer of this model, from a cache of layer 0), got {args.train_layers}")
    if args.head == "qa":
        cache, feats = _qa_source(args, enc, args.cache, args.input, True, "--cache")
        targets = feats   # spans and the context tokens
        ev = _qa_source(args, enc, args.eval_cache, args.eval_input, False, "--eval-cache") if args.eval_cache else None
        task, head, names = "qa", "qa", None
    else:
        if _task_settings(args.cache).get("task") == "qa":
            _fail(f"--cache {args.cache} is a QA cache: use --head qa")
        task = _task_of(args, args.cache)
        cache, targets, ex = _labelled_source(args, enc, args.cache, args.input, task, None, "--cache")
        names = ex.label_names
        ev = None
        if args.eval_cache:
            ecache, etargets, _ = _labelled_source(args, enc, args.eval_cache, args.eval_input, task, names,
                                                   "--eval-cache")
            ev = (ecache, etargets)
        head = _TASKS[task][1]
        if head == "classification" and args.head == "classification-pooler":
            head = "classification-pooler"
    kw = dict(optimizer=args.optimizer, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
              weight_decay=args.weight_decay, schedule=args.schedule, warmup=args.warmup,
              train_layers=args.train_layers, precision=args.precision, tempo=_tempo(args.tempo),
              pooling=args.pooling, device=enc.device, train_embeddings=args.train_embeddings)
    kw["pooler"] = args.pooler or None   # (heads without a pooler variant ignore it)
    if names is not None:
        kw["label_names"] = names
    if group is not None:   # several ranks: --batch-size is the global batch, each rank takes its slice
        from .distributed import DataParallel
        kw["reduction"] = DataParallel(group)
        kw["show_progress"] = group.is_main
    tr = Trainer(head, **kw)
    if group is None or group.is_main:
        print(f"{tr!r}", file=sys.stderr)
    for r in tr.fit(cache, targets, eval=ev, checkpoint_dir=args.output, resume=args.resume,
                    checkpoint_every=args.checkpoint_every):
        print(json.dumps(r))
    tr.save(args.output)
    print(f"saved to {args.output}")
    if tr._interrupt:   # Ctrl-C: the trainer stopped after the step in flight and saved
        print("fasttran: interrupted; continue with the same command and --resume", file=sys.stderr)
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
    task = _task_of(args, args.cache)
    cache, targets, ex = _labelled_source(args, enc, args.cache, args.input, task, tr.head.label_names, "--cache",
                                          labelled=None)
    if args.predictions:
        if task == "token":   # per word, by the first sub-token of each
            tok = enc.tokenize_words(ex.words, max_length=_task_settings(args.cache).get("max_length"))
            pred = tr.predict(cache, words=tok, output="labels")
            ids = {n: i for i, n in enumerate(tr.head.label_names or [])}
            pred = np.asarray([np.asarray([ids.get(w, w) for w in p]) for p in pred], dtype=object)
        else:
            pred = tr.predict(cache)
        np.save(args.predictions, pred, allow_pickle=task == "token")
    if ex.labels is None:
        print("no labels in the input: wrote predictions only" if args.predictions else "no labels in the input")
        return
    res = tr.evaluate(cache, targets)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, (dict, np.ndarray))}))


def cmd_export(args):
    from . import Trainer
    enc = _encoder(args, device="cpu")
    tr = Trainer.load(args.checkpoint, device="cpu")
    tr.export(args.output, encoder=enc)
    from .export import how_to_load, layout_of
    print(f"wrote {layout_of(tr.head, enc)} model to {args.output}")
    print(how_to_load(tr.head, args.output, enc))


# ---- compress -------------------------------------------------------------------------------------------
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
                          retrain_targets=args.retrain_targets, prune=tuple(args.prune), sign_match=args.sign_match,
                          sign_match_keys=args.sign_match_keys, int8=args.int8,
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
    k.add_argument("--retrain-targets", default="labels", choices=["labels", "teacher"],
                   help="what the re-fine-tuning learns: the labels, or the fine-tuned model's logits (distillation)")
    k.add_argument("--prune", nargs="*", default=["layer", "head", "ffn"], choices=["layer", "head", "ffn"],
                   metavar="KIND", help="kinds of part the pruning may remove: layer, head, ffn (FFN neuron groups); "
                                        "'head ffn' never removes a whole layer (pair tasks lose less that way); "
                                        "none: no pruning")
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
    sub = p.add_subparsers(dest="command", required=True, metavar="{encode,cache,train,evaluate,export,compress,finetune}")

    tasks = list(_TASKS)
    e = sub.add_parser("encode", help="embed texts with a frozen encoder into .npy or .safetensors", formatter_class=_Fmt)
    _common(e)
    e.add_argument("--output", required=True, help="OUT.npy or OUT.safetensors")
    e.add_argument("--pooling", default="mean", choices=["mean", "cls"], help="mean of the tokens, or the [CLS] row")
    e.add_argument("--layer", type=int, default=-1, help="layer to pool (-1: the last)")
    e.add_argument("--normalize", action="store_true", help="L2-normalise the embeddings")
    e.set_defaults(func=cmd_encode)

    c = sub.add_parser("cache", help="build a persistent activation cache directory (the encoder runs once)",
                       formatter_class=_Fmt)
    _common(c)
    c.add_argument("--output", required=True, help="cache directory")
    c.add_argument("--task", default="classification", choices=tasks + ["qa"],
                   help="what the file holds (see fasttran --help); qa: --input is SQuAD JSON, cut into question + "
                        "context windows; token: every token's state is kept")
    c.add_argument("--positions", default="mean", choices=["cls", "mean", "all"],
                   help="what is kept per example (QA, token: always every token; for `train --train-layers K`: "
                        "all, with --layer L-K)")
    c.add_argument("--layer", type=int, default=-1, help="layer whose output is cached (-1: the last; L-K for "
                   "`train --train-layers K`)")
    c.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "int8"],
                   help="storage type (default: float32; QA float16)")
    c.add_argument("--max-length", type=int, default=None, help="truncate to N tokens (QA: window length, 384)")
    c.add_argument("--doc-stride", type=int, default=128, help="QA: overlap of consecutive context windows")
    c.add_argument("--answers-only", action="store_true", help="QA: keep only windows holding the answer (training)")
    c.add_argument("--rebuild", action="store_true", help="replace a different cache already in --output")
    c.set_defaults(func=cmd_cache)

    lrs = ", ".join(f"{o}/{h} {v:g}" for (o, h), v in DEFAULT_LR.items())
    t = sub.add_parser("train", help="train a head from a cache; checkpoints to --output", formatter_class=_Fmt)
    _common(t, batch=32)
    t.add_argument("--cache", required=True, help="cache directory of --input (fasttran cache)")
    t.add_argument("--output", required=True, help="checkpoint directory (written every epoch and on Ctrl-C)")
    t.add_argument("--task", default=None, choices=tasks,
                   help="the task (default: the one the cache was built for)")
    t.add_argument("--head", default="classification", choices=["classification", "classification-pooler", "qa"],
                   help="linear classifier, BERT pooler + classifier, or extractive QA spans")
    t.add_argument("--pooler", action="store_true",
                   help="BERT's pooler before the classifier (with --pooling cls: exports as transformers' "
                        "BertForSequenceClassification)")
    t.add_argument("--pooling", default="mean", choices=["mean", "cls"],
                   help="how sentence heads pool every token's state (with --train-layers; a pooled cache "
                        "decides itself)")
    t.add_argument("--train-layers", type=int, default=0, metavar="K",
                   help="also train the encoder's top K layers, from a cache of layer L-K with --positions all")
    t.add_argument("--train-embeddings", action="store_true",
                   help="with --train-layers L (every layer, from a cache of layer 0): train the embeddings too -- "
                        "the word, position and type tables and their LayerNorm, as transformers' full fine-tuning "
                        "does")
    t.add_argument("--precision", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the trained layers' products (mixed precision; bfloat16 on CPUs with AVX512_BF16 or AMX, or CUDA)")
    t.add_argument("--tempo", default=None, metavar="OPTS",
                   help="memory options of the trained layers, comma-separated, or 'all': "
                        + ", ".join(_TEMPO_ALL))
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
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output (none yet: start; "
                   "under torchrun --max-restarts, a restarted job picks up its last checkpoint)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="also save the checkpoint every N steps (default: after every epoch only)")
    t.set_defaults(func=cmd_train)

    v = sub.add_parser("evaluate", help="accuracy/F1 (QA: exact match/F1) of a trained head on a cache",
                       formatter_class=_Fmt)
    _common(v)
    v.add_argument("--cache", required=True, help="cache directory of --input")
    v.add_argument("--checkpoint", required=True, help="checkpoint directory (fasttran train --output)")
    v.add_argument("--task", default=None, choices=tasks, help="the task (default: the one the cache was built for)")
    v.add_argument("--predictions", help="also write predictions (.npy labels; QA: JSON {id: answer})")
    v.set_defaults(func=cmd_evaluate)

    x = sub.add_parser("export", help="write a trained checkpoint as a model directory transformers (or "
                       "sentence-transformers) loads", formatter_class=_Fmt)
    _common(x, data=False)
    x.add_argument("--checkpoint", required=True, help="checkpoint directory (fasttran train --output)")
    x.add_argument("--output", required=True, help="model directory to write")
    x.set_defaults(func=cmd_export)
    _compress_parser(sub)
    from .finetune_cli import add_parser as _finetune_parser
    _finetune_parser(sub)
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
            with _quiet_unless_main():
                return args.func(args) or 0
        except FastTranError as e:
            sys.exit(f"fasttran {args.command}: {type(e).__name__}: {e}")
    except KeyboardInterrupt:
        print("\nfasttran: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
