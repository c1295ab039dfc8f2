"""SQuAD v1.1 for extractive QA: loading, windowed features (question + context, max length
384, doc stride 128, answers mapped to token positions through the fast tokenizer's offsets),
span post-processing back to text, and the official exact-match / F1 (answer normalisation of
the official evaluate-v1.1.py, best over all reference answers)."""
import collections
import json
import re
import string

import numpy as np

from .errors import InputError


def load_squad(path):
    """Questions of a SQuAD v1.1 JSON file: list of dicts (id, question, context, answers,
    answer_starts), in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)["data"]
    except (KeyError, ValueError) as e:
        raise InputError(f"{path} is not a SQuAD JSON file: {e}") from None
    out = []
    for art in data:
        for para in art["paragraphs"]:
            ctx = para["context"]
            for qa in para["qas"]:
                out.append({"id": qa["id"], "question": qa["question"], "context": ctx,
                            "answers": [a["text"] for a in qa["answers"]],
                            "answer_starts": [int(a["answer_start"]) for a in qa["answers"]]})
    return out


class SquadFeatures:
    """Tokenised windows of SQuAD examples. One example gives one or more features (windows of
    the context with `doc_stride` tokens of overlap). Attributes: input_ids, attention_mask,
    token_type_ids (F, L) padded to the longest window; context_mask (F, L) 1 on the context's
    tokens (the tokenizer's sequence id 1: the pair's second text, no special token), which a QA
    head's softmax runs over; example_index (F,); offsets (F, L, 2) character spans in the context
    (-1 outside it); start_positions, end_positions (F,) token positions of the first reference
    answer, -1 where the window does not contain it.

    `tokenizer`: a `tokenizers.Tokenizer`, or an Encoder (its tokenizer; token_type_ids are then
    zeros where its architecture has no segment types: RoBERTa, XLM-R, CamemBERT, DistilBERT)."""

    def __init__(self, examples, tokenizer, max_length=384, doc_stride=128, max_query_length=64):
        if max_length <= doc_stride:
            raise InputError(f"max_length ({max_length}) must exceed doc_stride ({doc_stride})")
        arch = getattr(tokenizer, "architecture", None)
        if arch is not None:   # an Encoder
            tokenizer = tokenizer._need_tokenizer()
        segments = arch is None or arch.token_types == "segments"
        self.examples = list(examples)
        self.max_length, self.doc_stride = int(max_length), int(doc_stride)
        saved = tokenizer.truncation
        try:
            tokenizer.enable_truncation(max_length=max_length, stride=doc_stride, strategy="only_second")
            encs = tokenizer.encode_batch([(e["question"].lstrip(), e["context"]) for e in self.examples])
        finally:
            if saved:
                tokenizer.enable_truncation(**{k: saved[k] for k in ("max_length", "stride", "strategy", "direction")
                                               if k in saved})
            else:
                tokenizer.no_truncation()
        windows, ex_index = [], []
        for i, e in enumerate(encs):
            for w in [e] + list(e.overflowing):
                windows.append(w)
                ex_index.append(i)
        F, L = len(windows), max(len(w.ids) for w in windows)
        self.input_ids = np.zeros((F, L), np.int32)
        self.attention_mask = np.zeros((F, L), np.int32)
        self.token_type_ids = np.zeros((F, L), np.int32)
        self.context_mask = np.zeros((F, L), np.int32)
        self.offsets = np.full((F, L, 2), -1, np.int64)
        self.example_index = np.array(ex_index, np.int64)
        self.start_positions = np.full(F, -1, np.int64)
        self.end_positions = np.full(F, -1, np.int64)
        for f, w in enumerate(windows):
            n = len(w.ids)
            self.input_ids[f, :n] = w.ids
            self.attention_mask[f, :n] = 1
            if segments:
                self.token_type_ids[f, :n] = w.type_ids
            ctx = np.array([s == 1 for s in w.sequence_ids], bool)
            self.context_mask[f, :n] = ctx
            offs = np.array(w.offsets, np.int64)
            self.offsets[f, :n][ctx] = offs[ctx]
            ex = self.examples[ex_index[f]]
            if not ex["answers"]:
                continue
            a0 = ex["answer_starts"][0]
            a1 = a0 + len(ex["answers"][0])
            cidx = np.flatnonzero(ctx)
            if not len(cidx) or offs[cidx[0], 0] > a0 or offs[cidx[-1], 1] < a1:
                continue   # the answer is not (wholly) inside this window
            s = cidx[np.flatnonzero(offs[cidx, 0] <= a0)[-1]]
            e_ = cidx[np.flatnonzero(offs[cidx, 1] >= a1)[0]]
            self.start_positions[f], self.end_positions[f] = s, e_

    def __len__(self):
        return len(self.example_index)

    def subset(self, idx):
        """The features at `idx` (examples kept whole, so post-processing still works)."""
        idx = np.asarray(idx)
        out = object.__new__(SquadFeatures)
        out.__dict__.update(self.__dict__)
        for k in ("input_ids", "attention_mask", "token_type_ids", "context_mask", "offsets", "example_index",
                  "start_positions", "end_positions"):
            setattr(out, k, getattr(self, k)[idx])
        return out

    def with_answers(self):
        """Features whose window holds the answer: the ones a QA head trains on."""
        return self.subset(np.flatnonzero(self.start_positions >= 0))

    def postprocess(self, logits, n_best=20, max_answer_length=30):
        """Answer text per question id from per-feature logits (a list, one (2, n) array per
        feature, -inf outside the context): the best span over all windows of a question with
        start <= end, at most `max_answer_length` tokens, by start + end logit."""
        if len(logits) != len(self):
            raise InputError(f"got logits for {len(logits)} features, there are {len(self)}")
        best = {}
        for f, lg in enumerate(logits):
            s_log, e_log = lg[0], lg[1]
            n = len(s_log)
            starts = np.argsort(-s_log)[:n_best]
            ends = np.argsort(-e_log)[:n_best]
            ex_i = int(self.example_index[f])
            for s in starts:
                if not np.isfinite(s_log[s]):
                    continue
                for e in ends:
                    if e < s or e - s + 1 > max_answer_length or not np.isfinite(e_log[e]):
                        continue
                    score = float(s_log[s] + e_log[e])
                    if ex_i not in best or score > best[ex_i][0]:
                        best[ex_i] = (score, int(self.offsets[f, s, 0]), int(self.offsets[f, e, 1]))
        out = {}
        for i, ex in enumerate(self.examples):
            if i in best:
                _, a, b = best[i]
                out[ex["id"]] = ex["context"][a:b]
            elif i in set(self.example_index.tolist()):
                out[ex["id"]] = ""
        return out

    def __repr__(self):
        return (f"SquadFeatures(examples={len(self.examples)}, features={len(self)}, max_length={self.max_length}, "
                f"doc_stride={self.doc_stride}, with_answer={int((self.start_positions >= 0).sum())})")


# ---- official evaluation (evaluate-v1.1.py) ---------------------------------------------------------
def normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction, ground_truth):
    p, g = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(prediction, ground_truth):
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_metrics(predictions, examples):
    """{'exact_match', 'f1'} in percent over `examples` (every question counts; a missing
    prediction scores 0), each the best over the question's reference answers."""
    em = f1 = 0.0
    for ex in examples:
        pred = predictions.get(ex["id"], "")
        em += max(exact_match_score(pred, g) for g in ex["answers"])
        f1 += max(f1_score(pred, g) for g in ex["answers"])
    n = max(len(examples), 1)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n, "questions": len(examples)}
