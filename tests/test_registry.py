"""The generic registry: registration, building from configs, clear errors, entry-point plugins."""

from __future__ import annotations

import pytest

from kvboost.registry import ALL_REGISTRIES, CHUNKERS, RECOMPUTE, Registry, UnknownPluginError


def test_every_family_has_its_first_members():
    expected = {
        "chunker": {"fixed"}, "hasher": {"sha256"}, "cache": {"memory"}, "eviction": {"lru"},
        "recompute": {"none", "full"}, "quant": {"none"}, "attn": {"sdpa", "eager", "triton", "cuda"},
    }  # fmt: skip
    for family, names in expected.items():
        assert names <= set(ALL_REGISTRIES[family].names()), family


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(UnknownPluginError) as err:
        RECOMPUTE.build("cachebland")
    message = str(err.value)
    assert "cachebland" in message and "none" in message and "full" in message


def test_build_from_mapping_passes_arguments():
    chunker = CHUNKERS.build({"name": "fixed", "chunk_size": 7, "description": "ignored"})
    assert chunker.chunk_size == 7


def test_build_from_omegaconf():
    from omegaconf import OmegaConf

    chunker = CHUNKERS.build(OmegaConf.create({"name": "fixed", "chunk_size": 5}))
    assert chunker.chunk_size == 5


def test_bad_arguments_name_the_plugin():
    with pytest.raises(TypeError, match="fixed"):
        CHUNKERS.build({"name": "fixed", "chunksize": 3})
    with pytest.raises(ValueError, match="name"):
        CHUNKERS.build({"chunk_size": 3})


def test_duplicate_registration_is_refused():
    reg: Registry[object] = Registry("demo")

    @reg.register("a")
    class A:
        pass

    with pytest.raises(ValueError, match="already registered"):

        @reg.register("a")
        class B:
            pass


def _plugin_package(monkeypatch, tmp_path, entry_point: str, module: str, source: str) -> None:
    """A module ``module`` (``source``) on the path, named by the only ``kvboost.plugins`` entry point, with the
    entry points not loaded yet (as in a fresh process)."""
    import importlib.metadata as md

    import kvboost.registry as registry_module

    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = md.EntryPoint(name=entry_point, value=module, group="kvboost.plugins")
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ep] if group == "kvboost.plugins" else [])
    monkeypatch.setattr(registry_module, "_entry_points_loaded", False)


def test_entry_point_plugins_are_loaded(monkeypatch, tmp_path):
    """A third-party module named by a kvboost.plugins entry point registers on first lookup."""
    import sys

    import kvboost.registry as registry_module

    _plugin_package(monkeypatch, tmp_path, "mine", "my_kvboost_plugin",
                    "from kvboost.registry import CHUNKERS\n"
                    "from kvboost.chunking.fixed import FixedChunker\n"
                    "@CHUNKERS.register('third_party_fixed', override=True)\n"
                    "class ThirdParty(FixedChunker):\n"
                    "    pass\n")  # fmt: skip
    try:
        registry_module.load_entry_point_plugins()
        assert "third_party_fixed" in CHUNKERS.names()
    finally:
        # Leave the registry as the other tests expect it (kvboost/configs/chunker/ mirrors it).
        CHUNKERS.unregister("third_party_fixed")
        sys.modules.pop("my_kvboost_plugin", None)


def test_repr_lists_the_registered_names_after_entry_points_load(monkeypatch, tmp_path):
    """repr(RECOMPUTE) shows entry-point plugins too: the registry loads them before listing."""
    import sys

    _plugin_package(monkeypatch, tmp_path, "repr_plugin", "my_repr_plugin",
                    "from kvboost.registry import RECOMPUTE\n"
                    "from kvboost.recompute.none import NoRecompute\n"
                    "@RECOMPUTE.register('third_party_none', override=True)\n"
                    "class ThirdParty(NoRecompute):\n"
                    "    pass\n")  # fmt: skip
    monkeypatch.setattr(RECOMPUTE, "_loaded", False)  # as in a fresh process: the first lookup loads the plugins
    try:
        text = repr(RECOMPUTE)
        assert "third_party_none" in text and "'none'" in text and text.startswith("Registry('recompute'")
    finally:
        RECOMPUTE.unregister("third_party_none")
        sys.modules.pop("my_repr_plugin", None)


def test_unknown_plugin_error_names_an_entry_point_that_failed_to_load(monkeypatch, tmp_path):
    """A plugin package whose import raises: asking for its strategy names the failed entry point and its
    exception, beside the registered names."""
    import kvboost.registry as registry_module

    _plugin_package(monkeypatch, tmp_path, "broken_strategies", "my_broken_plugin",
                    "import a_module_that_is_not_installed\n")
    monkeypatch.setattr(registry_module, "_entry_point_failures", {})
    registry_module.load_entry_point_plugins()
    with pytest.raises(UnknownPluginError) as err:
        RECOMPUTE.build("last_n")
    message = str(err.value)
    assert "unknown recompute plugin 'last_n'" in message and "full" in message
    assert "'broken_strategies' failed to load: ModuleNotFoundError" in message
    assert "a_module_that_is_not_installed" in message
