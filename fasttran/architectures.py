"""The encoder architectures fasttran loads, declared once: one :class:`Architecture` entry each.

An entry says which Hugging Face ``model_type`` values it covers, how its config names the sizes,
and how its layers differ from BERT's: layer norm placement, position ids, token types, activation,
embedding projection, pooler, and the checkpoint's tensor names (mapped onto fasttran's parameter
table, whose names are BertModel's). Nothing outside this file asks which model type it has: code
reads the entry's fields (tests/test_kinds.py greps for model-type strings elsewhere).

An entry whose fields name something the C encoder does not implement is refused with that reason.
The C encoder runs BERT's post-LN layers and ModernBERT's (pre-LN, rotary positions, GeGLU, no biases,
local / global attention): its forward, and what stands on it (encode, the cache, heads trained on the
cache). The operations that run BERT's layer code besides the forward (training encoder layers, int8,
compression, export of task heads) are refused for other layers by one check, :meth:`Architecture.require`;
training the top layers, int8, bf16 / fp16 encoders and compression's model, files and int8 also run
ModernBERT's, and export writes its own classes (PRE_LN_OPERATIONS).
Each entry also says which dense layer its task classes run before their classifier (`head_shapes`:
fasttran.heads.DenseShape), so a head made for an encoder exports to the architecture's own class.
"""
import dataclasses
import re

from .errors import CheckpointError, UnsupportedModelError

#: a layer's parameters in fasttran's table (BertModel's names after "encoder.layer.<i>.")
LAYER_TENSORS = (
    "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
    "attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias",
    "attention.output.dense.weight", "attention.output.dense.bias",
    "attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
    "intermediate.dense.weight", "intermediate.dense.bias", "output.dense.weight", "output.dense.bias",
    "output.LayerNorm.weight", "output.LayerNorm.bias")
_TABLE_LAYER = "encoder.layer."
_WORDS = "embeddings.word_embeddings.weight"

# transformers.BertConfig's defaults, used when a field is absent (as transformers does)
_BERT_DEFAULTS = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512,
    "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one family of checkpoints maps onto fasttran's encoder."""
    name: str
    model_types: tuple                    # config.json model_type values it covers
    hf_class: str                         # transformers' base model class (export, messages)
    norm: str = "post"                    # "post": LN(x + f(x)) (BERT); "pre": x + f(LN(x)) (ModernBERT)
    positions: str = "absolute"           # "absolute" learned table; "rotary" (RoPE)
    position_ids: str = "index"           # "index": t; "after_padding": RoBERTa's padding_idx + 1 + count
    token_types: str = "segments"         # "segments": types from the tokenizer (A 0, B 1); "zero": a type
                                          # table read at 0 for every token; "none": no type table
    gated_activation: bool = False        # GeGLU / SwiGLU FFNs
    biases: bool = True                   # linear layers and LayerNorms with biases
    attention_window: bool = False        # per-layer local / global attention
    fused_qkv: bool = False               # Q, K, V in one (3C, C) tensor (fasttran's attention.self.qkv.weight)
    embedding_projection: bool = False    # embedding_size may differ from hidden_size (ELECTRA)
    pooler: bool = True                   # the base model has a pooler (dense + tanh on the first token)
    config_keys: dict = dataclasses.field(default_factory=dict)   # fasttran's key -> the config's key
    defaults: dict = dataclasses.field(default_factory=dict)      # config defaults besides BERT's
    fixed: dict = dataclasses.field(default_factory=dict)         # values the config cannot change
    layer_prefix: str = _TABLE_LAYER      # the checkpoint's "encoder.layer." for layer tensors
    names: dict = dataclasses.field(default_factory=dict)         # fasttran's name -> the checkpoint's
    prefixes: tuple = ("",)               # what wrappers put before the names ("bert." ...): detected;
                                          # the first is what the architecture's *For* classes put
    #: export: {layout: {BertFor*'s tensor name: this architecture's}} where the head's tensors are named
    #: otherwise, or {layout: why no class of this architecture holds fasttran's head}
    heads: dict = dataclasses.field(default_factory=dict)
    #: the dense layer each *For* class runs before its classifier: {layout: fasttran.heads.DenseShape
    #: fields}; a layout not named has BERT's (sequence classification, multiple choice: the pooler,
    #: dense + tanh) or none (token classification, QA)
    head_shapes: dict = dataclasses.field(default_factory=dict)
    #: {layout: {DenseShape field: the config key that sets it}} (ModernBERT's classifier_activation ...)
    head_shape_keys: dict = dataclasses.field(default_factory=dict)
    #: {layout: {config key: value}} an export writes besides the shape's keys (ELECTRA's summary_type ...)
    head_configs: dict = dataclasses.field(default_factory=dict)
    #: the config key by which the *For* classes pool ("cls" / "mean"; ModernBERT's classifier_pooling),
    #: None: they read the first token
    head_pooling_key: str = None
    #: the config's (hidden, attention) dropout keys, and their value when absent (training encoder layers)
    dropout_keys: tuple = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    dropout_default: float = 0.1
    #: the config's key of the dropout on the embeddings' output -- the first layer's input, which is what
    #: the cache holds when every layer trains; None where the rows fasttran caches come after a projection
    #: that follows the dropout (ELECTRA's embeddings_project)
    embedding_dropout_key: str = "hidden_dropout_prob"

    def unsupported(self):
        """Why the C encoder cannot run this architecture ([] when it can)."""
        why = []
        if self.norm not in NORMS:
            why.append(f"{self.norm}-LN layers (fasttran's layers are post-LN or pre-LN)")
        if self.positions not in ("absolute", "rotary"):
            why.append(f"{self.positions} position embeddings (fasttran has learned absolute and rotary ones)")
        if self.norm == "post" and (self.positions != "absolute" or self.gated_activation or not self.biases or
                                    self.attention_window or self.fused_qkv):
            why.append("post-LN layers with ModernBERT's parts (rotary positions, GeGLU, no biases, windows)")
        return why

    def layer_differences(self):
        """How this architecture's layers differ from BERT's post-LN ones ([] for none)."""
        why = []
        if self.norm != "post":
            why.append(f"{self.norm}-LN layers")
        if self.positions != "absolute":
            why.append(f"{self.positions} position embeddings")
        if self.gated_activation:
            why.append("gated FFN activations (GeGLU)")
        if not self.biases:
            why.append("layers without biases")
        if self.attention_window:
            why.append("local / global attention windows")
        return why

    def require(self, operation):
        """The one capability check: raise UnsupportedModelError naming the architecture and `operation`
        when the operation (one of OPERATIONS) cannot run its layers."""
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; one of {sorted(OPERATIONS)}")
        if self.norm == "pre" and operation in PRE_LN_OPERATIONS and not self.unsupported():
            return   # the C code also has ModernBERT's pre-LN layer for these
        why = self.layer_differences()
        if why:
            raise UnsupportedModelError(
                f"{OPERATIONS[operation]} is not supported for {self.hf_class} (model_type {self.model_types[0]!r}) "
                f"yet: it runs BERT's post-LN layer code and {self.hf_class} has {'; '.join(why)}")

    # ---- tensor names ------------------------------------------------------------------------
    def checkpoint_name(self, name):
        """The checkpoint's name (without a wrapper prefix) of fasttran's tensor `name`."""
        if name in self.names:
            return self.names[name]
        if name.startswith(_TABLE_LAYER):
            i, _, rest = name[len(_TABLE_LAYER):].partition(".")
            return f"{self.layer_prefix}{i}.{self.names.get(rest, rest)}"
        return name

    @property
    def renames(self):
        """True when some tensor is named otherwise than in fasttran's (BertModel's) table."""
        return bool(self.names) or self.layer_prefix != _TABLE_LAYER

    def detect_prefix(self, tensor_names, source):
        """The wrapper prefix ("roberta.", "distilbert.", "" ...) of a checkpoint's tensor names."""
        key = self.checkpoint_name(_WORDS)
        found = sorted(n[:-len(key)] for n in tensor_names if n.endswith(key))
        if not found:
            raise CheckpointError(f"{source}: no tensor named '[prefix]{key}': not a {self.hf_class} checkpoint")
        return found[0]

    def layer_index_pattern(self, prefix):
        return re.compile(re.escape(prefix + self.layer_prefix) + r"(\d+)\.")

    # ---- export --------------------------------------------------------------------------------
    def export_class(self, layout, bert_class, bert_names):
        """(the architecture's class, {its tensor name: head tensor name}) for a head that exports as
        BERT's `bert_class` with `bert_names`; None, with the reason, where it has no such class."""
        how = self.heads.get(layout, {})
        if isinstance(how, str):
            return None, how
        wrapper = self.prefixes[0]
        names = {}
        for hf, ours in bert_names.items():
            hf = how.get(hf, hf)
            names[wrapper + hf[len("bert."):] if hf.startswith("bert.") else hf] = ours
        return self.hf_class[:-len("Model")] + bert_class[len("Bert"):], names

    def dense_from_pooler(self, layout):
        """Whether the architecture's class for `layout` runs the base model's pooler as its dense layer
        (BERT's sequence classification and multiple choice, RoBERTa's multiple choice): transformers
        then starts it from the checkpoint's pooler, and so do fasttran's heads (heads.make_head). The
        classes with a dense layer of their own (RoBERTa's classification head, DistilBERT's
        pre_classifier ...) start it at random."""
        how = self.heads.get(layout, {})
        return (self.pooler and layout in ("sequence-classification", "multiple-choice")
                and layout not in self.head_shapes and not isinstance(how, str)
                and "bert.pooler.dense.weight" not in how)

    def head_shape(self, layout, cfg=None, source="config.json"):
        """The fasttran.heads.DenseShape of the dense layer the architecture's class for `layout` runs
        before its classifier, under config `cfg`; None where the class has none (BERT's token and QA
        classes). An activation a class runs that fasttran's heads have not is refused, naming it."""
        from .heads.base import DenseShape
        if layout not in self.head_shapes:
            return DenseShape() if layout in ("sequence-classification", "multiple-choice") else None
        fields = dict(self.head_shapes[layout])
        keys = self.head_shape_keys.get(layout, {})
        for field, key in keys.items():
            if cfg is not None and key in cfg and cfg[key] is not None:
                fields[field] = cfg[key]
        act = fields.get("act", "tanh")
        if act not in _HEAD_ACTS:
            raise UnsupportedModelError(
                f"{source}: {keys.get('act', 'the activation')}={act!r}: {self.hf_class[:-5]}'s "
                f"{layout} head runs {act!r}, which fasttran's heads have not (they run {', '.join(_HEAD_ACTS)})")
        fields["act"] = _HEAD_ACTS[act]
        if not isinstance(fields.get("bias", True), bool):
            raise CheckpointError(f"{source}: {keys.get('bias', 'bias')} must be true or false, got "
                                  f"{fields['bias']!r}")
        return DenseShape(**fields)

    def head_config(self, layout, head):
        """The config entries an export of `head` in the architecture's class for `layout` writes: the
        shape's and pooling's keys, and the class's fixed ones."""
        out = dict(self.head_configs.get(layout, {}))
        acts = {v: k for k, v in _HEAD_ACTS.items()}
        for field, key in self.head_shape_keys.get(layout, {}).items():
            value = getattr(head.shape, field)
            out[key] = acts[value] if field == "act" else value
        if self.head_pooling_key and layout in ("sequence-classification", "multiple-choice"):
            out[self.head_pooling_key] = head.pooling
        return out

    def exported_name(self, name):
        """fasttran's encoder tensor `name` in the architecture's *For* classes"""
        return self.prefixes[0] + self.checkpoint_name(name)

    # ---- config --------------------------------------------------------------------------------
    def config_value(self, cfg, key):
        if key in self.fixed:
            return self.fixed[key]
        k = self.config_keys.get(key, key)
        return cfg.get(k, self.defaults.get(key, _BERT_DEFAULTS.get(key)))

    def config_key(self, key):
        """The config's name of fasttran's key `key` (DistilBERT's "n_layers" for "num_hidden_layers")."""
        return self.config_keys.get(key, key)

    def max_tokens(self, config):
        """Real tokens one sequence may hold: the positions minus those the padding id reserves."""
        off = config["pad_token_id"] + 1 if self.position_ids == "after_padding" else 0
        return config["max_position_embeddings"] - off


#: the layer norm placements the C encoder runs (ft_norm_placement)
NORMS = ("post", "pre")

#: operations that run BERT's post-LN layer code besides the forward: Architecture.require refuses them for
#: other layers (ModernBERT's), naming the operation
OPERATIONS = {
    "train_layers": "training encoder layers (Trainer(train_layers > 0), TopLayers)",
    "int8": "int8 quantization (dtype='int8', Encoder.quantize)",
    "compression": "compression (fasttran.compress)",
    "pruning": "pruning, sign matching, significance and the compression search (fasttran.compress apply / masks / "
               "significance / search)",
    "compressed_export": "transformers / ONNX export of a compressed model (fasttran.compress export_transformers / "
                         "export_onnx)",
    "export": "export of a task model (fasttran.export)",
    "reduced_precision": "half-precision and bfloat16 encoders",
}
#: the operations of OPERATIONS that also run ModernBERT's pre-LN layers (csrc/model/layer.c's pre-LN pair;
#: int8: csrc/model/encoder_int8.c quantizes the pre-LN layer's four projections; compression: a TaskModel's
#: evaluation, files and int8, its pruning and export staying refused as "pruning" / "compressed_export";
#: export writes them in ModernBERT's own classes; reduced precision: encoder.c's pre_ln_layer in the encoder's
#: storage type, bf16 / fp16 on CUDA, bf16 products with float32 activations on the CPU)
PRE_LN_OPERATIONS = ("train_layers", "int8", "compression", "export", "reduced_precision")

#: a config's activation names (transformers' ACT2FN) -> fasttran's head activations (fasttran._C.HEAD_ACTS)
_HEAD_ACTS = {"tanh": "tanh", "relu": "relu", "gelu": "gelu"}

_ROBERTA = dict(position_ids="after_padding", token_types="zero", prefixes=("roberta.", ""),
                defaults={"pad_token_id": 1},
                # RobertaClassificationHead drops the first token's row before its dense layer
                head_shapes={"sequence-classification": {"input_dropout": True}},
                # RobertaClassificationHead: dense + tanh + out_proj on the first token = fasttran's pooler head
                heads={"sequence-classification": {"bert.pooler.dense.weight": "classifier.dense.weight",
                                                   "bert.pooler.dense.bias": "classifier.dense.bias",
                                                   "classifier.weight": "classifier.out_proj.weight",
                                                   "classifier.bias": "classifier.out_proj.bias"}})

#: every architecture fasttran knows, supported or refused (with its reason)
ARCHITECTURES = (
    Architecture("bert", ("bert",), "BertModel", prefixes=("bert.", "")),
    Architecture("roberta", ("roberta",), "RobertaModel", **dict(_ROBERTA, defaults={"vocab_size": 50265,
                                                                                      "pad_token_id": 1})),
    Architecture("xlm-roberta", ("xlm-roberta",), "XLMRobertaModel", **_ROBERTA),
    Architecture("camembert", ("camembert",), "CamembertModel", **_ROBERTA),
    Architecture("distilbert", ("distilbert",), "DistilBertModel", token_types="none", pooler=False,
                 config_keys={"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                              "intermediate_size": "hidden_dim", "hidden_act": "activation"},
                 defaults={"num_hidden_layers": 6}, fixed={"layer_norm_eps": 1e-12, "type_vocab_size": 0},
                 dropout_keys=("dropout", "attention_dropout"), embedding_dropout_key="dropout",
                 layer_prefix="transformer.layer.", prefixes=("distilbert.", ""),
                 # DistilBertFor{SequenceClassification,MultipleChoice}: pre_classifier + ReLU + classifier on CLS
                heads={layout: {"bert.pooler.dense.weight": "pre_classifier.weight",
                                "bert.pooler.dense.bias": "pre_classifier.bias"}
                       for layout in ("sequence-classification", "multiple-choice")},
                head_shapes={"sequence-classification": {"act": "relu"}, "multiple-choice": {"act": "relu"}},
                 names={"attention.self.query.weight": "attention.q_lin.weight",
                        "attention.self.query.bias": "attention.q_lin.bias",
                        "attention.self.key.weight": "attention.k_lin.weight",
                        "attention.self.key.bias": "attention.k_lin.bias",
                        "attention.self.value.weight": "attention.v_lin.weight",
                        "attention.self.value.bias": "attention.v_lin.bias",
                        "attention.output.dense.weight": "attention.out_lin.weight",
                        "attention.output.dense.bias": "attention.out_lin.bias",
                        "attention.output.LayerNorm.weight": "sa_layer_norm.weight",
                        "attention.output.LayerNorm.bias": "sa_layer_norm.bias",
                        "intermediate.dense.weight": "ffn.lin1.weight", "intermediate.dense.bias": "ffn.lin1.bias",
                        "output.dense.weight": "ffn.lin2.weight", "output.dense.bias": "ffn.lin2.bias",
                        "output.LayerNorm.weight": "output_layer_norm.weight",
                        "output.LayerNorm.bias": "output_layer_norm.bias"}),
    Architecture("electra", ("electra",), "ElectraModel", embedding_projection=True, pooler=False,
                 embedding_dropout_key=None,
                 defaults={"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
                           "embedding_size": 128}, prefixes=("electra.", ""),
                 # ElectraClassificationHead: dense + GELU + out_proj on CLS; ElectraForMultipleChoice: its
                # SequenceSummary (first token, dense, summary_activation) + classifier
                heads={"sequence-classification": {"bert.pooler.dense.weight": "classifier.dense.weight",
                                                   "bert.pooler.dense.bias": "classifier.dense.bias",
                                                   "classifier.weight": "classifier.out_proj.weight",
                                                   "classifier.bias": "classifier.out_proj.bias"},
                       "multiple-choice": {"bert.pooler.dense.weight": "sequence_summary.summary.weight",
                                           "bert.pooler.dense.bias": "sequence_summary.summary.bias"}},
                # (ElectraClassificationHead drops its input; the SequenceSummary has no first dropout)
                head_shapes={"sequence-classification": {"act": "gelu", "input_dropout": True},
                             "multiple-choice": {"act": "gelu"}},
                head_shape_keys={"multiple-choice": {"act": "summary_activation"}},
                head_configs={"multiple-choice": {"summary_type": "first", "summary_use_proj": True,
                                                  "summary_proj_to_labels": False}}),
    Architecture("modernbert", ("modernbert",), "ModernBertModel", norm="pre", positions="rotary",
                 gated_activation=True, biases=False, attention_window=True, fused_qkv=True, pooler=False,
                 token_types="none", prefixes=("model.", ""), layer_prefix="layers.",
                 config_keys={"hidden_act": "hidden_activation", "layer_norm_eps": "norm_eps"},
                 defaults={"vocab_size": 50368, "num_hidden_layers": 22, "intermediate_size": 1152,
                           "max_position_embeddings": 8192, "pad_token_id": 50283, "layer_norm_eps": 1e-5},
                 fixed={"type_vocab_size": 0}, dropout_keys=("mlp_dropout", "attention_dropout"), dropout_default=0.0,
                 embedding_dropout_key="embedding_dropout",
                 # ModernBertFor*: ModernBertPredictionHead (dense [classifier_bias] + classifier_activation +
                # LayerNorm without bias) on the pooled state (classifier_pooling) or on every token, then classifier
                heads={layout: {"bert.pooler.dense.weight": "head.dense.weight", "bert.pooler.dense.bias": "head.dense.bias",
                                "bert.pooler.norm.weight": "head.norm.weight", "qa_outputs.weight": "classifier.weight",
                                "qa_outputs.bias": "classifier.bias"}
                       for layout in ("sequence-classification", "multiple-choice", "token-classification",
                                      "question-answering")},
                head_shapes={layout: {"act": "gelu", "bias": False, "norm": "layernorm", "norm_eps": 1e-5,
                                      "per_token": layout in ("token-classification", "question-answering")}
                             for layout in ("sequence-classification", "multiple-choice", "token-classification",
                                            "question-answering")},
                head_shape_keys={layout: {"act": "classifier_activation", "bias": "classifier_bias", "norm_eps": "norm_eps"}
                                 for layout in ("sequence-classification", "multiple-choice", "token-classification",
                                                "question-answering")},
                head_pooling_key="classifier_pooling",
                 names={"embeddings.word_embeddings.weight": "embeddings.tok_embeddings.weight",
                        "embeddings.LayerNorm.weight": "embeddings.norm.weight",
                        "attention.self.qkv.weight": "attn.Wqkv.weight", "attention.LayerNorm.weight": "attn_norm.weight",
                        "attention.output.dense.weight": "attn.Wo.weight",
                        "intermediate.LayerNorm.weight": "mlp_norm.weight", "intermediate.dense.weight": "mlp.Wi.weight",
                        "output.dense.weight": "mlp.Wo.weight"}),
)

BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}
BERT = BY_MODEL_TYPE["bert"]


def supported():
    """The model_type values fasttran loads, sorted."""
    return sorted(t for a in ARCHITECTURES if not a.unsupported() for t in a.model_types)


def of_config(cfg, source="config.json"):
    """The Architecture of a config dict (a config without model_type is BERT's), or
    UnsupportedModelError naming the model_type and what fasttran supports."""
    model_type = cfg.get("model_type", "bert")
    named = cfg.get("architecture")
    if "model_type" not in cfg and named is not None and named != BERT.name:
        # Encoder.config (fasttran's parsed fields, naming a non-BERT architecture) read as BERT's would
        # run the wrong layers and positions
        raise CheckpointError(
            f"{source}: a config without model_type naming architecture {named!r} is fasttran's parsed "
            "Encoder.config; pass Encoder.raw_config (config.json's own keys) to make an encoder from it")
    arch = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    listed = ", ".join(supported())
    if arch is None:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: {listed}")
    why = arch.unsupported()
    if why:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported yet: its {'; '.join(why)}. Supported model "
            f"types: {listed}")
    return arch


_ROPE_DEFAULTS = {"full_attention": 160000.0, "sliding_attention": 10000.0}   # ModernBertConfig's default thetas


def _rotary_fields(cfg, num_layers, source):
    """A rotary, windowed config's thetas per layer type, window and global layer period (ModernBertConfig:
    rope_parameters, or the older global_rope_theta / local_rope_theta; layer_types, or
    global_attn_every_n_layers)."""
    for key in ("attention_bias", "mlp_bias", "norm_bias"):
        if cfg.get(key):
            raise UnsupportedModelError(f"{source}: {key}=true is not supported (fasttran's ModernBERT layers have no "
                                        "biases)")
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object, got {params!r}")
    old = {"full_attention": cfg.get("global_rope_theta"), "sliding_attention": cfg.get("local_rope_theta")}
    theta = {}
    for kind, default in _ROPE_DEFAULTS.items():
        p = params.get(kind) or {}
        if p.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{source}: rope_type {p.get('rope_type')!r} ({kind}) is not supported; only "
                                        "'default'")
        t = p.get("rope_theta", old[kind] if old[kind] is not None else default)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise CheckpointError(f"{source}: rope_theta of {kind} must be a positive number, got {t!r}")
        theta[kind] = float(t)
    window = cfg.get("local_attention", 128)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise CheckpointError(f"{source}: local_attention must be an integer >= 2, got {window!r}")
    every = cfg.get("global_attn_every_n_layers", 3)
    types = cfg.get("layer_types")
    if types is not None:   # the explicit list: fasttran runs the "global every n" pattern it spells
        if not isinstance(types, list) or len(types) != num_layers or any(t not in _ROPE_DEFAULTS for t in types):
            raise CheckpointError(f"{source}: layer_types must list {num_layers} of {sorted(_ROPE_DEFAULTS)}, got {types!r}")
        globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
        every = globals_[1] - globals_[0] if len(globals_) > 1 else num_layers
        if [t == "full_attention" for t in types] != [i % every == 0 for i in range(num_layers)]:
            raise UnsupportedModelError(f"{source}: layer_types {types!r}: fasttran runs global attention every n layers "
                                        "from layer 0 (global_attn_every_n_layers), not this pattern")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise CheckpointError(f"{source}: global_attn_every_n_layers must be a positive integer, got {every!r}")
    return {"rope_theta": theta["full_attention"], "rope_theta_local": theta["sliding_attention"],
            "attention_window": window, "global_every": every}


def parse_fields(arch, cfg, source):
    """The config's values of fasttran's keys, under the architecture's names and defaults."""
    out = {k: arch.config_value(cfg, k) for k in _BERT_DEFAULTS}
    if arch.positions == "rotary":
        n = out["num_hidden_layers"]
        out.update(_rotary_fields(cfg, n if isinstance(n, int) and not isinstance(n, bool) else 0, source))
    if arch.embedding_projection:   # the embeddings' width; a projection to hidden_size where they differ
        emb = arch.config_value(cfg, "embedding_size")
        if isinstance(emb, bool) or not isinstance(emb, int) or emb < 1:
            raise CheckpointError(f"{source}: embedding_size must be a positive integer, got {emb!r}")
        out["embedding_size"] = emb
    return out

