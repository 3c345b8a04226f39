"""The package layout (``python -m kvboost.layout``, read from the source with ``ast``): imports point down
DESIGN.md's list (lab, then serving, then engine, then the rest) and no packages import each other in a circle."""

import pytest

from kvboost import layout

#: Package-level import cycles that exist and were not broken yet, each as the set of packages in one strongly
#: connected component (``kvboost.layout.cycles``). Empty: the move of the engine to ``kvboost/engine/`` (issue 61)
#: broke the last ones (kv <-> cache <-> lookup: ``parse_bytes`` moved to ``kv.sizing`` and
#: ``common_prefix_length`` to ``cache.sequence_store``; runtime <-> reuse: ``runtime/pipeline.py`` moved to
#: ``engine/pipeline.py``). The test compares for equality, so this list can only shrink: a new cycle fails, and so
#: does an entry here that no longer exists.
ALLOWED_PACKAGE_CYCLES: set[frozenset[str]] = set()
#: The same for cycles between modules (inside a package or across packages). Empty.
ALLOWED_MODULE_CYCLES: set[frozenset[str]] = set()


@pytest.fixture(scope="module")
def found():
    return layout.imports()


def offending(found, importer: str, imported: set[str]) -> list[str]:
    """Imports (any kind: module-level, lazy or type-only) from package ``importer`` into ``imported``."""
    return [f"{i.source}:{i.line} imports {i.target} ({i.kind})" for i in found
            if layout.package_of(i.source) == importer and layout.package_of(i.target) in imported]


def test_the_check_sees_the_packages_and_their_imports(found):
    packages = layout.graph(found, "package")
    assert {"kvboost.engine", "kvboost.serving", "kvboost.lab", "kvboost.runtime", "kvboost.kv"} <= set(packages)
    assert "kvboost.engine" in packages["kvboost.serving"]  # the server is a client of the engine
    assert "kvboost.engine" in packages["kvboost.lab"]
    kinds = {i.kind for i in found}
    assert {"module", "lazy", "type"} <= kinds, kinds  # build.py imports the engine lazily and for type checking


def test_the_engine_never_imports_serving_or_the_lab(found):
    assert offending(found, "kvboost.engine", {"kvboost.serving", "kvboost.lab"}) == []


def test_only_the_lab_may_import_serving(found):
    below = {layout.package_of(m) for m in layout.module_names()} - {"kvboost.serving", "kvboost.lab"}
    assert [line for p in sorted(below) for line in offending(found, p, {"kvboost.serving"})] == []


def test_the_library_never_imports_the_lab(found):
    library = {layout.package_of(m) for m in layout.module_names()} - {"kvboost.lab"}
    assert [line for p in sorted(library) for line in offending(found, p, {"kvboost.lab"})] == []


def test_no_new_package_cycle(found):
    cycles = set(layout.cycles(layout.graph(found, "package")))
    assert {layout.cycle_text(c) for c in cycles - ALLOWED_PACKAGE_CYCLES} == set(), "new package import cycle"
    assert {layout.cycle_text(c) for c in ALLOWED_PACKAGE_CYCLES - cycles} == set(), \
        "allowed cycle gone: remove it from ALLOWED_PACKAGE_CYCLES"


def test_no_new_module_cycle(found):
    cycles = set(layout.cycles(layout.graph(found, "module")))
    assert {layout.cycle_text(c) for c in cycles - ALLOWED_MODULE_CYCLES} == set(), "new module import cycle"
    assert {layout.cycle_text(c) for c in ALLOWED_MODULE_CYCLES - cycles} == set(), \
        "allowed cycle gone: remove it from ALLOWED_MODULE_CYCLES"


def test_the_check_finds_a_cycle_and_a_lazy_import(tmp_path):
    """The check itself, on a made-up package: a module-level circle is found, a lazy import is not part of one, a
    ``TYPE_CHECKING`` import is type-only, ``from pkg import submodule`` resolves to the submodule."""
    root = tmp_path / "kvboost"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from kvboost.a import x\n")
    (root / "a" / "x.py").write_text("from kvboost import b\n")
    (root / "b.py").write_text("from kvboost.a.x import thing\n"
                               "def f():\n    from kvboost import c\n"
                               "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvboost.c\n")
    (root / "c.py").write_text("import kvboost.b\n")
    found = layout.imports(root)
    kinds = {(i.source, i.target): i.kind for i in found}
    assert kinds[("kvboost.a", "kvboost.a.x")] == "module"
    assert kinds[("kvboost.b", "kvboost.c")] in {"lazy", "type"}
    assert layout.cycles(layout.graph(found, "package")) == [frozenset({"kvboost.a", "kvboost.b"})]
    assert layout.cycles(layout.graph(found, "module")) == [frozenset({"kvboost.a.x", "kvboost.b"})]
    assert layout.cycles(layout.graph([i for i in found if i.source != "kvboost.b" or i.kind != "module"])) == []
