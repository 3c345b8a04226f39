"""One engine core per engine, and no forward outside it (issue 42).

Every entry point of the engine (``generate``, ``generate_batch``, ``generate_many``, ``warm``, ``add_request``,
``score_ids``, the canonical store of a chat turn, content repair, speculative drafts, ``verify_correctness``,
``warmup``, an EngineLoop serving threads) goes through ``engine.core``: exactly one ``EngineCore`` is ever built
for an engine, and every call of the runner's ``run`` happens while that core steps (``core.stepping``).
"""

from __future__ import annotations

import threading

from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.engine import EngineLoop, SamplingParams
from kvboost.engine import core as core_module


class ChatToyTokenizer(ToyTokenizer):
    """The toy tokenizer with a chat template (the canonical store runs for chat requests)."""

    chat_template = "toy"


def _watch(engine, monkeypatch) -> list[bool]:
    """Record, for every runner forward, whether the engine's core was stepping then."""
    inside: list[bool] = []
    real = engine.runner.run

    def run(batch):
        inside.append(engine.core.stepping > 0)
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    return inside


def test_every_entry_point_uses_the_one_core(monkeypatch):
    built = []
    real_init = core_module.EngineCore.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(core_module.EngineCore, "__init__", counting_init)
    engine = KVBoost(tiny_model("llama", num_hidden_layers=4), ChatToyTokenizer(), model_identity="tiny", chat=False,
                     decode="eager", chunker={"name": "separator", "separator": "\n\n", "chunk_size": 16},
                     recompute={"name": "cacheblend", "ratio": 0.3, "check_layers": [1]},
                     speculative={"name": "layer_skip", "layers": 2, "num_draft": 3})  # fmt: skip
    assert built == [engine.core]
    inside = _watch(engine, monkeypatch)
    docs = ["The keeper's cat is called Miso and sleeps on the stairs.", "The ferry leaves at noon from pier nine."]
    for doc in docs:
        engine.warm(doc, chat=False)
    rag = engine.generate("Notes:\n\n" + "\n\n".join(reversed(docs)) + "\n\nWhat is the cat called?", 6)
    assert rag.content_hit_tokens > 0  # content repair ran (a layer-wise forward)
    chat = engine.generate([{"role": "user", "content": "Name three fruits, please."}], 6)
    assert chat.extra["canonical_prefill_tokens"] > 0 and chat.extra["target_forwards"] > 0  # canonical store, drafts
    engine.generate(random_ids(30, seed=1), 4, score_ids=random_ids(5, seed=2))
    engine.generate_batch([random_ids(20, seed=3), random_ids(25, seed=4)], 4)
    engine.generate_many([random_ids(40, seed=5) + random_ids(5, seed=s) for s in (6, 7, 8)], 3)
    handle = engine.add_request(random_ids(18, seed=9), SamplingParams(max_tokens=3))
    while engine.core.has_work():
        engine.step()
    assert handle.result(0).output_ids
    assert engine.verify_correctness([random_ids(40, seed=10)], max_new_tokens=4).passed
    engine.warmup(64)
    loop = EngineLoop(engine).start()
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        loop.submit(random_ids(15 + i, seed=20 + i), SamplingParams(max_tokens=4)).result(60)))
        for i in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r.finish_reason in ("stop", "length") for r in results)
    assert engine.generate(random_ids(22, seed=30), 3).output_ids  # generate while the loop drives the core
    loop.shutdown()
    assert built == [engine.core], f"{len(built)} engine cores were built"
    assert inside and all(inside), f"{inside.count(False)} of {len(inside)} forwards ran outside the core's steps"
    engine.close()
