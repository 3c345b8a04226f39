"""Extension builds never hang on a baton left by a killed build (kvboost.attention.ext_build)."""

from __future__ import annotations

import threading
import time

import pytest

from kvboost.attention import ext_build
from kvboost.models.loading import file_lock


@pytest.fixture
def fake_torch_load(tmp_path, monkeypatch):
    """torch's load replaced by one that records whether it found a baton (the real one would wait on it)."""
    calls = []
    monkeypatch.setattr(ext_build, "build_directory", lambda name: tmp_path / name)

    def load(name, **kwargs):
        calls.append((name, (tmp_path / name / "lock").exists(), kwargs))
        return f"module {name}"

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    return calls


def test_a_baton_left_by_a_killed_build_is_removed(tmp_path, fake_torch_load, caplog):
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "lock").touch()  # what a build killed mid-way leaves
    assert ext_build.load_extension("ext", sources=["a.cpp"]) == "module ext"
    assert fake_torch_load == [("ext", False, {"sources": ["a.cpp"]})]
    assert "stale build lock" in caplog.text


def test_a_live_builder_is_waited_for_and_its_baton_left_alone(tmp_path, fake_torch_load):
    (tmp_path / "ext").mkdir()
    lock = tmp_path / ".ext.kvboost-build.lock"
    holding, release = threading.Event(), threading.Event()

    def live_builder():
        with file_lock(lock):
            (tmp_path / "ext" / "lock").touch()
            holding.set()
            release.wait(10)
            (tmp_path / "ext" / "lock").unlink()  # a finished build removes its baton itself

    builder = threading.Thread(target=live_builder)
    builder.start()
    assert holding.wait(10)
    waiter = threading.Thread(target=ext_build.load_extension, args=("ext",))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not fake_torch_load and (tmp_path / "ext" / "lock").exists()
    release.set()
    builder.join(10)
    waiter.join(10)
    assert fake_torch_load == [("ext", False, {})]


def test_the_build_directory_is_torchs():
    """Under torch's root for extension builds: $TORCH_EXTENSIONS_DIR when set (torch's loader honours it; its
    get_default_build_root() does not), else the default."""
    import os

    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    assert str(ext_build.build_directory("kvboost_x")).startswith(root)
