"""What the command line's commands share: argument parsing (the formatter, the options every command
has), the --task list, reading a data file into fasttran.readers.Examples, tokenizing it, the
encoder of --model / --device and SQuAD windows. fasttran.cli (the commands) and
fasttran.finetune_cli (`fasttran finetune`) both build on it."""
import argparse
import json
import os
import sys


class Fmt(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (when it has one)."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if action.option_strings and d is not None and d is not False and d != argparse.SUPPRESS and "%(default)" not in h:
            h += " (default: %(default)s)"
        return h


def fail(msg):
    sys.exit(f"fasttran: {msg}")


#: --task -> (fasttran.readers task, Trainer task)
def _cli_tasks():
    from .heads import REGISTRY   # each head class names its --task values (Head.cli_tasks)
    return {name: (reader, cls.task) for cls in REGISTRY for name, reader in cls.cli_tasks.items()}


CLI_TASKS = _cli_tasks()


def read_data(args, path, task, label_names=None, labelled=True):
    """fasttran.readers.Examples of a data file for a --task (labelled: True = labels required, None =
    if present, False = none read), errors as one line"""
    from . import readers
    from .errors import FastTranError
    if not os.path.exists(path):
        fail(f"input file {path} not found")
    rtask = CLI_TASKS[task][0]
    try:
        if task == "token" or path.endswith((".conll", ".txt")):
            if task != "token":
                fail(f"{path}: a CoNLL column file is for --task token")
            ex = readers.read_conll(path, label_names=label_names, limit=args.limit)
        elif path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8-sig") as f:
                rows = []
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        fail(f"{path}:{n}: not JSON lines ({e}); SQuAD JSON files need --task qa / --head qa")
                    if not isinstance(row, dict):
                        fail(f"{path}:{n}: expected a JSON object per line")
                    rows.append(row)
                    if args.limit and len(rows) >= args.limit:
                        break
            if not rows:
                fail(f"{path}: no examples")
            tf = args.text_field or next((k for k in ("text", "sentence", "sentence1") if k in rows[0]), "text")
            pf = args.pair_field or (next((k for k in ("text_pair", "sentence2") if k in rows[0]), None)
                                     if task == "pair" else None)
            lf = args.label_field if (labelled is not False and any(args.label_field in r for r in rows)) else None
            ex = readers.from_records(rows, text=tf, text_pair=pf, label=lf,
                                      task=None if rtask == "classification" else rtask, label_names=label_names,
                                      source=path)
        else:
            ex = readers.read_glue_tsv(path, text=args.text_field, text_pair=args.pair_field,
                                       label=args.label_field if args.text_field else None,
                                       task=None if rtask == "classification" else rtask, label_names=label_names,
                                       limit=args.limit)
    except FastTranError as e:
        fail(str(e))
    if labelled is False:
        ex.labels = None
    if labelled and ex.labels is None:
        fail(f"{path} has no labels (column/field {args.label_field!r})")
    if ex.labels is not None and ex.task not in (rtask, None) and not (rtask == "classification" and ex.task is None):
        hint = {"regression": "--task regression", "classification": "--task classification or pair",
                "multilabel": "--task multi-label"}.get(ex.task, "")
        fail(f"{path}: its labels read as {ex.task} but --task is {task}" + (f" (use {hint})" if hint else ""))
    if task == "pair" and ex.text_pairs is None:
        fail(f"{path}: --task pair needs two text columns (e.g. sentence1 / sentence2, or --text-field and "
             "--pair-field)")
    return ex


def inputs(enc, ex, max_length=None):
    """(input_ids, attention_mask, token_type_ids, token labels or None) of Examples"""
    if ex.words is not None:
        tok = enc.tokenize_words(ex.words, ex.labels, max_length=max_length)
        return tok.input_ids, tok.attention_mask, tok.token_type_ids, tok.labels
    ids, mask, types = enc.tokenize(ex.texts, ex.text_pairs, max_length=max_length)
    return ids, mask, types, None


def targets(ex, tok_labels):
    return tok_labels if ex.words is not None else ex.labels


def encoder(args, device=None):
    import fasttran
    model = args.model or fasttran.models.minilm_path()
    device = device or args.device or ("cuda:0" if fasttran.cuda_available() else "cpu")
    return fasttran.Encoder.from_pretrained(model, device=device)


def squad_features(args, enc, settings):
    from .squad import SquadFeatures, load_squad
    examples = load_squad(args.input)
    if args.limit:
        examples = examples[:args.limit]
    if not examples:
        fail(f"{args.input} holds no questions")
    feats = SquadFeatures(examples, enc, max_length=settings["max_length"],
                          doc_stride=settings["doc_stride"])
    return feats.with_answers() if settings["answers_only"] else feats


def common_options(sp, batch=64, data=True, input_required=True):
    """the options every command shares: the model and device, and (data) the input file, its columns,
    --limit and --batch-size"""
    sp.add_argument("--model", default=None,
                    help="checkpoint directory (config.json + model.safetensors), or a Hub id; default: "
                         "all-MiniLM-L6-v2 (installed package or fasttran's model cache)")
    sp.add_argument("--device", default=None, help="cpu or cuda:N (default: a GPU if usable, else cpu)")
    if not data:
        return
    sp.add_argument("--input", required=input_required, default=None,
                    help="JSONL, TSV (GLUE's files as they are) or CoNLL file of examples (QA: SQuAD JSON)")
    sp.add_argument("--text-field", default=None, help="text field/column (default: found by name: text, "
                    "sentence, sentence1, #1 String, question, ...)")
    sp.add_argument("--pair-field", default=None, help="second text field/column of pairs (default: found by name)")
    sp.add_argument("--label-field", default="label", help="label field/column (TSV: found by name when 'label')")
    sp.add_argument("--limit", type=int, default=None, metavar="N", help="use the first N examples (QA: questions)")
    sp.add_argument("--batch-size", type=int, default=batch, help="examples per batch")
