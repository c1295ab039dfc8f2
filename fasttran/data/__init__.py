"""Small real data shipped with the package (for the demo), and loaders."""
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def load_sst2(path=None):
    """Read a GLUE SST-2 TSV (header `label<TAB>sentence`): returns (sentences, labels).
    Without a path, the SST-2 dev split shipped with fasttran (872 sentences)."""
    path = path or os.path.join(_HERE, "sst2_dev.tsv")
    sentences, labels = [], []
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header[:2] != ["label", "sentence"] and header[:2] != ["sentence", "label"]:
            raise ValueError(f"{path}: expected a 'label<TAB>sentence' header, got {header!r}")
        li = header.index("label")
        for n, line in enumerate(f, start=2):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 2 tab-separated fields, got {len(parts)}")
            labels.append(int(parts[li]))
            sentences.append(parts[1 - li])
    return sentences, labels


def sst2_path(split):
    """Path of the SST-2 sample shipped with fasttran: "dev" (all 872 dev sentences) or "train"
    (4,000 train sentences drawn at random with seed 2026)."""
    name = {"dev": "sst2_dev.tsv", "train": "sst2_train_sample.tsv"}.get(split)
    if name is None:
        raise ValueError(f"split must be 'dev' or 'train', got {split!r}")
    return os.path.join(_HERE, name)
