"""experiments/checks/decode_perplexity.py on a tiny random model: scoring a reply through the decode path (prefill
the prompt, then one decode step per reply token) gives the NLL a single HF forward over prompt + reply gives."""

from __future__ import annotations

import math

import torch
from kvboost_testkit.tiny import make_engine, random_ids


def test_decode_path_nll_is_teacher_forced_hf_nll():
    from experiments.checks.decode_perplexity import compare, score_arm, score_through_decode

    engine = make_engine("llama", decode="eager")
    model = engine.model
    free = engine.pool.num_free
    samples = [{"prompt_ids": random_ids(n, seed=n), "reply_ids": random_ids(m, seed=100 + n)}
               for n, m in ((9, 12), (23, 5), (40, 1))]  # fmt: skip
    refs, ref_top1 = [], []
    for s in samples:
        ids = s["prompt_ids"] + s["reply_ids"]
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        rows = logits[len(s["prompt_ids"]) - 1 : len(ids) - 1]  # the rows predicting the reply tokens
        refs += torch.nn.functional.cross_entropy(rows, torch.tensor(s["reply_ids"]), reduction="none").tolist()
        ref_top1 += rows.argmax(-1).tolist()
        nll, top1 = score_through_decode(engine, s["prompt_ids"], s["reply_ids"])
        assert len(nll) == len(s["reply_ids"])
        assert max(abs(a - b) for a, b in zip(nll, refs[-len(nll) :], strict=True)) < 1e-4
        assert top1 == ref_top1[-len(top1) :]

    result = score_arm(engine, samples)
    assert result["tokens_scored"] == sum(len(s["reply_ids"]) for s in samples)
    # one prefill and len(reply) - 1 decode steps per sample, all eager on this engine
    assert result["forwards"] == {"eager": sum(len(s["reply_ids"]) for s in samples)}
    assert abs(result["perplexity"] - math.exp(sum(refs) / len(refs))) < 1e-4 * result["perplexity"]
    targets = [t for s in samples for t in s["reply_ids"]]
    same = compare(result, result, targets)
    assert same["ppl_ratio"] == 1.0 and same["nll_abs_diff_max"] == 0.0 and same["top1_agreement"] == 1.0
    assert engine.pool.num_free == free  # every table was released
    engine.close()
