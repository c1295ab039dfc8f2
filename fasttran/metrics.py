"""The metrics GLUE and CoNLL report, in NumPy (no scikit-learn, SciPy or seqeval at run time; the
tests hold each one to them).

Classification: ``accuracy``, ``f1_score`` (binary / macro / micro), ``matthews_corrcoef`` (CoLA).
Regression: ``pearson``, ``spearman`` (average ranks for ties), ``mse``. Multi-label:
``multilabel_f1`` (micro and macro F1 at one threshold or one per label), ``best_thresholds``.
Token classification: ``entities`` and ``entity_scores`` (entity-level precision / recall / F1
with seqeval's default rules, i.e. conlleval's, per type too). ``glue_metrics(task, ...)`` gives
what GLUE reports for a task.

Where a value is undefined the functions follow the references: a precision, recall or F1 with a
zero denominator is 0.0 (scikit-learn's and seqeval's zero_division default); the Matthews
correlation of a constant prediction or truth is 0.0 (scikit-learn); Pearson and Spearman of a
constant input are NaN (SciPy), without a warning.
"""
import numpy as np

from .errors import InputError, InputTypeError


def _pair(y_true, y_pred, kind="labels"):
    """Two equal-length 1-D arrays; class labels must be integers (or strings), scores finite."""
    a, b = np.asarray(y_true), np.asarray(y_pred)
    if a.ndim != 1 or b.ndim != 1:
        raise InputError(f"expected 1-D y_true and y_pred, got shapes {a.shape} and {b.shape}")
    if a.shape != b.shape:
        raise InputError(f"y_true has {a.size} values but y_pred has {b.size}")
    if a.size == 0:
        raise InputError("no values: y_true and y_pred are empty")
    if kind == "labels":
        for name, x in (("y_true", a), ("y_pred", b)):
            if x.dtype.kind == "f":
                raise InputTypeError(f"{name} holds floats; class metrics take class ids (for scores or "
                                     "logits take the argmax first; for regression use pearson / spearman / mse)")
            if x.dtype.kind == "O":
                raise InputTypeError(f"{name} holds Python objects; give integer class ids or strings")
    else:
        out = []
        for name, x in (("y_true", a), ("y_pred", b)):
            if x.dtype.kind not in "iufb":
                raise InputTypeError(f"{name} must be numbers, got {x.dtype}")
            x = x.astype(np.float64)
            if not np.isfinite(x).all():
                raise InputError(f"{name} has {int((~np.isfinite(x)).sum())} non-finite value(s) (NaN or inf)")
            out.append(x)
        a, b = out
    return a, b


def accuracy(y_true, y_pred):
    """Fraction of equal entries."""
    a, b = _pair(y_true, y_pred)
    return float(np.mean(a == b))


def _prf(tp, fp, fn):
    """Precision, recall, F1 (arrays or scalars), 0 where a denominator is 0."""
    tp, fp, fn = (np.asarray(x, np.float64) for x in (tp, fp, fn))
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(tp + fp > 0, tp / (tp + fp), 0.0)
        r = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
        f = np.where(2 * tp + fp + fn > 0, 2 * tp / (2 * tp + fp + fn), 0.0)
    return p, r, f


def f1_score(y_true, y_pred, average="binary", pos_label=1, labels=None):
    """F1 as scikit-learn's ``f1_score``: average "binary" (of pos_label), "macro" (unweighted mean
    over `labels`, default the labels present in y_true or y_pred) or "micro" (from the summed
    counts; equals accuracy for single-label data over all labels)."""
    a, b = _pair(y_true, y_pred)
    if average == "binary":
        present = set(np.unique(a).tolist()) | set(np.unique(b).tolist())
        if len(present - {pos_label}) > 1:
            raise InputError(f"average='binary' needs two classes, got {sorted(present)}; use average='macro'")
        labels = [pos_label]
    elif average not in ("macro", "micro"):
        raise InputError(f"average must be 'binary', 'macro' or 'micro', got {average!r}")
    if labels is None:
        labels = np.union1d(a, b)
    labels = np.asarray(labels)
    tp = np.array([np.sum((a == c) & (b == c)) for c in labels])
    fp = np.array([np.sum((a != c) & (b == c)) for c in labels])
    fn = np.array([np.sum((a == c) & (b != c)) for c in labels])
    if average == "micro":
        return float(_prf(tp.sum(), fp.sum(), fn.sum())[2])
    return float(np.mean(_prf(tp, fp, fn)[2]))


def matthews_corrcoef(y_true, y_pred):
    """Matthews correlation (multi-class: Gorodkin's R_K, as scikit-learn); 0.0 when either side is
    constant."""
    a, b = _pair(y_true, y_pred)
    classes, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
    ia, ib = inv[:a.size], inv[a.size:]
    C = np.zeros((classes.size, classes.size), np.float64)
    np.add.at(C, (ia, ib), 1.0)
    t, p = C.sum(axis=1), C.sum(axis=0)
    c, s = np.trace(C), C.sum()
    cov_ytyp = c * s - t @ p
    cov_ypyp = s * s - p @ p
    cov_ytyt = s * s - t @ t
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def mse(y_true, y_pred):
    """Mean squared error."""
    a, b = _pair(y_true, y_pred, "scores")
    return float(np.mean((a - b) ** 2))


def pearson(x, y):
    """Pearson's r (NaN when an input is constant, as SciPy; at least 2 values)."""
    a, b = _pair(x, y, "scores")
    if a.size < 2:
        raise InputError("Pearson's r needs at least 2 values")
    a, b = a - a.mean(), b - b.mean()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return float("nan")
    return float(np.clip(np.dot(a / na, b / nb), -1.0, 1.0))


def rank(x):
    """Ranks from 1, ties given their average rank (SciPy's rankdata, method 'average')."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.concatenate([[True], xs[1:] != xs[:-1]])
    group = np.cumsum(starts) - 1
    first = np.nonzero(starts)[0]
    ends = np.append(first[1:], x.size)   # exclusive
    avg = (first + 1 + ends) / 2.0        # mean of ranks first+1 .. ends
    out = np.empty(x.size, np.float64)
    out[order] = avg[group]
    return out


def spearman(x, y):
    """Spearman's rho: Pearson's r of the ranks (ties averaged); NaN when an input is constant."""
    a, b = _pair(x, y, "scores")
    return pearson(rank(a), rank(b))


# ---- multi-label -------------------------------------------------------------------------------------
def _multilabel(y_true, y_score):
    t, s = np.asarray(y_true), np.asarray(y_score)
    if t.ndim != 2 or s.shape != t.shape:
        raise InputError(f"multi-label y_true and y_score must be (N, K) arrays of one shape, got {t.shape} and {s.shape}")
    if t.dtype.kind not in "iufb" or s.dtype.kind not in "iufb":
        raise InputTypeError(f"multi-label arrays must be numbers, got {t.dtype} and {s.dtype}")
    if not np.isin(t, (0, 1)).all():
        raise InputError("multi-label y_true must be 0/1 (a multi-hot matrix)")
    s = s.astype(np.float64)
    if not np.isfinite(s).all():
        raise InputError("y_score has non-finite values (NaN or inf)")
    return t.astype(bool), s


def _thresholds(threshold, K):
    th = np.asarray(threshold, np.float64)
    if th.ndim == 0:
        th = np.full(K, float(th))
    if th.shape != (K,):
        raise InputError(f"threshold must be a number or one per label ({K}), got shape {th.shape}")
    return th


def multilabel_f1(y_true, y_score, threshold=0.5):
    """Micro and macro F1 of multi-label predictions: label k is predicted where
    ``y_score[:, k] > threshold`` (a number, or one per label; for logits use 0.0, or
    sigmoid them first). y_score may already be 0/1 predictions.
    Returns {"micro_f1", "macro_f1", "micro_precision", "micro_recall", "per_label_f1" (K,)};
    macro averages every label column (scikit-learn's ``average="macro"``)."""
    t, s = _multilabel(y_true, y_score)
    pred = s > _thresholds(threshold, t.shape[1])
    tp = (t & pred).sum(axis=0)
    fp = (~t & pred).sum(axis=0)
    fn = (t & ~pred).sum(axis=0)
    p, r, f = _prf(tp.sum(), fp.sum(), fn.sum())
    per = _prf(tp, fp, fn)[2]
    return {"micro_f1": float(f), "macro_f1": float(per.mean()) if per.size else 0.0,
            "micro_precision": float(p), "micro_recall": float(r), "per_label_f1": per}


def best_thresholds(y_true, y_score):
    """Per-label thresholds that maximise each label's F1 on (y_true, y_score) -- tune them on dev
    data, then pass them to ``multilabel_f1(..., threshold=...)``. For each label the best set of
    top-scored examples is found; the threshold lies halfway between its lowest score and the next
    lower one (ties of F1 go to the smaller set). A label with no true example gets its highest
    score (nothing predicted). (K,) float64."""
    t, s = _multilabel(y_true, y_score)
    N, K = t.shape
    out = np.empty(K, np.float64)
    for k in range(K):
        order = np.argsort(-s[:, k], kind="mergesort")
        sc, tr = s[order, k], t[order, k]
        cut = np.nonzero(np.append(sc[1:] != sc[:-1], True))[0]   # the last index of each run of equal scores
        f = 2 * np.cumsum(tr)[cut] / (cut + 1 + tr.sum())
        if N == 0 or f.max() <= 0:
            out[k] = sc[0] if N else 0.5
            continue
        i = cut[int(np.argmax(f))]
        if i + 1 == N:
            out[k] = np.nextafter(sc[i], -np.inf)
        else:
            mid = (sc[i] + sc[i + 1]) / 2
            out[k] = mid if sc[i + 1] <= mid < sc[i] else sc[i + 1]
    return out


# ---- entities (seqeval / conlleval) -------------------------------------------------------------------
def _split_tag(tag):
    """seqeval's default (prefix) reading: 'B-PER' -> ('B', 'PER'); 'O' -> ('O', '_')."""
    return tag[0], (tag[1:].split("-", maxsplit=1)[-1] or "_")


def _end_of_chunk(prev_tag, tag, prev_type, type_):
    return (prev_tag in ("E", "S")
            or (prev_tag in ("B", "I") and tag in ("B", "S", "O"))
            or (prev_tag not in ("O", ".") and prev_type != type_))


def _start_of_chunk(prev_tag, tag, prev_type, type_):
    return (tag in ("B", "S")
            or (prev_tag in ("E", "S", "O") and tag in ("E", "I"))
            or (tag not in ("O", ".") and prev_type != type_))


def entities(tags):
    """The entities of one sentence's tags as (type, first, last) word indices, by seqeval's default
    rules (conlleval's): an entity starts at B-, or at I- after O or after another type, and ends
    before O, B- or another type. Tags may be IOB2 (or IOB1 / IOE / IOBES: E- and S- end them)."""
    out = []
    prev_tag, prev_type, begin = "O", "", 0
    for i, chunk in enumerate(list(tags) + ["O"]):
        if not isinstance(chunk, str) or not chunk:
            raise InputTypeError(f"tags must be non-empty strings such as 'B-PER' or 'O', got {chunk!r}")
        tag, type_ = _split_tag(chunk)
        if _end_of_chunk(prev_tag, tag, prev_type, type_):
            out.append((prev_type, begin, i - 1))
        if _start_of_chunk(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return out


def _tag_lists(seqs, label_names, name):
    if isinstance(seqs, str) or (len(seqs) and isinstance(seqs[0], str)):
        raise InputTypeError(f"{name} must be one list of tags per sentence (a list of lists)")
    out = []
    for i, s in enumerate(seqs):
        s = list(s)
        if s and not isinstance(s[0], str):
            if label_names is None:
                raise InputTypeError(f"{name}[{i}] holds class ids; pass label_names to turn them into tags")
            try:
                s = [label_names[int(x)] for x in s]
            except (IndexError, ValueError, TypeError):
                raise InputError(f"{name}[{i}] has ids outside label_names ({len(label_names)} names)") from None
        out.append(s)
    return out


def entity_scores(true_tags, pred_tags, label_names=None):
    """Entity-level precision, recall and F1 as seqeval computes them in its default mode (the
    conlleval rules of ``entities``): an entity counts when type, first and last word all match.

    true_tags, pred_tags: one list of tags per sentence ('B-PER', 'I-PER', 'O', ...), or of class
    ids with ``label_names``; the sentences must have equal lengths.
    Returns {"precision", "recall", "f1" (micro over all entities), "macro_f1" (mean over types),
    "accuracy" (per word), "per_type": {type: {"precision", "recall", "f1", "support"}}}; 0.0 where a
    denominator is 0 (no entities predicted or none true)."""
    t = _tag_lists(true_tags, label_names, "true_tags")
    p = _tag_lists(pred_tags, label_names, "pred_tags")
    if len(t) != len(p):
        raise InputError(f"true_tags has {len(t)} sentences but pred_tags has {len(p)}")
    te, pe = set(), set()
    words = same = 0
    for i, (a, b) in enumerate(zip(t, p)):
        if len(a) != len(b):
            raise InputError(f"sentence {i}: {len(a)} true tags but {len(b)} predicted; predictions must be per word "
                             "(words_from_tokens maps sub-token predictions back to words)")
        te.update((ty, i, s, e) for ty, s, e in entities(a))
        pe.update((ty, i, s, e) for ty, s, e in entities(b))
        words += len(a)
        same += sum(x == y for x, y in zip(a, b))
    if words == 0:
        raise InputError("no tags: every sentence is empty")
    per = {}
    for ty in sorted({e[0] for e in te | pe}):
        ti = {e for e in te if e[0] == ty}
        pi = {e for e in pe if e[0] == ty}
        pr, rc, f = _prf(len(ti & pi), len(pi - ti), len(ti - pi))
        per[ty] = {"precision": float(pr), "recall": float(rc), "f1": float(f), "support": len(ti)}
    pr, rc, f = _prf(len(te & pe), len(pe - te), len(te - pe))
    return {"precision": float(pr), "recall": float(rc), "f1": float(f),
            "macro_f1": float(np.mean([v["f1"] for v in per.values()])) if per else 0.0,
            "accuracy": same / words, "per_type": per}


# ---- GLUE ----------------------------------------------------------------------------------------------
GLUE_METRICS = {
    "cola": ("matthews_corrcoef",), "sst2": ("accuracy",), "mrpc": ("accuracy", "f1"), "qqp": ("accuracy", "f1"),
    "stsb": ("pearson", "spearman"), "mnli": ("accuracy",), "qnli": ("accuracy",), "rte": ("accuracy",),
    "wnli": ("accuracy",),
}


def glue_metrics(task, y_true, y_pred):
    """The metrics GLUE reports for `task` (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli; dashes
    and case ignored): {name: value}. MRPC and QQP's F1 is of class 1; STS-B takes scores."""
    key = str(task).lower().replace("-", "").replace("_", "")
    if key not in GLUE_METRICS:
        raise InputError(f"unknown GLUE task {task!r}; known: {', '.join(GLUE_METRICS)}")
    fns = {"accuracy": accuracy, "f1": f1_score, "matthews_corrcoef": matthews_corrcoef,
           "pearson": pearson, "spearman": spearman}
    return {m: fns[m](y_true, y_pred) for m in GLUE_METRICS[key]}
