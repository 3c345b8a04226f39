"""experiments/bench/bench_speculative.py: its pure helpers on toy records (no model is loaded)."""

from __future__ import annotations

import pytest

from experiments.bench import bench_speculative as bs

KNOWN = ("none", "prompt_lookup", "layer_skip", "draft_model")


def test_parse_strategies():
    assert bs.parse_strategies(" none, prompt_lookup ,", KNOWN) == ["none", "prompt_lookup"]
    for bad, message in (("", "empty"), ("none,foo", "unknown"), ("none,none", "more than once"),
                         ("prompt_lookup", "must include 'none'")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            bs.parse_strategies(bad, KNOWN)


def test_rotated_first_divergence_decode_seconds():
    assert bs.rotated(["a", "b", "c"], 4) == ["b", "c", "a"] and bs.rotated([], 2) == []
    assert bs.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bs.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert bs.first_divergence([1, 2], [1, 2, 3]) == 2
    assert bs.decode_seconds(11, 5.0) == pytest.approx(2.0)
    assert bs.decode_seconds(1, 0.0) == 0.0


def _rec(strategy, repeat, prompt, tokens, seconds, *, identical=True, drafted=0, accepted=0, forwards=None):
    return {"workload": "quote", "prompt_id": prompt, "repeat": repeat, "strategy": strategy,
            "decoded_tokens": tokens, "decode_s": seconds, "identical_to_none": identical,
            "first_divergence": None if identical else 3, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "target_forwards": tokens if forwards is None else forwards}  # fmt: skip


def test_summarize_and_markdown():
    recs = []
    for repeat, slow in ((0, 1.0), (1, 2.0)):
        for prompt in ("p0", "p1"):
            recs.append(_rec("none", repeat, prompt, 10, 1.0 * slow))
            recs.append(_rec("prompt_lookup", repeat, prompt, 10, 0.5 * slow, drafted=8, accepted=6, forwards=4,
                             identical=prompt == "p0"))  # fmt: skip
    summary = bs.summarize(recs, ["none", "prompt_lookup"])
    base, pl = summary["quote"]["none"], summary["quote"]["prompt_lookup"]
    assert base["decode_tok_s"]["median"] == pytest.approx(7.5) and base["decode_tok_s"]["min"] == pytest.approx(5)
    assert pl["speedup_vs_none"] == {"median": pytest.approx(2.0), "min": pytest.approx(2.0),
                                     "max": pytest.approx(2.0), "n": 2}  # fmt: skip
    assert pl["identical_fraction"] == 0.5 and pl["first_divergences"] == [3, 3]
    assert pl["acceptance_rate"] == pytest.approx(0.75) and pl["tokens_per_target_forward"] == pytest.approx(2.5)
    assert base["acceptance_rate"] is None and base["tokens_per_target_forward"] == pytest.approx(1.0)
    meta = {"load_average_start": [1.0, 1.0, 1.0], "load_average_end": None, "cpu_count": 2, "torch_threads": 2,
            "dtype": "float32", "decode_info": {"decode": "compiled", "decode_reason": "auto"}, "new_tokens": 8,
            "repeats": 2, "cache_policy": "cold.", "timing": "engine.", "workloads": {"quote": {"description": "d"}}}
    text = bs.markdown("python x.py", meta, summary, {"none": "none", "prompt_lookup": "prompt_lookup"})
    assert text.splitlines()[0] == "`python x.py`"
    assert "| prompt_lookup | 2/4 (50%), first diff at token 3, 3 | 75.0% (24/32) | 2.50 |" in text
    assert "2.00x [2.00, 2.00]" in text


def test_pick_passages():
    cands = [("a", "x " * 50), ("a", "y " * 100), ("b", "```code``` " * 100), ("c", "z " * 100), ("d", "w " * 10)]
    chosen = bs.pick_passages(cands, lambda text: len(text.split()), n=5)
    assert [(source, tokens) for source, _, tokens in chosen] == [("a", 100), ("c", 100)]
    assert bs.quote_message("Fix:", "text") == "Fix:\n\ntext"


def test_busy_warning():
    assert bs.busy_warning([0.1, 0, 0], threads=2, cpus=2) is None
    assert bs.busy_warning([3.0, 0, 0], threads=1, cpus=2) is None
    assert bs.busy_warning(None, threads=2, cpus=2) is None
    assert "--threads 1" in bs.busy_warning([1.5, 0, 0], threads=2, cpus=2)
