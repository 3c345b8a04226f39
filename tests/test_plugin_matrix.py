"""experiments/checks/plugin_matrix.py on a tiny random model: every family's cells pass (or are skipped with their
reason), a new plugin joins the matrix by itself, and a broken reuse path makes a cell FAIL."""

from __future__ import annotations

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, tiny_model

from experiments import redis_process
from experiments.checks import plugin_matrix as pm
from kvboost.engine import InferenceEngine
from kvboost.registry import ALL_REGISTRIES, HASHERS

TINY_PROMPTS = pm.Prompts(
    system="You are a careful assistant. Answer briefly and clearly. " * 2,
    questions=("What is two plus two?", "And three plus three?"),
    rag_system="Answer from the documents.",
    docs=("Alpha document: the red fox lives in the northern forest.",
          "Beta document: copper wires carry current with resistance.",
          "Gamma document: the keeper wrote letters every single week."),
    rag_question="Question: who wrote letters?",
    quoting="abc def ghi abc def ghi abc def ghi. Repeat: abc def",
    tiny="Hi.",
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def matrix(**options) -> pm.Matrix:
    # 4 layers: the recompute strategies that look at a layer range need more than 2
    model = tiny_model("llama", num_hidden_layers=4)
    options = {"prompts": TINY_PROMPTS, "chunk_size": 16, "engine_options": {"decode": "eager"}, **options}
    return pm.Matrix(model, ToyTokenizer(), "tiny-llama", **options)


def test_every_family_runs_on_a_tiny_model():
    cells = matrix().run(progress=False)
    by = {(c.family, c.plugin): c for c in cells}
    # every registered plugin of every family has its cell
    assert set(by) == {(f, n) for f, r in ALL_REGISTRIES.items() for n in r.names()}
    failed = [f"{c.family}:{c.plugin}: {c.detail}\n{c.traceback or ''}" for c in cells if c.status == "failed"]
    assert not failed, "\n".join(failed)
    assert pm.exit_status(cells) == 0
    for (family, plugin), c in by.items():
        if c.status == "skipped":
            assert c.detail, (family, plugin)
    if not torch.cuda.is_available():
        assert by[("attn", "cuda")].status == "skipped" and "CUDA" in by[("attn", "cuda")].detail
        assert by[("attn", "triton")].status == "skipped" and by[("attn", "triton")].detail == pm.TRITON_SLOW_REASON
    # what the cells measured is what they claim
    assert (
        by[("recompute", "full")].numbers["greedy_match"]
        and by[("recompute", "full")].numbers["content_hit_tokens"] > 0
    )
    assert by[("quant", "none")].numbers["lossless"] and by[("quant", "none")].numbers["cached_tokens"] > 0
    assert by[("eviction", "lru")].numbers["pressure"]["evicted"] > 0
    assert by[("cache", "disk")].numbers["tier_hits"] > 0
    assert by[("speculative", "draft_model")].numbers["accepted_tokens"] > 0  # the target's own weights draft
    for name in ("chunker", "hasher", "attn"):
        for c in cells:
            if c.family == name and c.status == "passed":
                assert c.numbers["cached_tokens"] > 0 and c.numbers["first_token_kl"] <= 1e-4
    text = pm.markdown_table(cells)
    assert text.count("\n") == len(cells) + 1 and "| speculative | prompt_lookup |" in text


def test_broken_reuse_fails_its_cells(monkeypatch):
    """Cached K/V damaged before every reuse request (a cold request writes its own rows): the exact-reuse cells
    must FAIL with the numbers, and the exit status says so."""
    generate = InferenceEngine.generate

    def damaged(self, prompt, max_new_tokens=64, mode="reuse", *args, **kwargs):
        if mode == "reuse":
            with torch.no_grad():
                for rows in (self.pool.keys, self.pool.values):
                    rows.add_(torch.randn_like(rows), alpha=5.0)
        return generate(self, prompt, max_new_tokens, mode, *args, **kwargs)

    monkeypatch.setattr(InferenceEngine, "generate", damaged)
    small_pool = {"decode": "eager", "kv": {"pool_bytes": "8MiB"}}  # the damage touches every row of the pool
    cells = matrix(engine_options=small_pool).run(["chunker:fixed", "quant:none", "attn:cuda"], progress=False)
    by = {(c.family, c.plugin): c for c in cells}
    for key in (("chunker", "fixed"), ("quant", "none")):
        cell = by[key]
        assert cell.status == "failed", cell
        assert "KL" in cell.detail and cell.numbers["first_token_kl"] > 1e-4
    assert pm.exit_status(cells) == 1
    assert "**FAIL**" in pm.markdown_table(cells)


def test_a_new_plugin_joins_the_matrix():
    sha = HASHERS.get("sha256")

    class Salted(sha):  # type: ignore[misc, valid-type]
        def fingerprint(self) -> str:
            return "salted-" + super().fingerprint()

    HASHERS.register("matrix_test_hasher")(Salted)
    try:
        m = matrix()
        assert ("hasher", "matrix_test_hasher") in m.planned()
        (cell,) = m.run(["hasher:matrix_test_hasher"], progress=False)
        assert cell.status == "passed", cell.detail
    finally:
        HASHERS.unregister("matrix_test_hasher")


def test_redis_without_a_server_binary_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(redis_process, "redis_server_binary", lambda: None)
    (cell,) = matrix().run(["cache:redis"], progress=False)
    assert cell.status == "skipped" and "redis-server" in cell.detail


def test_only_refuses_an_unknown_cell():
    with pytest.raises(ValueError, match="nosuch"):
        matrix().planned(["attn:nosuch"])
