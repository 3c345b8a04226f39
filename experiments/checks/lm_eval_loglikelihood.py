"""lm-evaluation-harness itself against kvboost-server (issue 62): its ``local-completions`` model
(``LocalCompletionsAPI.loglikelihood``: batches of token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``)
scores a hand-made 4-question multiple-choice set on the bundled SmolLM2-135M-Instruct (fp32, dense weights), and
each loglikelihood is compared with one plain Hugging Face forward's log_softmax of the same tokens. The questions
are written here: the machine has no network for a task's dataset. lm-eval is not a kvboost dependency: install it
(with ``aiohttp``, ``tenacity``, ``sqlitedict``, ``jsonlines``) somewhere and put it on PYTHONPATH.

    python experiments/checks/lm_eval_loglikelihood.py [eager|quantized]

``eager`` (default) decodes and prefills with the model's dense fp32 weights (the reference's arithmetic);
``quantized`` is the bundled model's CPU default (its GGUF 4-bit blocks, int16 activations: not exact)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # serve_app: uvicorn in a thread
from test_server import serve_app  # noqa: E402

from kvboost import KVBoost  # noqa: E402
from kvboost.engine.loop import EngineLoop  # noqa: E402
from kvboost.models.loading import bundled_model_dir  # noqa: E402
from kvboost.serving.server import create_app  # noqa: E402

try:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
except ImportError as exc:  # pragma: no cover - an optional tool
    sys.exit(f"lm-eval is not importable ({exc}): pip install lm-eval (it is not a kvboost dependency)")

#: (context, choices, index of the right one)
QUESTIONS = [("The capital of France is", [" Paris", " London", " Berlin"], 0),
             ("Water freezes at zero degrees", [" Celsius", " Kelvin", " money"], 0),
             ("The opposite of hot is", [" cold", " blue", " seven"], 0),
             ("One plus one equals", [" two", " nine", " purple"], 0)]  # fmt: skip


def main(decode: str = "eager") -> None:
    engine = KVBoost.from_pretrained(None, dtype="float32", weights="dense", decode=decode)
    loop = EngineLoop(engine).start()
    try:
        with serve_app(create_app(loop, model_name="smollm2")) as base:
            lm = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="smollm2",
                                     tokenizer_backend="huggingface", tokenizer=str(bundled_model_dir()),
                                     batch_size=3, max_retries=1)  # fmt: skip
            requests = [Instance("loglikelihood", {}, (ctx, choice), i)
                        for ctx, choices, _ in QUESTIONS for i, choice in enumerate(choices)]  # fmt: skip
            start = time.perf_counter()
            results = lm.loglikelihood(requests)
            elapsed = time.perf_counter() - start
    finally:
        loop.shutdown()
    tok, worst, correct, k = lm.tokenizer, 0.0, 0, 0
    for ctx, choices, gold in QUESTIONS:
        scores = []
        for choice in choices:
            ll, greedy = results[k]
            k += 1
            n_ctx = len(tok(ctx, add_special_tokens=False)["input_ids"])
            ids = tok(ctx + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0].float(), -1)
            ref = sum(float(lp[j - 1, ids[j]]) for j in range(n_ctx, len(ids)))
            worst = max(worst, abs(ref - ll))
            scores.append(ll)
            print(f"{ctx!r:34} {choice!r:11} lm-eval {ll:9.4f}  HF forward {ref:9.4f}  greedy={greedy}")
        correct += int(max(range(len(scores)), key=scores.__getitem__) == gold)
    engine.close()
    print(f"decode={decode}: accuracy {correct}/{len(QUESTIONS)}; max |loglikelihood - HF forward| = {worst:.2e}; "
          f"{len(requests)} loglikelihood requests in {elapsed:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
