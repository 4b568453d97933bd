"""The package graph, read from the source (ast, every import statement, function-level
and `if TYPE_CHECKING:` ones included: an annotation-only import still ties two modules
together; a package's __init__ counted like any module): no import cycle among the project's modules nor among its packages; engine/
never imports Ray; common/ imports neither torch nor Ray nor any other layer of blockray."""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set

from conftest import ROOT

PACKAGES = ("common", "engine", "actors", "pipeline", "tiny", "bench")


def _modules() -> Dict[str, str]:
    """{dotted module name: path} of every module of the project's packages."""
    found = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return found


def _imports(name: str, path: str) -> Set[str]:
    """Every module `name` imports (absolute names; `from pkg import sub` counts as pkg.sub)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    out: Set[str] = set()
    todo: List[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = {m for m in _imports(name, path) if m in mods and m != name}
    return graph


def _external(prefix: str) -> Dict[str, Set[str]]:
    """{module under `prefix`: top-level names of everything it imports}."""
    return {name: {m.split(".")[0] for m in _imports(name, path)}
            for name, path in _modules().items() if name == prefix or name.startswith(prefix + ".")}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_modules():
    assert _cycles(_graph()) == []


def test_type_checking_imports_count():
    """The reader sees an import under `if TYPE_CHECKING:` (engine.rules once imported
    engine.batch there, a cycle the graph did not show)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .batch import Batch\n")
        assert "engine.batch" in _imports("engine.m", path)


def test_no_import_cycle_among_packages():
    packages: Dict[str, Set[str]] = {}
    for mod, deps in _graph().items():
        packages.setdefault(mod.split(".")[0], set()).update(d.split(".")[0] for d in deps)
    for pkg, deps in packages.items():
        deps.discard(pkg)
    assert _cycles(packages) == [], packages


def test_engine_never_imports_ray():
    assert {m for m, names in _external("engine").items() if "ray" in names} == set()


def test_common_imports_no_torch_no_ray_no_other_layer():
    bad = {m: names & {"torch", "ray", *PACKAGES} - {"common"} for m, names in _external("common").items()}
    assert {m: n for m, n in bad.items() if n} == {}


def test_every_lazy_export_names_a_module_that_defines_it():
    """Read from the source, so nothing is imported: each `_EXPORTS` entry's module exists
    and defines, imports or lazily exports the name."""
    mods = _modules()
    for pkg, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        exports = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                        and any(getattr(t, "id", None) == "_EXPORTS" for t in n.targets)), {})
        for name, target in exports.items():
            mod = f"{pkg}{target}" if target.startswith(".") else target
            assert mod in mods, f"{pkg}._EXPORTS[{name!r}]: no module {mod}"
            src = open(mods[mod], encoding="utf-8").read()
            defines = rf"(def|class) {name}\b|^{name}\b.*=|import .*\b{name}\b|\"{name}\": "
            assert re.search(defines, src, re.M), (pkg, name, mod)
