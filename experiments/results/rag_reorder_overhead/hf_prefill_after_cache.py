"""HF forward of an n-token prompt: cold (no cache) vs after a cached head of h tokens (what hf_prefix does)."""
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
from transformers import DynamicCache
from kvboost.models.loading import load_model_and_tokenizer
dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
model, tok, _ = load_model_and_tokenizer(None, dtype=dtype, device="cpu")
print("dtype", model.dtype, "attn impl", model.config._attn_implementation)
n, head = 1500, 40
ids = torch.randint(100, 20000, (1, n))
def cold():
    return model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(), logits_to_keep=1)
def warm(past):
    return model(input_ids=ids[:, head:], use_cache=True, past_key_values=past, logits_to_keep=1)
with torch.inference_mode():
    pre = model(input_ids=ids[:, :head], use_cache=True, past_key_values=DynamicCache())
    base = pre.past_key_values
    def fresh():
        c = DynamicCache()
        for i, l in enumerate(base.layers):
            c.update(l.keys.clone(), l.values.clone(), i)
        return c
    cold(); warm(fresh())
    tc, tw = [], []
    for r in range(4):
        t = time.perf_counter(); cold(); tc.append(time.perf_counter() - t)
        c = fresh(); t = time.perf_counter(); warm(c); tw.append(time.perf_counter() - t)
    tc.sort(); tw.sort()
    print(f"cold {n} tokens: median {tc[len(tc)//2]*1e3:.0f} ms; after a {head}-token cache, {n-head} tokens: median {tw[len(tw)//2]*1e3:.0f} ms; ratio {tw[len(tw)//2]/tc[len(tc)//2]:.2f}")
