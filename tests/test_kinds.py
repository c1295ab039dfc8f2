"""Each kind declared once: head kinds live in their descriptors (csrc/train/head_<name>.c, listed
by FT_HEAD_KINDS in fasttran.h; fasttran/heads/<name>.py, registered by subclassing Head) and
devices in fasttran/device.py. Outside those files no code asks which head kind or which device
string it has: these greps fail on the switches they replaced."""
import os
import re

import fasttran

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _files(top, ext):
    for d, _, names in os.walk(os.path.join(ROOT, top)):
        for n in sorted(names):
            if n.endswith(ext):
                p = os.path.join(d, n)
                yield os.path.relpath(p, ROOT), open(p, encoding="utf-8").read()


def _code(text):
    """text without comments (C block and line comments; Python # comments and docstrings left in
    are fine for the patterns below, which need code syntax)"""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def test_no_head_kind_switch_in_c_outside_the_descriptors():
    kinds = [k.upper() for k in fasttran._C.HEAD_KINDS]
    assert {"LINEAR", "POOLER", "QA", "TOKEN", "CHOICE"} <= set(kinds)
    pat = re.compile(r"\bFT_HEAD_(%s)\b" % "|".join(kinds))
    found = [(path, m.group(0)) for ext in (".c", ".h", ".cu", ".cpp") for path, text in _files("csrc", ext)
             if path != os.path.join("csrc", "include", "fasttran.h")
             and not re.fullmatch(r"csrc/train/head_\w+\.c", path.replace(os.sep, "/"))
             for m in pat.finditer(_code(text))]
    assert not found, found


def test_no_head_kind_or_device_string_switch_in_python():
    kinds = "|".join(fasttran._C.HEAD_KINDS)
    kind_cmp = re.compile(r"\.kind\s*(==|!=|in\b)\s*[\"'(]?(%s)\b" % kinds)
    device_cmp = re.compile(r"""(==|!=)\s*["']cpu["']|["']cpu["']\s*(==|!=)|startswith\(\s*["']cuda""")
    found = []
    for path, text in _files("fasttran", ".py"):
        rel = path.replace(os.sep, "/")
        if not rel.startswith("fasttran/heads/") and kind_cmp.search(text):
            found.append((rel, kind_cmp.search(text).group(0)))
        if rel != "fasttran/device.py" and device_cmp.search(text):
            found.append((rel, device_cmp.search(text).group(0)))
    assert not found, found


def test_a_head_class_is_found_by_its_file_alone():
    from fasttran.heads import HEADS, REGISTRY, TASKS
    # every registered class names a C kind the core has, and the task table comes from the classes
    for cls in REGISTRY:
        assert cls.tasks and all(TASKS[t][0] is cls for t in cls.tasks), cls
    assert {"ClassificationHead", "RegressionHead", "MultiLabelHead", "TokenClassificationHead", "QAHead",
            "MultipleChoiceHead"} <= set(HEADS)


def test_no_codec_switch_outside_the_codec_list():
    """the cache's codecs are csrc/cache/codecs.h's list and their row coders: the cache code, its
    binding and the device tier never name a codec's type, and the Python cache layer never a codec"""
    assert {"float32", "float16", "bfloat16", "int8"} <= set(fasttran._C.CACHE_CODECS)
    pat = re.compile(r"\bFT_(F16|BF16|I8)\b")
    paths = [p for ext in (".c", ".cu") for p, _ in _files("csrc", ext)
             if re.match(r"csrc/(cache/|python/cache_type\.c|cuda/cache\.cu|cpu/cache_ops\.c)", p.replace(os.sep, "/"))]
    assert len(paths) >= 6
    found = [(p, m.group(0)) for p in paths for m in pat.finditer(_code(open(os.path.join(ROOT, p)).read()))]
    assert not found, found
    names = re.compile(r"""(==|!=)\s*["'](float16|bfloat16|int8)["']|["'](float16|bfloat16|int8)["']\s*(==|!=)""")
    found = [(p, names.search(t).group(0)) for p, t in _files(os.path.join("fasttran", "cache"), ".py") if names.search(t)]
    assert not found, found


def test_no_model_type_switch_outside_the_architecture_table():
    """architectures are fasttran/architectures.py's entries: no other code compares a model_type, or a
    string naming an architecture, to choose what to do (it reads the entry's fields)"""
    from fasttran.architectures import ARCHITECTURES
    names = sorted({t for a in ARCHITECTURES for t in a.model_types + (a.name,)} | {"deberta-v2"}, key=len, reverse=True)
    assert {"bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "modernbert"} <= set(names)
    quoted = "|".join(re.escape(n) for n in names)
    cmp = re.compile(r"""(==|!=|\bin\b|\bis\b)\s*[(\[{]?\s*["'](%s)["']|["'](%s)["']\s*(==|!=|\bin\b)|\bmodel_type\b["']?\]?\s*(==|!=|\bin\b)"""
                     % (quoted, quoted))
    found = [(p.replace(os.sep, "/"), m.group(0)) for p, text in _files("fasttran", ".py")
             if p.replace(os.sep, "/") != "fasttran/architectures.py" for m in cmp.finditer(text)]
    found += [(p, m.group(0)) for ext in (".c", ".h", ".cu", ".cpp") for p, text in _files("csrc", ext)
              for m in re.finditer(r'"(%s)"' % quoted, _code(text))]
    assert not found, found
    # the pattern catches the switches it is there for
    for bad in ('if cfg["model_type"] == "roberta":', "if model_type != 'bert':", 'x = t in ("distilbert", "bert")',
                'if "electra" == kind:'):
        assert cmp.search(bad), bad
