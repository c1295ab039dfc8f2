import json
import os
import platform
import time

import pytest

RESULTS = {}


@pytest.fixture(scope="session")
def record():
    """record(case, impl, seconds_per_call, items_per_call): collects results; at the end of the
    session prints the ratios and writes benchmarks/last_run.json."""
    def add(case, impl, seconds, items):
        RESULTS.setdefault(case, {})[impl] = {"seconds": seconds, "items_per_s": items / seconds}
    yield add
    if not RESULTS:
        return
    import numpy
    import fasttran
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpu": _cpu_name(), "cores": os.cpu_count(), "fasttran": fasttran.__version__,
            "blas": fasttran.build_info()["blas"], "numpy": numpy.__version__, "python": platform.python_version()}
    try:
        import torch, transformers
        meta.update(torch=torch.__version__, transformers=transformers.__version__,
                    torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    lines = ["", "case | impl | items/s | ratio vs reference"]
    for case, impls in RESULTS.items():
        ref = impls.get("torch")
        for impl, r in impls.items():
            ratio = (r["items_per_s"] / ref["items_per_s"]) if ref else float("nan")
            lines.append(f"{case} | {impl} | {r['items_per_s']:.1f} | {ratio:.2f}x")
    print("\n".join(lines))
    with open(os.path.join(os.path.dirname(__file__), "last_run.json"), "w") as f:
        json.dump({"meta": meta, "results": RESULTS}, f, indent=2)


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
