"""Data sets in the formats people have, as one record type (:class:`Examples`).

- ``read_glue_tsv(path)``: GLUE's TSV files as GLUE ships them (byte-order mark, a header or none,
  label names such as ``entailment``); MRPC, STS-B, CoLA, SST-2, QNLI, RTE, WNLI, QQP and MNLI are
  recognised by their header (CoLA, which has none, by its four columns), any other TSV by column
  names or indices.
- ``read_conll(path)``: CoNLL column files (one word a line, blank lines between sentences,
  ``-DOCSTART-`` lines between documents), tags checked against IOB2.
- ``from_records(rows, text=..., text_pair=..., label=...)``: any iterable of dicts, or a table read
  by column (a Hugging Face ``datasets.Dataset``, a pandas ``DataFrame``).

Labels become class ids (int64), scores (float32, regression), a multi-hot (N, K) float32 matrix
(multi-label) or one id array per sentence (token classification); ``label_names`` maps ids to
names. Reading dev with ``label_names=train.label_names`` gives it train's ids, and a label train
never had is an error naming it. Every error names the file and line (or the record).
"""
import numbers
import os
import re

import numpy as np

from .errors import FastTranIOError, InputError, InputTypeError

TASKS = ("classification", "regression", "multilabel", "tokens")

# label orders of the GLUE tasks whose files spell labels out (as the GLUE benchmark's loaders number them)
_NAMED_ORDERS = (("entailment", "neutral", "contradiction"), ("entailment", "not_entailment"))

# column names GLUE and common data sets use: (text, text_pair) candidates and label candidates, in order
_PAIR_COLUMNS = (("sentence1", "sentence2"), ("#1 String", "#2 String"), ("question", "sentence"),
                 ("question1", "question2"), ("premise", "hypothesis"), ("text", "text_pair"))
_TEXT_COLUMNS = ("sentence", "text")
_LABEL_COLUMNS = ("label", "gold_label", "Quality", "score", "is_duplicate", "labels")
_REGRESSION_COLUMNS = ("score",)

# the GLUE files' headers, for the name in the repr (the columns are found as above)
_GLUE_HEADERS = {
    ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"): "MRPC",
    ("index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"): "STS-B",
    ("sentence", "label"): "SST-2",
    ("index", "question", "sentence", "label"): "QNLI",
    ("index", "sentence1", "sentence2", "label"): "RTE / WNLI",
    ("id", "qid1", "qid2", "question1", "question2", "is_duplicate"): "QQP",
}
_MNLI_PREFIX = ("index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                "sentence1_parse", "sentence2_parse", "sentence1", "sentence2")
_COLA_JUDGEMENTS = {"", "*", "?", "??", "*?", "?*", "#", "**"}


class Examples:
    """A data set: texts (and text_pairs), or words per sentence, with labels.

    texts: list of str (None for token tasks); text_pairs: list of str or None; words: list of
    lists of str (token tasks) or None; labels: None (unlabelled), int64 (N,) class ids, float32 (N,)
    scores, float32 (N, K) multi-hot, or a list of int64 arrays (one id per word); label_names:
    list of str (the id's name) or None; task: one of ``TASKS`` or None; source: where it came
    from. ``len()`` is the number of examples; slicing and index arrays give a subset;
    ``tokenize(encoder)`` gives the encoder's inputs.
    """

    def __init__(self, texts=None, text_pairs=None, labels=None, label_names=None, words=None, task=None,
                 source=None):
        if task is not None and task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)} or None, got {task!r}")
        if (texts is None) == (words is None):
            raise InputError("Examples need texts (sentence tasks) or words (token tasks), not both or neither")
        n = len(texts if texts is not None else words)
        for name, v in (("text_pairs", text_pairs), ("labels", labels)):
            if v is not None and len(v) != n:
                raise InputError(f"{name} has {len(v)} entries for {n} examples")
        self.texts, self.text_pairs, self.words = texts, text_pairs, words
        self.labels, self.label_names, self.task, self.source = labels, label_names, task, source

    def __len__(self):
        return len(self.texts if self.texts is not None else self.words)

    @property
    def label_map(self):
        """{name: id} (None without label names)."""
        return None if self.label_names is None else {n: i for i, n in enumerate(self.label_names)}

    @property
    def num_labels(self):
        return None if self.label_names is None else len(self.label_names)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            raise InputTypeError("index Examples with a slice or an index array (a subset), e.g. examples[:100]")
        if isinstance(index, slice):
            pick = lambda seq: None if seq is None else seq[index]
        else:
            idx = np.asarray(index)
            if idx.dtype == bool:
                idx = np.nonzero(idx)[0]
            pick = lambda seq: None if seq is None else (seq[idx] if isinstance(seq, np.ndarray) else [seq[i] for i in idx])
        return Examples(pick(self.texts), pick(self.text_pairs), pick(self.labels), self.label_names,
                        pick(self.words), self.task, self.source)

    def tokenize(self, encoder, max_length=None):
        """The encoder's inputs: ``encoder.tokenize(texts, text_pairs)`` ((ids, mask, types)), or for
        token tasks ``encoder.tokenize_words(words, labels)`` (a WordTokens)."""
        if self.words is not None:
            return encoder.tokenize_words(self.words, self.labels, max_length=max_length)
        return encoder.tokenize(self.texts, self.text_pairs, max_length=max_length)

    def _label_summary(self):
        y = self.labels
        if y is None:
            return "unlabelled"
        if self.task == "regression":
            return f"regression, scores {float(y.min()):g}..{float(y.max()):g} (mean {float(y.mean()):.3g})"
        names = self.label_names or []
        if self.task == "multilabel":
            counts = y.sum(axis=0).astype(int)
        elif self.task == "tokens":
            flat = np.concatenate(y) if len(y) else np.zeros(0, np.int64)
            counts = np.bincount(flat[flat >= 0], minlength=len(names))
        else:
            counts = np.bincount(y, minlength=len(names))
        shown = ", ".join(f"{n}: {c:,}" for n, c in zip(names, counts))
        return f"{self.task}, {len(names)} labels ({shown if len(names) <= 12 else shown[:200] + ' ...'})"

    def __repr__(self):
        kind = "sentences" if self.words is not None else ("pairs" if self.text_pairs is not None else "texts")
        src = f"{self.source}: " if self.source else ""
        first = self.words[0][:8] if self.words is not None and len(self) else (self.texts[0][:60] if len(self) else "")
        return f"Examples({src}{len(self):,} {kind}, {self._label_summary()}; first: {first!r})"


# ---- labels --------------------------------------------------------------------------------------
_INT = re.compile(r"^[+-]?\d+$")


def _number(v):
    """A label value as ("int", n), ("float", x), ("name", s) or ("none", None)."""
    if v is None:
        return "none", None
    if isinstance(v, (bool, np.bool_)):
        return "bool", v
    if isinstance(v, (numbers.Integral, np.integer)):
        return "int", int(v)
    if isinstance(v, (numbers.Real, np.floating)):
        return "float", float(v)
    if isinstance(v, str):
        s = v.strip()
        if not s:
            return "none", None
        if _INT.match(s):
            return "int", int(s)
        try:
            x = float(s)
        except ValueError:
            return "name", s
        return "float", x
    return type(v).__name__, v


def _names_for(found):
    """Label names in a stable order: GLUE's order when the names are a GLUE task's, else sorted."""
    for order in _NAMED_ORDERS:
        if set(found) <= set(order):
            return list(order)
    return sorted(found)


class _Labels:
    """Turns raw label values into ids / scores, naming where each came from (``where(i)``)."""

    def __init__(self, task, label_names, where):
        if task is not None and task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)} or None (decided by the labels), got {task!r}")
        if label_names is not None:
            if isinstance(label_names, str) or not all(isinstance(n, str) for n in label_names):
                raise InputTypeError("label_names must be a list of strings (e.g. train.label_names)")
            label_names = list(label_names)
            if len(set(label_names)) != len(label_names):
                raise InputError(f"label_names has duplicates: {label_names}")
            if task == "regression":
                raise InputError("label_names are for class labels; task='regression' has none")
        self.task, self.names, self.where = task, label_names, where

    def _kinds(self, values):
        kinds = [_number(v) for v in values]
        for i, (k, v) in enumerate(kinds):
            if k not in ("int", "float", "name", "none"):
                raise InputTypeError(f"{self.where(i)}: label {v!r:.40} is a {k}; labels are class ids, names or scores")
        return kinds

    def _missing(self, kinds):
        i = next(i for i, (k, _) in enumerate(kinds) if k == "none")
        return InputError(f"{self.where(i)}: no label (an empty field) where the others have one")

    def scalar(self, values):
        """(task, labels, label_names) for one label per example; labels None when there are none."""
        kinds = self._kinds(values)
        present = {k for k, _ in kinds}
        if present == {"none"} or not kinds:
            return self.task, None, self.names
        if "none" in present:
            raise self._missing(kinds)
        task = self.task
        if task is None:
            task = ("classification" if self.names is not None or present == {"int"} or "name" in present
                    else "regression")
        if task == "regression":
            bad = next((i for i, (k, _) in enumerate(kinds) if k == "name"), None)
            if bad is not None:
                raise InputTypeError(f"{self.where(bad)}: label {kinds[bad][1]!r} is a string; regression takes numbers "
                                     "(task='classification' for named classes)")
            y = np.array([v for _, v in kinds], np.float64)
            bad = np.nonzero(~np.isfinite(y))[0]
            if bad.size:
                raise InputError(f"{self.where(int(bad[0]))}: label {y[bad[0]]} is not a finite number")
            return task, y.astype(np.float32), None
        if task != "classification":
            raise InputError(f"task={task!r} takes one label per example through multilabel()/tokens(), not here")
        return task, self._ids(kinds), self.names

    def _ids(self, kinds, what="label"):
        """int64 ids from ("int", n) / ("name", s) kinds; fixes self.names on first use."""
        present = {k for k, _ in kinds}
        bad = next((i for i, (k, _) in enumerate(kinds) if k == "float"), None)
        if bad is not None:
            raise InputTypeError(
                f"{self.where(bad)}: {what} {kinds[bad][1]!r} is a float; classification takes integer class ids "
                "or names (task='regression' for scores)")
        if present == {"int", "name"}:
            i = next(i for i, (k, _) in enumerate(kinds) if k == "int")
            j = next(i for i, (k, _) in enumerate(kinds) if k == "name")
            raise InputTypeError(f"mixed label types: {self.where(i)} has the class id {kinds[i][1]} and "
                                 f"{self.where(j)} the name {kinds[j][1]!r}; use one or the other")
        if "name" in present:
            if self.names is None:
                self.names = _names_for({v for _, v in kinds})
            index = {n: i for i, n in enumerate(self.names)}
            out = np.empty(len(kinds), np.int64)
            for i, (_, v) in enumerate(kinds):
                if v not in index:
                    raise InputError(
                        f"{self.where(i)}: {what} {v!r} is not one of the known labels {self.names} (a label the "
                        "training data never had); read this file with the training set's label_names, or "
                        "check the column")
                out[i] = index[v]
            return out
        out = np.array([v for _, v in kinds], np.int64)
        neg = np.nonzero(out < 0)[0]
        if neg.size:
            raise InputError(f"{self.where(int(neg[0]))}: {what} {out[neg[0]]} is negative; class ids start at 0 "
                             "(GLUE's test splits mark missing labels with -1: read them without a label column)")
        if self.names is None:
            self.names = [str(i) for i in range(int(out.max()) + 1 if out.size else 0)]
        elif out.size and out.max() >= len(self.names):
            i = int(np.argmax(out))
            raise InputError(f"{self.where(i)}: class id {out[i]} is not one of the {len(self.names)} known labels "
                             f"{self.names} (a label the training data never had)")
        return out

    def flat_ids(self, values, where_of, what="label"):
        """int64 ids of a flat list of label values (names or ids; none missing), errors naming
        where_of(j), the line or record value j came from."""
        where, self.where = self.where, where_of
        try:
            kinds = self._kinds(values)
            if any(k == "none" for k, _ in kinds):
                raise self._missing(kinds)
            return self._ids(kinds, what)
        finally:
            self.where = where

    def multilabel(self, values, sep):
        """(N, K) float32 multi-hot from label sets (lists, or sep-joined strings) of names or ids."""
        sets = []
        for i, v in enumerate(values):
            if v is None or isinstance(v, str):
                parts = [p.strip() for p in (v or "").split(sep)] if sep else [v or ""]
                parts = [p for p in parts if p]
            elif isinstance(v, (list, tuple, set, frozenset, np.ndarray)):
                parts = list(v)
            else:
                raise InputTypeError(f"{self.where(i)}: a multi-label label must be a list of labels or a "
                                     f"{sep!r}-separated string, got {type(v).__name__}")
            sets.append(parts)
        owners = [i for i, s in enumerate(sets) for _ in s]
        where = self.where
        ids = self.flat_ids([p for s in sets for p in s], lambda j: where(owners[j]))
        y = np.zeros((len(sets), len(self.names or [])), np.float32)
        y[owners, ids] = 1.0
        return "multilabel", y, self.names

    def per_word(self, values, lengths):
        """One int64 id array per sentence from per-word labels (names or ids)."""
        flat, owners = [], []
        for i, (v, n) in enumerate(zip(values, lengths)):
            if isinstance(v, str) or not hasattr(v, "__len__"):
                raise InputTypeError(f"{self.where(i)}: token labels must be a list with one label per word, "
                                     f"got {type(v).__name__}")
            if len(v) != n:
                raise InputError(f"{self.where(i)}: {len(v)} labels for {n} words; token labels must be aligned "
                                 "to the words, one per word")
            flat.extend(v)
            owners.extend([i] * n)
        where = self.where
        ids = self.flat_ids(flat, lambda j: where(owners[j]))
        return "tokens", np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else [], self.names


# ---- files ---------------------------------------------------------------------------------------
def _read_lines(path):
    """The file's lines (BOM dropped, LF or CRLF), numbered from 1; errors name the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as e:
        raise FastTranIOError(e.errno, f"{path}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start}); convert the file to UTF-8") from None
    if not text.strip():
        raise InputError(f"{path}: the file is empty")
    lines = text.split("\n")
    while lines and not lines[-1].strip("\r"):
        lines.pop()   # the final newline, trailing blank lines
    return path, [l[:-1] if l.endswith("\r") else l for l in lines]


def _column(spec, header, ncols, what, path):
    """A column given by name (needs a header) or index (negative from the end) -> index."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if header is None:
            raise InputError(f"{path}: {what}={spec!r} names a column, but the file has no header; give its index")
        if spec not in header:
            raise InputError(f"{path}: no column {spec!r} for {what}; the header has {header}")
        return header.index(spec)
    if isinstance(spec, bool) or not isinstance(spec, (int, np.integer)):
        raise InputTypeError(f"{what} must be a column name or index, got {type(spec).__name__}")
    if not -ncols <= spec < ncols:
        raise InputError(f"{path}: {what}={spec} is out of range for {ncols} columns")
    return int(spec) % ncols


def _guess_columns(header, rows):
    """(text, text_pair, label, task, layout name) for a file the caller gave no columns for."""
    if header is not None:
        h = tuple(header)
        name = _GLUE_HEADERS.get(h) or ("MNLI" if h[:len(_MNLI_PREFIX)] == _MNLI_PREFIX else None)
        text = pair = None
        for a, b in _PAIR_COLUMNS:
            if a in h and b in h:
                text, pair = a, b
                break
        else:
            text = next((c for c in _TEXT_COLUMNS if c in h), None)
        label = next((c for c in _LABEL_COLUMNS if c in h), None)
        task = "regression" if label in _REGRESSION_COLUMNS else None
        return text, pair, label, task, name
    # no header: CoLA's layout (source, label, original judgement, sentence)
    if rows and len(rows[0]) == 4 and all(r[1] in ("0", "1") and r[2] in _COLA_JUDGEMENTS and " " not in r[0]
                                          for r in rows[:50]):
        return 3, None, 1, "classification", "CoLA"
    return None, None, None, None, None


def _header_of(first, header):
    """The header row or None: header=True/False as given, else a first row that names known columns."""
    if header is None:
        known = set(_TEXT_COLUMNS + _LABEL_COLUMNS + _MNLI_PREFIX) | {c for p in _PAIR_COLUMNS for c in p}
        header = bool(known & set(first))
    return list(first) if header else None


def read_glue_tsv(path, text=None, text_pair=None, label=None, task=None, label_names=None, header=None,
                  label_sep=",", limit=None):
    """Read a GLUE-style TSV file into :class:`Examples`.

    GLUE's files as GLUE ships them need no arguments: MRPC, STS-B (regression), SST-2, QNLI, RTE,
    WNLI, QQP and MNLI (train, dev_matched / dev_mismatched) are recognised by their header, CoLA
    (no header) by its four columns; test files without a label column read unlabelled. Fields are
    split on tabs only (quotes are text, as in GLUE's own readers); a UTF-8 byte-order mark and CRLF
    line ends are accepted.

    text, text_pair, label: columns by header name or index (negative from the end); text_pair
    None for single sentences, label None for unlabelled data (when not found by name).
    task: "classification", "regression", "multilabel" (label = label_sep-separated names or ids)
    or None: decided by the labels (all integers -> class ids; names -> classes numbered in GLUE's
    order for GLUE's names, else sorted; numbers with a fraction -> regression).
    label_names: the classes' names in id order, e.g. ``train.label_names`` when reading dev: the
    ids then agree with train's, and a label train never had is an error.
    header: True / False, or None to detect (a first line naming known columns).
    limit: read only the first `limit` examples.
    Errors (InputError / InputTypeError, naming file:line): an empty file, a line whose column count
    differs from the first line's, a missing text or label field, float labels for classification,
    strings for regression, class ids mixed with names, an unknown label."""
    path, lines = _read_lines(path)
    rows = [l.split("\t") for l in (lines if limit is None else lines[:int(limit) + 1])]
    head = _header_of(rows[0], header)
    start = 1 if head is not None else 0
    ncols = len(rows[0])
    for n, r in enumerate(rows[start:], start=start + 1):
        if len(r) != ncols:
            raise InputError(f"{path}:{n}: {len(r)} tab-separated columns, expected {ncols} "
                             f"(as {'the header' if head is not None else 'the first line'} has)")
    body = rows[start:]
    if limit is not None:
        body = body[:int(limit)]
    if not body:
        raise InputError(f"{path}: no examples (only a header)")
    layout = None
    if text is None:
        if text_pair is not None or label is not None:
            raise InputError(f"{path}: name the text column too (text=...) when giving text_pair or label")
        text, text_pair, label, guessed_task, layout = _guess_columns(head, body)
        if text is None:
            raise InputError(f"{path}: cannot tell which column holds the text ({'header ' + str(head) if head else 'no header'}, "
                             f"{ncols} columns); give text= (and text_pair=, label=) by name or index")
        task = task or guessed_task
    ti = _column(text, head, ncols, "text", path)
    pi = _column(text_pair, head, ncols, "text_pair", path)
    li = _column(label, head, ncols, "label", path)
    where = lambda i: f"{path}:{i + start + 1}"
    texts = [r[ti] for r in body]
    pairs = [r[pi] for r in body] if pi is not None else None
    labels, names = None, label_names
    if li is not None:
        lab = _Labels(task, label_names, where)
        values = [r[li] for r in body]
        task, labels, names = lab.multilabel(values, label_sep) if task == "multilabel" else lab.scalar(values)
    else:
        task = None
    name = os.path.basename(path) if layout is None else f"{layout} {os.path.basename(path)}"
    return Examples(texts, pairs, labels, names, task=task, source=name)


# ---- CoNLL -----------------------------------------------------------------------------------------
_TAG = re.compile(r"^(O|[BI]-\S+)$")


def _check_iob2(tags, path, first_line):
    """IOB2: every tag O, B-X or I-X, and I-X only after B-X or I-X."""
    prev = "O"
    for k, t in enumerate(tags):
        if not _TAG.match(t):
            raise InputError(f"{path}:{first_line + k}: tag {t!r} is not IOB2 (O, B-TYPE or I-TYPE); "
                             "read another column (column=...) or pass scheme=None to take tags as they are")
        if t.startswith("I-") and prev[2:] != t[2:]:
            raise InputError(f"{path}:{first_line + k}: {t} follows {prev}: in IOB2 an entity starts with B-; "
                             "for IOB1 files pass scheme='IOB1' (converted to IOB2), or scheme=None")
        prev = t


def _iob1_to_iob2(tags):
    out, prev = [], "O"
    for t in tags:
        if t.startswith("I-") and prev[2:] != t[2:]:
            t = "B-" + t[2:]
        out.append(t)
        prev = t
    return out


def _tag_names(found):
    """O first, then each type's B- and I- (both, so dev may have an I- train never showed), by type."""
    types = sorted({t[2:] for t in found if t[:2] in ("B-", "I-")})
    rest = sorted(t for t in found if t != "O" and t[:2] not in ("B-", "I-"))
    return (["O"] if "O" in found or types else []) + [f"{p}-{t}" for t in types for p in "BI"] + rest


def read_conll(path, column=-1, word_column=0, label_names=None, scheme="IOB2", limit=None):
    """Read a CoNLL column file (CoNLL-2003 and the like) into token-task :class:`Examples`: words
    per sentence and one label id per word.

    One word a line, columns split on whitespace, a blank line between sentences; ``-DOCSTART-``
    lines (document breaks) are skipped. column: the tag column (default the last);
    word_column: the word column. scheme: "IOB2" (tags checked: O, B-X, I-X with I-X only inside
    an entity of type X), "IOB1" (converted to IOB2) or None (tags taken as they are).
    label_names: e.g. ``train.label_names`` for dev (a tag train never had is an error); default:
    O, then B-/I- of each type in alphabetical order. limit: the first `limit` sentences.
    Errors name file:line: an empty file, a line with another column count, tags that break the
    scheme."""
    if scheme not in ("IOB2", "IOB1", None):
        raise InputError(f"scheme must be 'IOB2', 'IOB1' or None, got {scheme!r}")
    path, lines = _read_lines(path)
    sents, tags, starts = [], [], []   # starts: each sentence's first line number
    ncols = first_data = None
    in_sentence = False
    for n, line in enumerate(lines, start=1):
        parts = line.split()
        if not parts or parts[0] == "-DOCSTART-":
            in_sentence = False
            if limit is not None and len(sents) >= limit:
                break
            continue
        if ncols is None:
            ncols, first_data = len(parts), n
            wc = _column(word_column, None, ncols, "word_column", path)
            tc = _column(column, None, ncols, "column", path)
        elif len(parts) != ncols:
            raise InputError(f"{path}:{n}: {len(parts)} columns, expected {ncols} (as {path}:{first_data} has)")
        if not in_sentence:
            sents.append([])
            tags.append([])
            starts.append(n)
            in_sentence = True
        sents[-1].append(parts[wc])
        tags[-1].append(parts[tc])
    if limit is not None:
        sents, tags, starts = sents[:limit], tags[:limit], starts[:limit]
    if not sents:
        raise InputError(f"{path}: no sentences (only -DOCSTART- or blank lines)")
    if scheme == "IOB1":
        tags = [_iob1_to_iob2(t) for t in tags]
    if scheme is not None:
        for t, s in zip(tags, starts):
            _check_iob2(t, path, s)
    if label_names is None:
        label_names = _tag_names({t for ts in tags for t in ts})
    lines_of = [s + k for ts, s in zip(tags, starts) for k in range(len(ts))]
    ids = _Labels("tokens", label_names, None).flat_ids([t for ts in tags for t in ts],
                                                        lambda j: f"{path}:{lines_of[j]}", what="tag")
    labels = np.split(ids, np.cumsum([len(t) for t in tags])[:-1])
    return Examples(words=sents, labels=labels, label_names=label_names, task="tokens",
                    source=os.path.basename(path))


# ---- records -------------------------------------------------------------------------------------
def _columns_of(records, names, n_limit):
    """{name: list of values} from a column table (datasets.Dataset, DataFrame) or rows of dicts."""
    wanted = [c for c in names if c is not None]
    cols = getattr(records, "column_names", None)
    if cols is None and hasattr(records, "columns") and hasattr(records, "__getitem__") and not isinstance(records, dict):
        cols = [str(c) for c in records.columns]   # pandas
    if cols is not None:
        cols = list(cols)
        for c in wanted:
            if c not in cols:
                raise InputError(f"no column {c!r}; the data set has {cols}")
        out = {}
        for c in wanted:
            col = records[c]
            col = col.tolist() if hasattr(col, "tolist") and not isinstance(col, list) else list(col)
            out[c] = col if n_limit is None else col[:n_limit]
        return out, lambda i: f"row {i}"
    if isinstance(records, (str, bytes, dict)):
        raise InputTypeError(f"records must be an iterable of dicts (or a datasets.Dataset), got {type(records).__name__}"
                             + ("; for a file use read_glue_tsv / read_conll" if isinstance(records, str) else ""))
    try:
        it = iter(records)
    except TypeError:
        raise InputTypeError(f"records must be an iterable of dicts, got {type(records).__name__}") from None
    out = {c: [] for c in wanted}
    for i, r in enumerate(it):
        if n_limit is not None and i >= n_limit:
            break
        if not hasattr(r, "keys") or not hasattr(r, "__getitem__"):
            raise InputTypeError(f"record {i} is a {type(r).__name__}, expected a dict of columns")
        for c in wanted:
            if c not in r:
                raise InputError(f"record {i} has no {c!r}; its keys are {sorted(map(str, r.keys()))}")
            out[c].append(r[c])
    return out, lambda i: f"record {i}"


def _feature_names(records, column):
    """A datasets.Dataset's ClassLabel names for a column (also inside a Sequence / List), else None."""
    feats = getattr(records, "features", None)
    if feats is None or column is None:
        return None
    try:
        f = feats[column]
    except (KeyError, TypeError):
        return None
    for _ in range(3):
        names = getattr(f, "names", None)
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return names
        f = getattr(f, "feature", None)
        if isinstance(f, (list, tuple)) and f:
            f = f[0]
    return None


def from_records(records, text="text", text_pair=None, label="label", words=None, task=None, label_names=None,
                 label_sep=",", limit=None, source=None):
    """Examples from an iterable of dicts with named columns, or from a table read by column: a
    Hugging Face ``datasets.Dataset`` (its ClassLabel names become label_names), a pandas
    DataFrame.

    text, text_pair, label: the column names (label None: unlabelled). words: a column of word
    lists for token classification (then label is the per-word label column, e.g. "ner_tags").
    task / label_names / label_sep: as in :func:`read_glue_tsv`; a multi-label column holds lists
    of names or ids (or label_sep-separated strings). limit: the first `limit` records.
    Errors name the record: a missing column, a text that is not a string, labels as in
    read_glue_tsv, token labels not aligned to the words."""
    if label_names is None:
        label_names = _feature_names(records, label)
    if words is not None:
        cols, where = _columns_of(records, [words, label], limit)
        sents = []
        for i, ws in enumerate(cols[words]):
            if isinstance(ws, str) or not hasattr(ws, "__len__") or not all(isinstance(w, str) for w in ws):
                raise InputTypeError(f"{where(i)}: {words!r} must be a list of words (strings), got {ws!r:.60}")
            sents.append(list(ws))
        if not sents:
            raise InputError("no records")
        labels = names = None
        task = None
        if label is not None:
            task, labels, names = _Labels("tokens", label_names, where).per_word(cols[label], [len(s) for s in sents])
        return Examples(words=sents, labels=labels, label_names=names, task=task, source=source)
    cols, where = _columns_of(records, [text, text_pair, label], limit)
    if not cols[text]:
        raise InputError("no records")
    for c in (text, text_pair):
        if c is None:
            continue
        for i, v in enumerate(cols[c]):
            if not isinstance(v, str):
                raise InputTypeError(f"{where(i)}: {c!r} is {type(v).__name__} ({v!r:.40}), expected a string")
    labels, names = None, label_names
    if label is not None:
        lab = _Labels(task, label_names, where)
        task, labels, names = (lab.multilabel(cols[label], label_sep) if task == "multilabel"
                               else lab.scalar(cols[label]))
    else:
        task = None
    return Examples(cols[text], cols[text_pair] if text_pair is not None else None, labels, names, task=task,
                    source=source)
