"""Greedy decode of the tiny random llama, 8 requests x 64 tokens through the engine core (ms per decode step, best
and median of 10 timed runs): the neutral-sampling fast path before / after the sampling fields (issue 62). Run it
with PYTHONPATH pointing at each tree (see experiments/results/README.md)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the tiny model of the test kit
from kvboost_testkit.tiny import ToyTokenizer, tiny_model  # noqa: E402

import kvboost  # noqa: E402
from kvboost import KVBoost  # noqa: E402
from kvboost.engine.requests import SamplingParams  # noqa: E402
torch.manual_seed(0); torch.set_num_threads(1)
engine = KVBoost(tiny_model("llama"), ToyTokenizer(), model_identity="tiny", decode="eager",
                 chunker={"name": "fixed", "chunk_size": 16})
best = []
for rep in range(11):
    hs = [engine.core.add(f"prompt number {i} about things", SamplingParams(max_tokens=64, temperature=0), chat=False,
                          mode="cold") for i in range(8)]
    while not all(h.done for h in hs):
        engine.core.step()
    # decode time only: after every request has its first token
    hs = [engine.core.add(f"prompt number {i} about things", SamplingParams(max_tokens=64, temperature=0), chat=False,
                          mode="cold") for i in range(8)]
    while not all(h.num_events for h in hs):
        engine.core.step()
    t = time.perf_counter(); steps = 0
    while not all(h.done for h in hs):
        engine.core.step(); steps += 1
    best.append((time.perf_counter() - t) / steps * 1e3)
print(kvboost.__file__, f"ms/step best {min(best[1:]):.3f} median {sorted(best[1:])[5]:.3f}")
engine.close()
