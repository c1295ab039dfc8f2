"""GLUE task files as compression reads them: SST-2 (single sentences), MRPC (sentence pairs) and CoLA,
from a data directory laid out as fasttran's tests expect (`DIR/sst2/{train,dev}.tsv`,
`DIR/glue/{MRPC,CoLA}/{train,dev}.tsv`) or the task's own folder. Without a directory, SST-2 comes
from the sample fasttran ships (all 872 dev sentences, 4,000 training sentences)."""
import os

from ..errors import CheckpointNotFoundError, InputError

TASKS = ("sst2", "mrpc", "cola")
_FOLDERS = {"sst2": ("sst2", "glue/SST-2", "SST-2"), "mrpc": ("glue/MRPC", "MRPC"), "cola": ("glue/CoLA", "CoLA")}


def _find(task, split, data_dir):
    if data_dir is None:
        if task == "sst2":
            from ..data import sst2_path
            return sst2_path(split)
        raise InputError(f"task {task!r} needs its GLUE files: pass the data directory (holding glue/{task.upper()}/"
                         f"{split}.tsv)")
    for sub in ("",) + _FOLDERS[task]:
        path = os.path.join(data_dir, sub, f"{split}.tsv")
        if os.path.isfile(path):
            return path
    raise CheckpointNotFoundError(f"no {split}.tsv for task {task!r} under {data_dir} (looked in "
                                  f"{', '.join(os.path.join(data_dir, s) for s in _FOLDERS[task])})")


def load_task(task, split, data_dir=None, limit=None):
    """(first sentences, second sentences or None, labels) of a task's split ("train" / "dev")."""
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    path = _find(task, split, data_dir)
    a, b, y = [], [], []
    with open(path, encoding="utf-8-sig") as f:
        lines = f.read().split("\n")
    if task in ("sst2", "mrpc"):
        header, rows = lines[0].split("\t"), lines[1:]
    else:
        header, rows = None, lines   # CoLA: no header (source, label, original mark, sentence)
    for n, line in enumerate(rows, 2 if header else 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        try:
            if task == "sst2":
                li = header.index("label")
                y.append(int(parts[li]))
                a.append(parts[1 - li])
            elif task == "mrpc":
                y.append(int(parts[0]))
                a.append(parts[3])
                b.append(parts[4])
            else:
                y.append(int(parts[1]))
                a.append(parts[3])
        except (ValueError, IndexError):
            raise InputError(f"{path}:{n}: not a {task} row: {line[:80]!r}") from None
        if limit and len(y) >= limit:
            break
    return a, (b if task == "mrpc" else None), y
