"""Compress a fine-tuned model: significance analysis, structured pruning that makes the
model physically smaller, sign-matching attention, a search under an accuracy / latency / size
budget, and saving, loading and export. The work runs in C (csrc/model/compress.c, the encoder's
forward masks and per-layer structure, the layer stack's first-order significance, the CPU
attention's sign matching); this package validates, orders and measures.

    >>> from fasttran import compress
    >>> model = compress.TaskModel.load("finetuned")            # Trainer.export(...) of a fine-tuned model
    >>> dev = compress.TaskData.from_texts(model, texts, labels)
    >>> sig = compress.significance(model, dev)                  # masking and gradient x activation
    >>> print(sig.table())
    >>> small = compress.apply(model, {"layers": {"5": "prune", "0": {"heads": {"3": "prune"}}}})
    >>> tiny = compress.quantize(small)                          # int8 weights (VNNI / AMX products)
    >>> result = compress.search(model, train, select, dev, max_drop=0.5)   # re-fine-tunes after pruning
    >>> result.model.save("small"); result.plot("tradeoff.png")
"""
from .measure import latency, pareto, plot_tradeoff
from .model import TaskData, TaskModel, attention_mode_names, export_onnx, export_transformers, metrics, quantize
from .plan import apply, in_original_numbering, masks, parse as check_plan, vocabulary
from .search import SearchResult, save_result, search
from .significance import Significance, significance, spearman

__all__ = ["TaskData", "TaskModel", "quantize", "export_transformers", "export_onnx", "metrics", "apply", "masks", "check_plan",
           "in_original_numbering", "vocabulary", "attention_mode_names", "significance", "Significance", "spearman", "search",
           "SearchResult", "save_result", "latency", "pareto", "plot_tradeoff"]
