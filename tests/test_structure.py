"""The code's dependency graph has no cycle, in Python and in C.

Method (static, over the source tree; nothing is imported or compiled):

* Python: every module of the ``fasttran`` package is parsed with ``ast``; each ``import`` and
  ``from ... import ...`` statement anywhere in it -- at module level or inside a function or class
  body alike -- is an edge to the fasttran module it names. Relative imports are resolved against
  the importing module's package, and ``from . import x`` (or ``from .pkg import x``) counts as an
  edge to the module ``pkg.x`` when such a module exists, else to ``pkg`` itself. A package's
  ``__init__`` is a node of its own; ``fasttran._C`` (compiled) is not part of the graph.
* C: the nodes are the files under ``csrc/`` (``.c``, ``.h``, ``.cu``, ``.cuh``, ``.cpp``). A file
  depends on each csrc file it ``#include``s with quotes (resolved against its own folder, then
  ``csrc/``, then ``csrc/include/``). A ``.c`` file also depends on every other ``.c`` file that
  defines a function it calls: definitions are found with a regular expression over
  ``csrc/**/*.c`` (a line that starts at column 0 with a return type and a name followed by ``(``
  and whose declaration ends in ``{`` rather than ``;``; ``static`` functions are private to their
  file and not counted), calls with ``\\bname\\s*\\(`` over the file's text with comments and string
  literals removed. Function-like macros are not followed.

A cycle found is printed (the chain of files) when the test fails.
"""
import ast
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PKG = os.path.join(ROOT, "fasttran")
CSRC = os.path.join(ROOT, "csrc")


def cycles(graph):
    """The strongly connected components of more than one node (or with a self edge), each as one
    cycle through it: [[a, b, ..., a], ...] (Tarjan's algorithm, iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    comps.append(sorted(comp))
    return [_one_cycle(graph, set(c)) for c in comps]


def _one_cycle(graph, comp):
    """A shortest cycle through the component's first node, staying inside the component."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if path[-1] == start else path[::-1] + [start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


# ---- Python ------------------------------------------------------------------------------------------
def python_modules():
    """{dotted module name: file path} of the fasttran package"""
    mods = {}
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        for f in filenames:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                mods[".".join(rel)] = os.path.join(dirpath, f)
    return mods


# made by the build (compiled, or written by setup.py): no fasttran imports of their own
EXTENSIONS = {"fasttran._C", "fasttran._build_config"}


def python_graph():
    mods = python_modules()
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        package = name if is_pkg else name.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name not in EXTENSIONS]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod in EXTENSIONS:
                    continue
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    if sub not in EXTENSIONS:
                        targets.append(sub if sub in mods else mod)
            for t in targets:
                while t and t not in mods:   # `import fasttran.cache.layout` names a module; a.b.c of a
                    t = t.rpartition(".")[0]  # function falls back to its module
                if t and t != name:
                    graph[name].add(t)
    return graph


# ---- C -----------------------------------------------------------------------------------------------
C_EXT = (".c", ".h", ".cu", ".cuh", ".cpp")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
# a definition: at column 0, a return type (words, pointers) then the name and "(", parameters up to the
# matching ")" on one or more lines, then "{" (a prototype ends in ";")
_DEFINITION = re.compile(r'^(?!static\b)(?!typedef\b)(?:[A-Za-z_][\w ]*?[\s\*]+)\**([A-Za-z_]\w*)\s*\(([^;{}]*?)\)\s*\{',
                         re.M)
_CALL = re.compile(r'\b([A-Za-z_]\w*)\s*\(')


def c_files():
    out = []
    for dirpath, dirnames, filenames in os.walk(CSRC):
        for f in filenames:
            if f.endswith(C_EXT):
                out.append(os.path.relpath(os.path.join(dirpath, f), CSRC).replace(os.sep, "/"))
    return sorted(out)


def _strip(text):
    return _COMMENT_OR_STRING.sub(lambda m: '""' if m.group(0).startswith('"') else " ", text)


def c_graph():
    files = c_files()
    known = set(files)
    texts = {}
    for f in files:
        with open(os.path.join(CSRC, f), encoding="utf-8", errors="replace") as fh:
            texts[f] = fh.read()
    graph = {f: set() for f in files}
    for f, text in texts.items():
        here = os.path.dirname(f)
        for inc in _INCLUDE.findall(text):
            for cand in (os.path.normpath(os.path.join(here, inc)).replace(os.sep, "/"), inc, "include/" + inc):
                if cand in known:
                    if cand != f:
                        graph[f].add(cand)
                    break
    # cross-file function references between .c files
    defined = {}
    for f in files:
        if f.endswith(".c"):
            for m in _DEFINITION.finditer(_strip(texts[f])):
                name = m.group(1)
                if name not in ("if", "for", "while", "switch", "return", "sizeof"):
                    defined.setdefault(name, set()).add(f)
    for f in files:
        if not f.endswith(".c"):
            continue
        for name in set(_CALL.findall(_strip(texts[f]))):
            for g in defined.get(name, ()):
                if g != f:
                    graph[f].add(g)
    return graph


def _report(kind, found):
    return f"{len(found)} cycle(s) among {kind}:\n" + "\n".join("  " + " -> ".join(c) for c in found)


# ---- tests -------------------------------------------------------------------------------------------
def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    found = cycles(g)
    assert sorted(map(tuple, found)) == [("a", "b", "c", "a"), ("e", "e")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graphs_see_known_edges():
    """the scanners find what is certainly there (else a broken scanner would pass the tests below)"""
    py = python_graph()
    assert "fasttran.errors" in py["fasttran.distributed"]      # module level: from .errors import ...
    assert "fasttran._info" in py["fasttran.distributed"]       # inside functions: from ._info import ...
    assert "fasttran.cache.activation" in py["fasttran.cache"]  # a package's __init__
    c = c_graph()
    assert "core/status.h" in c["core/status.c"]                # an include
    assert "core/status.c" in c["io/atomic.c"]                  # a call of ft_error, defined in status.c
    assert "model/encoder.c" in c["train/model.c"] or "model/layer.c" in c["train/model.c"]


def test_no_python_import_cycle():
    found = cycles(python_graph())
    assert not found, _report("fasttran's modules (imports)", found)


def test_no_c_include_or_call_cycle():
    found = cycles(c_graph())
    assert not found, _report("csrc's files (#include and cross-file calls)", found)


if __name__ == "__main__":
    for kind, g in (("python", python_graph()), ("c", c_graph())):
        print(_report(kind, cycles(g)))
