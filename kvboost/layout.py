"""The package layout of kvboost, read from its source with :mod:`ast` (nothing is imported): ``python -m kvboost.layout``.

A *package* is a top-level unit of kvboost: a subpackage (``kvboost.engine``, ``kvboost.cache``...) or a top-level
module (``kvboost.decoding``); ``kvboost`` itself is the facade (``kvboost/__init__.py``). An import belongs to one
of three kinds:

- *module-level*: runs when the module is imported (top level, and inside top-level ``if`` / ``try`` / ``with`` and
  class bodies). Only these make import cycles, and only these are edges of the graphs below.
- *lazy*: inside a function or method; runs when it is called. Listed apart (``--lazy``), never in a cycle.
- *type-only*: under ``if TYPE_CHECKING:``; never runs. Ignored.

``from a.b import c`` imports the module ``a.b.c`` when there is one, else ``a.b``. The cycles reported are the
strongly connected components (more than one node) of the package graph and of the module graph.
tests/test_layout.py holds the rules (which package may import which, and the cycles allowed).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent  # the kvboost package folder
TOP = "kvboost"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported kvboost module
    line: int
    kind: str  # "module" | "lazy" | "type"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, by dotted name (``kvboost.serving`` for ``kvboost/serving/__init__.py``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (TOP, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def package_of(module: str) -> str:
    """The top-level unit a module belongs to: ``kvboost.cache.memory`` -> ``kvboost.cache``."""
    return ".".join(module.split(".")[:2])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(body: Iterable[ast.stmt], kind: str) -> Iterable[tuple[ast.stmt, str]]:
    """Each import statement under ``body`` with its kind (see the module docstring)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(node.body, "lazy" if kind == "module" else kind)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, "type")
            yield from _walk(node.orelse, kind)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _walk([c for c in children if isinstance(c, ast.AST)], kind)


def _resolve(module: str, is_package: bool, node: ast.stmt, names: dict[str, Path]) -> list[str]:
    """The kvboost modules one import statement imports (``from`` imports resolved to submodules where they are)."""
    def deepest(dotted: str) -> str | None:
        while dotted and dotted not in names:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    if isinstance(node, ast.Import):
        found = [deepest(alias.name) for alias in node.names if alias.name.split(".")[0] == TOP]
        return [f for f in found if f]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    if stem.split(".")[0] != TOP:
        return []
    out = []
    for alias in node.names:
        sub = f"{stem}.{alias.name}"
        target = sub if sub in names else deepest(stem)
        if target:
            out.append(target)
    return out


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of a kvboost module by a kvboost module."""
    names = module_names(root)
    found: dict[Import, None] = {}  # one per (importer, imported, line, kind), in source order
    for module, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, kind in _walk(tree.body, "module"):
            for target in _resolve(module, path.name == "__init__.py", node, names):
                if target != module:
                    found[Import(module, target, node.lineno, kind)] = None
    return list(found)


def graph(found: Iterable[Import], level: str = "package") -> dict[str, set[str]]:
    """Module-level import edges between packages (``level="package"``) or modules (``level="module"``)."""
    edges: dict[str, set[str]] = {}
    for imp in found:
        if imp.kind != "module":
            continue
        a, b = (package_of(imp.source), package_of(imp.target)) if level == "package" else (imp.source, imp.target)
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b:
            edges[a].add(b)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one node (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=sorted)


def short(name: str) -> str:
    return name if name == TOP else name[len(TOP) + 1:]


def cycle_text(component: frozenset[str]) -> str:
    return " <-> ".join(short(n) for n in sorted(component))


def report(root: Path = ROOT, lazy: bool = False) -> str:
    found = imports(root)
    packages = graph(found, "package")
    modules = graph(found, "module")
    lines = [f"packages ({len(packages)}), each with the packages it imports at module level:"]
    for p in sorted(packages):
        lines.append(f"  {short(p):<14} -> {', '.join(short(q) for q in sorted(packages[p])) or '-'}")
    if lazy:
        lines.append("lazy imports between packages (inside functions; not in the cycles):")
        pairs = sorted({(package_of(i.source), package_of(i.target)) for i in found
                        if i.kind == "lazy" and package_of(i.source) != package_of(i.target)})
        for a, b in pairs:
            lines.append(f"  {short(a)} -> {short(b)}")
    package_cycles, module_cycles = cycles(packages), cycles(modules)
    lines.append(f"package cycles: {len(package_cycles)}")
    lines += [f"  {cycle_text(c)}" for c in package_cycles]
    lines.append(f"module cycles: {len(module_cycles)}")
    lines += [f"  {cycle_text(c)}" for c in module_cycles]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvboost.layout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lazy", action="store_true", help="also list the lazy (function-level) imports")
    print(report(lazy=parser.parse_args(argv).lazy))


if __name__ == "__main__":
    main()
