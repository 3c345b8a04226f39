"""verify_correctness checks what the configured dtype and attention can promise, and says so (issue 33 item 2):
fp32 and bf16 under a batch-invariant backend: KL <= 1e-4; bf16 with the default kernels: the bf16 tolerance."""

from __future__ import annotations

import torch
from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.quality import (
    FP32_KL_TOLERANCE,
    LOW_PRECISION_KL_TOLERANCE,
    VerifiedCorrectness,
    exactness_promise,
)
from kvboost.types import CorrectnessReport

PROMPTS = [random_ids(40, seed=21), random_ids(33, seed=22)]


def _engine(dtype: torch.dtype = torch.float32, **options) -> KVBoost:
    options.setdefault("chunker", {"name": "fixed", "chunk_size": 16})
    return KVBoost(tiny_model("llama").to(dtype), ToyTokenizer(), model_identity="tiny-q", **options)


def test_fp32_promises_the_design_tolerance():
    report = _engine().verify_correctness(PROMPTS, max_new_tokens=4)
    assert isinstance(report, CorrectnessReport) and isinstance(report, VerifiedCorrectness)
    assert report.passed, str(report)
    assert report.kl_tolerance == FP32_KL_TOLERANCE == 1e-4
    assert report.dtype == "float32" and "1e-04" in report.criterion
    assert report.to_dict()["criterion"] == report.criterion and report.to_dict()["dtype"] == "float32"


def test_bf16_says_what_it_promises_and_passes():
    """bf16 with the default kernels: exact reuse equals a cold prefill up to bf16 rounding; the report says so,
    names its tolerance and how to get bit-equal reuse."""
    report = _engine(torch.bfloat16).verify_correctness(PROMPTS, max_new_tokens=4)
    assert report.kl_tolerance == LOW_PRECISION_KL_TOLERANCE > FP32_KL_TOLERANCE
    assert report.dtype == "bfloat16"
    for words in ("bfloat16 rounding", "dtype=float32", "attn=batch_invariant", f"{LOW_PRECISION_KL_TOLERANCE:.0e}"):
        assert words in report.criterion, report.criterion
    assert report.passed, str(report)
    text = str(report)
    assert text.startswith("verify_correctness: passed (bfloat16;") and text.count("\n") == len(PROMPTS)


def test_bf16_under_a_batch_invariant_backend_promises_fp32s_tolerance():
    engine = _engine(torch.bfloat16, attn={"name": "batch_invariant", "tile": 16, "key_block": 16})
    tolerance, why = exactness_promise(engine)
    assert tolerance == FP32_KL_TOLERANCE and "bit-equal" in why
    report = engine.verify_correctness(PROMPTS[:1], max_new_tokens=3)
    assert report.passed, str(report)
    assert max(c.first_token_kl for c in report.checks) == 0.0  # bit-equal, not merely close


def test_an_explicit_tolerance_wins_and_a_lossy_quantizer_is_named():
    engine = _engine(quant="kivi8")
    tolerance, why = exactness_promise(engine)
    assert tolerance == FP32_KL_TOLERANCE and "lossy" in why and "kivi8" in why
    report = engine.verify_correctness(PROMPTS[:1], max_new_tokens=2, kl_tolerance=0.5)
    assert report.kl_tolerance == 0.5 and report.criterion.startswith("first-token KL <= 5e-01 as asked")


def test_a_failing_check_is_shown_with_its_numbers():
    report = VerifiedCorrectness(checks=[], kl_tolerance=1e-4, dtype="bfloat16", criterion="x")
    assert not report.passed and "FAILED" in str(report)


def test_bf16_accepts_greedy_tokens_that_part_only_at_a_near_tie():
    from kvboost.quality import NEAR_TIE_LOGITS
    from kvboost.types import PromptCheck

    parted = PromptCheck(prompt="p", greedy_match=False, first_token_kl=1e-3, first_divergence=2, reuse_ratio=0.6,
                         max_abs_logit_diff=0.1)  # fmt: skip
    common = dict(checks=[parted], kl_tolerance=LOW_PRECISION_KL_TOLERANCE, dtype="bfloat16", criterion="c")
    assert VerifiedCorrectness(**common, tie_margins=[0.1], near_tie=NEAR_TIE_LOGITS).passed
    assert "near tie: margin 0.100" in str(VerifiedCorrectness(**common, tie_margins=[0.1], near_tie=NEAR_TIE_LOGITS))
    assert not VerifiedCorrectness(**common, tie_margins=[2.0], near_tie=NEAR_TIE_LOGITS).passed
    assert not VerifiedCorrectness(**common, tie_margins=[0.1], near_tie=None).passed  # fp32: no tie is accepted
    assert not VerifiedCorrectness(**{**common, "kl_tolerance": 1e-4}, tie_margins=[0.1], near_tie=0.5).passed


# ------------------------------------------------------------------ issue 59: teacher-forced fidelity


def test_captured_teacher_forced_rows_are_the_models_distributions_over_the_answer():
    """The rows capture_teacher_forced collects from a score_ids request equal a plain forward of prompt + answer
    (fp32 rounding), and their gathered log-probabilities sum to the engine's answer_logprob."""
    from kvboost.quality import capture_teacher_forced

    engine = _engine()
    prompt, answer = PROMPTS[0], [5, 9, 17, 3]
    with capture_teacher_forced() as rows:
        result = engine.generate(prompt, max_new_tokens=2, mode="cold", score_ids=answer)
    assert len(rows) == 1 and rows[0].shape == (len(answer), engine.model.config.vocab_size)
    logp = rows[0].double()
    assert float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum()) == \
        __import__("pytest").approx(result.extra["answer_logprob"], abs=1e-4)  # fmt: skip
    ids = torch.tensor([list(prompt) + answer[:-1]])
    with torch.no_grad():
        direct = torch.log_softmax(engine.model(ids).logits[0, len(prompt) - 1 :].double(), -1)
    assert torch.allclose(logp, direct, atol=1e-4)
    with capture_teacher_forced() as none_scored:
        engine.generate(prompt, max_new_tokens=2, mode="cold")
    assert none_scored == []  # only score_ids requests are captured


def test_answer_fidelity_hand_computed_and_zero_against_itself():
    import pytest

    from kvboost.quality import answer_fidelity

    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    kl0 = 0.5 * torch.log(torch.tensor(0.5 / 0.25)) + 0.5 * torch.log(torch.tensor(0.5 / 0.75))
    out = answer_fidelity(p, q)
    assert out["first_token_kl"] == pytest.approx(float(kl0)) and out["answer_kl"] == pytest.approx(float(kl0) / 2)
    assert answer_fidelity(p, p) == {"answer_kl": 0.0, "first_token_kl": 0.0}
    with pytest.raises(ValueError, match="one shape"):
        answer_fidelity(p, q[:1])
    with pytest.raises(ValueError, match="one shape"):
        answer_fidelity(p[:0], q[:0])
