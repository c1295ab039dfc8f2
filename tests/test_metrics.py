"""fasttran.metrics against the references people use: scikit-learn (accuracy, F1, Matthews, multi-
label F1), SciPy (Pearson, Spearman with ties) and seqeval (entity-level scores on real CoNLL-2003
valid tags with perturbed predictions, and on random tag soup that breaks IOB2), plus the edge cases
where a value is undefined."""
import warnings

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics as skm

import fasttran
from fasttran import metrics as M
from fasttran.readers import read_conll

from conftest import conll_file


@pytest.mark.parametrize("seed", range(6))
def test_classification_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 300)), int(rng.integers(2, 6))
    a, b = rng.integers(0, k, n), rng.integers(0, k, n)
    if seed % 2:
        b = np.where(rng.random(n) < 0.7, a, b)   # mostly right
    assert M.accuracy(a, b) == pytest.approx(skm.accuracy_score(a, b), abs=1e-15)
    assert M.matthews_corrcoef(a, b) == pytest.approx(skm.matthews_corrcoef(a, b), abs=1e-12)
    for avg in ("macro", "micro"):
        assert M.f1_score(a, b, average=avg) == pytest.approx(skm.f1_score(a, b, average=avg, zero_division=0), abs=1e-12)
    a2, b2 = a % 2, b % 2
    assert M.f1_score(a2, b2) == pytest.approx(skm.f1_score(a2, b2, zero_division=0), abs=1e-12)
    assert M.matthews_corrcoef(a2, b2) == pytest.approx(skm.matthews_corrcoef(a2, b2), abs=1e-12)
    assert M.f1_score(a, b, average="macro", labels=range(k + 1)) == pytest.approx(
        skm.f1_score(a, b, average="macro", labels=list(range(k + 1)), zero_division=0), abs=1e-12)


def test_classification_edge_cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for a, b in (([1, 1, 1], [1, 1, 1]), ([0, 0, 0], [0, 0, 0]), ([0, 1, 0], [0, 0, 0]), ([1, 1], [0, 0])):
            assert M.matthews_corrcoef(a, b) == skm.matthews_corrcoef(a, b)          # 0.0 when a side is constant
            assert M.f1_score(a, b) == skm.f1_score(a, b, zero_division=0)           # 0.0: no positive predicted
    assert M.glue_metrics("CoLA", [1, 0, 1], [1, 0, 0]) == {"matthews_corrcoef": pytest.approx(0.5)}
    assert set(M.glue_metrics("mrpc", [1, 0], [1, 1])) == {"accuracy", "f1"}
    with pytest.raises(fasttran.InputTypeError, match="holds floats; class metrics take class ids"):
        M.accuracy([0.2, 0.8], [0, 1])
    with pytest.raises(fasttran.InputError, match="y_true has 2 values but y_pred has 3"):
        M.f1_score([0, 1], [0, 1, 1])
    with pytest.raises(fasttran.InputError, match="needs two classes"):
        M.f1_score([0, 1, 2], [0, 1, 2])
    with pytest.raises(fasttran.InputError, match="empty"):
        M.accuracy([], [])
    with pytest.raises(fasttran.InputError, match="unknown GLUE task 'sts'"):
        M.glue_metrics("sts", [1.0], [1.0])


@pytest.mark.parametrize("seed", range(6))
def test_regression_metrics_match_scipy(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(3, 400))
    x = rng.normal(size=n)
    y = 0.6 * x + rng.normal(size=n)
    if seed % 2:   # STS-B-like scores: many ties
        x, y = np.round(x * 2) / 2, np.round(y * 4) / 4
    assert M.pearson(x, y) == pytest.approx(scipy.stats.pearsonr(x, y)[0], abs=1e-12)
    assert M.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0], abs=1e-12)
    assert np.array_equal(M.rank(x), scipy.stats.rankdata(x))
    assert M.mse(x, y) == pytest.approx(skm.mean_squared_error(x, y), rel=1e-12)
    assert M.glue_metrics("STS-B", x, y)["spearman"] == M.spearman(x, y)


def test_regression_edge_cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # SciPy warns; fasttran returns the same NaN quietly
        ref = scipy.stats.pearsonr([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])[0]
    assert np.isnan(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(M.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
        assert np.isnan(M.spearman([2, 2, 2], [1, 2, 3]))
    assert M.pearson([1, 2], [2, 4]) == pytest.approx(1.0) and M.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    with pytest.raises(fasttran.InputError, match="non-finite"):
        M.pearson([1.0, np.nan], [1.0, 2.0])
    with pytest.raises(fasttran.InputError, match="at least 2 values"):
        M.pearson([1.0], [1.0])
    with pytest.raises(fasttran.InputTypeError, match="must be numbers"):
        M.mse(["a"], ["b"])


@pytest.mark.parametrize("seed", range(4))
def test_multilabel_matches_sklearn(seed):
    rng = np.random.default_rng(200 + seed)
    n, k = int(rng.integers(1, 200)), int(rng.integers(1, 8))
    y = (rng.random((n, k)) < 0.3).astype(np.float32)
    scores = np.clip(0.5 * y + 0.7 * rng.random((n, k)), 0, 1)
    th = rng.uniform(0.2, 0.8, k) if seed % 2 else 0.5
    pred = (scores > th).astype(int)
    got = M.multilabel_f1(y, scores, threshold=th)
    for avg in ("micro", "macro"):
        assert got[f"{avg}_f1"] == pytest.approx(skm.f1_score(y, pred, average=avg, zero_division=0), abs=1e-12)
    assert got["micro_precision"] == pytest.approx(skm.precision_score(y, pred, average="micro", zero_division=0))
    assert np.allclose(got["per_label_f1"], skm.f1_score(y, pred, average=None, zero_division=0))
    # tuned thresholds: each label's F1 is the best any threshold gives
    best = M.best_thresholds(y, scores)
    tuned = M.multilabel_f1(y, scores, threshold=best)["per_label_f1"]
    for j in range(k):
        cands = np.concatenate([scores[:, j], scores[:, j] - 1e-9, [scores[:, j].max() + 1]])
        top = max(skm.f1_score(y[:, j], scores[:, j] > c, zero_division=0) for c in cands)
        assert tuned[j] == pytest.approx(top, abs=1e-12)


def test_multilabel_edge_cases():
    y = np.zeros((3, 2))
    assert M.multilabel_f1(y, np.zeros((3, 2)))["macro_f1"] == 0.0     # nothing true, nothing predicted
    assert M.multilabel_f1([[1, 0]], [[3.0, -2.0]], threshold=0.0)["micro_f1"] == 1.0   # logits at 0
    with pytest.raises(fasttran.InputError, match=r"one per label \(2\)"):
        M.multilabel_f1(y, y, threshold=[0.5, 0.5, 0.5])
    with pytest.raises(fasttran.InputError, match="0/1"):
        M.multilabel_f1([[2, 0]], [[1, 0]])


def seqeval_scores(true, pred):
    from seqeval.metrics import accuracy_score, classification_report, f1_score, precision_score, recall_score
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # seqeval warns on zero division (and returns 0)
        return (precision_score(true, pred), recall_score(true, pred), f1_score(true, pred),
                f1_score(true, pred, average="macro"), accuracy_score(true, pred),
                classification_report(true, pred, output_dict=True, zero_division=0))


def assert_like_seqeval(true, pred):
    got = M.entity_scores(true, pred)
    p, r, f, macro, acc, report = seqeval_scores(true, pred)
    assert (got["precision"], got["recall"], got["f1"]) == pytest.approx((p, r, f), abs=1e-12)
    assert got["macro_f1"] == pytest.approx(macro, abs=1e-12) and got["accuracy"] == pytest.approx(acc, abs=1e-12)
    types = {t for t in report if not t.endswith(" avg")}
    assert set(got["per_type"]) == types
    for t in types:
        g, ref = got["per_type"][t], report[t]
        assert (g["precision"], g["recall"], g["f1"], g["support"]) == pytest.approx(
            (ref["precision"], ref["recall"], ref["f1-score"], ref["support"]), abs=1e-12), t
    return got


def test_entities_match_seqeval_on_conll_valid():
    """Gold CoNLL-2003 valid tags against predictions with 10% of the tags replaced at random
    (so invalid IOB2 -- I- after O, a type switch inside an entity -- occurs, which seqeval's
    default mode still reads by the conlleval rules), then with only B/I swaps and type swaps."""
    valid = read_conll(conll_file("valid"))
    names = valid.label_names
    true = [[names[i] for i in l] for l in valid.labels]
    rng = np.random.default_rng(7)
    pred = [[names[rng.integers(len(names))] if rng.random() < 0.1 else t for t in s] for s in true]
    got = assert_like_seqeval(true, pred)
    assert 0.5 < got["f1"] < 0.95 and got["per_type"]["PER"]["support"] == 1842
    swapped = [[("I" + t[1:] if t[0] == "B" else "B" + t[1:]) if t != "O" and rng.random() < 0.05 else t for t in s]
               for s in true]
    assert_like_seqeval(true, swapped)
    perfect = M.entity_scores(valid.labels, valid.labels, label_names=names)   # class ids + names
    assert perfect["f1"] == 1.0 and perfect["accuracy"] == 1.0


def test_entities_random_tag_soup_match_seqeval():
    rng = np.random.default_rng(11)
    tags = ["O", "B-A", "I-A", "B-B", "I-B", "E-A", "S-B"]
    for _ in range(40):
        true = [[tags[j] for j in rng.integers(0, len(tags), rng.integers(0, 12))] for _ in range(rng.integers(1, 6))]
        pred = [[tags[j] for j in rng.integers(0, len(tags), len(s))] for s in true]
        if sum(map(len, true)):
            assert_like_seqeval(true, pred)


def test_entity_edge_cases():
    none = M.entity_scores([["O", "O"]], [["O", "O"]])   # no entities anywhere: 0.0, as seqeval
    assert (none["precision"], none["recall"], none["f1"], none["per_type"]) == (0.0, 0.0, 0.0, {})
    assert M.entities(["B-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-ORG"]) == [
        ("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 4), ("ORG", 5, 5)]
    with pytest.raises(fasttran.InputError, match="sentence 0: 2 true tags but 1 predicted"):
        M.entity_scores([["O", "B-PER"]], [["O"]])
    with pytest.raises(fasttran.InputTypeError, match="one list of tags per sentence"):
        M.entity_scores(["O", "B-PER"], ["O", "B-PER"])
    with pytest.raises(fasttran.InputTypeError, match="pass label_names"):
        M.entity_scores([[0, 1]], [[0, 1]])
