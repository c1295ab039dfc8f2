"""Import timm.optim.Lamb without importing the rest of timm (whose package __init__ needs
torchvision, which has no wheel for the local torch build here): register bare parent packages
pointing at timm's folders, then import the optimizer module itself. Returns None when timm is
not installed (pip install --no-deps timm)."""
import importlib
import importlib.util
import sys
import types


def timm_lamb():
    if "timm.optim.lamb" in sys.modules:
        return sys.modules["timm.optim.lamb"].Lamb
    spec = importlib.util.find_spec("timm")
    if spec is None:
        return None
    root = spec.submodule_search_locations[0]
    for name, path in (("timm", root), ("timm.optim", root + "/optim")):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    try:
        return importlib.import_module("timm.optim.lamb").Lamb
    except ImportError:
        return None
