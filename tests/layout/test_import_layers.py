"""The package's modules import one another without circles, counting the imports inside
functions too (a lazy import is still a dependency; lazy imports of third-party packages are
not counted), and a package's ``__init__`` of comm only re-exports. Read from the source with
``ast``: nothing is imported."""

import ast
import os

import zero_kernels

ROOT = os.path.dirname(zero_kernels.__file__)
PKG = "zero_kernels"


def _modules() -> dict[str, str]:
    """Module name -> its file, for every .py of the package."""
    out = {}
    base = os.path.dirname(ROOT)
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _edges(mods: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its file). ``from P import n``
    depends on ``P.n`` where that is a module (or the native extension ``_C``), else on P."""
    out = {}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                elif node.module and node.module.split(".")[0] == PKG:
                    target = node.module
                else:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in mods or a.name == "_C" else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == PKG)
        out[m] = {d for d in deps if d in mods and d != m}
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_even_through_imports_inside_functions():
    mods = _modules()
    assert len(mods) > 50, mods  # the walk found the package
    cycles = _cycles(_edges(mods))
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_circle():
    """The finder itself: a circle through a lazy import is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_comm_init_only_reexports():
    """zero_kernels/comm/__init__.py defines nothing: imports, its docstring and __all__."""
    path = os.path.join(ROOT, "comm", "__init__.py")
    tree = ast.parse(open(path).read())
    bad = [
        type(n).__name__
        for n in tree.body
        if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr))
        and not (
            isinstance(n, (ast.Assign, ast.AugAssign))
            and all(getattr(t, "id", None) == "__all__" for t in _targets(n))
        )
    ]
    assert not bad, bad


def _targets(n):
    return n.targets if isinstance(n, ast.Assign) else [n.target]
