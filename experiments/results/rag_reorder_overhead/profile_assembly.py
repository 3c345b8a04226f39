"""Where kvboost's lookup + assembly time goes on a rag_reorder query (content hits of 5 warmed documents)."""
import cProfile, pstats, sys, io
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "../../.."))
import torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
from experiments.workloads import WORKLOADS
from experiments.workloads.base import WorkloadEnv
from kvboost.engine import InferenceEngine
from kvboost.models.loading import load_model_and_tokenizer
dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
model, tok, ident = load_model_and_tokenizer(None, dtype=dtype, device="cpu")
engine = InferenceEngine(model, tok, model_identity=ident, chunker={"name": "separator", "separator": "\n\n", "chunk_size": 64})
wl = WORKLOADS.build({"name": "rag_reorder", "num_queries": 3, "num_documents": 24}, env=WorkloadEnv(tok, lambda p: len(engine.tokenize(p))))
for text in wl.shared_context():
    engine.warm(text)
reqs = list(wl.requests())
engine.generate(reqs[0].prompt, max_new_tokens=2)  # one untimed
for r in reqs[1:]:
    pr = cProfile.Profile(); pr.enable()
    res = engine.generate(r.prompt, max_new_tokens=1, store=False)
    pr.disable()
    m = res.metrics()
    print({k: round(m[k], 1) if isinstance(m.get(k), float) else m.get(k) for k in ("ttft_ms", "prompt_tokens", "cached_tokens", "prefill_tokens")},
          {k: round(res.extra.get(k, 0), 1) for k in ("tokenize_ms", "lookup_ms", "assemble_ms", "prefill_ms")})
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35); print(s.getvalue()[:6000])
