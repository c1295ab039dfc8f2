"""Text to the encoder's inputs, and token predictions back to words (what Encoder.tokenize and tokenize_words run).

Sentence pairs and pre-split words go through the checkpoint's tokenizer.json (the `tokenizers`
library) exactly as transformers' tokenizer does for the same checkpoint: ``[CLS] a [SEP] b [SEP]``
with token types 0 / 1, truncation ``longest_first``, padding to the longest. For token
classification each word's first sub-token carries the word's label and every other position
(special tokens, later sub-tokens, padding) carries -100, the value losses ignore (as transformers'
token-classification examples do); ``words_from_tokens`` maps per-token predictions back to words.
"""
import collections
import numbers

import numpy as np

from .errors import InputError, InputTypeError

IGNORE = -100   # the label of positions a loss and the metrics skip (torch's CrossEntropyLoss default)


def text_list(texts, name):
    """A list of str from one string or an iterable of strings; anything else is refused by name."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, (bytes, bytearray)):
        raise InputTypeError(f"{name} must be strings, got bytes; decode them first (.decode('utf-8'))")
    try:
        out = list(texts)
    except TypeError:
        raise InputTypeError(f"{name} must be a string or a list of strings, got {type(texts).__name__}") from None
    for i, t in enumerate(out):
        if not isinstance(t, str):
            hint = " (missing text: use '' for an empty one)" if t is None else ""
            raise InputTypeError(f"{name}[{i}] is {type(t).__name__} ({t!r:.40}), expected a string{hint}")
    return out


def word_lists(words):
    """Sentences as lists of words (str); a flat list of strings or a plain string is refused (it is
    ambiguous: one sentence of words, or several unsplit texts)."""
    if isinstance(words, str) or (isinstance(words, (list, tuple)) and words and isinstance(words[0], str)):
        raise InputTypeError(
            "words must be a list of sentences, each a list of words (e.g. [['EU', 'rejects', 'German', 'call']]); "
            "for one sentence pass [words], for whole texts use tokenize(texts)")
    try:
        sents = list(words)
    except TypeError:
        raise InputTypeError(f"words must be a list of lists of words, got {type(words).__name__}") from None
    out = []
    for i, s in enumerate(sents):
        if isinstance(s, str) or not isinstance(s, (list, tuple, np.ndarray)):
            raise InputTypeError(f"words[{i}] must be a list of words, got {type(s).__name__} ({s!r:.40})")
        s = list(s)
        for j, w in enumerate(s):
            if not isinstance(w, str):
                raise InputTypeError(f"words[{i}][{j}] is {type(w).__name__} ({w!r:.40}), expected a string")
        out.append(s)
    return out


def word_labels(labels, sentences):
    """Per-word integer labels, one sequence per sentence, each as long as its sentence."""
    try:
        labels = list(labels)
    except TypeError:
        raise InputTypeError(f"labels must be one list of integer labels per sentence, got {type(labels).__name__}") from None
    if len(labels) != len(sentences):
        raise InputError(f"labels has {len(labels)} sentences but words has {len(sentences)}: give one label list per sentence")
    out = []
    for i, (lab, ws) in enumerate(zip(labels, sentences)):
        if isinstance(lab, (str, numbers.Number)) or not hasattr(lab, "__len__"):
            raise InputTypeError(f"labels[{i}] must be a list with one label per word, got {type(lab).__name__} ({lab!r:.40})")
        if len(lab) != len(ws):
            raise InputError(
                f"labels[{i}] has {len(lab)} labels for {len(ws)} words: token labels must be aligned to the words, "
                "one per word (sub-tokens are labelled by tokenize_words)")
        a = np.asarray(lab) if len(lab) else np.zeros(0, np.int64)
        if a.dtype.kind in "USO":
            bad = next((x for x in lab if not isinstance(x, (numbers.Integral, np.integer))), None)
            raise InputTypeError(
                f"labels[{i}] holds {type(bad).__name__} values such as {bad!r}; tokenize_words takes integer class "
                "ids: map tag names to ids first (fasttran.readers gives ids and label_names)")
        if a.dtype.kind == "b" or a.dtype.kind not in "iu" or a.ndim != 1:
            raise InputTypeError(f"labels[{i}] must be integer class ids, got {a.dtype} values of shape {a.shape}")
        a = a.astype(np.int64)
        if ((a < 0) & (a != IGNORE)).any():
            raise InputError(f"labels[{i}] has the negative label {int(a[(a < 0) & (a != IGNORE)][0])}; "
                             f"class ids are >= 0 ({IGNORE} marks a word to ignore)")
        out.append(a)
    return out


_Fields = collections.namedtuple("WordTokens", "input_ids attention_mask token_type_ids labels word_ids")


class WordTokens(_Fields):
    """``Encoder.tokenize_words``'s result: unpacks as ``(input_ids, attention_mask, token_type_ids,
    labels, word_ids)``, all (B, T) int64 arrays (``labels`` None when no labels were given).

    labels: the word's label on its first sub-token, -100 elsewhere (special tokens, the word's
    other sub-tokens, padding). word_ids: the position's word index in its sentence, -1 where
    there is none (special tokens, padding), as transformers' ``word_ids()`` with -1 for None.
    num_words: (B,) the words each sentence had. missing_words: (B,) how many of them have no
    first sub-token in the output -- cut off by truncation (max_length), or a word the tokenizer
    turns into nothing (an empty string, a lone control character); they get no label here and
    ``words_from_tokens`` gives them its ``fill`` value.
    """

    def __new__(cls, input_ids, attention_mask, token_type_ids, labels, word_ids, num_words, max_length):
        self = super().__new__(cls, input_ids, attention_mask, token_type_ids, labels, word_ids)
        self.num_words = num_words
        self.max_length = max_length
        self.missing_words = num_words - first_positions(word_ids).sum(axis=1)
        return self

    def __getnewargs__(self):   # pickle and copy keep the word counts
        return (*self, self.num_words, self.max_length)

    def __repr__(self):
        B, T = self.input_ids.shape
        cut = int(self.missing_words.sum())
        miss = (f", {cut} word(s) without a token in {int((self.missing_words > 0).sum())} sentence(s) "
                f"(max_length={self.max_length})") if cut else ""
        return (f"WordTokens({B} sentences, {int(self.num_words.sum())} words, {T} positions, "
                f"labels={'yes' if self.labels is not None else 'no'}{miss})")


def first_positions(word_ids):
    """(B, T) bool: the positions holding a word's first sub-token."""
    w = np.asarray(word_ids)
    prev = np.concatenate([np.full((w.shape[0], 1), -1, w.dtype), w[:, :-1]], axis=1)
    return (w >= 0) & (w != prev)


def pad_encodings(encs, pad_id, labels=None, types=True):
    """tokenizers Encodings -> (ids, mask, types) int64 padded to the longest; with labels (per-word
    ids per sentence) also (token labels, word ids). types=False: zeros (an architecture whose
    tokenizer gives no token types: RoBERTa's, DistilBERT's)."""
    with_types = types
    T = max((len(e.ids) for e in encs), default=0)
    B = len(encs)
    ids = np.full((B, T), pad_id, np.int64)
    mask = np.zeros((B, T), np.int64)
    types = np.zeros((B, T), np.int64)
    for i, e in enumerate(encs):
        n = len(e.ids)
        ids[i, :n] = e.ids
        mask[i, :n] = e.attention_mask
        if with_types:
            types[i, :n] = e.type_ids
    if labels is None:
        return ids, mask, types
    wids = np.full((B, T), -1, np.int64)
    for i, e in enumerate(encs):
        wids[i, :len(e.ids)] = [-1 if w is None else w for w in e.word_ids]
    tok_labels = None
    if labels is not False:
        tok_labels = np.full((B, T), IGNORE, np.int64)
        first = first_positions(wids)
        for i, lab in enumerate(labels):
            tok_labels[i, first[i]] = lab[wids[i, first[i]]]
    return ids, mask, types, tok_labels, wids


def words_from_tokens(token_predictions, word_ids, num_words=None, fill=None):
    """Per-token predictions back to words: for each sentence, the prediction at each word's first
    sub-token (the position ``tokenize_words`` labelled), in word order.

    token_predictions: (B, T) or (B, T, ...) array-like (class ids, scores, logits...).
    word_ids: (B, T) ints, -1 where no word (``WordTokens.word_ids``), or the ``WordTokens`` itself
    (then ``num_words`` comes from it).
    num_words: (B,) the sentences' word counts; words past the last one seen (cut off by
    truncation) are then returned as ``fill``. Without it, a sentence's list ends at its last
    word that has a token. A word with no token inside the sentence (an empty string) is ``fill``
    as well.
    Returns a list of B lists (Python scalars for (B, T) input, arrays for (B, T, K)).
    """
    if isinstance(word_ids, WordTokens):
        if num_words is None:
            num_words = word_ids.num_words
        word_ids = word_ids.word_ids
    w = np.asarray(word_ids)
    if w.ndim != 2 or w.dtype.kind not in "iu":
        raise InputTypeError(f"word_ids must be a (batch, seq) integer array, got {w.dtype} of shape {w.shape}")
    p = np.asarray(token_predictions)
    if p.ndim < 2 or p.shape[:2] != w.shape:
        raise InputError(f"token_predictions has shape {p.shape}; its first two dimensions must be word_ids' {w.shape}")
    if num_words is not None:
        num_words = np.asarray(num_words)
        if num_words.shape != (w.shape[0],):
            raise InputError(f"num_words must have one count per sentence ({w.shape[0]}), got shape {num_words.shape}")
        if (w.max(axis=1, initial=-1) >= num_words).any():
            i = int(np.nonzero(w.max(axis=1, initial=-1) >= num_words)[0][0])
            raise InputError(f"sentence {i}: word_ids name word {int(w[i].max())} but num_words says {int(num_words[i])} words")
    first = first_positions(w)
    out = []
    for i in range(w.shape[0]):
        n = int(num_words[i]) if num_words is not None else int(w[i].max(initial=-1)) + 1
        words = [fill] * n
        for t in np.nonzero(first[i])[0]:
            v = p[i, t]
            words[w[i, t]] = v.item() if p.ndim == 2 else v
        out.append(words)
    return out
