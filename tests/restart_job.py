"""A torchrun job for tests/test_distributed_training.py: every rank builds the cache (split over
the ranks, on disk; a complete one is opened, not rebuilt) and trains with a checkpoint every 2
steps, resuming from the last one. Rank 1 of the job's first attempt kills itself (SIGKILL) after
step `kill_at`, mid-epoch; torchrun --max-restarts=1 starts the job again.

    torchrun --nproc-per-node=2 --master-addr=127.0.0.1 --max-restarts=1 restart_job.py TINY CACHE CKPT OUT KILL_AT"""
import hashlib
import json
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(tiny_dir, cache_dir, ck_dir, out, kill_at):
    import fasttran
    from fasttran.distributed import DataParallel, init
    from test_distributed_training import _data, _trainer
    group = init()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    enc, ids, mask, y = _data(tiny_dir)
    tr = _trainer(DataParallel(group), "classification", 8, epochs=3)
    cache = fasttran.ActivationCache.build(enc, ids, mask, layer=enc.num_layers - 1, positions="all",
                                           disk_dir=cache_dir, group=group, show_progress=False)
    shards = sorted((f, os.stat(os.path.join(cache_dir, f)).st_mtime_ns) for f in os.listdir(cache_dir)
                    if f.startswith("shard-"))
    step = tr._optimizer_step

    def maybe_die(total, warm):
        r = step(total, warm)
        if attempt == 0 and group.rank == 1 and tr.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return r
    tr._optimizer_step = maybe_die
    tr.fit(cache, y, checkpoint_dir=ck_dir, resume=True, checkpoint_every=2)
    if group.is_main:
        params = np.asarray(tr.model.params)
        with open(out, "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": tr.global_step, "shards": shards,
                                "params": hashlib.sha256(params.tobytes()).hexdigest()}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
