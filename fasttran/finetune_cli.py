"""`fasttran finetune`: one command from a task's files to an exported model.

    fasttran finetune --task mrpc --data DIR [--train-layers K] [--optimizer adamw|lamb]
        [--precision float32|bfloat16] [--epochs N] [--lr LR] [--output DIR]

The tasks are declared once, in TASKS: where each task's files are (GLUE's folder names, the split
files), how they are read (columns, header, label names), the Trainer task and the metric that picks
the best epoch. The command reads the train and dev splits, builds the activation caches (the
encoder runs once to the states of layer L-K: by default K = L, every layer trained, or L/2 from
22,000 training examples (QA: windows) on, with AdamW, in bf16 mixed precision where the device
multiplies bf16 natively, trainer.FINETUNE_DEFAULT, finetune_layers and finetune_precision;
--train-layers 0: the head alone on the last layer), trains with the
recipe for the optimizer and K (trainer.DEFAULT_TOPK_RECIPES), evaluates on dev after every epoch,
puts back the best epoch's weights (Trainer.fit(keep_best=...)), exports (fasttran.export) and
prints a table of the epochs and the line saying what loads the export. `--input FILE [--eval-input
FILE]` takes any file the `cache` command reads instead, with --task naming the kind of task
(classification, pair, regression, token, qa ...) and the same column options.
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

from . import cli_io

#: CoNLL-2003's entity tags, in the order fasttran.readers.read_conll numbers them
CONLL_TAGS = ("O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER")
_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_NLI3 = ("entailment", "neutral", "contradiction")


@dataclass(frozen=True)
class Task:
    """A known task: its files, how they read, what trains on them and what scores it."""
    name: str
    folders: tuple       # the task's folder names, tried in order (GLUE's spelling first)
    files: dict          # split ("train" / "dev") -> file names tried in order
    kind: str            # the --task of the other commands (fasttran.cli): pair, classification, token, qa ...
    metric: str          # the dev metric that picks the best epoch (an eval key of the Trainer's head)
    columns: dict = field(default_factory=dict)   # read_glue_tsv's text / text_pair / label / header
    label_names: tuple = None   # the classes in id order (None: scores, or SQuAD's spans)
    parents: tuple = ("", "glue")   # folders of DIR that may hold the task's folder ("": DIR itself)
    what: str = ""       # one line for --help

    @property
    def reader(self):
        return reader_of(self.kind)


def reader_of(kind):
    """how a kind of task's files read: SQuAD JSON (answer windows cut once the tokenizer is there),
    CoNLL columns, or GLUE-style rows"""
    return {"token": "conll", "qa": "squad"}.get(kind, "glue")


def head_task(kind):
    """the Trainer task of a --task kind"""
    return cli_io.CLI_TASKS[kind][1] if kind in cli_io.CLI_TASKS else kind


def _glue(name, folder, kind, metric, columns, label_names, what, dev="dev.tsv", more=()):
    return Task(name, (folder,) + tuple(more), {"train": ("train.tsv",), "dev": (dev,)}, kind, metric,
                dict(columns, header=columns.get("header", True)), label_names, what=what)


TASKS = {t.name: t for t in (
    _glue("mrpc", "MRPC", "pair", "f1", {"text": "#1 String", "text_pair": "#2 String", "label": "Quality"}, _BINARY,
          "paraphrase or not (sentence pairs), F1"),
    _glue("sst2", "SST-2", "classification", "accuracy", {"text": "sentence", "label": "label"}, _BINARY,
          "sentiment (sentences), accuracy", more=("sst2",)),
    _glue("cola", "CoLA", "classification", "matthews_corrcoef", {"text": 3, "label": 1, "header": False}, _BINARY,
          "grammatical or not (sentences; no header, label in column 1), Matthews correlation"),
    _glue("stsb", "STS-B", "regression", "pearson", {"text": "sentence1", "text_pair": "sentence2", "label": "score"},
          None, "similarity score 0-5 (sentence pairs), Pearson"),
    _glue("rte", "RTE", "pair", "accuracy", {"text": "sentence1", "text_pair": "sentence2", "label": "label"}, _NLI2,
          "entailment (sentence pairs), accuracy"),
    _glue("qnli", "QNLI", "pair", "accuracy", {"text": "question", "text_pair": "sentence", "label": "label"}, _NLI2,
          "does the sentence answer the question, accuracy"),
    _glue("mnli", "MNLI", "pair", "accuracy", {"text": "sentence1", "text_pair": "sentence2", "label": "gold_label"},
          _NLI3, "entailment / neutral / contradiction (dev_matched), accuracy", dev="dev_matched.tsv"),
    Task("conll", ("conll2003", "CoNLL-2003", "conll"), {"train": ("train.txt",), "dev": ("valid.txt", "dev.txt")},
         "token", "f1", label_names=CONLL_TAGS, parents=("",), what="named entities (CoNLL-2003 columns), entity F1"),
    Task("squad", ("squad", "SQuAD"), {"train": ("train-v1.1.json", "train-subset-v1.1.json"), "dev": ("dev-v1.1.json",)},
         "qa", "f1", parents=("",), what="extractive QA (SQuAD v1.1 JSON), F1"),
)}


def task_files(task, data_dir):
    """{split: path} of a known task's train and dev files under `data_dir`: DIR/<folder>/<file>,
    DIR/glue/<folder>/<file> (GLUE tasks) or DIR/<file> itself; an InputError naming every path tried."""
    from .errors import InputError
    spec = task_spec(task)
    if not data_dir:
        raise InputError(f"--task {spec.name} needs --data DIR: the folder holding {spec.folders[0]}/ (or "
                         f"{'glue/' + spec.folders[0] + '/' if 'glue' in spec.parents else spec.folders[0] + '/'}), "
                         "or --input FILE [--eval-input FILE] for files of your own")
    if not os.path.isdir(data_dir):
        raise InputError(f"--data {data_dir}: no such directory")
    out = {}
    for split, names in spec.files.items():
        tried = []
        dirs = [os.path.join(data_dir, p, f) for p in spec.parents for f in spec.folders] + [data_dir]
        for d in dirs:
            for n in names:
                path = os.path.normpath(os.path.join(d, n))
                tried.append(path)
                if os.path.isfile(path):
                    out[split] = path
                    break
            if split in out:
                break
        if split not in out:
            raise InputError(f"no {split} file for --task {spec.name} under --data {data_dir}; tried:\n  "
                             + "\n  ".join(tried) + f"\npass --data the directory that holds {spec.folders[0]}/ "
                             f"as it ships, or give the files with --input FILE --eval-input FILE "
                             f"--task {spec.kind}")
    return out


def task_spec(task):
    from .errors import InputError
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)} (or, with --input, one of "
                         f"{', '.join(kinds())})")
    return TASKS[task]


def kinds():
    """the --task values that name a kind of task for files of one's own (--input)"""
    return list(cli_io.CLI_TASKS) + ["qa"]


def read_split(task, path, label_names=None, limit=None):
    """A known task's file read as its table entry says: fasttran.readers.Examples (SQuAD: the list
    of questions, fasttran.squad.load_squad). label_names default to the table's."""
    from . import readers
    from .errors import InputError
    spec = task_spec(task)
    names = list(label_names if label_names is not None else spec.label_names or []) or None
    if spec.reader == "squad":
        from .squad import load_squad
        ex = load_squad(path)
        return ex[:limit] if limit else ex
    if spec.reader == "conll":
        return readers.read_conll(path, label_names=names, limit=limit)
    cols = dict(spec.columns)
    ex = readers.read_glue_tsv(path, cols.pop("text"), cols.pop("text_pair", None), cols.pop("label"),
                               task="regression" if spec.kind == "regression" else "classification",
                               label_names=names, limit=limit, **cols)
    if ex.labels is None:
        raise InputError(f"{path}: no labels")
    return ex


# ---- the command -----------------------------------------------------------------------------------
@dataclass
class _Data:
    kind: str          # the cli --task
    train: object      # Examples (qa: None, the windows are cut once the tokenizer is there)
    dev: object
    label_names: list
    files: dict
    metric: str


def _load(args):
    """_Data of the command's arguments: a known task's files, or --input / --eval-input"""
    if args.input:
        if args.task not in kinds():
            cli_io.fail(f"--input takes --task naming the kind of task ({', '.join(kinds())}); "
                        f"{args.task!r} is {'a known task: use --data DIR' if args.task in TASKS else 'unknown'}")
        if not args.eval_input:
            cli_io.fail("--input needs --eval-input FILE: the dev split the best epoch is picked on")
        if args.data:
            cli_io.fail("give either --data (a known task's files) or --input / --eval-input, not both")
        files = {"train": args.input, "dev": args.eval_input}
        for what, path in (("--input", args.input), ("--eval-input", args.eval_input)):
            if not os.path.isfile(path):
                cli_io.fail(f"{what} {path}: no such file")
        if reader_of(args.task) == "squad":
            return _Data(args.task, None, None, None, files, args.metric or "f1")
        train = cli_io.read_data(args, args.input, args.task)
        dev = cli_io.read_data(args, args.eval_input, args.task, label_names=train.label_names)
        from .heads import head_class
        return _Data(args.task, train, dev, train.label_names, files,
                     args.metric or head_class(head_task(args.task)).main_metric)
    from .errors import FastTranError
    spec = TASKS.get(args.task)
    if spec is None:
        cli_io.fail(f"unknown task {args.task!r}; known tasks: {', '.join(TASKS)}; or --input FILE --eval-input FILE "
                    f"with --task one of {', '.join(kinds())}")
    try:
        files = task_files(spec.name, args.data)
        if spec.reader == "squad":
            return _Data(spec.kind, None, None, None, files, args.metric or spec.metric)
        train = read_split(spec.name, files["train"], limit=args.limit)
        dev = read_split(spec.name, files["dev"], label_names=train.label_names, limit=args.limit)
    except FastTranError as e:
        cli_io.fail(str(e))
    return _Data(spec.kind, train, dev, train.label_names, files, args.metric or spec.metric)


def _cache(enc, ids, mask, types, layer, positions, dtype, where, batch_size):
    from . import ActivationCache
    if where:
        os.makedirs(where, exist_ok=True)
    return ActivationCache.build(enc, ids, mask, types, layer=layer, positions=positions, dtype=dtype,
                                 disk_dir=where, batch_size=batch_size, rebuild=True, show_progress=True)


def _fmt(v):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"


def results_table(history, metric, best_epoch):
    """The epochs as a text table: epoch, train loss, dev metric, seconds; * marks the epoch kept."""
    key = f"eval_{metric}"
    w = max(10, len(metric) + 4)
    lines = [f"  {'epoch':>5}  {'train loss':>10}  {'dev ' + metric:>{w}}  {'seconds':>8}"]
    for r in history:
        mark = "*" if r["epoch"] == best_epoch else " "
        secs = r["seconds"] + r.get("eval_seconds", 0.0)
        lines.append(f"{mark} {r['epoch']:>5}  {r['train_loss']:>10.4f}  {_fmt(r.get(key)):>{w}}  {secs:>8.2f}")
    return "\n".join(lines)


def run(args):
    """The command. Returns a namespace: trainer (its history and best_epoch), train_cache, dev
    ((cache, targets); QA: (cache, SquadFeatures)), data, output -- the caches None where they were
    temporary (QA without --cache-dir)."""
    from . import Trainer
    from .export import how_to_load, layout_of
    data = _load(args)
    enc = cli_io.encoder(args)
    from .trainer import FINETUNE_DEFAULT, finetune_embeddings, finetune_layers, finetune_precision
    squad = reader_of(data.kind) == "squad"
    if getattr(args, "search", False) and squad:
        cli_io.fail("--search is for the sentence and token tasks (QA's windows are cut per question)")
    K = args.train_layers
    if K is not None and not 0 <= K <= enc.num_layers:
        cli_io.fail(f"--train-layers {K}: the model has {enc.num_layers} layers")
    if getattr(args, "precision", None) not in (None, "float32") and K == 0:
        cli_io.fail(f"--precision {args.precision} trains the encoder's layers in mixed precision: the head alone "
                    "(--train-layers 0) trains in float32")
    t0 = time.perf_counter()
    if squad:   # the windows first: their number sets the default depth
        st = {"max_length": args.max_length or 384, "doc_stride": 128}
        tr_feats = cli_io.squad_features(argparse.Namespace(input=data.files["train"], limit=args.limit), enc,
                                         dict(st, answers_only=True))
        dev_feats = cli_io.squad_features(argparse.Namespace(input=data.files["dev"], limit=args.limit), enc,
                                          dict(st, answers_only=False))
        print(f"train: {tr_feats!r}\ndev:   {dev_feats!r}", file=sys.stderr)
    if K is None:   # the sweep's default depth, by the training split's size (trainer.finetune_layers)
        K = finetune_layers(enc.num_layers, len(tr_feats.input_ids) if squad else len(data.train))
    optimizer = args.optimizer or FINETUNE_DEFAULT["optimizer"]
    precision = getattr(args, "precision", None) or finetune_precision(K, enc.device)
    embeddings = getattr(args, "train_embeddings", None)
    if embeddings and K != enc.num_layers:
        cli_io.fail(f"--train-embeddings trains the embeddings under every layer: it needs --train-layers "
                    f"{enc.num_layers} (every layer of this model), got {K}")
    embeddings = finetune_embeddings(K, enc.num_layers) if embeddings is None else embeddings
    layer = enc.num_layers - K if K else -1
    from .heads import head_class
    head = head_task(data.kind)
    sequence = not head_class(head).takes_tokens
    positions = "all" if (K or not sequence) else "mean"
    work = args.cache_dir
    tmp = None
    if work is None and squad:   # QA windows keep every token: on disk, not in memory
        tmp = tempfile.TemporaryDirectory(prefix="fasttran-finetune-")
        work = tmp.name
    search = None
    try:
        if squad:
            train_cache = _cache(enc, tr_feats.input_ids, tr_feats.attention_mask, tr_feats.token_type_ids, layer,
                                 "all", "float16", os.path.join(work, "train"), args.cache_batch_size)
            dev_cache = _cache(enc, dev_feats.input_ids, dev_feats.attention_mask, dev_feats.token_type_ids, layer,
                               "all", "float16", os.path.join(work, "dev"), args.cache_batch_size)
            targets, ev = tr_feats, (dev_cache, dev_feats)   # (the features: spans and context)
        else:
            print(f"train: {data.train!r}\ndev:   {data.dev!r}", file=sys.stderr)
            caches = []
            for split, ex in (("train", data.train), ("dev", data.dev)):
                ids, mask, types, tok = cli_io.inputs(enc, ex, args.max_length)
                c = _cache(enc, ids, mask, types, layer, positions, "float32",
                           os.path.join(work, split) if work else None, args.cache_batch_size)
                caches.append((c, cli_io.targets(ex, tok)))
                if split == "train" and getattr(args, "search", False):   # the split less its last tenth; that tenth
                    y = cli_io.targets(ex, tok)
                    n = len(y)
                    cut = n - max(1, n // 10)
                    if cut < 1:
                        cli_io.fail(f"--search needs at least 2 training examples, the split has {n}")
                    search = []
                    for part, sl in (("search-train", slice(0, cut)), ("search-holdout", slice(cut, n))):
                        sc = _cache(enc, ids[sl], mask[sl], None if types is None else types[sl], layer, positions,
                                    "float32", os.path.join(work, part) if work else None, args.cache_batch_size)
                        search.append((sc, y[sl]))
            (train_cache, targets), ev = caches
        cache_seconds = time.perf_counter() - t0
        n_train, n_dev = len(train_cache), len(ev[0])
        kw = dict(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed, train_layers=K,
                  optimizer=optimizer, precision=precision,
                  device=enc.device, head_lr=getattr(args, "head_lr", None),
                  layer_lr_decay=getattr(args, "layer_lr_decay", None), train_embeddings=embeddings)
        if data.label_names is not None:
            kw["label_names"] = list(data.label_names)
        if sequence and K:   # BERT's pooler on [CLS]: the layout transformers' pipelines load, head in place
            kw.update(pooling="cls", pooler=True)
        tr = Trainer(head, **kw)
        if search is not None:   # the lr picked on the split's last tenth, an epoch per try
            print(f"searching the lr: {', '.join(f'{x:g}' for x in [tr.lr * f for f in tr.LR_SEARCH_FACTORS])}, an "
                  f"epoch each on {len(search[0][1])} training examples, scored on the {len(search[1][1])} after them",
                  file=sys.stderr)
            tr.search_lr(*search[0], search[1], metric=data.metric)
            del search
        print(f"{tr!r}", file=sys.stderr)
        tr.fit(train_cache, targets, eval=ev, keep_best=data.metric)
    finally:
        if tmp is not None:
            tmp.cleanup()
    out = args.output or f"finetuned-{args.task}"
    tr.export(out, encoder=enc)
    info = {"task": args.task, "kind": data.kind, "files": data.files, "metric": data.metric,
            "best_epoch": tr.best_epoch, "train_layers": K, "train_embeddings": embeddings, "optimizer": optimizer,
            "precision": precision,
            "model": enc.path, "cache_seconds": cache_seconds,
            "history": tr.history, "lr": tr.lr, "head_lr": tr.head_lr, "lr_search": tr.lr_search_tries}
    from ._C import atomic_write
    atomic_write(os.path.join(out, "finetune.json"), [json.dumps(info, indent=1).encode()])
    best = tr.history[tr.best_epoch - 1]
    print(f"\n{args.task}: {n_train} train / {n_dev} dev examples, caches built in "
          f"{cache_seconds:.1f} s, {'head only' if not K else f'top {K} layer(s)' + (' + embeddings' if embeddings else '') + ' + head'}"
          + (f", {precision} mixed precision" if precision != "float32" else ""))
    if tr.lr_search_tries:
        print("lr search (held out: the training split's last tenth, one epoch per try):")
        for t in tr.lr_search_tries:
            mark = "*" if t["lr"] == tr.lr else " "
            print(f"{mark} lr {t['lr']:<8g}  held-out {data.metric} {_fmt(t[data.metric])}  {t['seconds']:>8.2f} s")
    print(results_table(tr.history, data.metric, tr.best_epoch))
    print(f"kept epoch {tr.best_epoch}: dev {data.metric} {_fmt(best.get('eval_' + data.metric))}")
    print(f"wrote {layout_of(tr.head)} model to {out}")
    print(how_to_load(tr.head, out))
    if layout_of(tr.head) == "sentence-transformers":
        print("(with --train-layers K the sentence tasks pool [CLS] through BERT's pooler: the export then loads in "
              "transformers' AutoModelForSequenceClassification and pipeline('text-classification'))")
    if tmp is not None:
        train_cache, ev = None, None
    return argparse.Namespace(trainer=tr, train_cache=train_cache, dev=ev, data=data, output=out)


def cmd_finetune(args):
    run(args)


def add_parser(sub):
    """the `finetune` subcommand on the CLI's subparsers"""
    from .trainer import DEFAULT_LR, DEFAULT_TOPK_RECIPES, FINETUNE_DEFAULT
    table = "\n".join(f"  {t.name:<6} {t.what}" for t in TASKS.values())
    f = sub.add_parser(
        "finetune", formatter_class=cli_io.Fmt,
        help="one command from a task's files (GLUE, CoNLL-2003, SQuAD) to an exported model",
        description="Read the task's train and dev files, build the caches, train with the defaults, evaluate on "
                    "dev every epoch, keep the best epoch's weights and export them.\n\nknown tasks (--data DIR "
                    "holds the task's folder as it ships, e.g. DIR/RTE/train.tsv, or DIR/glue/RTE/train.tsv):\n"
                    + table + "\n\nfiles of your own: --input FILE --eval-input FILE with --task "
                    + "|".join(kinds()) + " (columns as for `fasttran cache`)")
    f.add_argument("--task", required=True, metavar="TASK",
                   help=f"{', '.join(TASKS)}; with --input: {', '.join(kinds())}")
    f.add_argument("--data", default=None, metavar="DIR", help="directory holding the task's folder (or glue/<folder>)")
    cli_io.common_options(f, batch=32, input_required=False)
    f.add_argument("--eval-input", default=None, help="dev file of --input (the best epoch is picked on it)")
    f.add_argument("--output", default=None, help="exported model directory (default: ./finetuned-<task>)")
    f.add_argument("--train-layers", type=int, default=None, metavar="K",
                   help="train the encoder's top K layers with the head (default: every layer, "
                        f"{FINETUNE_DEFAULT['large_layers']:g} x them from {FINETUNE_DEFAULT['large_train']:,} "
                        "training examples on, fasttran.trainer.finetune_layers; 0: the head alone on the frozen "
                        "encoder's features). "
                        "With K > 0 the sentence tasks pool [CLS] through BERT's pooler: the export loads in "
                        "transformers' pipelines")
    f.add_argument("--train-embeddings", default=None, action=argparse.BooleanOptionalAction,
                   help="with every layer trained: train the embeddings too (the word, position and type tables "
                        "and their LayerNorm, as transformers' full fine-tuning does); default: "
                        + ("yes" if FINETUNE_DEFAULT["embeddings"] else "no") + " (FINETUNE_DEFAULT)")
    f.add_argument("--optimizer", default=None, choices=["adamw", "lamb"],
                   help="default AdamW (FINETUNE_DEFAULT); each optimizer has its own recipe per K")
    f.add_argument("--precision", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the trained layers' products (default: bfloat16 mixed precision where the device multiplies "
                        "bf16 natively -- CUDA, or a CPU with AVX512_BF16 -- else float32; FINETUNE_DEFAULT). The "
                        "weights and their sums stay float32; the export is float32")
    f.add_argument("--epochs", type=int, default=None,
                   help="passes over the training split (default 3, or the --train-layers recipe's)")
    f.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: the recipe for the optimizer and K, fasttran.trainer."
                        f"DEFAULT_TOPK_RECIPES: e.g. AdamW, every layer of a 6-layer model: "
                        f"{DEFAULT_TOPK_RECIPES['adamw'][6]['lr']:g}; the head alone: the Trainer's DEFAULT_LR, "
                        f"AdamW {DEFAULT_LR[('adamw', 'linear')]:g}). A given --lr is every parameter's unless "
                        "--head-lr / --layer-lr-decay say otherwise")
    f.add_argument("--head-lr", type=float, default=None,
                   help="with --train-layers: the head's own learning rate (default: the recipe's, or --lr)")
    f.add_argument("--layer-lr-decay", type=float, default=None,
                   help="with --train-layers: the layer d below the top trains at lr x decay^d (default: the "
                        "recipe's, or 1 with --lr)")
    f.add_argument("--search", action="store_true",
                   help="pick the lr first: the default's x0.5, x1, x2 each trained an epoch on the training split "
                        "less its last tenth and scored on that tenth (Trainer.search_lr; about 1.5-2x the time)")
    f.add_argument("--metric", default=None, help="dev metric that picks the best epoch (default: the task's)")
    f.add_argument("--seed", type=int, default=0, help="head init, batch order and dropout")
    f.add_argument("--max-length", type=int, default=None, help="truncate to N tokens (QA: window length, 384)")
    f.add_argument("--cache-batch-size", type=int, default=64, help="examples per encoder batch of the caches")
    f.add_argument("--cache-dir", default=None,
                   help="keep the caches here (default: in memory; QA: a temporary directory)")
    f.set_defaults(func=cmd_finetune)
    return f
