"""A fine-tuned model (the encoder with its trained top layers, and the task head) written in the
layouts the Hugging Face tools load, so that it goes straight into a transformers pipeline:

    head                                   directory loads in                      as
    classification / regression /          AutoModelForSequenceClassification     BertForSequenceClassification
      multi-label, BERT's pooler, CLS        (problem_type, id2label)
    token classification                   AutoModelForTokenClassification        BertForTokenClassification
    QA spans                               AutoModelForQuestionAnswering          BertForQuestionAnswering
    any other sequence head (mean          sentence_transformers.SentenceTransformer: Transformer -> Pooling ->
      pooling, or no pooler)                 [Dense tanh (the pooler)] -> Dense (the classifier); encode() gives
                                             the logits

Another architecture's encoder goes out in its own classes (DistilBertForSequenceClassification,
ModernBertForTokenClassification ...), where the class's dense layer before its classifier is the
head's shape (fasttran.architectures' head_shapes; ModernBERT's classes also pool by mean).
BERT's classes put a classifier on the pooler of the [CLS] token only: a head on mean-pooled
states, or one without the pooler, has no transformers class, so it goes out in the layout
sentence-transformers loads (its Pooling and Dense modules, the classic module names every
version reads). Every directory also holds the tokenizer files and fasttran's own head.json +
head.safetensors, so Encoder.from_pretrained and the Trainer read it back.
"""
import dataclasses
import json
import os

from . import _C
from .architectures import BERT
from .errors import InputError, UnsupportedModelError
from .heads.base import Head, describe_shape
from .safetensors_io import write_safetensors

#: sentence-transformers' Dense activation of a head's dense layer (a shape without a LayerNorm)
_ST_ACTS = {"tanh": "torch.nn.modules.activation.Tanh", "relu": "torch.nn.modules.activation.ReLU",
            "gelu": "torch.nn.modules.activation.GELU"}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def layout_of(head, encoder=None):
    """'sequence-classification', 'token-classification', 'question-answering', ... or
    'sentence-transformers': where export() puts this head (the head says: Head.export_layout;
    over `encoder`, in its architecture's classes)"""
    return (head.export_layout() if encoder is None else _layout(encoder, head))[0]


def how_to_load(head, path, encoder=None):
    """One line telling a user what loads an export of `head` (over `encoder`) in `path`, and with what."""
    layout, arch, _, _ = head.export_layout() if encoder is None else _layout(encoder, head)
    if arch is None:
        return (f"{path}: sentence-transformers layout -- transformers has no class for this head ({head.pooling} "
                f"pooling{'' if 'pooler.dense.weight' in head.tensors else ', no pooler'}); load it with "
                f"sentence_transformers.SentenceTransformer({str(path)!r}).encode(texts), which gives the logits "
                "(train with pooling='cls' and pooler=True for transformers' AutoModelForSequenceClassification)")
    auto = "AutoModelFor" + arch.split("For", 1)[1]
    return f"{path}: transformers.{auto}.from_pretrained({str(path)!r}) ({arch}, the head in place)"


def _write_json(path, obj):
    _C.atomic_write(path, [json.dumps(obj, indent=2).encode()])


def _bert_config(encoder, architecture, extra):
    cfg = {k: v for k, v in encoder._raw_config.items() if not k.startswith("_")}
    c = encoder.config
    cfg.update({k: c[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
                                  "layer_norm_eps", "pad_token_id")})
    cfg.update({"architectures": [architecture], "model_type": "bert", "position_embedding_type": "absolute",
                "torch_dtype": "float32"})
    cfg.update(extra)
    return cfg


def _own_config(encoder, architecture, extra):
    """another architecture's config: its own, as it came, naming the class"""
    cfg = {k: v for k, v in encoder._raw_config.items() if not k.startswith("_")}
    cfg.update({"architectures": [architecture], "torch_dtype": "float32"})
    cfg.update(extra)
    return cfg


def _inference(shape):
    """a DenseShape as inference runs it: the input dropout (training's) set aside"""
    return None if shape is None else dataclasses.replace(shape, input_dropout=False)


def _mismatch(arch, layout, head, cfg):
    """why the architecture's class for `layout` cannot hold `head` (None: it can): its dense layer's
    shape (fasttran.architectures' head_shapes) or its pooling"""
    want = _inference(arch.head_shape(layout, cfg))
    have = _inference(head.shape if head.dense else None)
    cls = arch.hf_class[:-len("Model")]
    if want != have:
        return (f"{cls}'s {layout} head runs {describe_shape(want)}, this head {describe_shape(have)} (a head made "
                f"for this encoder -- Trainer(..., pooler=True), make_head(..., encoder=) -- has its shape)")
    if layout in ("sequence-classification", "multiple-choice") and head.pooling != "cls" and not arch.head_pooling_key:
        return f"{cls}'s {layout} class scores the first token; this head pools by {head.pooling}"
    return None


def _layout(encoder, head):
    """head.export_layout() in the encoder's architecture: RobertaForSequenceClassification ... for
    BertFor*, where the class's head is this head's shape; a sequence head whose class cannot hold
    it goes out as sentence-transformers' layout, any other such head is refused with the reason"""
    arch = encoder.architecture
    layout, cls, extra, names = head.export_layout(mean=arch.head_pooling_key is not None)
    if cls is None:
        return layout, cls, extra, names
    how = _mismatch(arch, layout, head, encoder._raw_config)
    if how is None:
        if arch is BERT:
            return layout, cls, extra, names
        own, how = arch.export_class(layout, cls, names)
        if own is not None:
            return layout, own, dict(extra, **arch.head_config(layout, head)), how
    if layout == "sequence-classification" and head.shape.norm is None and not head.shape.per_token:
        return Head.export_layout(head)
    raise UnsupportedModelError(f"export of a {layout} head is not supported for {arch.hf_class}: {how}")


def export(path, encoder, head, pooling="mean"):
    """Write `encoder` (the fine-tuned one: frozen layers + trained top layers) with `head` into
    directory `path` (see the module's table; another architecture's encoder goes out in its own
    classes: RobertaForSequenceClassification's head is fasttran's pooler head, dense + tanh +
    out_proj on the first token). Returns the layout written."""
    encoder.architecture.require("export")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    layout, arch, extra, names = _layout(encoder, head)
    state = {k: v for k, v in encoder.state_dict().items() if not k.startswith("pooler.")}
    heads = head.state_dict()
    if arch is None:
        encoder.save_pretrained(path)   # the Transformer module: a BertModel
        mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        C = head.hidden_size
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        _write_json(os.path.join(path, "1_Pooling", "config.json"), {
            "word_embedding_dimension": C, "pooling_mode_cls_token": head.pooling == "cls",
            "pooling_mode_mean_tokens": head.pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False})
        dense = []
        if "pooler.dense.weight" in heads:
            dense.append((heads["pooler.dense.weight"], heads.get("pooler.dense.bias"), _ST_ACTS[head.shape.act]))
        dense.append((heads["classifier.weight"], heads["classifier.bias"], "torch.nn.modules.linear.Identity"))
        for k, (w, b, act) in enumerate(dense, start=2):
            sub = f"{k}_Dense"
            os.makedirs(os.path.join(path, sub), exist_ok=True)
            _write_json(os.path.join(path, sub, "config.json"), {
                "in_features": int(w.shape[1]), "out_features": int(w.shape[0]), "bias": b is not None,
                "activation_function": act})
            write_safetensors(os.path.join(path, sub, "model.safetensors"),
                              {"linear.weight": w, **({} if b is None else {"linear.bias": b})}, {"format": "pt"})
            mods.append({"idx": k, "name": str(k), "path": sub, "type": "sentence_transformers.models.Dense"})
        _write_json(os.path.join(path, "modules.json"), mods)
        _write_json(os.path.join(path, "sentence_bert_config.json"),
                    {"max_seq_length": int(getattr(encoder, "max_seq_length", 512) or 512), "do_lower_case": False})
        _write_json(os.path.join(path, "config_sentence_transformers.json"),
                    {"__version__": {"fasttran": _C.version}, "prompts": {}, "default_prompt_name": None,
                     "similarity_fn_name": None})
    else:
        tensors = {encoder.architecture.exported_name(k): v for k, v in state.items()}
        tensors.update({hf: heads[name] for hf, name in names.items()})
        write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
        _write_json(os.path.join(path, "config.json"), (_bert_config if encoder.architecture is BERT else _own_config)(
            encoder, arch, extra))
    if encoder.path:
        base = encoder.path if os.path.isdir(encoder.path) else os.path.dirname(encoder.path)
        for name in _TOKENIZER_FILES:
            f = os.path.join(base, name)
            if os.path.isfile(f):
                with open(f, "rb") as fh:
                    _C.atomic_write(os.path.join(path, name), [fh.read()])
    write_safetensors(os.path.join(path, "head.safetensors"), heads, {"format": "fasttran-head"})
    _write_json(os.path.join(path, "head.json"), {"head": head.config(), "pooling": pooling, "layout": layout})
    return layout


def fine_tuned_encoder(encoder, top):
    """A CPU copy of `encoder` with the trained layers of `top` (a TopLayers) in place, or the encoder
    itself when nothing was trained"""
    if top is None:
        return encoder
    from .encoder import Encoder
    clone = Encoder(encoder._raw_config, device="cpu")
    clone._core.copy_weights_from(encoder._core)
    top.export_to(clone)
    clone.path = encoder.path
    if encoder.tokenizer is not None:
        clone.tokenizer = encoder.tokenizer
    return clone


def check_exportable(encoder, what="export()"):
    if encoder is None:
        raise InputError(f"{what} needs the encoder the features came from: the cache has none (open it with "
                         "ActivationCache.open(path, encoder=...)), or pass export(path, encoder=...)")
