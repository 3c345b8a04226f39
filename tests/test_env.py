"""``python -m kvboost.env``: the CPU features that change kvboost's numbers, and the tests and claims that assert
or promise something else on the other CPU kind (issue 33 item 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvboost import env

ROOT = Path(__file__).resolve().parents[1]


def test_kind_follows_the_flags(monkeypatch):
    for flags, kind in (({"amx_bf16", "avx512_bf16"}, "intel-amx"), ({"avx512_bf16"}, "avx512-bf16"), (set(), "other")):
        monkeypatch.setattr(env, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert env.cpu_features()["kind"] == kind
        assert env.has_amx() == ("amx_bf16" in flags)


def test_conditional_entries_name_real_tests_and_say_both_sides(monkeypatch):
    for row in env.conditional_report():
        assert row["needs"] and row["here"] and row["elsewhere"]
        where = row["where"]
        if where.startswith("tests/"):
            assert (ROOT / where.split("::")[0].split(" ")[0]).is_file(), where
            if "::" in where:
                name = where.split("::")[1].split("[")[0].split(" ")[0]
                assert f"def {name}(" in (ROOT / where.split("::")[0]).read_text(), where
    # on the other kind, the int4 entry asserts the other side
    amx = {r["where"]: r["here"] for r in env.conditional_report()}
    monkeypatch.setattr(env, "cpu_flags", lambda: frozenset({"amx_bf16", "avx512_bf16"}))
    with_amx = {r["where"]: r["here"] for r in env.conditional_report()}
    monkeypatch.setattr(env, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    zen4 = {r["where"]: r["here"] for r in env.conditional_report()}
    int4 = next(w for w in amx if "test_fused_int4pack" in w)
    assert "bit-equal" in with_amx[int4] and "1e-6" in zen4[int4]


def test_the_command_prints_the_report_and_json():
    text = subprocess.run([sys.executable, "-m", "kvboost.env"], capture_output=True, text=True, check=True).stdout
    assert text.startswith("cpu:") and "amx_bf16=" in text and "conditional tests and claims" in text
    out = subprocess.run([sys.executable, "-m", "kvboost.env", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["kind"] in ("intel-amx", "avx512-bf16", "other") and data["conditional"]
