"""The model compression works on: a fine-tuned encoder with its task head and pooling (what
`Trainer.export` writes), its data, its own file format and the export to transformers' layout --
each architecture's own (BertModel, RobertaModel, DistilBertModel, ElectraModel ...: config keys and
tensor names through fasttran/architectures.py).

    >>> model = TaskModel.load("finetuned")               # a Trainer.export directory, or a compressed model
    >>> dev = TaskData.from_texts(model, texts, labels)    # tokenized once, batched by length
    >>> model.evaluate(dev)                                # {'accuracy', 'f1', 'loss', 'examples'}
    >>> model.save("small")                                # atomic files, sizes and CRC-32C recorded, checked on load
"""
import json
import os

import numpy as np

from ..architectures import BERT
from ..encoder import ATTENTION_MODES, STRUCTURE_KEYS, Encoder, vocab_map
from ..errors import CheckpointError, CheckpointNotFoundError, InputError, InputTypeError, UnsupportedError
from ..heads import ClassificationHead, Head
from ..safetensors_io import crc32c, read_safetensors, write_file, write_safetensors

#: the record of a compressed model directory (files with size and CRC-32C, plan, origin, metrics)
RECORD = "compression.json"
FORMAT = "fasttran-compressed-1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


class TaskData:
    """Tokenized examples with labels, kept ragged and served in batches of similar length (so
    little padding). `ids`, `mask`, `types`: (n, T) int arrays padded on the right; `labels` (n,)."""

    def __init__(self, ids, mask, types, labels):
        ids, mask = np.asarray(ids), np.asarray(mask)
        types = np.zeros_like(ids) if types is None else np.asarray(types)
        labels = np.asarray(labels)
        if ids.ndim != 2 or mask.shape != ids.shape or types.shape != ids.shape:
            raise InputError(f"input_ids, attention_mask and token_type_ids must be (n, T) arrays of one shape, got "
                             f"{ids.shape}, {mask.shape}, {types.shape}")
        if labels.shape != (len(ids),) or labels.dtype.kind not in "iu":
            raise InputError(f"labels must be ({len(ids)},) integers, got {labels.shape} {labels.dtype}")
        self.lengths = mask.astype(bool).sum(1).astype(np.int64)
        if len(ids) == 0 or (self.lengths == 0).any():
            raise InputError("every example needs at least one real token (and there must be examples)")
        if not (mask.astype(bool) == (np.arange(mask.shape[1])[None, :] < self.lengths[:, None])).all():
            raise InputError("attention_mask must be right-padded (ones, then zeros)")
        self.ids, self.types = ids.astype(np.int64), types.astype(np.int64)
        self.labels = labels.astype(np.int64)
        self._order = np.argsort(self.lengths, kind="stable")

    @classmethod
    def from_texts(cls, model, texts, labels, pairs=None, max_length=128):
        """Tokenize `texts` (and, for a pair task, `pairs`: the second sentences) with the model's
        tokenizer (token type 1 for the second sentence, as BERT was trained)."""
        tok = (model.encoder if isinstance(model, TaskModel) else model).tokenizer
        if tok is None:
            raise UnsupportedError("the model has no tokenizer (tokenizer.json): pass token ids to TaskData()")
        texts = list(texts)
        if pairs is not None and len(pairs) != len(texts):
            raise InputError(f"{len(texts)} first sentences but {len(pairs)} second ones")
        enc = model.encoder if isinstance(model, TaskModel) else model
        tok.enable_truncation(max_length=int(max_length))
        try:
            encs = tok.encode_batch(texts if pairs is None else list(zip(texts, pairs)))
        finally:
            tok.enable_truncation(max_length=enc.max_seq_length)
        segments = enc.architecture.token_types == "segments"   # (else zeros, as the encoder takes them)
        T = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), T), np.int64)
        mask, types = np.zeros_like(ids), np.zeros_like(ids)
        for i, e in enumerate(encs):
            n = len(e.ids)
            ids[i, :n], mask[i, :n] = e.ids, 1
            if segments:
                types[i, :n] = e.type_ids
        return cls(ids, mask, types, labels)

    def __len__(self):
        return len(self.labels)

    def subset(self, index):
        """The examples at `index` (an array of positions), as a new TaskData."""
        index = np.asarray(index, np.int64)
        T = int(self.lengths[index].max())
        mask = (np.arange(T)[None, :] < self.lengths[index][:, None]).astype(np.int64)
        return TaskData(self.ids[index, :T], mask, self.types[index, :T], self.labels[index])

    def split(self, n, seed=0):
        """(a random n examples, the rest): e.g. a selection set held out of the training data."""
        perm = np.random.default_rng(seed).permutation(len(self))
        return self.subset(np.sort(perm[:n])), self.subset(np.sort(perm[n:]))

    def batches(self, batch_size=64):
        """(positions, ids, mask, types) padded to each batch's longest, in length order."""
        for k in range(0, len(self), batch_size):
            idx = self._order[k:k + batch_size]
            T = int(self.lengths[idx].max())
            mask = (np.arange(T)[None, :] < self.lengths[idx][:, None]).astype(np.int64)
            yield idx, self.ids[idx, :T], mask, self.types[idx, :T]

    def padded(self):
        """(ids, mask, types) of every example, padded to the longest (the Trainer's inputs)."""
        T = int(self.lengths.max())
        mask = (np.arange(T)[None, :] < self.lengths[:, None]).astype(np.int64)
        return self.ids[:, :T], mask, self.types[:, :T]

    def __repr__(self):
        return (f"TaskData({len(self)} examples, {int(self.lengths.sum())} tokens, "
                f"labels {np.bincount(self.labels).tolist()})")


def metrics(logits, labels):
    """accuracy, F1 (binary: of class 1; else macro), mean cross-entropy"""
    pred = logits.argmax(1)
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    loss = float(-logp[np.arange(len(labels)), labels].mean())
    K = logits.shape[1]
    f1s = []
    for c in ([1] if K == 2 else range(K)):
        tp = int(((pred == c) & (labels == c)).sum())
        f1s.append(2 * tp / max(2 * tp + int(((pred == c) & (labels != c)).sum()) +
                                int(((pred != c) & (labels == c)).sum()), 1))
    return {"accuracy": float((pred == labels).mean()), "f1": float(np.mean(f1s)), "loss": loss,
            "examples": int(len(labels))}


class TaskModel:
    """A fine-tuned encoder, its classification head and pooling: what compression changes.

    `origin` maps the current structure to the model it was compressed from (per current layer: the
    original layer, its heads and FFN groups), so plans and reports speak of the original's parts."""

    def __init__(self, encoder, head, pooling="mean", origin=None, info=None):
        if not isinstance(encoder, Encoder):
            raise InputTypeError(f"encoder must be a fasttran.Encoder, got {type(encoder).__name__}")
        encoder.architecture.require("compression")
        emb = encoder.config.get("embedding_size", encoder.hidden_size)
        if emb != encoder.hidden_size:
            raise UnsupportedError(
                f"compression of an encoder whose embeddings are projected (embedding_size {emb} != hidden_size "
                f"{encoder.hidden_size}, {encoder.architecture.hf_class}) is not supported")
        if not isinstance(head, ClassificationHead):
            raise InputTypeError(f"compression takes a classification head, got {type(head).__name__}")
        if head.hidden_size != encoder.hidden_size:
            raise InputError(f"the head takes width {head.hidden_size}, the encoder gives {encoder.hidden_size}")
        if pooling not in ("mean", "cls"):
            raise InputError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        self.encoder, self.head, self.pooling = encoder, head, pooling
        self.origin = origin or identity_origin(encoder)
        self.info = dict(info or {})
        if origin is None:   # the model compression starts from: its structure names the parts
            self.info.setdefault("original_structure", {k: v for k, v in self.structure.items()})

    # ---- structure ---------------------------------------------------------------------------
    @property
    def structure(self):
        """{"layer_heads", "layer_intermediate", "head_attention", "sign_match_keys"} of the encoder"""
        return self.encoder.structure

    @property
    def num_layers(self):
        return self.encoder.num_layers

    @property
    def head_size(self):
        c = self.encoder.config
        return c["hidden_size"] // c["num_attention_heads"]

    @property
    def weights(self):
        """'float32', or 'int8' (the layers' projections and maybe the word embeddings in int8)"""
        return "int8" if self.encoder.dtype == "int8" else "float32"

    @property
    def size_bytes(self):
        """Bytes of the model's weights as stored (encoder + head), what `save` writes besides JSON:
        4 per float32 value; an int8 tensor 1 per value and 4 per row for its scales."""
        return 4 * self.head.num_parameters + self.encoder.weight_bytes

    # ---- inference ---------------------------------------------------------------------------
    def pooled(self, ids, mask, types, **masks):
        """(B, C) pooled encoder output; `masks`: Encoder.forward_masked's (significance)"""
        return self.encoder.forward_masked(ids, mask, types, layer=self.num_layers, pooling=self.pooling, **masks)

    def logits(self, data, batch_size=64, **masks):
        """(n, K) logits of every example of `data` (TaskData), in its order"""
        out = np.empty((len(data), self.head.num_labels), np.float32)
        for idx, ids, mask, types in data.batches(batch_size):
            out[idx] = self.head.step(self.pooled(ids, mask, types, **masks))[0]
        return out

    def evaluate(self, data, batch_size=64, **masks):
        """{'accuracy', 'f1', 'loss', 'examples'} on `data`"""
        return metrics(self.logits(data, batch_size, **masks), data.labels)

    def predict(self, data, batch_size=64):
        return self.logits(data, batch_size).argmax(1)

    # ---- files -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path):
        """A model directory: what `Trainer.export` writes (config.json, model.safetensors, head.safetensors,
        head.json, tokenizer files) or what `save` writes (the same and compression.json, whose sizes and
        CRC-32C are checked before each file is read)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"model directory {path!r} does not exist")
        record = None
        rec_path = os.path.join(path, RECORD)
        if os.path.isfile(rec_path):
            record = _read_record(rec_path)
        for name in ("config.json", "model.safetensors", "head.safetensors", "head.json"):
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointNotFoundError(
                    f"{path}: no {name}; compression takes a fine-tuned model with its head, as Trainer.export "
                    "(train_layers >= 1) or TaskModel.save writes it")
        files = record["files"] if record else {}
        for name in ("config.json", "head.json"):
            if name in files:
                _check_file(os.path.join(path, name), files[name])
        try:
            with open(os.path.join(path, "config.json")) as f:
                raw = json.load(f)
            with open(os.path.join(path, "head.json")) as f:
                head_cfg = json.load(f)
        except ValueError as e:
            raise CheckpointError(f"{path}: not valid JSON: {e}") from e
        enc = Encoder(raw, _source=os.path.join(path, "config.json"))
        weights = files.get("model.safetensors", {})
        if raw.get("fasttran_weights", "float32") == "int8":   # int8 tensors with their scales (state_dict)
            if not isinstance(raw.get("fasttran_int8_embeddings"), bool):
                raise CheckpointError(f"{path}/config.json: an int8 model needs fasttran_int8_embeddings (true/false)")
            enc.quantize(embeddings=raw["fasttran_int8_embeddings"], inplace=True)
            enc.load_state_dict(read_safetensors(os.path.join(path, "model.safetensors"), weights or None))
        elif raw.get("fasttran_weights", "float32") != "float32":
            raise CheckpointError(f"{path}/config.json: fasttran_weights {raw['fasttran_weights']!r}; expected "
                                  "'float32' or 'int8'")
        else:
            enc.load_weights(os.path.join(path, "model.safetensors"), expect=weights or None)
        enc.path = os.path.abspath(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            enc.load_tokenizer(path)
        if not isinstance(head_cfg, dict) or not isinstance(head_cfg.get("head"), dict):
            raise CheckpointError(f"{path}/head.json: expected {{'head': {{...}}, 'pooling': ...}}")
        head = Head.from_config(head_cfg["head"])
        head.load_state_dict(read_safetensors(os.path.join(path, "head.safetensors"), files.get("head.safetensors")))
        origin = record.get("origin") if record else None
        model = cls(enc, head, head_cfg.get("pooling", "mean"), origin=origin,
                    info=record.get("info") if record else None)
        if origin is not None:
            check_origin(model, origin, rec_path)
        return model

    def save(self, path):
        """Write the model into directory `path`: config.json (with the compressed structure),
        model.safetensors, head.safetensors, head.json, the tokenizer files, and compression.json
        (format, origin, plan and metrics in `info`, each file's size and CRC-32C). Every file is
        written atomically by the project's writer; compression.json last, so a directory without
        it (an interrupted save) is not taken for a compressed model. Returns `path`."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        files = {}
        rec_path = os.path.join(path, RECORD)
        if os.path.exists(rec_path):
            os.remove(rec_path)   # the old record must not vouch for the new files while they are written
        if self.weights == "int8":   # the int8 tensors with their per-row scales, as state_dict gives them
            files["model.safetensors"] = write_safetensors(os.path.join(path, "model.safetensors"),
                                                           self.encoder.state_dict(), {"format": "fasttran-int8"})
        else:
            files["model.safetensors"] = self.encoder.save_weights(os.path.join(path, "model.safetensors"))
        files["head.safetensors"] = write_safetensors(os.path.join(path, "head.safetensors"), self.head.state_dict(),
                                                      {"format": "fasttran-head"})
        c, arch = self.encoder.config, self.encoder.architecture
        cfg = {k: v for k, v in self.encoder.raw_config.items() if not k.startswith("_")}
        if arch is BERT:
            cfg.update({"architectures": ["BertModel"], "model_type": "bert",
                        "num_hidden_layers": c["num_hidden_layers"], "add_pooling_layer": self.encoder.has_pooler})
        else:   # its own config and names (save_weights), as its base model's checkpoint
            cfg.update({"architectures": [arch.hf_class], arch.config_key("num_hidden_layers"): c["num_hidden_layers"],
                        "add_pooling_layer": self.encoder.has_pooler})
        for k in STRUCTURE_KEYS:
            cfg.pop(k, None)
            if k in c:
                cfg[k] = c[k]
        cfg.pop("fasttran_weights", None)
        cfg.pop("fasttran_int8_embeddings", None)
        if self.weights == "int8":
            cfg["fasttran_weights"] = "int8"
            cfg["fasttran_int8_embeddings"] = self.encoder.int8_embeddings
        for name, obj in (("config.json", cfg), ("head.json", {"head": self.head.config(), "pooling": self.pooling})):
            files[name] = _write_json(os.path.join(path, name), obj)
        tok_dir = self.encoder.tokenizer_dir
        for name in _TOKENIZER_FILES if tok_dir else ():
            src = os.path.join(tok_dir, name)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, name)):
                with open(src, "rb") as f:
                    write_file(os.path.join(path, name), f.read())
        _write_json(rec_path, {"format": FORMAT, "files": files, "origin": self.origin, "info": _jsonable(self.info)})
        return path

    def __repr__(self):
        s = self.structure
        return (f"TaskModel({self.num_layers} layers, heads {s['layer_heads']}, FFN {s['layer_intermediate']}, "
                + ("int8 weights, " if self.weights == "int8" else "")
                + f"{self.size_bytes / 1e6:.1f} MB, {self.head.num_labels} labels, {self.pooling} pooling)")


# ---- origin: the current structure in the original model's numbering ------------------------------
def identity_origin(encoder):
    """An uncompressed model's origin: every layer, head and neuron its own."""
    s = encoder.structure
    return {"layers": list(range(encoder.num_layers)),
            "heads": [list(range(n)) for n in s["layer_heads"]],
            "neurons": [list(range(n)) for n in s["layer_intermediate"]],
            "ffn_group_size": None}


def check_origin(model, origin, where):
    s = model.structure
    try:
        ok = (len(origin["layers"]) == model.num_layers and
              [len(h) for h in origin["heads"]] == s["layer_heads"] and
              [len(r) for r in origin["neurons"]] == s["layer_intermediate"])
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: its 'origin' does not describe this model's structure")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _with_tokenizer_of(model, encoder):
    """`model` (a TaskModel loaded from a temporary export) tokenizing as `encoder` does, with no path of
    its own (the export is gone)"""
    model.encoder.path = None
    model.encoder.use_tokenizer_of(encoder)
    return model


def _write_json(path, obj):
    data = json.dumps(_jsonable(obj), indent=1, sort_keys=True).encode()
    return write_file(path, data)


def _check_file(path, rec):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != int(rec["bytes"]) or crc32c(data) != int(rec["crc32c"]):
        raise CheckpointError(f"{path} does not match its record in {RECORD} (size {len(data)} vs {rec['bytes']}, or "
                              "its CRC-32C): the file was changed or damaged after it was saved")


def _read_record(path):
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or not isinstance(rec.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} record")
    for name, r in rec["files"].items():
        if not isinstance(r, dict) or not isinstance(r.get("bytes"), int) or not isinstance(r.get("crc32c"), int):
            raise CheckpointError(f"{path}: the record of {name} is not {{'bytes': int, 'crc32c': int}}")
    return rec


# ---- transformers' layout ---------------------------------------------------------------------
def export_transformers(model, path):
    """Write the encoder in the layout transformers' base model class of its architecture loads
    (`BertModel`, `RobertaModel`, `DistilBertModel` ...: config.json in its keys, model.safetensors in
    its names, tokenizer files) with outputs equal to fasttran's, and the head beside it (head.safetensors,
    head.json). transformers 5 has no per-layer head counts or FFN widths (prune_heads and head_mask
    are gone), so every layer gets the uniform shapes back: a pruned head's Q, K, V rows and biases and
    its columns of the output projection are zeros (its attention output is exactly zero, whatever its
    softmax), a pruned FFN neuron's rows of the first projection, its bias and its column of the second
    are zeros (GELU(0) = 0). Removed layers are simply absent. The zeros cost their full size and time
    in transformers: the file and the GEMMs are those of the unpruned layers. Sign-matching heads have
    no transformers equivalent and are refused. A pruned vocabulary gets every row back (a removed id's
    row is a copy of the unknown token's: what fasttran reads for it). An int8 model's weights are written dequantized
    (scale x q, float32): transformers then computes what fasttran's int8 model computes up to the
    int8 activations' rounding. Returns `path`."""
    model.encoder.architecture.require("compressed_export")   # BERT's layer names, written out below
    s = model.structure
    if any(m != 0 for m in s["head_attention"]):
        raise UnsupportedError("this model has sign-matching attention heads, which transformers cannot express; "
                               "export the model before applying sign matching, or keep it in fasttran's format")
    enc = model.encoder
    c = enc.config
    C, NH = c["hidden_size"], c["num_attention_heads"]
    hs, I = C // NH, max(max(s["layer_intermediate"], default=0), c["intermediate_size"])
    sd = enc.state_dict()
    for name in [k for k in sd if k + "_scale" in sd]:   # int8: the weights dequantized (scale x q)
        sd[name] = sd.pop(name + "_scale")[:, None] * sd[name].astype(np.float32)
    vmap, _ = vocab_map(c)
    if vmap is not None:   # a pruned vocabulary: every id its row again (removed ids: the unknown token's)
        sd["embeddings.word_embeddings.weight"] = sd["embeddings.word_embeddings.weight"][vmap]
    out = {k: v for k, v in sd.items() if not k.startswith("encoder.layer.")}
    for l in range(enc.num_layers):
        p = f"encoder.layer.{l}."
        A, Il = s["layer_heads"][l] * hs, s["layer_intermediate"][l]
        for w in ("query", "key", "value"):
            W = np.zeros((C, C), np.float32)
            W[:A] = sd[p + f"attention.self.{w}.weight"]
            b = np.zeros(C, np.float32)
            b[:A] = sd[p + f"attention.self.{w}.bias"]
            out[p + f"attention.self.{w}.weight"], out[p + f"attention.self.{w}.bias"] = W, b
        Wo = np.zeros((C, C), np.float32)
        Wo[:, :A] = sd[p + "attention.output.dense.weight"]
        out[p + "attention.output.dense.weight"] = Wo
        W1, b1, W2 = np.zeros((I, C), np.float32), np.zeros(I, np.float32), np.zeros((C, I), np.float32)
        W1[:Il], b1[:Il], W2[:, :Il] = sd[p + "intermediate.dense.weight"], sd[p + "intermediate.dense.bias"], \
            sd[p + "output.dense.weight"]
        out[p + "intermediate.dense.weight"], out[p + "intermediate.dense.bias"] = W1, b1
        out[p + "output.dense.weight"] = W2
        for k in ("attention.output.dense.bias", "attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
                  "output.dense.bias", "output.LayerNorm.weight", "output.LayerNorm.bias"):
            out[p + k] = sd[p + k]
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    arch = enc.architecture
    if arch is not BERT:   # the base model's own names
        out = {arch.checkpoint_name(k): v for k, v in out.items()}
    write_safetensors(os.path.join(path, "model.safetensors"), out, {"format": "pt"})
    cfg = {k: v for k, v in enc.raw_config.items() if not k.startswith("_") and k not in STRUCTURE_KEYS}
    if arch is BERT:
        cfg.update({"architectures": ["BertModel"], "model_type": "bert", "num_hidden_layers": enc.num_layers,
                    "intermediate_size": I, "num_attention_heads": NH, "torch_dtype": "float32"})
    else:
        cfg.pop("fasttran_weights", None)
        cfg.pop("fasttran_int8_embeddings", None)
        cfg.update({"architectures": [arch.hf_class], arch.config_key("num_hidden_layers"): enc.num_layers,
                    arch.config_key("intermediate_size"): I, arch.config_key("num_attention_heads"): NH,
                    "torch_dtype": "float32"})
    _write_json(os.path.join(path, "config.json"), cfg)
    write_safetensors(os.path.join(path, "head.safetensors"), model.head.state_dict(), {"format": "fasttran-head"})
    _write_json(os.path.join(path, "head.json"), {"head": model.head.config(), "pooling": model.pooling})
    tok_dir = enc.tokenizer_dir
    for name in _TOKENIZER_FILES if tok_dir else ():
        src = os.path.join(tok_dir, name)
        if os.path.isfile(src):
            with open(src, "rb") as f:
                write_file(os.path.join(path, name), f.read())
    return path


def attention_mode_names(model):
    """per layer, the attention mode name of each head"""
    s, out, k = model.structure, [], 0
    for n in s["layer_heads"]:
        out.append([ATTENTION_MODES[m] for m in s["head_attention"][k:k + n]])
        k += n
    return out


def export_onnx(model, path, opset=17):
    """The model (encoder, pooling and head: input_ids, attention_mask, token_type_ids -> logits) as an
    ONNX file for ONNX Runtime, through the transformers layout (export_transformers: pruned parts
    zero-filled, sign matching refused) and torch.onnx's TorchScript exporter; batch and sequence
    axes dynamic. Needs torch, transformers and onnx. Returns `path`."""
    model.encoder.architecture.require("compressed_export")
    try:
        import torch
        from transformers import AutoModel
    except ImportError:
        from ..errors import MissingDependencyError
        raise MissingDependencyError("ONNX export needs torch and transformers: pip install 'fasttran[test]'") from None
    import tempfile
    W = torch.tensor(model.head.tensors["classifier.weight"])
    b = torch.tensor(model.head.tensors["classifier.bias"])
    pooler = None
    if "pooler.dense.weight" in model.head.tensors:
        pooler = (torch.tensor(model.head.tensors["pooler.dense.weight"]), torch.tensor(model.head.tensors["pooler.dense.bias"]))
    cls = model.pooling == "cls"
    types = model.encoder.architecture.token_types != "none"   # (DistilBERT's model takes no token types)

    class Wrap(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            kw = {"token_type_ids": token_type_ids} if types else {}
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
            if not types:   # the input stays in the graph, unused
                h = h + 0 * token_type_ids[:, :1, None].to(h.dtype)
            if cls:
                x = h[:, 0]
            else:
                m = attention_mask.to(h.dtype).unsqueeze(-1)
                x = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
            if pooler is not None:
                x = torch.tanh(x @ pooler[0].T + pooler[1])
            return x @ W.T + b

    with tempfile.TemporaryDirectory(prefix="fasttran-onnx-") as d:
        export_transformers(model, d)
        bert = AutoModel.from_pretrained(d, attn_implementation="eager").eval()
    x = torch.ones((2, 8), dtype=torch.long)
    path = os.fspath(path)
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(Wrap(bert), (x, x, torch.zeros_like(x)), path, opset_version=opset, dynamo=False,
                          input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes,
                                        "logits": {0: "batch"}})
    return path


def quantize(model, embeddings=True):
    """A new TaskModel whose encoder keeps each layer's four projections (and, with `embeddings`, the
    word embeddings) in int8 with one scale per output channel (Encoder.quantize: int8 products on
    VNNI / AMX CPUs, exact int32 sums); the head stays float32. For inference: an int8 model cannot
    be trained or pruned further (prune first, then quantize)."""
    if model.weights == "int8":
        raise InputError("this model is int8 already")
    head = Head.from_config(model.head.config())
    head.load_state_dict(model.head.state_dict())
    info = dict(model.info)
    info["weights"] = {"dtype": "int8", "embeddings": bool(embeddings)}
    import copy
    return TaskModel(model.encoder.quantize(embeddings=embeddings), head, model.pooling,
                     origin=copy.deepcopy(model.origin), info=copy.deepcopy(info))


#: the tensors Encoder.quantize stores in int8 (the layers' four projections -- ModernBERT's fused Wqkv is one
#: qkv view --; the word embeddings too)
_INT8_SUFFIXES = ("attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
                  "attention.self.qkv.weight", "output.dense.weight", "intermediate.dense.weight")


def int8_size(model, embeddings=True, vocab_rows=None, int8=True):
    """The size_bytes `quantize(model, embeddings)` would have (float32 model; nothing is made), with
    `vocab_rows` word-embedding rows when given (a vocabulary still to be pruned); int8=False: in float32."""
    n = 4 * model.head.num_parameters
    for name, shape in model.encoder.parameter_shapes():
        values = int(np.prod(shape))
        q = name.endswith(_INT8_SUFFIXES) and name.startswith("encoder.layer.") or (
            embeddings and name == "embeddings.word_embeddings.weight")
        if name == "embeddings.word_embeddings.weight" and vocab_rows is not None:   # a vocabulary to be pruned
            values, shape = vocab_rows * int(shape[1]), (vocab_rows, shape[1])
        n += values + 4 * int(shape[0]) if q and int8 else 4 * values
    return n
