"""`fasttran finetune`'s export in transformers: the dev score of transformers' model loaded from it
(scored as benchmarks/time_to_accuracy.py scores its reference) against the epoch finetune kept; for
MRPC, pipeline("text-classification")'s scores against fasttran's own logits (compress.TaskModel on
the same export); for CoNLL, pipeline("token-classification") on a sentence.

    fasttran finetune --task mrpc --data DIR --output OUT
    python benchmarks/check_finetune_export.py mrpc OUT        (or: conll OUT)

Data from $FASTTRAN_DATA (default ../shared/data), as benchmarks/tasks.py."""
import os
import json
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks as task_data  # noqa: E402
import time_to_accuracy as tta  # noqa: E402
from torch_topk import engines  # noqa: E402
import transformers as tf  # noqa: E402

task, out = sys.argv[1], sys.argv[2]
path, enc = engines(1)
tr_in, y, dv_in, ydev, names = task_data.load(task, enc, None)
kind = "token" if task == "conll" else "cls"
dev = tta._Rows(dv_in, ydev, kind)
model = (tf.AutoModelForTokenClassification if kind == "token" else tf.AutoModelForSequenceClassification
         ).from_pretrained(out).eval()
logits = tta._logits(model, dev, kind)
score = tta.score_reference(task, kind, logits, dev, ydev, names)
info = json.load(open(out + "/finetune.json"))
kept = info["history"][info["best_epoch"] - 1]
print(f"{task}: transformers' model from the export scores {score:.2f} on dev; finetune kept epoch "
      f"{info['best_epoch']}: {100 * kept['eval_' + info['metric']]:.2f}")
tok = tf.AutoTokenizer.from_pretrained(out)
if kind == "cls":
    from fasttran import readers
    ex = readers.read_glue_tsv(os.path.join(task_data.DATA, "glue", "MRPC", "dev.tsv"))
    from fasttran.compress import TaskModel, TaskData
    tm = TaskModel.load(out)
    n = 64
    data = TaskData.from_texts(tm, ex.texts[:n], np.zeros(n, np.int64), pairs=ex.text_pairs[:n])
    ft = tm.logits(data)
    pipe = tf.pipeline("text-classification", model=out, device="cpu")
    got = np.array([[d["score"] for d in sorted(pipe({"text": a, "text_pair": b}, function_to_apply="none",
                                                     top_k=None), key=lambda d: d["label"])]
                    for a, b in zip(ex.texts[:n], ex.text_pairs[:n])])
    print(f"pipeline vs fasttran's TaskModel logits, {n} dev pairs: max |diff| {np.abs(got - ft).max():.2e}")
else:
    pipe = tf.pipeline("token-classification", model=out, device="cpu", aggregation_strategy="simple")
    print("pipeline:", pipe("EU rejects German call to boycott British lamb ."))
